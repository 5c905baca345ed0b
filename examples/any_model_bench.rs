//! Planning by measurement against the two ways a user finds a training
//! configuration without a memory model, for the two models of
//! `examples/any_models.rs` (`examples/common/models.rs`), on the CPU:
//!
//! * **oomfix**: [`MeasuredPlanner`] probes a few passes per setting, plans
//!   under the budget, and verifies the chosen plan with one real step;
//! * **halve on OOM**: accelerate's `find_executable_batch_size`: one real
//!   step at the whole batch as the micro-batch, then at half of it, and so
//!   on until one fits (fp32, no other fix);
//! * **every configuration**: one real step of each configuration of the
//!   space (micro-batch × precision × checkpointing × attention ×
//!   optimizer), the fastest that fits chosen.
//!
//! A step "runs out of memory" on the CPU when its measured heap peak
//! (above what was live before its trainer was built, as
//! [`oomfix::anymodel::verify_step`] measures it) is over the budget. The
//! estimate error of oomfix's planning is given at the chosen plan and, from
//! the configurations measured one by one, over the whole space.
//!
//! `cargo run --release --example any_model_bench` prints the table
//! (`docs/any-model-bench.md`).

use candle_core::{DType, Device};
use oomfix::anymodel::{spec_of, verify_step, MeasuredModel, MeasuredPlanner, ModelProber};
use oomfix::search::Measurement;
use oomfix::strategies::model::{self, Model};
use oomfix::strategies::{Attention, Checkpointing, OptimizerImpl, Plan, Precision};
use oomfix::units::format_bytes;
use oomfix::{Estimator, Planner, Target, TrainOptions};

#[global_allocator]
static ALLOC: oomfix::track::CountingAlloc = oomfix::track::CountingAlloc;

#[path = "common/models.rs"]
mod models;

/// One method's outcome on one model.
struct Row {
    method: &'static str,
    real_steps: usize,
    plan: Option<Plan>,
    measured: Option<Measurement>,
    estimate_error: String,
}

/// What the benchmark plans: a model, its budget, batch and sequence length.
struct Case<B> {
    name: &'static str,
    build: B,
    budget: u64,
    global_batch: usize,
    seq_len: usize,
}

