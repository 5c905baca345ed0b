//! Drive the strategy pipeline against a budget.
//!
//! The search starts from the baseline plan (whole batch, fp32, plain autograd,
//! `candle_nn::AdamW`, one device, with the user's [`Pins`] applied), then
//! applies the pipeline's fixes in order, each as many steps as it offers,
//! keeping what earlier fixes did. From the first plan that fits it explores
//! the plans one fix's step away (a fix relaxed or tightened), and from each
//! of those that fits the next ones, and returns the fitting plan with the
//! lowest modelled time per optimizer step ([`crate::speed`]; the global batch
//! is the same for all). The way from the first fit to the chosen plan is
//! recorded step by step; the other plans explored are counted
//! ([`SearchResult::explored`]). With a verifier, the fastest few candidates
//! are measured and the fastest measured one that fits is chosen.
//!
//! A plan fits when its estimated peak plus the headroom ([`Headroom`]) is
//! within the budget, its host memory within the host budget, and, when
//! measured, its measured peak within the budget. Every plan evaluated is an
//! [`Attempt`], logged as a `tracing` span named `attempt`.

mod explore;
mod headroom;
mod hints;
mod longest;
mod pins;
mod result;
mod run;
mod stock_candle;

pub use headroom::{Headroom, CPU_HEADROOM, CUDA_HEADROOM};
pub use hints::HINT_LORA_RANK;
pub use pins::Pins;
pub use result::{
    Attempt, Longest, Measurement, SearchResult, Skipped, Verifier, Verify, MAX_SEQ_LEN,
    MAX_TOKENS_PER_STEP,
};

use crate::memory::{Estimator, Target};
use crate::spec::ModelSpec;
use explore::Explored;
use oomfix_strategies::model::Capabilities;
use oomfix_strategies::{Pipeline, Plan, Strategy};
use std::collections::HashMap;
use std::sync::Arc;

/// Builder for a search; see the crate docs for an example.
pub struct Planner {
    budget: u64,
    global_batch: usize,
    seq_len: Option<usize>,
    target: Target,
    gpus: usize,
    pipeline: Pipeline,
    /// `None`: [`MemoryModel`] with the hooks of the pipeline's fixes.
    estimator: Option<Box<dyn Estimator>>,
    verifier: Option<Box<dyn Verifier>>,
    verify: Verify,
    half: Option<oomfix_strategies::Precision>,
    capabilities: Capabilities,
    pins: Pins,
    headroom: Option<Headroom>,
    host_budget: Option<u64>,
    beyond_context: bool,
}

/// Builder methods of [`Planner`] that each set one field to the value
/// given (`= Some`: to `Some` of it, for a field that is optional).
macro_rules! setters {
    ($($(#[$doc:meta])* $name:ident($value:ident: $ty:ty) => $field:ident $(= $wrap:ident)?;)*) => {$(
        $(#[$doc])*
        pub fn $name(mut self, $value: $ty) -> Self {
            self.$field = setters!(@value $value $($wrap)?);
            self
        }
    )*};
    (@value $value:ident) => { $value };
    (@value $value:ident $wrap:ident) => { $wrap($value) };
}

impl Planner {
    /// A planner for `budget_bytes` per device with the defaults: global batch 8,
    /// the model's sequence length (at most 1024), `cuda:0`, one GPU, the default pipeline.
    pub fn new(budget_bytes: u64) -> Self {
        Planner {
            budget: budget_bytes,
            global_batch: 8,
            seq_len: None,
            target: Target::Cuda(0),
            gpus: 1,
            pipeline: Pipeline::default(),
            estimator: None,
            verifier: None,
            verify: Verify::Off,
            half: None,
            capabilities: Capabilities::ALL,
            pins: Pins::default(),
            headroom: None,
            host_budget: None,
            beyond_context: false,
        }
    }

    setters! {
        /// Whether a sequence length beyond the model's context
        /// (`max_position_embeddings`) is planned (default: no, a usage error).
        /// A model with rotary positions computes positions past its context,
        /// but was not trained on them; a model with learned positions has none
        /// there and is refused either way.
        allow_beyond_context(allow: bool) => beyond_context;
        /// Plan fields the search keeps as given.
        pins(pins: Pins) => pins;
        /// The margin a plan must leave below the budget (default:
        /// [`Headroom::default_for`] the target).
        headroom(headroom: Headroom) => headroom = Some;
        /// Host memory available to offloaded optimizer state and activations
        /// (default: unbounded).
        host_budget(bytes: u64) => host_budget = Some;
        /// Sequences per optimizer step (held constant by every fix).
        global_batch(n: usize) => global_batch;
        /// Tokens per sequence.
        seq_len(n: usize) => seq_len = Some;
        /// The device the plan is for.
        target(target: Target) => target;
        /// Devices available to the sharding fix.
        gpus(n: usize) => gpus;
        /// The fixes to apply, in order.
        pipeline(pipeline: Pipeline) => pipeline;
        /// The 16-bit type of the precision fix (`None`: bf16 where the device has it, else fp16).
        half_precision(half: Option<oomfix_strategies::Precision>) => half;
        /// What the model can do for the fixes that need its help (default:
        /// everything, as oomfix's own model families can); a fix whose needs
        /// the model lacks is skipped and recorded in [`SearchResult::skipped`].
        model_capabilities(capabilities: Capabilities) => capabilities;
    }

    /// Replaces the analytic memory model.
    pub fn estimator(mut self, estimator: impl Estimator + 'static) -> Self {
        self.estimator = Some(Box::new(estimator));
        self
    }

    /// Measures attempts with real steps (`mode` says which).
    pub fn verify_with(mut self, verifier: impl Verifier + 'static, mode: Verify) -> Self {
        self.verifier = Some(Box::new(verifier));
        self.verify = mode;
        self
    }

    /// The device planned for.
    pub(crate) fn target_of(&self) -> Target {
        self.target
    }

    /// The fixes searched, in order.
    pub(crate) fn pipeline_of(&self) -> &Pipeline {
        &self.pipeline
    }

    /// The budget per device.
    pub(crate) fn budget_of(&self) -> u64 {
        self.budget
    }

    /// The sequence length used for `spec`: as set, else the model's maximum, capped at 1024.
    pub fn seq_len_for(&self, spec: &ModelSpec) -> usize {
        self.seq_len
            .unwrap_or_else(|| match spec.config.max_positions {
                0 => 1024,
                m => m.min(1024),
            })
    }
}

/// State of one search.
struct Run<'a> {
    planner: &'a Planner,
    estimator: &'a dyn Estimator,
    spec: &'a ModelSpec,
    headroom: Headroom,
    attempts: Vec<Attempt>,
    /// Every plan estimated: whether its estimate fits, its modelled time,
    /// and the plan and fix it was reached from.
    explored: HashMap<Plan, Explored>,
    /// The pipeline's fixes the model can take, in order.
    usable: Vec<Arc<dyn Strategy>>,
}
