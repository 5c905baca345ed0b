//! The memory model: `(ModelSpec, Plan, Target) -> Breakdown`.
//!
//! Every term is a named function of the model's shape and the plan, derived
//! from what the trainer in [`crate::train`] actually allocates in candle. The
//! model is per device: under sharding it describes one rank.
//!
//! The peak is the largest of the live sets of the moments that can hold it;
//! each moment counts only what is alive at that moment:
//!
//! * **loss backward**: candle keeps every forward intermediate on the path to
//!   a parameter alive until the loss is dropped, and the backward starts at
//!   the loss, whose working set (several `[n,V]` f32 tensors) is often the
//!   largest of the step. No parameter gradient exists yet.
//! * **last segment's recompute** (with checkpointing): every checkpointed
//!   segment input is still alive, beside the recomputed segment and its
//!   backward; only the head's and that segment's gradients exist. Under LoRA
//!   or at long sequences this is the peak.
//! * **end of backward**: the first block's backward (every gradient but the
//!   embedding lookup's exists)
//!   and the embedding lookup's (every gradient exists), with the forward's
//!   tensors still alive.
//! * **optimizer step**: gradients plus the optimizer's temporaries.
//! * everything else (the forward, later blocks' backward) holds a subset of
//!   one of those.
//!
//! Weights, master weights, optimizer state and the gradients accumulated from
//! earlier micro-batches are alive at every moment. With the optimizer
//! offloaded, master weights and optimizer state are host memory
//! ([`Breakdown::host`]), outside the device's peak.
//!
//! The training state's terms (weights, master weights, gradients, optimizer
//! state and the step's temporaries, per rank, on the device and the host) are
//! the fixes' own: each fix's memory hook sets its part of
//! [`oomfix_strategies::StateBytes`] ([`state_bytes`]; the hooks and their
//! order: [`oomfix_strategies::memory`]). This module adds what depends on
//! the model's op sequence: activations and the backward's working set,
//! which the plan's precision, checkpointing and attention change. The
//! backward's working sets are those of the linked candle-core
//! ([`Backward::linked`]): the workspace's patched one, or candle-core as
//! released, which holds a tensor of zeros and a sum at each edge.

mod activations;

pub use crate::facts::{
    builtin_execution, builtins, model_facts, state_bytes, step_cost, trained_facts, trained_state,
};

pub use crate::target::Target;
pub use activations::{
    activation_bytes, activation_bytes_for, add_cpu_head_backward, cpu_matmul_workspace,
    embedding_backward_copies, mlp_backward_ni, widen_cpu_bf16_matmuls, Activations, Backward,
    Moment,
};

use crate::spec::{Family, ModelSpec};
use oomfix_strategies::{Checkpointing, Execution, Pipeline, Plan, StateBytes, Strategy};
use serde::Serialize;
use std::sync::Arc;

/// The moment of the step at which the peak occurs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PeakMoment {
    /// The backward through the loss and the head (activations and the loss's
    /// working set alive, no parameter gradient yet).
    LossBackward,
    /// The backward of the last checkpointed segment, the first one it
    /// recomputes (every segment's input still alive, few gradients yet).
    SegmentRecompute,
    /// End of backward (activations and fresh gradients both alive).
    #[default]
    Backward,
    /// A sharded plan's reduction of a micro-batch's gradients (stage 1: of
    /// the step's sums): the gradients backward left and the collective's
    /// buffers, no activations.
    GradientReduction,
    /// Inside the optimizer step.
    OptimizerStep,
}

impl std::fmt::Display for PeakMoment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            PeakMoment::LossBackward => "loss backward",
            PeakMoment::SegmentRecompute => "last segment's recompute",
            PeakMoment::Backward => "end of backward",
            PeakMoment::GradientReduction => "gradient reduction",
            PeakMoment::OptimizerStep => "optimizer step",
        })
    }
}

