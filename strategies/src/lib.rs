//! Memory-saving training mechanisms for [candle](https://github.com/huggingface/candle),
//! and the plan they act on.
//!
//! Each fix lives in one module and is one [`Strategy`]:
//!
//! * its planner half rewrites a [`Plan`] (pure and cheap: used by a planner to
//!   search for a configuration that fits a memory budget);
//! * its memory hook sets its terms of the training state's bytes
//!   ([`memory`]), which a memory model adds activations to;
//! * its execution hook says what a forward/backward pass does for it
//!   ([`Execution`]);
//! * beside it, in the same module, the candle mechanism that executes that
//!   part of the plan in a real training loop (gradient accumulation, mixed
//!   precision with loss scaling, memory-efficient attention, the LM loss in
//!   chunks of tokens, activation checkpointing, a fused in-place AdamW,
//!   ZeRO-style sharding, AdamW offloaded to the host, low-rank adapters on
//!   frozen, optionally 4-bit, base weights).
//!
//! [`builtins`] is the one list of built-in fixes, in their default order; a
//! [`Pipeline`] is an ordered list of fixes. The order is the product: the
//! default order applies the cheapest fix first. How to add a fix:
//! `strategies/README.md`.
//!
//! [`nn`] holds what any candle model needs to train at all: layers with
//! `candle_nn`'s names and shapes built on ops with their own backward (fused
//! norms, projections, activations, RoPE, embedding, attention probabilities)
//! and a fused cross-entropy, in place of candle's fast paths that have none.
//!
//! ```
//! use oomfix_strategies::{Pipeline, Plan, SearchContext};
//!
//! let pipeline = Pipeline::default();
//! assert_eq!(
//!     pipeline.names(),
//!     [
//!         "accumulate", "precision", "flash-attention", "chunked-loss", "checkpoint",
//!         "fused-adamw", "offload-activations", "tiled-mlp", "shard", "offload", "lora",
//!     ]
//! );
//!
//! // Tighten a plan step by step with the first fix: micro-batch 8 -> 4 -> 2 -> 1.
//! let ctx = SearchContext::new(8, 12);
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

use std::sync::Arc;

pub mod accumulate;
pub mod adamw;
pub mod attention;
pub mod checkpoint;
pub mod chunked_loss;
pub mod clip;
pub mod compare;
#[cfg(feature = "cuda")]
mod cuda;
mod custom_op;
mod error;
mod execution;
mod facts;
mod float;
mod intern;
mod kernel_cache;
pub mod lora;
pub mod memory;
pub mod model;
pub mod nn;
pub mod offload;
pub mod offload_activations;
mod plan;
pub mod precision;
mod reduce;
mod seed;
pub mod shard;
pub mod tiled_mlp;

/// CUDA C prepended to every NVRTC kernel source of this crate:
/// the 16-bit float types (`Bf16`, `F16`, raw bits) and their conversions to
/// and from f32 (round to nearest even, as the `half` crate converts).
#[cfg(feature = "cuda")]
pub const CUDA_HALF_PRELUDE: &str = include_str!("half.cuh");

pub use error::{Error, Result};
pub use execution::{Execution, Part, PartRun, Parts, SegmentInputs};
pub use memory::{ModelFacts, StateBytes, StepCost};
pub use plan::{
    Attention, Checkpointing, Extensions, OptimizerImpl, Plan, Precision, Sharding, MAX_EXTENSIONS,
};

/// What a strategy may look at besides the plan itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
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
    /// What the model can do for the fixes that need its help
    /// ([`model::Capabilities`]): a fix whose needs it lacks is skipped
    /// ([`Strategy::unusable`]).
    pub model: model::Capabilities,
}

impl SearchContext {
    /// A search for `global_batch` sequences per optimizer step on a model of
    /// `layers` blocks, on one GPU that computes in bf16, has a flash
    /// attention kernel and memory apart from the host's, for a model that
    /// can take every fix ([`model::Capabilities::ALL`]; change the public
    /// fields for another device or model).
    pub fn new(global_batch: usize, layers: usize) -> Self {
        SearchContext {
            global_batch,
            gpus: 1,
            supports_bf16: true,
            flash_attention: true,
            layers,
            host_offload: true,
            model: model::Capabilities::ALL,
        }
    }
}

