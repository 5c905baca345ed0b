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

mod activations;
mod runtime;

pub use activations::{
    activation_bytes, embedding_backward_copies, mlp_backward_ni, widen_cpu_bf16_matmuls,
    Activations, Moment, EMBEDDING_BACKWARD_COPIES, HEAD_WEIGHT_BACKWARD_COPIES, LOSS_BACKWARD_NV,
};
pub use runtime::{Target, CUBLAS_WORKSPACE_BYTES, CUDA_CONTEXT_BYTES, CUDA_POOL_SLACK};

use crate::spec::{Family, ModelSpec};
use oomfix_strategies::{OptimizerImpl, Plan};
use serde::Serialize;

/// The moment of the step at which the peak occurs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// The backward through the loss and the head (activations and the loss's
    /// working set alive, no parameter gradient yet).
    LossBackward,
    /// End of backward (activations and fresh gradients both alive).
    #[default]
    Backward,
    /// Inside the optimizer step.
    OptimizerStep,
}

impl std::fmt::Display for Phase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Phase::LossBackward => "loss backward",
            Phase::Backward => "end of backward",
            Phase::OptimizerStep => "optimizer step",
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
    /// Peak device bytes over the step: live bytes, runtime and pool slack.
    pub peak: u64,
    /// When the peak occurs.
    pub peak_phase: Phase,
    /// Host memory the plan needs besides the device's, not part of `peak`:
    /// with the optimizer offloaded, the fp32 master weights and moments, plus
    /// staging tensors in the compute dtype (gradients down, weights back up);
    /// 0 otherwise. On [`Target::Cpu`] this is the same memory as the peak's
    /// (the planner does not offload there; an offloaded plan estimated for
    /// the CPU needs `peak + host`).
    pub host: u64,
}

impl Breakdown {
    /// The components as `(name, bytes)`, in display order.
    pub fn components(&self) -> [(&'static str, u64); 10] {
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
            Phase::LossBackward => !matches!(component, "gradients" | "optimizer_transient"),
            Phase::Backward => component != "optimizer_transient",
            Phase::OptimizerStep => !matches!(component, "activations" | "backward_transient"),
        }
    }
}

/// Anything that predicts a plan's memory.
pub trait Estimator: Send + Sync {
    /// Bytes per component and the peak, on one device.
    fn estimate(&self, spec: &ModelSpec, plan: &Plan, target: &Target) -> Breakdown;
}

/// The analytic model documented in this module.
#[derive(Debug, Clone, Copy, Default)]
pub struct MemoryModel;

/// How many times the largest parameter tensor `candle_nn::AdamW` holds in
/// temporaries during its per-tensor update: each of its 14 elementwise ops (measured)
/// allocates a full-size output, and since the moments are `Var`s the outputs
/// stay referenced by the graph until the tensor's update ends.
pub const CANDLE_ADAMW_TEMPORARIES: u64 = 14;

impl Estimator for MemoryModel {
    fn estimate(&self, spec: &ModelSpec, plan: &Plan, target: &Target) -> Breakdown {
        let p = spec.parameters();
        let n = plan.shard.world_size.max(1) as u64;
        let stage = if n > 1 { plan.shard.stage } else { 0 };
        let cb = plan.precision.compute_bytes();
        let shard = |bytes: u64, from_stage: u8| {
            if stage >= from_stage {
                bytes.div_ceil(n)
            } else {
                bytes
            }
        };

        // Weights: during forward and backward every rank holds all compute weights
        // (stage 3 gathers them all before the forward); between steps and in the
        // optimizer step only its shard.
        let weights = p * cb;
        let offloaded = plan.optimizer.is_offloaded();
        let master_weights = if plan.precision.is_mixed() && !offloaded {
            shard(4 * p, 1)
        } else {
            0
        };
        let gradients = p * cb;
        let accumulated_gradients = if plan.grad_accum > 1 {
            shard(p * cb, 2)
        } else {
            0
        };
        let optimizer_state = if offloaded { 0 } else { shard(8 * p, 1) };
        let host = if offloaded {
            shard(12 * p, 1) + shard(gradients, 2)
        } else {
            0
        };
        let mut act = activation_bytes(spec, plan);
        if *target == Target::Cpu {
            widen_cpu_bf16_matmuls(&mut act, spec, plan);
        }
        let optimizer_transient = optimizer_transient(spec, plan);
        let runtime = target.runtime_bytes();
        let pool_slack = target.pool_slack_bytes();

        // Alive at every moment of the backward.
        let state = weights + master_weights + optimizer_state + accumulated_gradients + runtime;
        let block_gradients = gradients - stem_only_parameters(spec).min(p) * cb;
        let moments = [
            (Phase::LossBackward, act.loss, 0),
            (Phase::Backward, act.blocks, block_gradients),
            (Phase::Backward, act.embedding, gradients),
        ];
        let (backward_phase, moment, backward) = moments
            .into_iter()
            .map(|(phase, m, grads)| (phase, m, state + grads + m.total()))
            .fold((Phase::Backward, Moment::default(), 0), |best, x| {
                if x.2 > best.2 {
                    x
                } else {
                    best
                }
            });
        let step_weights = shard(weights, 3);
        let step = step_weights
            + master_weights
            + optimizer_state
            + shard(gradients, 2)
            + optimizer_transient
            + runtime;
        let (peak, peak_phase) = if step > backward {
            (step, Phase::OptimizerStep)
        } else {
            (backward, backward_phase)
        };
        Breakdown {
            weights,
            master_weights,
            gradients,
            accumulated_gradients,
            optimizer_state,
            activations: moment.activations,
            backward_transient: moment.transient,
            optimizer_transient,
            runtime,
            pool_slack,
            peak: target.round_up(peak) + pool_slack,
            peak_phase,
            host,
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

/// Temporaries of the optimizer step on one rank.
///
/// * `candle_nn::AdamW`: [`CANDLE_ADAMW_TEMPORARIES`] copies of the largest
///   tensor (its per-tensor update allocates that many full-size outputs), plus,
///   under mixed precision, the fp32 copy of the one 16-bit gradient being
///   stepped (the trainer steps one tensor at a time and upcasts just its grad).
/// * fused AdamW: updates in place and reads 16-bit gradients directly: nothing.
/// * offloaded AdamW: a strided gradient made contiguous on the device before
///   its copy to the host, one at a time (the largest tensor in the compute
///   dtype); the weights come back into their own storage.
pub fn optimizer_transient(spec: &ModelSpec, plan: &Plan) -> u64 {
    match plan.optimizer {
        OptimizerImpl::FusedAdamW => 0,
        OptimizerImpl::OffloadedAdamW => plan.precision.compute_bytes() * spec.largest_tensor(),
        OptimizerImpl::CandleAdamW => {
            let upcast = if plan.precision.is_mixed() {
                4 * spec.largest_tensor()
            } else {
                0
            };
            CANDLE_ADAMW_TEMPORARIES * 4 * spec.largest_tensor() + upcast
        }
    }
}

#[cfg(test)]
mod tests;
