//! Activation offload: the checkpointed segments' inputs wait in host memory
//! for their recompute, instead of on the device.
//!
//! With every block checkpointed, the device keeps one `[b, s, h]` tensor per
//! block through the whole forward and into the backward; at long sequences
//! these inputs are most of what the step holds beside the weights (on
//! Llama-3.1-8B's shape at 49,640 tokens, 31 inputs take 11.7 GiB while the
//! last block is recomputed). Under this fix each input but the first goes to
//! host memory as soon as its segment's forward has run, and comes back just
//! before the segment is recomputed in the backward
//! ([`crate::checkpoint::backward_with`] with [`SegmentInputs::OnHost`]), so
//! the device holds one of them at a time.
//!
//! The copies go to and from page-locked host buffers (one per segment,
//! locked once and kept for the later steps), queued on the device's stream:
//! each waits for the work queued before it and the compute queued after it
//! waits for it, but the host does not (it queues the next block meanwhile),
//! and they run at the bus's speed. Their cost is two transfers of the
//! offloaded inputs over the host bus per micro-batch; the step-time model
//! counts it as host-bus traffic. The arithmetic is unchanged: the
//! recompute starts from the same values, so the gradients are those of the
//! inputs kept on the device, bit for bit.
//!
//! It needs checkpointing (the pipeline puts it after [`crate::checkpoint`])
//! and memory apart from the host's: on the CPU it is unusable.

use crate::{Checkpointing, Execution, Plan, SearchContext, SegmentInputs, Strategy};

/// Planner half: keep the checkpointed segments' inputs in host memory
/// (`offload-activations`).
///
/// ```
/// use oomfix_strategies::offload_activations::OffloadActivations;
/// use oomfix_strategies::{Checkpointing, Execution, Plan, SearchContext, SegmentInputs, Strategy};
///
/// let ctx = SearchContext::new(8, 12);
/// let plan = Plan::baseline(8, 1024);
/// // Nothing to offload without checkpointing.
/// assert!(OffloadActivations.tighten(&plan, &ctx).is_none());
/// let checkpointed = Plan { checkpoint: Checkpointing::Every(1), ..plan };
/// let offloaded = OffloadActivations.tighten(&checkpointed, &ctx).unwrap();
/// assert!(offloaded.offload_activations);
/// assert!(OffloadActivations.tighten(&offloaded, &ctx).is_none());
/// assert!(!OffloadActivations.relax(&offloaded, &ctx).unwrap().offload_activations);
/// let mut cpu = ctx;
/// cpu.host_offload = false; // the CPU: its memory is the host's
/// assert!(OffloadActivations.tighten(&checkpointed, &cpu).is_none());
/// let exec = Execution::for_plan(&offloaded, &oomfix_strategies::builtins());
/// assert_eq!(exec.segment_inputs, SegmentInputs::OnHost);
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct OffloadActivations;

impl Strategy for OffloadActivations {
    fn name(&self) -> &'static str {
        "offload-activations"
    }
    fn tighten(&self, plan: &Plan, ctx: &SearchContext) -> Option<Plan> {
        let checkpointed = matches!(plan.checkpoint, Checkpointing::Every(k) if k > 0);
        (ctx.host_offload && checkpointed && !plan.offload_activations).then_some(Plan {
            offload_activations: true,
            ..*plan
        })
    }
    fn relax(&self, plan: &Plan, _ctx: &SearchContext) -> Option<Plan> {
        plan.offload_activations.then_some(Plan {
            offload_activations: false,
            ..*plan
        })
    }
    /// The segments' inputs in host memory. Its memory and time terms are
    /// activations and host-bus traffic, which the memory and step-time
    /// models derive from the execution.
    fn execution(&self, plan: &Plan, exec: &mut Execution) {
        if plan.offload_activations {
            exec.segment_inputs = SegmentInputs::OnHost;
        }
    }
    /// Needs memory apart from the host's.
    fn unusable(&self, ctx: &SearchContext) -> Option<String> {
        (!ctx.host_offload)
            .then(|| "needs a GPU: on the CPU the activations are in host memory already".into())
    }
}