/// One memory fix: its planner half and its hooks into the memory model and
/// the training step.
///
/// `tighten` returns the next, more memory-frugal plan this fix can offer, or
/// `None` when it has nothing more to give. `relax` goes the other way: the next
/// faster, less frugal plan, used after a fit to undo what is no longer needed.
/// Both are pure functions of the plan. [`memory`](Strategy::memory) sets the
/// fix's terms of the training state's bytes for a plan, and
/// [`execution`](Strategy::execution) what a forward/backward pass does for it;
/// both do nothing by default and must do nothing for a plan the fix has not
/// touched (every registered fix's hooks run for every plan).
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
    /// Changes what the memory hooks see of the model for `plan`, for a fix
    /// that changes what is trained ([`lora`]: the adapters are trained, the
    /// base model is frozen). Runs for every registered fix before any
    /// [`memory`](Strategy::memory) hook ([`memory::state_of`]). The default
    /// changes nothing.
    fn facts(&self, _plan: &Plan, _facts: &mut ModelFacts) {}
    /// Sets this fix's terms of `state` for `plan` (see [`memory`] for the
    /// order the hooks run in). The default changes nothing.
    fn memory(&self, _plan: &Plan, _model: &ModelFacts, _state: &mut StateBytes) {}
    /// Sets what a forward/backward pass of `plan` does for this fix. The
    /// default changes nothing.
    fn execution(&self, _plan: &Plan, _exec: &mut Execution) {}
    /// Sets this fix's terms of what `plan`'s optimizer step costs
    /// ([`memory::StepCost`]: where it runs, the bytes it moves, the
    /// parameters it steps). The default changes nothing; what a pass
    /// recomputes is the execution hook's, which the time model reads.
    fn time(&self, _plan: &Plan, _model: &ModelFacts, _cost: &mut StepCost) {}
    /// Why this fix cannot be used in the search `ctx` describes (the model
    /// lacks what the fix needs of it: [`model`]'s table), or `None` when it
    /// can. A planner skips an unusable fix and records the reason. The
    /// default: always usable.
    ///
    /// ```
    /// use oomfix_strategies::{checkpoint::Checkpoint, model::Capabilities, SearchContext, Strategy};
    /// let mut ctx = SearchContext::new(8, 12);
    /// assert!(Checkpoint.unusable(&ctx).is_none());
    /// ctx.model = Capabilities::NONE;
    /// assert!(Checkpoint.unusable(&ctx).unwrap().contains("blocks"));
    /// ```
    fn unusable(&self, _ctx: &SearchContext) -> Option<String> {
        None
    }
}

/// The built-in fixes in their default order. This is the one list of them:
/// a new built-in fix is one module plus one line here.
pub fn builtins() -> Vec<Arc<dyn Strategy>> {
    vec![
        Arc::new(accumulate::Accumulate),
        Arc::new(precision::MixedPrecision),
        Arc::new(attention::FlashAttention),
        Arc::new(chunked_loss::ChunkedLoss),
        Arc::new(checkpoint::Checkpoint),
        Arc::new(adamw::FusedAdamWStrategy),
        Arc::new(offload_activations::OffloadActivations),
        Arc::new(tiled_mlp::TiledMlp),
        Arc::new(shard::Shard),
        Arc::new(offload::Offload),
        Arc::new(lora::LoraFix),
    ]
}

/// The fixes whose hooks apply to a plan searched with `pipeline`: the
/// built-in ones in their order, then the pipeline's others in its order.
pub fn registered(pipeline: &Pipeline) -> Vec<Arc<dyn Strategy>> {
    let mut fixes = builtins();
    for fix in pipeline.strategies() {
        if !fixes.iter().any(|f| f.name() == fix.name()) {
            fixes.push(Arc::clone(fix));
        }
    }
    fixes
}

/// An ordered list of strategies: the order in which fixes are applied.
#[derive(Clone)]
pub struct Pipeline {
    strategies: Vec<Arc<dyn Strategy>>,
}

impl Default for Pipeline {
    /// Every built-in fix in the order of [`builtins`]: accumulate, precision,
    /// flash-attention, chunked-loss, checkpoint, fused-adamw,
    /// offload-activations, shard, offload, lora.
    fn default() -> Self {
        Pipeline {
            strategies: builtins(),
        }
    }
}

impl std::fmt::Debug for Pipeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.names()).finish()
    }
}

impl Pipeline {
    /// An empty pipeline (the identity: the baseline plan is the only attempt).
    pub fn new() -> Self {
        Pipeline {
            strategies: Vec::new(),
        }
    }

    /// Appends a strategy; builder style.
    pub fn with(mut self, strategy: impl Strategy + 'static) -> Self {
        self.strategies.push(Arc::new(strategy));
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
        let builtins = builtins();
        let mut p = Pipeline::new();
        for name in names {
            let name = name.as_ref().trim();
            if p.names().contains(&name) {
                return Err(Error::Config(format!("strategy `{name}` is listed twice")));
            }
            let fix = builtins.iter().find(|f| f.name() == name).ok_or_else(|| {
                let known: Vec<&str> = builtins.iter().map(|f| f.name()).collect();
                Error::Config(format!(
                    "unknown strategy `{name}` (known: {})",
                    known.join(", ")
                ))
            })?;
            p.strategies.push(Arc::clone(fix));
        }
        Ok(p)
    }

    /// The strategies in order.
    pub fn strategies(&self) -> &[Arc<dyn Strategy>] {
        &self.strategies
    }

    /// The strategies' names in order.
    pub fn names(&self) -> Vec<&'static str> {
        self.strategies.iter().map(|s| s.name()).collect()
    }
}
