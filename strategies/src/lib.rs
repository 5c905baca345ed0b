//! Memory-saving training mechanisms for [candle](https://github.com/huggingface/candle),
//! and the plan they act on.
//!
//! Each fix lives in one module and has two halves:
//!
//! * a [`Strategy`] that rewrites a [`Plan`] (pure and cheap: used by a planner to
//!   search for a configuration that fits a memory budget), and
//! * the candle mechanism that executes that part of the plan in a real training
//!   loop (gradient accumulation, mixed precision with loss scaling,
//!   memory-efficient attention, activation checkpointing, a fused in-place
//!   AdamW, ZeRO-style sharding, AdamW offloaded to the host).
//!
//! [`nn`] holds what any candle model needs to train at all: layers with
//! `candle_nn`'s names and shapes built on ops with their own backward (fused
//! norms, projections, activations, RoPE, embedding, attention probabilities)
//! and a fused cross-entropy, in place of candle's fast paths that have none.
//!
//! A [`Pipeline`] is an ordered list of strategies. The order is the product: the
//! default order applies the cheapest fix first.
//!
//! ```
//! use oomfix_strategies::{Pipeline, Plan, SearchContext};
//!
//! let pipeline = Pipeline::default();
//! assert_eq!(
//!     pipeline.names(),
//!     ["accumulate", "precision", "flash-attention", "checkpoint", "fused-adamw", "shard", "offload"]
//! );
//!
//! // Tighten a plan step by step with the first fix: micro-batch 8 -> 4 -> 2 -> 1.
//! let ctx = SearchContext {
//!     global_batch: 8, gpus: 1, supports_bf16: true, flash_attention: true, layers: 12, host_offload: true,
//! };
//! let mut plan = Plan::baseline(8, 1024);
//! let mut seen = vec![plan.micro_batch];
//! while let Some(next) = pipeline.strategies()[0].tighten(&plan, &ctx) {
//!     plan = next;
//!     seen.push(plan.micro_batch);
//! }
//! assert_eq!(seen, [8, 4, 2, 1]);
//! assert_eq!(plan.grad_accum, 8); // global batch kept
//! ```

#![warn(missing_docs)]

pub mod accumulate;
pub mod adamw;
pub mod attention;
pub mod checkpoint;
#[cfg(feature = "cuda")]
mod cuda;
mod error;
pub mod nn;
pub mod offload;
mod plan;
pub mod precision;
mod reduce;
pub mod shard;

/// CUDA C prepended to every NVRTC kernel source of this crate:
/// the 16-bit float types (`Bf16`, `F16`, raw bits) and their conversions to
/// and from f32 (round to nearest even, as the `half` crate converts).
#[cfg(feature = "cuda")]
pub const CUDA_HALF_PRELUDE: &str = include_str!("half.cuh");

pub use error::{Error, Result};
pub use plan::{Attention, Checkpointing, OptimizerImpl, Plan, Precision, Sharding};

/// What a strategy may look at besides the plan itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SearchContext {
    /// Sequences per optimizer step, summed over micro-batches and ranks; held constant.
    pub global_batch: usize,
    /// Devices available for sharding.
    pub gpus: usize,
    /// Whether the device computes in bf16 (else 16-bit compute means f16 with loss scaling).
    pub supports_bf16: bool,
    /// Whether the device has a kernel for [`attention::flash_attention`] (the CPU does).
    pub flash_attention: bool,
    /// Number of transformer blocks (bounds the checkpointing interval).
    pub layers: usize,
    /// Whether the device's memory is apart from the host's, so that optimizer
    /// state can move to the host ([`offload`]): GPUs, not the CPU.
    pub host_offload: bool,
}

/// One memory fix, seen from the planner's side.
///
/// `tighten` returns the next, more memory-frugal plan this fix can offer, or
/// `None` when it has nothing more to give. `relax` goes the other way: the next
/// faster, less frugal plan, used after a fit to undo what is no longer needed.
/// Both are pure functions of the plan.
pub trait Strategy: Send + Sync {
    /// Short, stable name used on the command line and in logs (`accumulate`, `shard`, …).
    fn name(&self) -> &'static str;
    /// The next plan that uses less memory, or `None` if this fix is exhausted.
    fn tighten(&self, plan: &Plan, ctx: &SearchContext) -> Option<Plan>;
    /// The next plan that is faster (and may use more memory), or `None`.
    /// The default never relaxes.
    fn relax(&self, _plan: &Plan, _ctx: &SearchContext) -> Option<Plan> {
        None
    }
}

/// An ordered list of strategies: the order in which fixes are applied.
pub struct Pipeline {
    strategies: Vec<Box<dyn Strategy>>,
}

impl Default for Pipeline {
    /// The default order: accumulate, precision, flash-attention, checkpoint,
    /// fused-adamw, shard, offload.
    fn default() -> Self {
        Pipeline::from_names(&Self::DEFAULT_ORDER).expect("default names are valid")
    }
}

impl std::fmt::Debug for Pipeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.names()).finish()
    }
}

impl Pipeline {
    /// Names of the built-in strategies in their default order.
    pub const DEFAULT_ORDER: [&'static str; 7] = [
        "accumulate",
        "precision",
        "flash-attention",
        "checkpoint",
        "fused-adamw",
        "shard",
        "offload",
    ];

    /// An empty pipeline (the identity: the baseline plan is the only attempt).
    pub fn new() -> Self {
        Pipeline {
            strategies: Vec::new(),
        }
    }

    /// Appends a strategy; builder style.
    pub fn with(mut self, strategy: impl Strategy + 'static) -> Self {
        self.strategies.push(Box::new(strategy));
        self
    }

    /// Builds a pipeline from built-in strategy names, in the given order.
    ///
    /// ```
    /// let p = oomfix_strategies::Pipeline::from_names(&["checkpoint", "precision"]).unwrap();
    /// assert_eq!(p.names(), ["checkpoint", "precision"]);
    /// assert!(oomfix_strategies::Pipeline::from_names(&["nope"]).is_err());
    /// ```
    pub fn from_names<S: AsRef<str>>(names: &[S]) -> Result<Self> {
        let mut p = Pipeline::new();
        for name in names {
            let name = name.as_ref().trim();
            if p.names().contains(&name) {
                return Err(Error::Config(format!("strategy `{name}` is listed twice")));
            }
            p.strategies.push(builtin(name).ok_or_else(|| {
                Error::Config(format!(
                    "unknown strategy `{name}` (known: {})",
                    Self::DEFAULT_ORDER.join(", ")
                ))
            })?);
        }
        Ok(p)
    }

    /// The strategies in order.
    pub fn strategies(&self) -> &[Box<dyn Strategy>] {
        &self.strategies
    }

    /// The strategies' names in order.
    pub fn names(&self) -> Vec<&'static str> {
        self.strategies.iter().map(|s| s.name()).collect()
    }
}

fn builtin(name: &str) -> Option<Box<dyn Strategy>> {
    Some(match name {
        "accumulate" => Box::new(accumulate::Accumulate),
        "precision" => Box::new(precision::MixedPrecision),
        "flash-attention" => Box::new(attention::FlashAttention),
        "checkpoint" => Box::new(checkpoint::Checkpoint),
        "fused-adamw" => Box::new(adamw::FusedAdamWStrategy),
        "shard" => Box::new(shard::Shard),
        "offload" => Box::new(offload::Offload),
        _ => return None,
    })
}
