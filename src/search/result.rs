//! What a search gives back: every attempt, the chosen plan, the advice
//! when nothing fits; and the measurements a verifier adds to attempts.

#[cfg(doc)]
use super::Planner;
use super::{Headroom, Pins};
use crate::memory::{Breakdown, Target};
use crate::spec::ModelSpec;
use crate::speed::StepTime;
use crate::Result;
use oomfix_strategies::Plan;
use serde::Serialize;

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