/// Estimated bytes per component on one device, and the peak.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct Breakdown {
    /// Compute weights (fp32, or the 16-bit copy under mixed precision).
    pub weights: u64,
    /// fp32 master weights kept beside 16-bit compute weights.
    pub master_weights: u64,
    /// Gradients as the backward produces them (compute dtype): the full set
    /// (at the end of backward the embedding lookup's may still be missing).
    pub gradients: u64,
    /// The accumulated gradient set carried between micro-batches.
    pub accumulated_gradients: u64,
    /// AdamW first and second moments.
    pub optimizer_state: u64,
    /// Forward intermediates alive at the backward's largest moment.
    pub activations: u64,
    /// The backward's working tensors at that moment.
    pub backward_transient: u64,
    /// The optimizer step's temporaries.
    pub optimizer_transient: u64,
    /// Device runtime outside the tensors (CUDA context, cuBLAS workspace).
    pub runtime: u64,
    /// What the device's memory pool holds beyond live tensors at the peak
    /// ([`Target::pool_slack_bytes`]).
    pub pool_slack: u64,
    /// What the collective backend keeps on each rank for the whole job
    /// ([`Target::communicator_bytes`]: NCCL's communicator), alive at
    /// every moment; 0 for one process.
    pub communicator: u64,
    /// What the collective backend holds for the largest bucket of a
    /// sharded plan ([`Target::collective_buffer_bytes`]), where the peak
    /// is a moment of a collective (a gradient reduction, or the
    /// parameters' broadcast in the step); 0 at other moments.
    pub collective_buffers: u64,
    /// Peak device bytes over the step: live bytes, runtime and pool slack
    /// (on [`Target::Cpu`], with the `host` bytes: the same memory).
    pub peak: u64,
    /// When the peak occurs.
    pub peak_phase: PeakMoment,
    /// Host memory the plan needs besides the device's: with the optimizer
    /// offloaded, the fp32 master weights and moments, plus staging tensors
    /// in the compute dtype (gradients down, weights back up); 0 otherwise.
    /// On [`Target::Cpu`] this is the same memory as the device's, and
    /// already part of `peak` (the planner does not offload there).
    pub host: u64,
}

impl Breakdown {
    /// The components as `(name, bytes)`, in display order.
    pub fn components(&self) -> [(&'static str, u64); 12] {
        [
            ("weights", self.weights),
            ("master_weights", self.master_weights),
            ("gradients", self.gradients),
            ("accumulated_gradients", self.accumulated_gradients),
            ("optimizer_state", self.optimizer_state),
            ("activations", self.activations),
            ("backward_transient", self.backward_transient),
            ("optimizer_transient", self.optimizer_transient),
            ("runtime", self.runtime),
            ("pool_slack", self.pool_slack),
            ("communicator", self.communicator),
            ("collective_buffers", self.collective_buffers),
        ]
    }

    /// The peak without the pool's slack: the live bytes and the runtime, what
    /// the pool's *used* high-water mark plus the memory outside it measures.
    pub fn allocated_peak(&self) -> u64 {
        self.peak - self.pool_slack
    }

    /// The components that make up the peak, largest first.
    pub fn peak_components(&self) -> Vec<(&'static str, u64)> {
        let mut parts: Vec<_> = self
            .components()
            .into_iter()
            .filter(|(name, bytes)| *bytes > 0 && self.in_peak(name))
            .collect();
        parts.sort_by_key(|p| std::cmp::Reverse(p.1));
        parts
    }

    fn in_peak(&self, component: &str) -> bool {
        match self.peak_phase {
            PeakMoment::LossBackward => !matches!(component, "gradients" | "optimizer_transient"),
            PeakMoment::SegmentRecompute | PeakMoment::Backward => {
                component != "optimizer_transient"
            }
            PeakMoment::GradientReduction => !matches!(
                component,
                "activations" | "backward_transient" | "optimizer_transient"
            ),
            PeakMoment::OptimizerStep => !matches!(component, "activations" | "backward_transient"),
        }
    }
}

/// Anything that predicts a plan's memory.
pub trait Estimator: Send + Sync {
    /// Bytes per component and the peak, on one device.
    fn estimate(&self, spec: &ModelSpec, plan: &Plan, target: &Target) -> Breakdown;
    /// The modelled time of one optimizer step of `plan` (default:
    /// [`crate::speed::step_time`] of the passes the built-in fixes make).
    fn step_time(&self, spec: &ModelSpec, plan: &Plan, target: &Target) -> crate::speed::StepTime {
        crate::speed::step_time(spec, plan, builtins(), target)
    }
    /// Whether the estimates of `spec` include its activations. When they
    /// do not, a peak is a lower bound (weights, gradients, optimizer state
    /// and the step's temporaries only) and reports say so. Default: yes.
    fn models_activations(&self, _spec: &ModelSpec) -> bool {
        true
    }
}

/// A shared estimator is one (so that its owner can read what it learnt
/// after a search, as with [`crate::anymodel::MeasuredModel`]).
impl<E: Estimator + ?Sized> Estimator for Arc<E> {
    fn estimate(&self, spec: &ModelSpec, plan: &Plan, target: &Target) -> Breakdown {
        (**self).estimate(spec, plan, target)
    }
    fn step_time(&self, spec: &ModelSpec, plan: &Plan, target: &Target) -> crate::speed::StepTime {
        (**self).step_time(spec, plan, target)
    }
    fn models_activations(&self, spec: &ModelSpec) -> bool {
        (**self).models_activations(spec)
    }
}

/// The analytic model documented in this module, with the built-in fixes'
/// memory hooks.
#[derive(Debug, Clone, Copy, Default)]
pub struct MemoryModel;

impl MemoryModel {
    /// [`Estimator::estimate`] with the backward working sets of `backward`
    /// instead of the linked candle-core's: what the same plan needs with
    /// the other backward (`vendor/README.md`).
    pub fn estimate_with(
        &self,
        spec: &ModelSpec,
        plan: &Plan,
        target: &Target,
        backward: Backward,
    ) -> Breakdown {
        estimate(spec, plan, target, builtins(), backward)
    }