impl<M, B> Case<B>
where
    M: Model + Send + 'static,
    B: Fn(DType, &Device) -> candle_core::Result<M> + Copy + Send + Sync + 'static,
{
    fn planner(&self) -> Planner {
        Planner::new(self.budget)
            .global_batch(self.global_batch)
            .seq_len(self.seq_len)
            .target(Target::Cpu)
    }

    /// One real step of `plan`.
    fn step(&self, plan: Plan) -> oomfix::Result<Measurement> {
        verify_step(self.build, plan, &Device::Cpu, &TrainOptions::default())
    }

    fn fits(&self, m: &Measurement) -> bool {
        m.peak_bytes <= self.budget
    }

    fn oomfix(&self) -> oomfix::Result<Row> {
        let planned = MeasuredPlanner::new(self.planner(), self.build)
            .name(self.name)
            .run()?;
        let chosen = planned.result.chosen();
        let measured = chosen.and_then(|a| a.measured);
        let estimate_error = match (chosen, measured) {
            (Some(a), Some(m)) => percent(a.estimate.peak, m.peak_bytes),
            _ => "-".into(),
        };
        Ok(Row {
            method: "oomfix (planning by measurement)",
            real_steps: planned.probe_steps() + planned.verify_steps(),
            plan: chosen.map(|a| a.plan),
            measured,
            estimate_error,
        })
    }

    /// accelerate's `find_executable_batch_size`: halve the micro-batch on
    /// out-of-memory, accumulating to the same global batch.
    fn halving(&self) -> oomfix::Result<Row> {
        let mut micro_batch = self.global_batch;
        let mut steps = 0;
        while micro_batch > 0 {
            let plan = Plan {
                micro_batch,
                grad_accum: self.global_batch / micro_batch,
                ..Plan::baseline(self.global_batch, self.seq_len)
            };
            let m = self.step(plan)?;
            steps += 1;
            if self.fits(&m) {
                return Ok(Row {
                    method: "halve on OOM",
                    real_steps: steps,
                    plan: Some(plan),
                    measured: Some(m),
                    estimate_error: "none made".into(),
                });
            }
            micro_batch /= 2;
        }
        Ok(Row {
            method: "halve on OOM",
            real_steps: steps,
            plan: None,
            measured: None,
            estimate_error: "none made".into(),
        })
    }

    /// The space: micro-batches that divide the batch (powers of two) ×
    /// fp32/bf16 × no checkpointing/every block × composed/flash attention
    /// (where the model computes attention as told) × candle's/fused AdamW.
    fn space(&self, attention: bool) -> Vec<Plan> {
        let base = Plan::baseline(self.global_batch, self.seq_len);
        let attentions: &[Attention] = if attention {
            &[Attention::Composed, Attention::Flash]
        } else {
            &[Attention::Composed]
        };
        let mut out = Vec::new();
        let mut micro_batch = 1;
        while micro_batch <= self.global_batch {
            for precision in [Precision::F32, Precision::Bf16] {
                for checkpoint in [Checkpointing::None, Checkpointing::Every(1)] {
                    for &attention in attentions {
                        for optimizer in [OptimizerImpl::CandleAdamW, OptimizerImpl::FusedAdamW] {
                            out.push(Plan {
                                micro_batch,
                                grad_accum: self.global_batch / micro_batch,
                                precision,
                                checkpoint,
                                attention,
                                optimizer,
                                ..base
                            });
                        }
                    }
                }
            }
            micro_batch *= 2;
        }
        out
    }

    /// Every configuration measured; the fastest that fits chosen. Also
    /// returns oomfix's estimate error over the space (median and largest,
    /// absolute) and the probe steps those estimates took.
    fn every(&self) -> oomfix::Result<(Row, String)> {
        let caps = (self.build)(DType::F32, &Device::Cpu)?.capabilities();
        let space = self.space(caps.attention);
        let measured: Vec<(Plan, Measurement)> = space
            .iter()
            .map(|&p| Ok((p, self.step(p)?)))
            .collect::<oomfix::Result<_>>()?;
        let best = measured
            .iter()
            .filter(|(_, m)| self.fits(m))
            .min_by(|a, b| seconds(&a.1).total_cmp(&seconds(&b.1)));
        // oomfix's measured model, estimating every configuration of the space.
        let prober = ModelProber::new(self.build, &Device::Cpu, self.seq_len)?;
        let vars = prober.vars().to_vec();
        let spec = spec_of(self.name, &vars, caps.blocks);
        let facts = model::facts(&vars, caps.blocks);
        drop(vars);
        let estimator = MeasuredModel::new(
            facts,
            Box::new(prober),
            [1, 2],
            oomfix::strategies::builtins(),
        )?;
        let mut errors: Vec<f64> = measured
            .iter()
            .map(|(p, m)| {
                let e = estimator.estimate(&spec, p, &Target::Cpu).peak as f64;
                (e / m.peak_bytes as f64 - 1.0).abs()
            })
            .collect();
        errors.sort_by(f64::total_cmp);
        let over_space = format!(
            "{} configurations: median |error| {:.2}%, largest {:.2}% ({} probe steps)",
            errors.len(),
            100.0 * errors[errors.len() / 2],
            100.0 * errors.last().copied().unwrap_or(0.0),
            estimator.probes().len()
        );
        Ok((
            Row {
                method: "every configuration",
                real_steps: measured.len(),
                plan: best.map(|b| b.0),
                measured: best.map(|b| b.1),
                estimate_error: "none made".into(),
            },
            over_space,
        ))
    }

    fn run(&self) -> oomfix::Result<()> {
        let rows = [self.oomfix()?, self.halving()?];
        let (every, over_space) = self.every()?;
        println!(
            "\n### {} (budget {}, global batch {}{})\n",
            self.name,
            format_bytes(self.budget),
            self.global_batch,
            if self.seq_len > 1 {
                format!(" × {} tokens", self.seq_len)
            } else {
                String::new()
            }
        );
        println!(
            "| method | real steps | plan found | its measured peak | its step | estimate error |"
        );
        println!("|---|---:|---|---:|---:|---:|");
        for r in rows.iter().chain([&every]) {
            println!(
                "| {} | {} | {} | {} | {} | {} |",
                r.method,
                r.real_steps,
                r.plan.map_or("none fits".into(), |p| p.to_string()),
                r.measured
                    .map_or("-".into(), |m| format_bytes(m.peak_bytes)),
                r.measured
                    .map_or("-".into(), |m| format!("{:.0} ms", 1e3 * seconds(&m))),
                r.estimate_error
            );
        }
        println!("\noomfix's estimates over the space: {over_space}");
        Ok(())
    }
}

fn seconds(m: &Measurement) -> f64 {
    m.step_seconds.unwrap_or(f64::INFINITY)
}

/// `estimate / measured - 1` in percent.
fn percent(estimate: u64, measured: u64) -> String {
    format!("{:+.2}%", 100.0 * (estimate as f64 / measured as f64 - 1.0))
}

fn main() -> oomfix::Result<()> {
    // The budgets and batches of examples/any_models.rs.
    Case {
        name: "vit",
        build: models::vit,
        budget: 24 << 20,
        global_batch: 32,
        seq_len: 1,
    }
    .run()?;
    Case {
        name: "conv-lm",
        build: models::conv_lm,
        budget: 24 << 20,
        global_batch: 16,
        seq_len: 128,
    }
    .run()
}
