//! Drive the strategy pipeline against a budget.
//!
//! The search starts from the baseline plan (whole batch, fp32, plain autograd,
//! `candle_nn::AdamW`, one device), then applies the pipeline's fixes in order,
//! each as many steps as it offers, keeping what earlier fixes did. At the first
//! plan that fits it relaxes, in reverse pipeline order, whatever is no longer
//! needed (a larger micro-batch, no checkpointing, a lower ZeRO stage) as long as
//! the plan still fits. Every plan evaluated is an [`Attempt`], logged as a
//! `tracing` span named `attempt`.

use crate::memory::{Breakdown, Estimator, MemoryModel, Target};
use crate::spec::ModelSpec;
use crate::{Error, Result};
use oomfix_strategies::{Pipeline, Plan, SearchContext, Sharding};

/// A measured step: what a verifier reports for one plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Measurement {
    /// Peak bytes allocated during a steady-state step.
    pub peak_bytes: u64,
    /// Peak bytes reserved by the allocator (equal to `peak_bytes` on CPU).
    pub reserved_bytes: u64,
    /// The step ran out of memory (the peak is then a lower bound).
    pub out_of_memory: bool,
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
    /// Whether the plan fits: the estimate, and the measurement when there is one.
    pub fits: bool,
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
}

/// The outcome of a search.
#[derive(Debug, Clone)]
pub struct SearchResult {
    /// The budget searched against, in bytes per device.
    pub budget_bytes: u64,
    /// The device planned for.
    pub target: Target,
    /// Every attempt in the order it was made.
    pub attempts: Vec<Attempt>,
    /// Index into `attempts` of the chosen plan, if one fits.
    pub chosen: Option<usize>,
    /// When nothing fits: changes that would make the closest attempt fit.
    pub advice: Vec<String>,
}

impl SearchResult {
    /// Whether a plan fits.
    pub fn fits(&self) -> bool {
        self.chosen.is_some()
    }
    /// The chosen attempt.
    pub fn chosen(&self) -> Option<&Attempt> {
        self.chosen.map(|i| &self.attempts[i])
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
        }
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
        let mut ctx = SearchContext::new(self.global_batch, spec.config.layers);
        ctx.gpus = self.gpus;
        ctx.supports_bf16 = match self.half {
            Some(h) => h == oomfix_strategies::Precision::Bf16,
            None => self.target.supports_bf16(),
        };
        ctx.flash_attention = self.target.has_flash_attention(spec.config.head_dim());
        ctx.host_offload = self.target.has_host_memory();
        let registered;
        let estimator: &dyn Estimator = match &self.estimator {
            Some(e) => e.as_ref(),
            None => {
                registered = MemoryModel::registered(&self.pipeline);
                &registered
            }
        };
        let mut run = Run {
            planner: self,
            estimator,
            spec,
            attempts: Vec::new(),
        };
        let mut plan = Plan::baseline(self.global_batch, seq_len);
        let mut fits = run.evaluate("baseline", plan)?;
        let strategies = self.pipeline.strategies();
        'fixes: for s in strategies {
            while !fits {
                let Some(next) = s.tighten(&plan, &ctx) else {
                    continue 'fixes;
                };
                plan = next;
                fits = run.evaluate(s.name(), plan)?;
            }
            break;
        }
        let mut chosen = None;
        if fits {
            chosen = Some(run.attempts.len() - 1);
            for s in strategies.iter().rev() {
                while let Some(next) = s.relax(&plan, &ctx) {
                    // a plan already tried (the baseline's micro-batch, say) is not tried again
                    let index = match run.attempts.iter().position(|a| a.plan == next) {
                        Some(i) => i,
                        None => {
                            run.evaluate(&format!("relax {}", s.name()), next)?;
                            run.attempts.len() - 1
                        }
                    };
                    if !run.attempts[index].fits {
                        break;
                    }
                    plan = next;
                    chosen = Some(index);
                }
            }
        }
        let advice = if fits { Vec::new() } else { run.advice(&ctx) };
        Ok(SearchResult {
            budget_bytes: self.budget,
            target: self.target,
            attempts: run.attempts,
            chosen,
            advice,
        })
    }
}

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
            other => span.record(key.as_str(), other.to_string().as_str()),
        };
    }
}

/// State of one search.
struct Run<'a> {
    planner: &'a Planner,
    estimator: &'a dyn Estimator,
    spec: &'a ModelSpec,
    attempts: Vec<Attempt>,
}

impl Run<'_> {
    /// The `attempt` span of `plan`: its serde fields, the budget, the
    /// estimate's terms; `measured_bytes` and `fits` are recorded later.
    fn span(&self, strategy: &str, plan: &Plan, estimate: &Breakdown) -> tracing::Span {
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
            optimizer = tracing::field::Empty,
            world_size = tracing::field::Empty,
            shard_stage = tracing::field::Empty,
            extensions = tracing::field::Empty,
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
            peak_phase = %estimate.peak_phase,
            host_bytes = estimate.host,
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
        let span = self.span(strategy, &plan, &estimate);
        let _enter = span.enter();
        let estimate_fits = estimate.peak <= p.budget;
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
        });
        Ok(fits)
    }

    /// What would make the closest attempt fit: a budget, more GPUs, a shorter sequence.
    fn advice(&self, ctx: &SearchContext) -> Vec<String> {
        let p = self.planner;
        let closest = self
            .attempts
            .iter()
            .min_by_key(|a| a.peak())
            .expect("at least one attempt");
        let mut advice = vec![if closest.ran_out_of_memory() {
            format!(
                "the closest plan ran out of memory when measured: it needs more than {} (the estimates below may be low too)",
                crate::units::format_bytes(p.budget)
            )
        } else {
            format!(
                "a budget of {} would fit the closest plan",
                crate::units::format_bytes(closest.peak())
            )
        }];
        let fits =
            |plan: &Plan| self.estimator.estimate(self.spec, plan, &p.target).peak <= p.budget;
        let base = closest.plan;
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
                    },
                    ..base
                })
            })
        {
            advice.push(format!("{n} GPUs with ZeRO stage 3 would fit (--gpus {n})"));
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
                attempts: Vec::new(),
            };
            let span = run.span(
                "baseline",
                &plan,
                &estimator.estimate(&spec, &plan, &Target::Cpu),
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
