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

use crate::memory::{Backward, Breakdown, Estimator, MemoryModel, Target};
use crate::spec::ModelSpec;
use crate::speed::StepTime;
use crate::{Error, Result};
use oomfix_strategies::lora::{BasePrecision, Lora};
use oomfix_strategies::model::Capabilities;
use oomfix_strategies::{
    Attention, Checkpointing, OptimizerImpl, Pipeline, Plan, Precision, SearchContext, Sharding,
    Strategy,
};
use serde::Serialize;
use std::collections::HashMap;
use std::sync::Arc;

/// A measured step: what a verifier reports for one plan.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Measurement {
    /// Peak bytes allocated during a steady-state step.
    pub peak_bytes: u64,
    /// Peak bytes reserved by the allocator (equal to `peak_bytes` on CPU).
    pub reserved_bytes: u64,
    /// The step ran out of memory (the peak is then a lower bound).
    pub out_of_memory: bool,
    /// Wall time of a steady-state optimizer step in seconds, when timed.
    pub step_seconds: Option<f64>,
}

/// How much of the budget a plan must leave unused: the estimate's margin of
/// error, so that a plan reported as fitting does not run out of memory. A
/// fixed part and a part proportional to the estimated peak, as the
/// estimate's misses are: a few allocations it does not model (the same
/// size whatever the model) and a fraction of what it does.
///
/// ```
/// use oomfix::Headroom;
///
/// let h: Headroom = "1MiB+1%".parse().unwrap();
/// assert_eq!(h, Headroom { fixed: 1 << 20, fraction: 0.01 });
/// assert_eq!(h.bytes(100 << 20), 2 << 20);
/// assert_eq!("5%".parse::<Headroom>().unwrap(), Headroom::fraction(0.05));
/// assert_eq!("512MiB".parse::<Headroom>().unwrap(), Headroom::fixed(512 << 20));
/// assert_eq!(h.to_string(), "1.00 MiB + 1%");
/// assert_eq!("7%".parse::<Headroom>().unwrap().to_string(), "7%");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Headroom {
    /// Bytes kept whatever the estimate.
    pub fixed: u64,
    /// A fraction of the estimated peak kept besides (0.05: 5%).
    pub fraction: f64,
}

/// The default headroom of CPU plans, from docs/accuracy.md's 270
/// configurations: the estimate's largest misses are a fixed amount (at
/// most 1.33 MB below the measured peak, from 11 MB to 570 MB estimates;
/// 7.1% of the smallest), so 1% of the estimate leaves at most 0.70 MiB
/// uncovered, rounded up to 1 MiB.
pub const CPU_HEADROOM: Headroom = Headroom {
    fixed: 1 << 20,
    fraction: 0.01,
};

/// The default headroom of CUDA plans, from what the device held beyond the
/// estimate: the pool's *reserved* peak plus the memory outside it, against
/// this model's estimates, over 254 H200 steps (the accuracy matrix measured
/// twice, docs/pool-reserve-gpu.md; the GPT-2 small and Llama-160M sweeps,
/// docs/sweep.md). The pool's reserve varies from run to run (one
/// configuration reserved 368 MiB beyond its live bytes in one run, 656 MiB
/// in the next): 192 MiB + 3% of the estimate covers every step but two
/// (GPT-2 small at 4 × 2 in fp32, composed attention and every block
/// checkpointed, which reserved 635 MiB more than estimated, 11%).
pub const CUDA_HEADROOM: Headroom = Headroom {
    fixed: 192 << 20,
    fraction: 0.03,
};

impl Headroom {
    /// No headroom: the estimate itself must fit.
    pub const NONE: Headroom = Headroom {
        fixed: 0,
        fraction: 0.0,
    };

    /// A headroom of `bytes` whatever the estimate.
    pub fn fixed(bytes: u64) -> Headroom {
        Headroom {
            fixed: bytes,
            ..Headroom::NONE
        }
    }

    /// A headroom of `fraction` of the estimated peak (0.05: 5%).
    pub fn fraction(fraction: f64) -> Headroom {
        Headroom {
            fraction,
            ..Headroom::NONE
        }
    }

    /// The headroom taken when none is set: measured from the estimate's
    /// error on `target` ([`CPU_HEADROOM`], [`CUDA_HEADROOM`]).
    pub fn default_for(target: &Target) -> Headroom {
        match target {
            Target::Cpu => CPU_HEADROOM,
            Target::Cuda(_) => CUDA_HEADROOM,
        }
    }

    /// Bytes to keep free above an estimated peak of `peak` bytes.
    pub fn bytes(&self, peak: u64) -> u64 {
        let proportional = (peak as f64 * self.fraction.max(0.0)).ceil() as u64;
        self.fixed.saturating_add(proportional)
    }
}

impl std::fmt::Display for Headroom {
    /// `1.00 MiB + 1%`, `5%`, `512.00 MiB`, `0`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let pct = format!("{}%", (self.fraction * 1e4).round() / 100.0);
        match (self.fixed, self.fraction > 0.0) {
            (0, false) => f.write_str("0"),
            (0, true) => f.write_str(&pct),
            (b, false) => f.write_str(&crate::units::format_bytes(b)),
            (b, true) => write!(f, "{} + {pct}", crate::units::format_bytes(b)),
        }
    }
}

impl std::str::FromStr for Headroom {
    type Err = String;
    /// `5%`, `0.5GiB`, `512MiB`, a number of bytes, `0`, or a size and a
    /// percentage joined by `+` (`64MiB+1%`).
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let invalid = || {
            format!(
                "`{s}` is not a headroom (a percentage from 0% to below 100%, a size, \
                 or both joined by `+`, e.g. 64MiB+1%)"
            )
        };
        let mut headroom = Headroom::NONE;
        let (mut sized, mut pct) = (false, false);
        for term in s.split('+').map(str::trim) {
            if let Some(p) = term.strip_suffix('%') {
                match p.trim().parse::<f64>() {
                    Ok(p) if !pct && p.is_finite() && (0.0..100.0).contains(&p) => {
                        headroom.fraction = p / 100.0;
                        pct = true;
                    }
                    _ => return Err(invalid()),
                }
            } else if !sized {
                headroom.fixed = crate::units::parse_bytes(term).map_err(|_| invalid())?;
                sized = true;
            } else {
                return Err(invalid());
            }
        }
        Ok(headroom)
    }
}