    /// The analytic model with the memory hooks of every fix `pipeline` can
    /// use ([`oomfix_strategies::registered`]): the built-in ones and the
    /// pipeline's others.
    pub fn registered(pipeline: &Pipeline) -> WithFixes {
        WithFixes {
            fixes: oomfix_strategies::registered(pipeline),
        }
    }
}

/// Whether the analytic model knows `spec`'s op sequence: not for an
/// unknown architecture ([`Family::Generic`]), whose activations it does
/// not model.
pub fn analytic_activations(spec: &ModelSpec) -> bool {
    spec.config.family != Family::Generic
}

impl Estimator for MemoryModel {
    fn models_activations(&self, spec: &ModelSpec) -> bool {
        analytic_activations(spec)
    }
    fn estimate(&self, spec: &ModelSpec, plan: &Plan, target: &Target) -> Breakdown {
        estimate(spec, plan, target, builtins(), Backward::linked())
    }
}

/// The analytic model with the memory hooks of a list of fixes
/// ([`MemoryModel::registered`]).
pub struct WithFixes {
    fixes: Vec<Arc<dyn Strategy>>,
}

impl Estimator for WithFixes {
    fn models_activations(&self, spec: &ModelSpec) -> bool {
        analytic_activations(spec)
    }
    fn estimate(&self, spec: &ModelSpec, plan: &Plan, target: &Target) -> Breakdown {
        estimate(spec, plan, target, &self.fixes, Backward::linked())
    }
    fn step_time(&self, spec: &ModelSpec, plan: &Plan, target: &Target) -> crate::speed::StepTime {
        crate::speed::step_time(spec, plan, &self.fixes, target)
    }
}

impl WithFixes {
    /// [`Estimator::estimate`] with the backward working sets of `backward`
    /// ([`MemoryModel::estimate_with`]).
    pub fn estimate_with(
        &self,
        spec: &ModelSpec,
        plan: &Plan,
        target: &Target,
        backward: Backward,
    ) -> Breakdown {
        estimate(spec, plan, target, &self.fixes, backward)
    }
}

fn estimate(
    spec: &ModelSpec,
    plan: &Plan,
    target: &Target,
    fixes: &[Arc<dyn Strategy>],
    backward: Backward,
) -> Breakdown {
    let (facts, s) = trained_state(spec, plan, fixes);
    let p = facts.parameters;
    let cb = plan.precision.compute_bytes();
    let exec = Execution::for_plan(plan, fixes);
    let mut act = activation_bytes_for(spec, plan, &exec, backward);
    if *target == Target::Cpu {
        widen_cpu_bf16_matmuls(&mut act, spec, plan, &exec);
        add_cpu_head_backward(&mut act, spec, plan, &exec, backward);
    }
    // A frozen weight converted for the pass, while the backward crosses a block.
    act.blocks.transient += s.pass_transient;
    // Host memory: the fixes' (an offloaded optimizer's) and the segment
    // inputs kept there.
    let host = s.host + act.host;
    let runtime = target.runtime_bytes();
    let pool_slack =
        target.pool_slack_bytes(spec.config.layers, spec.config.intermediate, plan, &exec);
    let communicator = target.communicator_bytes(plan.shard.world_size);
    // Outside the tensors, at every moment.
    let outside = runtime + communicator;

    // Alive at every moment of the backward.
    let state =
        s.weights + s.master_weights + s.optimizer_state + s.accumulated_gradients + outside;
    // The stem's own gradients come last (none under LoRA: it is frozen).
    let stem_gradients = match plan.lora {
        Some(_) => 0,
        None => (stem_only_parameters(spec).min(p) * cb).min(s.gradients),
    };
    let block_gradients = s.gradients - stem_gradients;
    // With checkpointing, the last segment's recompute: every segment's
    // input is alive, and only the head's gradients and the segment's own
    // exist (the blocks' share, less the earlier blocks').
    let (last_segment, last_segment_gradients) = match exec.checkpoint {
        Checkpointing::Every(k) if k > 0 => {
            let layers = spec.config.layers.max(1) as u64;
            let recomputed = (k as u64).min(layers);
            let gradients = match plan.lora {
                Some(_) => s.gradients * recomputed / layers,
                None => {
                    let earlier_params = (layers - recomputed) * spec.config.block_parameters();
                    let trained = p.saturating_sub(stem_only_parameters(spec)).max(1);
                    let earlier_bytes = u128::from(block_gradients)
                        * u128::from(earlier_params.min(trained))
                        / u128::from(trained);
                    block_gradients - earlier_bytes as u64
                }
            };
            let moment = Moment {
                activations: act.blocks.activations + act.later_segment_inputs,
                transient: act.blocks.transient,
            };
            (moment, gradients)
        }
        _ => (Moment::default(), 0),
    };
    let after = AfterBackward::of(plan, &s, p, facts.largest_tensor, target);
    let accumulation = Moment {
        activations: 0,
        transient: after.first_sum,
    };
    let moments = [
        (PeakMoment::LossBackward, act.loss, 0),
        (
            PeakMoment::SegmentRecompute,
            last_segment,
            last_segment_gradients,
        ),
        (PeakMoment::Backward, act.blocks, block_gradients),
        (PeakMoment::Backward, act.embedding, s.gradients),
        (PeakMoment::Backward, accumulation, s.gradients),
    ];
    let (backward_phase, moment, backward) = moments
        .into_iter()
        .map(|(phase, m, grads)| (phase, m, state + grads + m.total()))
        .fold((PeakMoment::Backward, Moment::default(), 0), |best, x| {
            if x.2 > best.2 {
                x
            } else {
                best
            }
        });
    // A sharded plan's reduction of a micro-batch's gradients (stage 1
    // reduces the step's sums: the accumulated ones, or the gradients
    // themselves with one micro-batch).
    let reduction = (s.collective_bucket > 0).then(|| {
        let local = if plan.shard.stage >= 2 || s.accumulated_gradients == 0 {
            s.gradients
        } else {
            0
        };
        state + local + after.reduced + after.buffers
    });
    let step = step_bytes(&s, &after, 0) + outside;
    let (peak, peak_phase, collective_buffers) = assemble_peak(
        &[
            (backward, backward_phase, 0),
            (
                reduction.unwrap_or(0),
                PeakMoment::GradientReduction,
                after.buffers,
            ),
            (step, PeakMoment::OptimizerStep, after.broadcast),
        ],
        host,
        target,
        pool_slack,
    );
    Breakdown {
        weights: s.weights,
        master_weights: s.master_weights,
        gradients: s.gradients,
        accumulated_gradients: s.accumulated_gradients,
        optimizer_state: s.optimizer_state,
        activations: moment.activations,
        backward_transient: moment.transient,
        optimizer_transient: s.optimizer_transient,
        runtime,
        pool_slack,
        communicator,
        collective_buffers,
        peak,
        peak_phase,
        host,
    }
}

/// The bytes of the optimizer step's moment: the state it holds (its
/// weights, masters, moments, gradients and temporaries), `extra` bytes the
/// estimator adds, and the owners' broadcast; without what is outside the
/// tensors.
pub(crate) fn step_bytes(s: &StateBytes, after: &AfterBackward, extra: u64) -> u64 {
    s.step_weights
        + extra
        + s.master_weights
        + s.optimizer_state
        + s.step_gradients
        + s.optimizer_transient
        + after.broadcast
}

/// A step's peak from the bytes of its moments, `(bytes, moment, collective
/// buffers held then)` in the step's order: the highest (the first of
/// equals), with on the CPU the `host` bytes an offloaded optimizer keeps
/// (the same memory as the device's), rounded to the allocator's
/// granularity, plus the pool's slack; `u64::MAX` when a moment's bytes are
/// unknown (`u64::MAX`). Every estimator assembles its peak here.
pub(crate) fn assemble_peak(
    moments: &[(u64, PeakMoment, u64)],
    host: u64,
    target: &Target,
    pool_slack: u64,
) -> (u64, PeakMoment, u64) {
    let (live, moment, buffers) =
        moments
            .iter()
            .copied()
            .fold((0, PeakMoment::Backward, 0), |best, x| {
                if x.0 > best.0 {
                    x
                } else {
                    best
                }
            });
    if live == u64::MAX {
        return (u64::MAX, moment, 0);
    }
    let host_shared = if *target == Target::Cpu { host } else { 0 };
    (
        target.round_up(live + host_shared) + pool_slack,
        moment,
        buffers,
    )
}

/// What a step holds after its backward besides the training state, for
/// every estimator ([`MemoryModel`], [`crate::anymodel::MeasuredModel`]).
pub(crate) struct AfterBackward {
    /// The first step's local accumulation adds the second micro-batch's
    /// gradients into sums it does not own yet (the first micro-batch's
    /// gradients): one new sum at a time (the largest tensor) beside both;
    /// later steps add in place. ZeRO 2-3 accumulate the reduced share,
    /// below the gradient reduction's moment: 0 there.
    pub first_sum: u64,
    /// What the collective backend holds for the largest bucket of a
    /// gradient reduction ([`Target::collective_buffer_bytes`]; 0 unsharded).
    pub buffers: u64,
    /// What a gradient reduction holds besides the local gradients and the
    /// buffers: at ZeRO 1 the owned share of the reduced gradients (kept
    /// for the step) and, when the accumulator keeps the sums being sent,
    /// the bucket's flat copy of them.
    pub reduced: u64,
    /// The buffers of the owners' broadcast of their updated parameters in
    /// the step (ZeRO 1 and 2; stage 3 frees them instead).
    pub broadcast: u64,
}

impl AfterBackward {
    /// Of `plan` with the state `s` of a model of `parameters`, the largest
    /// tensor of `largest` elements, on `target`.
    pub(crate) fn of(
        plan: &Plan,
        s: &StateBytes,
        parameters: u64,
        largest: u64,
        target: &Target,
    ) -> Self {
        let first_sum = if plan.grad_accum > 1 && plan.shard.stage <= 1 {
            largest * (s.accumulated_gradients / parameters.max(1))
        } else {
            0
        };
        let cb = plan.precision.compute_bytes();
        let buffers = target.collective_buffer_bytes(s.reduction_bucket, cb);
        let reduced = if plan.shard.stage == 1 && s.collective_bucket > 0 {
            let flat = if plan.grad_accum > 1 {
                s.reduction_bucket * cb
            } else {
                0
            };
            plan.per_rank(s.gradients, 1) + flat
        } else {
            0
        };
        let broadcast = if (1..=2).contains(&plan.shard.stage) {
            target.collective_buffer_bytes(s.collective_bucket, cb)
        } else {
            0
        };
        AfterBackward {
            first_sum,
            buffers,
            reduced,
            broadcast,
        }
    }
}

/// Parameters only the embedding stem uses (position and token-type tables,
/// BERT's embedding norm, an untied token embedding): their gradients are made
/// by the last operation of the backward, after every block's.
pub fn stem_only_parameters(spec: &ModelSpec) -> u64 {
    let c = &spec.config;
    let (h, v, positions) = (c.hidden as u64, c.vocab as u64, c.max_positions as u64);
    match c.family {
        Family::Gpt2 => positions * h,
        Family::Llama if c.tied_embeddings => 0,
        Family::Llama => v * h,
        Family::Bert => (positions + 2) * h + 2 * h,
        Family::Generic => 0,
    }
}

#[cfg(test)]
mod tests;
