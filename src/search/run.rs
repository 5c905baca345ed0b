//! One search: the baseline, the pipeline's fixes applied in order until
//! a plan fits, then the exploration and the advice; each plan evaluated
//! as an attempt.

use super::{Attempt, Headroom, Planner, Run, SearchResult, Skipped, Verify};
use crate::memory::{Breakdown, Estimator, MemoryModel};
use crate::spec::ModelSpec;
use crate::speed::StepTime;
use crate::{usable, Error, Result};
use oomfix_strategies::{Plan, SearchContext, Strategy};
use std::collections::HashMap;
use std::sync::Arc;

impl Planner {
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
        ctx.flash_attention = self.target.has_flash_attention(spec.config.head_dim());
        ctx.host_offload = self.target.has_host_memory();
        ctx.model = self.capabilities;
        ctx.model.attention &= spec.config.flash_computes_it();
        ctx.model.chunked_loss &= spec.config.chunked_loss_computes_it();
        let mut plan = self.pins.baseline(self.global_batch, seq_len, self.gpus)?;
        // A pin the model or device cannot honour is refused, not planned.
        let pinned = self.pins.names();
        let fixes = oomfix_strategies::registered(&self.pipeline);
        if let Some((fix, reason)) =
            usable::first_unusable(&plan, &ctx, &fixes, |f| pinned.contains(&f.field))
        {
            return Err(Error::Usage(format!("{} {reason}", fix.flag)));
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
            serde_json::Value::Bool(b) => span.record(key.as_str(), *b),
            other => span.record(key.as_str(), other.to_string().as_str()),
        };
    }
}

impl Run<'_> {
    /// The modelled time of `plan`: the estimator's.
    pub(super) fn time(&self, plan: &Plan) -> StepTime {
        self.estimator
            .step_time(self.spec, plan, &self.planner.target)
    }

    /// Whether an estimate (and its host memory) fits, with the headroom.
    pub(super) fn estimate_fits(&self, estimate: &Breakdown) -> bool {
        let p = self.planner;
        estimate
            .peak
            .saturating_add(self.headroom.bytes(estimate.peak))
            <= p.budget
            && p.host_budget.is_none_or(|h| estimate.host <= h)
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
    pub(super) fn evaluate(&mut self, strategy: &str, plan: Plan) -> Result<bool> {
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::Target;
    use oomfix_strategies::lora::{BasePrecision, Lora};
    use oomfix_strategies::Pipeline;

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