/// Plan fields fixed by the user: the search starts from them and never
/// changes them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
#[non_exhaustive]
pub struct Pins {
    /// Sequences per micro-batch.
    pub micro_batch: Option<usize>,
    /// Micro-batches per optimizer step.
    pub grad_accum: Option<usize>,
    /// Compute precision.
    pub precision: Option<Precision>,
    /// Activation checkpointing.
    pub checkpoint: Option<Checkpointing>,
    /// Attention.
    pub attention: Option<Attention>,
    /// Whether the LM loss is computed in chunks of tokens (`chunked-loss`).
    pub chunked_loss: Option<bool>,
    /// Whether the checkpointed segments' inputs wait in host memory
    /// (`offload-activations`).
    pub offload_activations: Option<bool>,
    /// Tokens per tile of the blocks' MLP (`tiled-mlp`); `Some(None)`: untiled.
    pub mlp_tile: Option<Option<usize>>,
    /// Optimizer.
    pub optimizer: Option<OptimizerImpl>,
    /// ZeRO stage (1–3 shard over the planner's GPUs; 0 runs on one).
    pub shard_stage: Option<u8>,
    /// The most bytes one collective of a sharded plan moves (a setting
    /// rather than a searched field: every plan takes it).
    pub bucket_bytes: Option<usize>,
    /// Low-rank adapters to train on the frozen model (`lora`): every plan
    /// carries them; the search starts from their base precision.
    pub lora: Option<Lora>,
    /// The frozen base's storage, kept as given (needs [`lora`](Self::lora)).
    pub base_precision: Option<BasePrecision>,
}

impl Pins {
    /// The names of the pinned fields, as the plan's serde form names them
    /// (`base_precision`: the base of its `lora`).
    pub fn names(&self) -> Vec<&'static str> {
        [
            ("micro_batch", self.micro_batch.is_some()),
            ("grad_accum", self.grad_accum.is_some()),
            ("precision", self.precision.is_some()),
            ("checkpoint", self.checkpoint.is_some()),
            ("attention", self.attention.is_some()),
            ("chunked_loss", self.chunked_loss.is_some()),
            ("offload_activations", self.offload_activations.is_some()),
            ("mlp_tile", self.mlp_tile.is_some()),
            ("optimizer", self.optimizer.is_some()),
            ("shard_stage", self.shard_stage.is_some()),
            ("bucket_bytes", self.bucket_bytes.is_some()),
            ("lora", self.lora.is_some()),
            ("base_precision", self.base_precision.is_some()),
        ]
        .into_iter()
        .filter_map(|(n, pinned)| pinned.then_some(n))
        .collect()
    }

    /// Whether `plan` keeps every pinned field.
    pub fn admit(&self, plan: &Plan) -> bool {
        fn keeps<T: PartialEq>(pin: Option<T>, value: T) -> bool {
            pin.is_none_or(|p| p == value)
        }
        keeps(self.micro_batch, plan.micro_batch)
            && keeps(self.grad_accum, plan.grad_accum)
            && keeps(self.precision, plan.precision)
            && keeps(self.checkpoint, plan.checkpoint)
            && keeps(self.attention, plan.attention)
            && keeps(self.chunked_loss, plan.chunked_loss)
            && keeps(self.offload_activations, plan.offload_activations)
            && keeps(self.mlp_tile, plan.mlp_tile)
            && keeps(self.optimizer, plan.optimizer)
            && keeps(self.shard_stage, plan.shard.stage)
            && self.lora.is_some() == plan.lora.is_some()
            && self
                .base_precision
                .is_none_or(|b| plan.lora.is_some_and(|l| l.base == b))
    }

    /// The baseline plan for `global` sequences of `seq_len` tokens over
    /// `gpus` devices with the pins applied; an error when they contradict
    /// each other or the global batch.
    fn baseline(&self, global: usize, seq_len: usize, gpus: usize) -> Result<Plan> {
        let mut plan = Plan::baseline(global, seq_len);
        if let Some(bytes) = self.bucket_bytes {
            if bytes == 0 {
                return Err(Error::Usage("a bucket must hold at least 1 byte".into()));
            }
            plan.shard.bucket_bytes = bytes;
        }
        if let Some(stage) = self.shard_stage {
            if stage > 3 {
                return Err(Error::Usage(format!(
                    "ZeRO stage {stage} does not exist (0 to 3)"
                )));
            }
            if stage > 0 {
                plan.shard = Sharding {
                    world_size: gpus,
                    stage,
                    ..plan.shard
                };
            }
        }
        let world = plan.shard.world_size;
        if !global.is_multiple_of(world) {
            return Err(Error::Usage(format!(
                "a global batch of {global} does not split over {world} GPUs"
            )));
        }
        let per_rank = global / world;
        let split = |part: usize, what: &str| -> Result<usize> {
            if part == 0 || !per_rank.is_multiple_of(part) {
                return Err(Error::Usage(format!(
                    "a {what} of {part} does not divide the {per_rank} sequences per rank and step"
                )));
            }
            Ok(per_rank / part)
        };
        (plan.micro_batch, plan.grad_accum) = match (self.micro_batch, self.grad_accum) {
            (Some(m), Some(a)) if m * a != per_rank => {
                return Err(Error::Usage(format!(
                    "a micro-batch of {m} times {a} accumulation steps is not the {per_rank} sequences per rank and step"
                )))
            }
            (Some(m), _) => (m, split(m, "micro-batch")?),
            (None, Some(a)) => (split(a, "number of accumulation steps")?, a),
            (None, None) => (per_rank, 1),
        };
        plan.precision = self.precision.unwrap_or(plan.precision);
        plan.checkpoint = self.checkpoint.unwrap_or(plan.checkpoint);
        plan.attention = self.attention.unwrap_or(plan.attention);
        plan.chunked_loss = self.chunked_loss.unwrap_or(plan.chunked_loss);
        if self.offload_activations == Some(true) {
            // Host memory holds what checkpointing keeps: every block
            // checkpointed unless the checkpointing is pinned too.
            if self.checkpoint == Some(Checkpointing::None) {
                return Err(Error::Usage(
                    "--activations host keeps the checkpointed blocks' inputs on the host: \
                     it needs checkpointing, not --checkpoint none"
                        .into(),
                ));
            }
            plan.checkpoint = self.checkpoint.unwrap_or(Checkpointing::Every(1));
            plan.offload_activations = true;
        }
        if let Some(Some(tile)) = self.mlp_tile {
            if tile == 0 || tile > seq_len {
                return Err(Error::Usage(format!(
                    "an MLP tile of {tile} tokens is not within the sequence of {seq_len}"
                )));
            }
        }
        plan.mlp_tile = self.mlp_tile.unwrap_or(plan.mlp_tile);
        plan.optimizer = self.optimizer.unwrap_or(plan.optimizer);
        plan.lora = match (self.lora, self.base_precision) {
            (None, Some(base)) => {
                return Err(Error::Usage(format!(
                    "a base precision ({base}) is the storage of LoRA's frozen weights: it needs a LoRA rank (--lora)"
                )))
            }
            (Some(lora), base) => Some(Lora {
                base: base.unwrap_or(lora.base),
                ..lora
            }),
            (None, None) => None,
        };
        Ok(plan)
    }
}

