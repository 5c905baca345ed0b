//! The fixes' side of the memory model: the training state's bytes on one
//! rank, which each fix's [`Strategy::memory`] hook
//! sets for its part of a plan.
//!
//! A memory model (oomfix's is one) starts from [`StateBytes::unfixed`] (fp32
//! everything, `candle_nn::AdamW`, one rank), calls every registered fix's
//! hook in the registry's order, and adds what depends on the model's op
//! sequence (activations and the backward's working set) itself. The
//! built-in hooks, in order: `accumulate` adds the accumulated gradients,
//! `precision` the 16-bit compute copies and fp32 master weights,
//! `fused-adamw` the optimizer step's temporaries, `shard` divides what each
//! ZeRO stage shards, `offload` moves master weights and moments to the host.
//! `flash-attention` and `checkpoint` change activations only, which the
//! memory model reads from the [`Execution`](crate::Execution) their
//! execution hooks make; `lora` adds the frozen base weights and the one
//! weight a pass dequantizes at a time.
//!
//! Before the memory hooks, each fix's [`Strategy::facts`]
//! hook may change what is trained: under `lora` the trained parameters are
//! the adapters' and the base model's are frozen ([`state_of`] runs both).
//!
//! A step-time model does the same with the optimizer step's costs: it
//! starts from [`StepCost::unfixed`] (`candle_nn::AdamW` over every
//! parameter on the device) and calls every registered fix's
//! [`Strategy::time`] hook: `fused-adamw` makes the
//! step one pass over the state, `shard` steps this rank's share,
//! `offload` moves the step to the host and its traffic onto the bus.

use crate::{Plan, Strategy};
use std::sync::Arc;

pub use crate::facts::{Linear, ModelFacts, MAX_LINEARS};

/// How many times the largest parameter tensor `candle_nn::AdamW` holds in
/// temporaries during its per-tensor update: each of its 14 elementwise ops
/// (measured) allocates a full-size output, and since the moments are `Var`s
/// the outputs stay referenced by the graph until the tensor's update ends.
pub const CANDLE_ADAMW_TEMPORARIES: u64 = 14;

/// What one optimizer step costs on one rank besides the forward and
/// backward passes, term by term: the fixes' time terms, which a step-time
/// model turns into seconds with its device's rates.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
#[non_exhaustive]
pub struct StepCost {
    /// Parameters this rank's optimizer steps (all, or its ZeRO share).
    pub stepped_parameters: f64,
    /// Device memory traffic of the step per stepped parameter, in bytes.
    pub device_bytes_per_parameter: f64,
    /// Host bus traffic per stepped parameter, in bytes (gradients down,
    /// weights back up).
    pub bus_bytes_per_parameter: f64,
    /// Whether the host's CPU runs the step (then at its own rate per
    /// parameter).
    pub on_host: bool,
}

impl StepCost {
    /// `candle_nn::AdamW` on the device over every parameter of `model`, in
    /// `plan`'s precision: each of its [`CANDLE_ADAMW_TEMPORARIES`]
    /// elementwise ops writes a full-size fp32 output that the next reads,
    /// over the fp32 weights, gradients and moments, and under mixed
    /// precision the gradient's upcast and the weights' copy back.
    ///
    pub fn unfixed(plan: &crate::Plan, model: &ModelFacts) -> Self {
        let bytes = plan.precision.compute_bytes() as f64;
        let temporaries = CANDLE_ADAMW_TEMPORARIES as f64;
        let mixed = if plan.precision.is_mixed() {
            4.0 + 2.0 * bytes
        } else {
            0.0
        };
        StepCost {
            stepped_parameters: model.parameters as f64,
            device_bytes_per_parameter: 2.0 * 4.0 * temporaries + 2.0 * 4.0 * 3.0 + mixed,
            bus_bytes_per_parameter: 0.0,
            on_host: false,
        }
    }
}

/// Bytes of training state on one rank (activations excluded), term by term.
///
/// Terms named `step_*` are what the optimizer step holds, where it differs
/// from what forward and backward hold (ZeRO stage 3 shards the weights
/// between steps but gathers them for the passes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct StateBytes {
    /// Compute weights during forward and backward.
    pub weights: u64,
    /// Compute weights during the optimizer step.
    pub step_weights: u64,
    /// fp32 master weights kept beside 16-bit compute weights.
    pub master_weights: u64,
    /// The most gradients the backward holds at once: the full set, or
    /// less where each segment's are reduced as soon as they are made.
    pub gradients: u64,
    /// Gradients held during the optimizer step.
    pub step_gradients: u64,
    /// The accumulated gradients carried between micro-batches.
    pub accumulated_gradients: u64,
    /// Optimizer moments.
    pub optimizer_state: u64,
    /// Temporaries of the optimizer step.
    pub optimizer_transient: u64,
    /// Host memory the plan needs besides the device's.
    pub host: u64,
    /// Elements of the largest bucket one collective call moves (0 on one
    /// rank). What the collective backend holds for it besides the bucket
    /// (copies, its output) depends on the backend: the memory model counts it.
    pub collective_bucket: u64,
    /// Elements of the largest bucket of a gradient reduction:
    /// `collective_bucket`, or fewer where each segment's gradients are
    /// reduced on their own (0 on one rank).
    pub reduction_bucket: u64,
    /// What a forward or backward pass holds besides activations while it
    /// crosses a block: a frozen weight converted to the compute dtype, one
    /// at a time (`lora`).
    pub pass_transient: u64,
}

impl StateBytes {
    /// The state of a plan with no fix: fp32 weights and gradients, AdamW's
    /// two fp32 moments, nothing accumulated, sharded or offloaded.
    pub fn unfixed(model: &ModelFacts) -> Self {
        let p = model.parameters;
        StateBytes {
            weights: 4 * p,
            step_weights: 4 * p,
            master_weights: 0,
            gradients: 4 * p,
            step_gradients: 4 * p,
            accumulated_gradients: 0,
            optimizer_state: 8 * p,
            optimizer_transient: 0,
            host: 0,
            collective_bucket: 0,
            reduction_bucket: 0,
            pass_transient: 0,
        }
    }
}

/// The facts the memory hooks see for `plan` (`model` changed by each of
/// `fixes`' [`facts`](Strategy::facts) hooks in order) and the training
/// state's bytes: the unfixed state of those facts, changed by each fix's
/// [`memory`](Strategy::memory) hook in order.
pub fn state_of(
    plan: &Plan,
    model: &ModelFacts,
    fixes: &[Arc<dyn Strategy>],
) -> (ModelFacts, StateBytes) {
    let mut facts = *model;
    for fix in fixes {
        fix.facts(plan, &mut facts);
    }
    let mut state = StateBytes::unfixed(&facts);
    for fix in fixes {
        fix.memory(plan, &facts, &mut state);
    }
    (facts, state)
}