/// Runs real training steps for a plan and measures them.
pub trait Verifier {
    /// Measures one plan. An error aborts the search; an out-of-memory is a measurement.
    fn measure(&self, spec: &ModelSpec, plan: &Plan) -> Result<Measurement>;
}

/// Which attempts are measured by the verifier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Verify {
    /// Estimates only.
    #[default]
    Off,
    /// Every attempt whose estimate fits (so the reported plan is measured).
    Fitting,
    /// Every attempt.
    All,
}

/// One evaluated plan.
#[derive(Debug, Clone)]
pub struct Attempt {
    /// `baseline`, the strategy that produced it, or `relax <strategy>`.
    pub strategy: String,
    /// The plan.
    pub plan: Plan,
    /// The memory model's estimate.
    pub estimate: Breakdown,
    /// The verifier's measurement, when it ran.
    pub measured: Option<Measurement>,
    /// Whether the plan fits: the estimate with the headroom, the host
    /// memory, and the measurement when there is one.
    pub fits: bool,
    /// The modelled time of one optimizer step.
    pub time: StepTime,
}

impl Attempt {
    /// The most trustworthy peak: measured when measured, else estimated. A
    /// measured step that ran out of memory only tells that the need is above
    /// what was in use when it failed: then the larger of that and the estimate.
    pub fn peak(&self) -> u64 {
        match self.measured {
            Some(m) if m.out_of_memory => self.estimate.peak.max(m.peak_bytes),
            Some(m) => m.peak_bytes.max(m.reserved_bytes),
            None => self.estimate.peak,
        }
    }

    /// Whether the measured step ran out of memory.
    pub fn ran_out_of_memory(&self) -> bool {
        self.measured.is_some_and(|m| m.out_of_memory)
    }

    /// The measured step's seconds, when it was timed (and finite).
    pub fn measured_seconds(&self) -> Option<f64> {
        self.measured
            .and_then(|m| m.step_seconds)
            .filter(|s| s.is_finite())
    }

    /// Tokens per second of the modelled step (global batch × sequence length).
    pub fn tokens_per_second(&self) -> f64 {
        (self.plan.global_batch() * self.plan.seq_len) as f64
            / self.time.total.max(f64::MIN_POSITIVE)
    }
}

/// A fix of the pipeline that the search did not use, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Skipped {
    /// The fix's name.
    pub strategy: String,
    /// Why it cannot be used ([`oomfix_strategies::Strategy::unusable`]).
    pub reason: String,
}

/// The outcome of a search.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct SearchResult {
    /// The budget searched against, in bytes per device.
    pub budget_bytes: u64,
    /// Host memory the plan may use besides the device's (offloaded state), if bounded.
    pub host_budget_bytes: Option<u64>,
    /// The margin kept below the budget.
    pub headroom: Headroom,
    /// The plan fields the user pinned.
    pub pins: Pins,
    /// Plans estimated while looking for the fastest that fits, the recorded
    /// attempts included.
    pub explored: usize,
    /// The device planned for.
    pub target: Target,
    /// Every attempt in the order it was made.
    pub attempts: Vec<Attempt>,
    /// Index into `attempts` of the chosen plan, if one fits.
    pub chosen: Option<usize>,
    /// When nothing fits: changes that would make the closest attempt fit.
    pub advice: Vec<String>,
    /// The pipeline's fixes the model cannot take, with the reason, in
    /// pipeline order (never tried, never explored).
    pub skipped: Vec<Skipped>,
    /// Whether the estimates include activations. When not (an unknown
    /// architecture), every estimated peak is a lower bound and a plan
    /// "fits" only on that lower bound, unless measured.
    pub activations_modelled: bool,
    /// What the reader should know about how the estimates were made: with
    /// candle-core as released linked (a crate depending on oomfix, outside
    /// its workspace's `[patch]`), what the shown plan needs there and with
    /// the patched candle-core the `oomfix` command links, and the plan the
    /// command would choose (also logged as a warning).
    pub notes: Vec<String>,
    /// When the search was for the longest sequence that fits
    /// ([`Planner::longest`]): how it was found.
    pub longest: Option<Longest>,
}

/// How [`Planner::longest`] found the longest sequence that fits.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Longest {
    /// The longest sequence it may be: the model's context (or
    /// [`MAX_SEQ_LEN`] beyond it), at most [`MAX_TOKENS_PER_STEP`] tokens a step.
    pub upper: usize,
    /// The longest that fits (`None`: not even one token).
    pub seq_len: Option<usize>,
    /// Each length searched, in order, and whether a plan fit.
    pub trail: Vec<(usize, bool)>,
}

/// The longest sequence planned: 1 Mi tokens.
pub const MAX_SEQ_LEN: usize = 1 << 20;

/// The most tokens per optimizer step (global batch × sequence length)
/// planned: 2^28, sixteen times today's largest runs; it keeps the memory
/// model's byte counts within 64 bits for realistic model shapes.
pub const MAX_TOKENS_PER_STEP: u64 = 1 << 28;

impl SearchResult {
    /// Whether a plan fits.
    pub fn fits(&self) -> bool {
        self.chosen.is_some()
    }
    /// Whether `attempt`'s peak is only a lower bound: activations are not
    /// modelled and it was not measured.
    pub fn is_lower_bound(&self, attempt: &Attempt) -> bool {
        !self.activations_modelled && attempt.measured.is_none()
    }
    /// The chosen attempt.
    pub fn chosen(&self) -> Option<&Attempt> {
        self.chosen.map(|i| &self.attempts[i])
    }
    /// Bytes the chosen plan leaves unused below the budget (its estimated
    /// peak, or its measured one when larger).
    pub fn margin_bytes(&self) -> Option<u64> {
        self.chosen()
            .map(|a| self.budget_bytes.saturating_sub(a.peak()))
    }
    /// The attempt with the lowest peak (the one to report when nothing fits).
    pub fn closest(&self) -> &Attempt {
        self.attempts
            .iter()
            .min_by_key(|a| a.peak())
            .expect("a search makes at least one attempt")
    }
}

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
    /// Whether a sequence length beyond the model's context
    /// (`max_position_embeddings`) is planned (default: no, a usage error).
    /// A model with rotary positions computes positions past its context,
    /// but was not trained on them; a model with learned positions has none
    /// there and is refused either way.
    pub fn allow_beyond_context(mut self, allow: bool) -> Self {
        self.beyond_context = allow;
        self
    }
    /// Plan fields the search keeps as given.
    pub fn pins(mut self, pins: Pins) -> Self {
        self.pins = pins;
        self
    }
    /// The margin a plan must leave below the budget (default:
    /// [`Headroom::default_for`] the target).
    pub fn headroom(mut self, headroom: Headroom) -> Self {
        self.headroom = Some(headroom);
        self
    }
    /// Host memory available to offloaded optimizer state and activations
    /// (default: unbounded).
    pub fn host_budget(mut self, bytes: u64) -> Self {
        self.host_budget = Some(bytes);
        self
    }
    /// Sequences per optimizer step (held constant by every fix).
    pub fn global_batch(mut self, n: usize) -> Self {
        self.global_batch = n;
        self
    }
    /// Tokens per sequence.
    pub fn seq_len(mut self, n: usize) -> Self {
        self.seq_len = Some(n);
        self
    }
    /// The device the plan is for.
    pub fn target(mut self, target: Target) -> Self {
        self.target = target;
        self
    }
    /// Devices available to the sharding fix.
    pub fn gpus(mut self, n: usize) -> Self {
        self.gpus = n;
        self
    }
    /// The fixes to apply, in order.
    pub fn pipeline(mut self, pipeline: Pipeline) -> Self {
        self.pipeline = pipeline;
        self
    }
    /// The 16-bit type of the precision fix (`None`: bf16 where the device has it, else fp16).
    pub fn half_precision(mut self, half: Option<oomfix_strategies::Precision>) -> Self {
        self.half = half;
        self
    }
    /// What the model can do for the fixes that need its help (default:
    /// everything, as oomfix's own model families can); a fix whose needs
    /// the model lacks is skipped and recorded in [`SearchResult::skipped`].
    pub fn model_capabilities(mut self, capabilities: Capabilities) -> Self {
        self.capabilities = capabilities;
        self
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

    /// Runs the search for `spec`.
    pub fn run(&self, spec: &ModelSpec) -> Result<SearchResult> {
        if self.global_batch == 0 {
            return Err(Error::Usage("the global batch must be at least 1".into()));
        }
        if self.gpus == 0 {
            return Err(Error::Usage("the number of GPUs must be at least 1".into()));
        }
        let seq_len = self.seq_len_for(spec);
        if seq_len == 0 {
            return Err(Error::Usage(
                "the sequence length must be at least 1".into(),
            ));
        }
        let max = spec.config.max_positions;
        if spec.config.family.has_learned_positions() && seq_len > max {
            return Err(Error::Usage(format!(
                "a sequence length of {seq_len} exceeds the model's {max} learned positions"
            )));
        }
        if max > 0 && seq_len > max && !self.beyond_context {
            let assumed = spec
                .assumptions
                .iter()
                .find(|a| a.starts_with("context limit"))
                .map_or(String::new(), |a| format!("; {a}"));
            return Err(Error::Usage(format!(
                "a sequence length of {seq_len} is beyond the model's context of {max} tokens \
                 (max_position_embeddings{assumed}), which it was not trained for: \
                 --allow-beyond-context plans it anyway"
            )));
        }
        let mut ctx = SearchContext::new(self.global_batch, spec.config.layers);
        ctx.gpus = self.gpus;
        ctx.supports_bf16 = match self.half {
            Some(h) => h == oomfix_strategies::Precision::Bf16,
            None => self.target.supports_bf16(),
        };
        ctx.flash_attention = self.target.has_flash_attention(spec.config.head_dim())
            && spec.config.flash_computes_it();
        ctx.host_offload = self.target.has_host_memory();
        ctx.model = self.capabilities;
        ctx.model.chunked_loss &= spec.config.chunked_loss_computes_it();
        // A pin the model or device cannot honour is refused, not planned.
        if self.pins.attention == Some(Attention::Flash) && !ctx.flash_attention {
            let why = if spec.config.flash_computes_it() {
                format!(
                    "no flash-attention kernel for a head size of {} on {}",
                    spec.config.head_dim(),
                    self.target
                )
            } else {
                "it does not compute Gemma's soft-capped scores and sliding windows".to_string()
            };
            return Err(Error::Usage(format!(
                "--attention flash cannot be used for this model: {why}"
            )));
        }
        if self.pins.offload_activations == Some(true) && !ctx.host_offload {
            return Err(Error::Usage(
                "--activations host needs a GPU: on the CPU the activations are in host memory already"
                    .into(),
            ));
        }
        if self.pins.chunked_loss == Some(true) && !ctx.model.chunked_loss {
            return Err(Error::Usage(
                "--loss chunked cannot be used for this model: its loss is not an LM head's \
                 cross-entropy the chunks compute (a soft-capped head, or a loss of its own)"
                    .into(),
            ));
        }
        if matches!(self.pins.mlp_tile, Some(Some(_))) && !ctx.model.tiled_mlp {
            return Err(Error::Usage(
                "--mlp-tile cannot be used for this model: it does not run its MLP in tiles".into(),
            ));
        }
        let skipped: Vec<Skipped> = self
            .pipeline
            .strategies()
            .iter()
            .filter_map(|s| {
                let reason = s.unusable(&ctx)?;
                tracing::info!(strategy = s.name(), %reason, "fix skipped");
                Some(Skipped {
                    strategy: s.name().to_string(),
                    reason,
                })
            })
            .collect();
        let usable: Vec<Arc<dyn Strategy>> = self
            .pipeline
            .strategies()
            .iter()
            .filter(|s| !skipped.iter().any(|k| k.strategy == s.name()))
            .cloned()
            .collect();
        let registered;
        let estimator: &dyn Estimator = match &self.estimator {
            Some(e) => e.as_ref(),
            None => {
                registered = MemoryModel::registered(&self.pipeline);
                &registered
            }
        };
        let activations_modelled = estimator.models_activations(spec);
        if !activations_modelled {
            tracing::warn!(
                family = %spec.config.family,
                "activations are not modelled for this model: estimates are lower bounds"
            );
        }
        let mut run = Run {
            planner: self,
            estimator,
            spec,
            headroom: self.headroom.unwrap_or(Headroom::default_for(&self.target)),
            attempts: Vec::new(),
            explored: HashMap::new(),
            usable,
        };
        let mut plan = self.pins.baseline(self.global_batch, seq_len, self.gpus)?;
        let mut fits = run.evaluate("baseline", plan)?;
        let strategies = run.usable.clone();
        'fixes: for s in &strategies {
            while !fits {
                let Some(next) = s.tighten(&plan, &ctx).filter(|next| self.pins.admit(next)) else {
                    continue 'fixes;
                };
                plan = next;
                fits = run.evaluate(s.name(), plan)?;
            }
            break;
        }
        let chosen = if fits {
            run.fastest(run.attempts.len() - 1, &ctx)?
        } else {
            None
        };
        let advice = if fits { Vec::new() } else { run.advice(&ctx) };
        let shown = chosen.unwrap_or_else(|| {
            let peaks = run.attempts.iter().map(Attempt::peak).enumerate();
            peaks.min_by_key(|&(_, p)| p).map_or(0, |(i, _)| i)
        });
        let notes = match (&self.estimator, activations_modelled) {
            (None, true) => self.stock_candle_note(spec, &run.attempts[shown], chosen.is_some())?,
            _ => None,
        };
        Ok(SearchResult {
            budget_bytes: self.budget,
            host_budget_bytes: self.host_budget,
            headroom: run.headroom,
            pins: self.pins,
            explored: run.explored.len(),
            target: self.target,
            attempts: run.attempts,
            chosen,
            advice,
            skipped,
            activations_modelled,
            notes: notes.into_iter().collect(),
            longest: None,
        })
    }

    /// The longest sequence at which a plan fits, and the search at it.
    ///
    /// Lengths are searched by bisection between 1 and the longest allowed
    /// ([`Longest::upper`]: the model's context, or [`MAX_SEQ_LEN`] with
    /// [`allow_beyond_context`](Self::allow_beyond_context) on a model
    /// without learned positions; at most [`MAX_TOKENS_PER_STEP`] tokens a
    /// step), each by a whole search over every fix on estimates alone; a
    /// plan that fits at a length fits at every shorter one (the estimate
    /// grows with the length). The search at the length found is then run
    /// as configured, a verifier included; when it measures no fitting plan
    /// there, the result says so. When not even one token fits, the result
    /// is the search at one token.
    ///
    /// ```
    /// use oomfix::{ModelSpec, Planner, Target};
    ///
    /// let spec = ModelSpec::default_model(); // GPT-2 small: 1,024 positions
    /// let result = Planner::new(2 << 30).global_batch(1).target(Target::Cuda(0)).longest(&spec)?;
    /// let longest = result.longest.as_ref().unwrap();
    /// assert_eq!(longest.seq_len, Some(1024)); // the whole context fits in 2 GiB
    /// assert_eq!(result.chosen().unwrap().plan.seq_len, 1024);
    /// # Ok::<(), oomfix::Error>(())
    /// ```
    pub fn longest(mut self, spec: &ModelSpec) -> Result<SearchResult> {
        let max = spec.config.max_positions;
        let context =
            if max == 0 || (self.beyond_context && !spec.config.family.has_learned_positions()) {
                MAX_SEQ_LEN
            } else {
                max.min(MAX_SEQ_LEN)
            };
        let per_step = (MAX_TOKENS_PER_STEP / self.global_batch.max(1) as u64) as usize;
        let upper = context.min(per_step).max(1);
        let verifier = self.verifier.take();
        let verify = std::mem::replace(&mut self.verify, Verify::Off);
        let mut trail = Vec::new();
        let mut fits_at = |planner: &mut Planner, n: usize| -> Result<bool> {
            planner.seq_len = Some(n);
            let _span = tracing::info_span!("longest", seq_len = n).entered();
            let fits = planner.run(spec)?.fits();
            trail.push((n, fits));
            Ok(fits)
        };
        let found = if fits_at(&mut self, upper)? {
            Some(upper)
        } else if upper == 1 || !fits_at(&mut self, 1)? {
            None
        } else {
            // Invariant: `lo` fits, `hi` does not.
            let (mut lo, mut hi) = (1, upper);
            while hi - lo > 1 {
                let mid = lo + (hi - lo) / 2;
                if fits_at(&mut self, mid)? {
                    lo = mid;
                } else {
                    hi = mid;
                }
            }
            Some(lo)
        };
        tracing::info!(upper, longest = ?found, probes = trail.len(), "longest sequence searched");
        self.seq_len = Some(found.unwrap_or(1));
        self.verifier = verifier;
        self.verify = verify;
        let mut result = self.run(spec)?;
        result.longest = Some(Longest {
            upper,
            seq_len: found,
            trail,
        });
        Ok(result)
    }

    /// With candle-core as released linked ([`Backward::linked`]): what
    /// `shown` needs with this candle and with the patched one, and the plan
    /// the search chooses with the patched one (as the `oomfix` command,
    /// which links it, does). `None` with the patched candle-core.
    fn stock_candle_note(
        &self,
        spec: &ModelSpec,
        shown: &Attempt,
        fits: bool,
    ) -> Result<Option<String>> {
        if Backward::linked() == Backward::FirstGradientAsIs {
            return Ok(None);
        }
        let patched = MemoryModel::registered(&self.pipeline);
        let patched_peak = patched
            .estimate_with(spec, &shown.plan, &self.target, Backward::FirstGradientAsIs)
            .peak;
        let as_the_command = Planner {
            budget: self.budget,
            global_batch: self.global_batch,
            seq_len: self.seq_len,
            target: self.target,
            gpus: self.gpus,
            pipeline: self.pipeline.clone(),
            estimator: Some(Box::new(PatchedBackward(patched))),
            verifier: None,
            verify: Verify::Off,
            half: self.half,
            capabilities: self.capabilities,
            pins: self.pins,
            headroom: self.headroom,
            host_budget: self.host_budget,
            beyond_context: self.beyond_context,
        }
        .run(spec)?;
        let choice = match (as_the_command.chosen(), fits) {
            (Some(a), true) if a.plan == shown.plan => "it chooses the same plan".to_string(),
            (Some(a), _) => format!("it chooses {}", a.plan),
            (None, _) => "nothing fits there either".to_string(),
        };
        let note = format!(
            "candle-core as released is linked, not the patched one the oomfix command builds \
             with (vendor/README.md): its backward adds each first gradient to a tensor of zeros, \
             and the estimates count that. The {} plan needs {} here and {} with the patched \
             candle-core, with which {choice}. To plan and train as the command does, add to \
             your Cargo.toml: [patch.crates-io] candle-core = {{ path = \
             \"path/to/oomfix/vendor/candle-core\" }}",
            if fits { "chosen" } else { "closest" },
            crate::units::format_bytes(shown.estimate.peak),
            crate::units::format_bytes(patched_peak),
        );
        static WARNED: std::sync::Once = std::sync::Once::new();
        WARNED.call_once(|| tracing::warn!("{note}"));
        Ok(Some(note))
    }
}

/// The analytic model with the patched candle-core's backward.
struct PatchedBackward(crate::memory::WithFixes);

impl Estimator for PatchedBackward {
    fn estimate(&self, spec: &ModelSpec, plan: &Plan, target: &Target) -> Breakdown {
        self.0
            .estimate_with(spec, plan, target, Backward::FirstGradientAsIs)
    }
    fn step_time(&self, spec: &ModelSpec, plan: &Plan, target: &Target) -> StepTime {
        self.0.step_time(spec, plan, target)
    }
}

/// The LoRA rank the advice of a search that fits nothing tries (PEFT's
/// examples' and the QLoRA paper's common choice).
pub const HINT_LORA_RANK: u32 = 16;

/// How many plans the search estimates at most while looking for the fastest.
const MAX_EXPLORED: usize = 4096;
/// How many of the fastest candidates a verifier measures.
const VERIFIED_CANDIDATES: usize = 3;

/// Records `plan`'s serde fields on an attempt's span: numbers as numbers,
/// strings as strings, anything else (the extensions) as its JSON text. The
/// span declares one field per key (a test checks that none is missing).
fn record_plan(span: &tracing::Span, plan: &Plan) {
    let Ok(serde_json::Value::Object(fields)) = serde_json::to_value(plan) else {
        return;
    };
    for (key, value) in &fields {
        match value {
            serde_json::Value::Number(n) if n.is_u64() => {
                span.record(key.as_str(), n.as_u64().unwrap_or_default())
            }
            serde_json::Value::String(text) => span.record(key.as_str(), text.as_str()),
            serde_json::Value::Bool(b) => span.record(key.as_str(), *b),
            other => span.record(key.as_str(), other.to_string().as_str()),
        };
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

/// A plan estimated while exploring.
#[derive(Debug, Clone)]
struct Explored {
    fits: bool,
    seconds: f64,
    peak: u64,
    from: Option<(Plan, String)>,
}

impl Run<'_> {
    /// The modelled time of `plan`: the estimator's.
    fn time(&self, plan: &Plan) -> StepTime {
        self.estimator
            .step_time(self.spec, plan, &self.planner.target)
    }

    /// Whether an estimate (and its host memory) fits, with the headroom.
    fn estimate_fits(&self, estimate: &Breakdown) -> bool {
        let p = self.planner;
        estimate
            .peak
            .saturating_add(self.headroom.bytes(estimate.peak))
            <= p.budget
            && p.host_budget.is_none_or(|h| estimate.host <= h)
    }

    /// From the first fitting attempt (`first`), every plan a fix's step away
    /// from a fitting one, transitively (at most [`MAX_EXPLORED`]): the index
    /// of the attempt of the fastest that fits, the way to it recorded. With a
    /// verifier the [`VERIFIED_CANDIDATES`] fastest are recorded (and so
    /// measured), and the fastest measured attempt that fits is chosen.
    fn fastest(&mut self, first: usize, ctx: &SearchContext) -> Result<Option<usize>> {
        let p = self.planner;
        let start = self.attempts[first].plan;
        let mut queue = std::collections::VecDeque::from([start]);
        self.explored.insert(
            start,
            Explored {
                fits: true,
                seconds: self.attempts[first].time.total,
                peak: self.attempts[first].estimate.peak,
                from: None,
            },
        );
        while let Some(plan) = queue.pop_front() {
            for s in self.usable.iter().rev() {
                let moves = [
                    (s.relax(&plan, ctx), format!("relax {}", s.name())),
                    (s.tighten(&plan, ctx), s.name().to_string()),
                ];
                for (next, label) in moves {
                    let Some(next) = next.filter(|n| p.pins.admit(n)) else {
                        continue;
                    };
                    if self.explored.contains_key(&next) || self.explored.len() >= MAX_EXPLORED {
                        continue;
                    }
                    let estimate = self.estimator.estimate(self.spec, &next, &p.target);
                    let fits = self.estimate_fits(&estimate);
                    let seconds = self.time(&next).total;
                    self.explored.insert(
                        next,
                        Explored {
                            fits,
                            seconds,
                            peak: estimate.peak,
                            from: Some((plan, label)),
                        },
                    );
                    if fits {
                        queue.push_back(next);
                    }
                }
            }
        }
        // Fastest first; equal times (ZeRO 1 and 2 move the same bytes, say)
        // go to the less quantized LoRA base (4 bits change the model's
        // function: only when they buy time or the fit), then to the lower
        // peak, then to the plan's encoding: the same search always chooses
        // the same plan.
        let mut candidates: Vec<(Plan, f64, u64, String)> = self
            .explored
            .iter()
            .filter(|(_, e)| e.fits)
            .map(|(plan, e)| {
                (
                    *plan,
                    e.seconds,
                    e.peak,
                    serde_json::to_string(plan).unwrap_or_default(),
                )
            })
            .collect();
        let base = |p: &Plan| p.lora.map(|l| l.base);
        candidates.sort_by(|a, b| {
            a.1.total_cmp(&b.1)
                .then_with(|| base(&a.0).cmp(&base(&b.0)))
                .then_with(|| a.2.cmp(&b.2))
                .then_with(|| a.3.cmp(&b.3))
        });
        let measuring = p.verifier.is_some() && p.verify != Verify::Off;
        let tried = if measuring { VERIFIED_CANDIDATES } else { 1 };
        let mut modelled_best = None;
        for (plan, ..) in candidates.into_iter().take(tried) {
            if let Some(index) = self.record_way(plan)? {
                modelled_best = modelled_best.or(Some(index));
            }
        }
        // Measured, the fastest measured attempt that fits (the candidates'
        // and any other fitting attempt measured on the way) wins; times
        // measured and modelled are not compared with each other.
        let measured_best = self
            .attempts
            .iter()
            .enumerate()
            .filter(|(_, a)| a.fits)
            .filter_map(|(i, a)| Some((i, a.measured_seconds()?)))
            .min_by(|a, b| a.1.total_cmp(&b.1))
            .map(|(i, _)| i);
        Ok(measured_best.or(modelled_best).or(Some(first)))
    }

    /// Records the way from the first fit to `plan` as attempts (those not
    /// yet recorded), and returns the index of `plan`'s attempt; `None` when a
    /// plan on the way does not fit once measured.
    fn record_way(&mut self, plan: Plan) -> Result<Option<usize>> {
        let mut way = vec![];
        let mut at = plan;
        while let Some(e) = self.explored.get(&at) {
            let Some((from, label)) = e.from.clone() else {
                break;
            };
            way.push((at, label));
            at = from;
        }
        let mut index = self.attempts.iter().rposition(|a| a.plan == at);
        for (step, label) in way.into_iter().rev() {
            let i = match self.attempts.iter().position(|a| a.plan == step) {
                Some(i) => i,
                None => {
                    self.evaluate(&label, step)?;
                    self.attempts.len() - 1
                }
            };
            if !self.attempts[i].fits {
                return Ok(None);
            }
            index = Some(i);
        }
        Ok(index)
    }

    /// The `attempt` span of `plan`: its serde fields, the budget, the
    /// estimate's terms; `measured_bytes` and `fits` are recorded later.
    fn span(
        &self,
        strategy: &str,
        plan: &Plan,
        estimate: &Breakdown,
        time: &StepTime,
    ) -> tracing::Span {
        let span = tracing::info_span!(
            "attempt",
            index = self.attempts.len(),
            strategy,
            micro_batch = tracing::field::Empty,
            grad_accum = tracing::field::Empty,
            seq_len = tracing::field::Empty,
            precision = tracing::field::Empty,
            checkpoint = tracing::field::Empty,
            attention = tracing::field::Empty,
            chunked_loss = tracing::field::Empty,
            offload_activations = tracing::field::Empty,
            mlp_tile = tracing::field::Empty,
            optimizer = tracing::field::Empty,
            world_size = tracing::field::Empty,
            shard_stage = tracing::field::Empty,
            extensions = tracing::field::Empty,
            lora = tracing::field::Empty,
            budget_bytes = self.planner.budget,
            estimated_bytes = estimate.peak,
            weights_bytes = estimate.weights,
            master_weights_bytes = estimate.master_weights,
            gradients_bytes = estimate.gradients,
            accumulated_gradients_bytes = estimate.accumulated_gradients,
            optimizer_state_bytes = estimate.optimizer_state,
            activations_bytes = estimate.activations,
            backward_transient_bytes = estimate.backward_transient,
            optimizer_transient_bytes = estimate.optimizer_transient,
            runtime_bytes = estimate.runtime,
            pool_slack_bytes = estimate.pool_slack,
            communicator_bytes = estimate.communicator,
            peak_phase = %estimate.peak_phase,
            host_bytes = estimate.host,
            estimated_step_seconds = time.total,
            measured_bytes = tracing::field::Empty,
            fits = tracing::field::Empty,
        );
        record_plan(&span, plan);
        span
    }

    /// Estimates (and, as configured, measures) `plan`; records and logs the attempt.
    fn evaluate(&mut self, strategy: &str, plan: Plan) -> Result<bool> {
        let p = self.planner;
        let estimate = self.estimator.estimate(self.spec, &plan, &p.target);
        let time = self.time(&plan);
        let span = self.span(strategy, &plan, &estimate, &time);
        let _enter = span.enter();
        let estimate_fits = self.estimate_fits(&estimate);
        let measure = match p.verify {
            Verify::Off => false,
            Verify::Fitting => estimate_fits,
            Verify::All => true,
        };
        let measured = match (&p.verifier, measure) {
            (Some(v), true) => Some(v.measure(self.spec, &plan)?),
            _ => None,
        };
        let fits = estimate_fits
            && measured
                .is_none_or(|m| !m.out_of_memory && m.peak_bytes.max(m.reserved_bytes) <= p.budget);
        if let Some(m) = measured {
            span.record("measured_bytes", m.peak_bytes);
        }
        span.record("fits", fits);
        tracing::info!(fits, "{strategy}: {plan}");
        self.attempts.push(Attempt {
            strategy: strategy.to_string(),
            plan,
            estimate,
            measured,
            fits,
            time,
        });
        Ok(fits)
    }

    /// For a search that trains every parameter: whether the closest plan
    /// would fit with rank-[`HINT_LORA_RANK`] adapters on every linear
    /// projection of the blocks, the base in 16 bits, else in NF4, else in
    /// double-quantized NF4; the flags and the estimated peak.
    fn lora_hint(&self, base: &Plan) -> Option<String> {
        if base.lora.is_some() || !crate::memory::analytic_activations(self.spec) {
            return None;
        }
        let facts = crate::memory::model_facts(self.spec);
        [
            BasePrecision::Bf16,
            BasePrecision::Nf4,
            BasePrecision::Nf4Double,
        ]
        .into_iter()
        .find_map(|precision| {
            let lora = Lora::new(HINT_LORA_RANK, None, None, precision, &facts).ok()?;
            let plan = Plan {
                lora: Some(lora),
                ..*base
            };
            let estimate = self
                .estimator
                .estimate(self.spec, &plan, &self.planner.target);
            let flag = match precision {
                BasePrecision::Bf16 => String::new(),
                other => format!(" --base-precision {other}"),
            };
            self.estimate_fits(&estimate).then(|| {
                format!(
                    "--lora {HINT_LORA_RANK}{flag} would fit ({})",
                    crate::units::format_bytes(estimate.peak)
                )
            })
        })
    }

    /// What would make the closest attempt fit: a budget (or host memory,
    /// when that is what fails), more GPUs (on CUDA, where ranks add device
    /// memory), a shorter sequence, LoRA.
    fn advice(&self, ctx: &SearchContext) -> Vec<String> {
        use crate::units::format_bytes;
        let p = self.planner;
        let closest = self
            .attempts
            .iter()
            .min_by_key(|a| a.peak())
            .expect("at least one attempt");
        let needed = closest.peak() + self.headroom.bytes(closest.peak());
        let host_short = p.host_budget.filter(|&h| closest.estimate.host > h);
        let mut advice = Vec::new();
        if closest.ran_out_of_memory() {
            advice.push(format!(
                "the closest plan ran out of memory when measured: it needs more than {} (the estimates below may be low too)",
                format_bytes(p.budget)
            ));
        } else if needed > p.budget {
            advice.push(match host_short {
                None => format!(
                    "a budget of {} would fit the closest plan",
                    format_bytes(needed)
                ),
                Some(_) => format!(
                    "a budget of {} and {} of host memory would fit the closest plan",
                    format_bytes(needed),
                    format_bytes(closest.estimate.host)
                ),
            });
        }
        if let Some(host_budget) = host_short {
            advice.push(format!(
                "host memory is what fails: the closest plan keeps {} on the host (the offloaded \
                 optimizer state or activations) and {} may be used there (--host-budget SIZE; default: the \
                 memory available now)",
                format_bytes(closest.estimate.host),
                format_bytes(host_budget)
            ));
            if let Some(on_device) = self
                .attempts
                .iter()
                .filter(|a| a.estimate.host == 0 && !a.ran_out_of_memory())
                .min_by_key(|a| a.peak())
            {
                advice.push(format!(
                    "without offloading, a budget of {} would fit ({})",
                    format_bytes(on_device.peak() + self.headroom.bytes(on_device.peak())),
                    on_device.plan
                ));
            }
        }
        let fits =
            |plan: &Plan| self.estimate_fits(&self.estimator.estimate(self.spec, plan, &p.target));
        let base = closest.plan;
        // Ranks add device memory on GPUs; on the CPU they share the host's.
        if matches!(p.target, Target::Cuda(_)) {
            let divisors_of_batch = oomfix_strategies::accumulate::divisors(ctx.global_batch);
            if let Some(n) = divisors_of_batch
                .iter()
                .copied()
                .filter(|&n| n > 1)
                .find(|&n| {
                    let per_rank = ctx.global_batch / n;
                    fits(&Plan {
                        micro_batch: 1,
                        grad_accum: per_rank,
                        shard: Sharding {
                            world_size: n,
                            stage: 3,
                            ..base.shard
                        },
                        ..base
                    })
                })
            {
                advice.push(if cfg!(feature = "nccl") {
                    format!("{n} GPUs with ZeRO stage 3 would fit (--gpus {n})")
                } else {
                    format!(
                        "{n} GPUs with ZeRO stage 3 would fit (--gpus {n}); training over them \
                         needs a build with --features nccl"
                    )
                });
            }
        }
        if let Some(hint) = self.lora_hint(&base) {
            advice.push(hint);
        }
        let mut seq = base.seq_len / 2;
        while seq >= 16 {
            if fits(&Plan {
                seq_len: seq,
                ..base
            }) {
                advice.push(format!(
                    "a sequence length of {seq} would fit (--seq-len {seq})"
                ));
                break;
            }
            seq /= 2;
        }
        advice
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every key of a plan's serde form has a field in the attempt span.
    #[test]
    fn every_plan_field_is_an_attempt_span_field() {
        let mut plan = Plan::baseline(8, 64);
        plan.extensions.set("toy", Some(1)).unwrap();
        let facts = oomfix_strategies::ModelFacts::new(64, 64, 1).with_linear("proj", 8, 8);
        plan.lora = Some(Lora::new(4, None, None, BasePrecision::Nf4, &facts).unwrap());
        let keys: Vec<String> = match serde_json::to_value(plan).unwrap() {
            serde_json::Value::Object(map) => map.keys().cloned().collect(),
            _ => unreachable!("a plan is an object"),
        };
        let subscriber = tracing_subscriber::registry();
        tracing::subscriber::with_default(subscriber, || {
            let spec = ModelSpec::default_model();
            let planner = Planner::new(1 << 40).pipeline(Pipeline::new());
            let estimator = MemoryModel;
            let run = Run {
                planner: &planner,
                estimator: &estimator,
                spec: &spec,
                headroom: Headroom::NONE,
                attempts: Vec::new(),
                explored: HashMap::new(),
                usable: Vec::new(),
            };
            let span = run.span(
                "baseline",
                &plan,
                &estimator.estimate(&spec, &plan, &Target::Cpu),
                &run.time(&plan),
            );
            let fields = span.metadata().expect("an enabled span").fields();
            for key in &keys {
                assert!(
                    fields.field(key.as_str()).is_some(),
                    "no span field `{key}`"
                );
            }
        });
    }
}
