//! The exhaustive sweep behind the step-time model and the search's choice.
//!
//! For small GPT-2 and Llama shapes on the CPU (GPT-2 small and a 160M Llama
//! at sequence 1024 with `--device cuda:N`), every configuration of the
//! pipeline's space that runs there (micro-batch × precision × attention ×
//! checkpointing × optimizer, the global batch held) is trained for a few
//! steps: its shortest step time and its measured peak are recorded beside the
//! step-time model's estimate and the work terms it is made of
//! ([`oomfix::speed::StepWork`]). Then, at a budget that some configurations
//! fit and others do not, it checks what the planner chooses (with its
//! default headroom) against the fastest measured configuration that fits,
//! and whether any configuration the planner reports as fitting measured
//! above the budget.
//!
//! ```sh
//! cargo run --release --example sweep -- [--steps N] [--out docs/sweep.json] [--models gpt2,llama] [--measured FILE]
//! scripts/build-cuda.sh --example sweep   # then, on the GPU machine:
//! sweep --device cuda:0 --out sweep-cuda.json
//! ```
//!
//! `--plans A+B` keeps the configurations whose description contains every
//! `+`-separated part (e.g. `micro-batch 8 x`): a partial sweep, whose
//! choice and budget are of those configurations only.
//!
//! `--recheck N`: where the plan chosen is not the fastest measured, times
//! the two again, alternately, N rounds of `--steps` steps each (the
//! shortest step of each over all rounds): single timings of configurations
//! within a few percent of each other are ordered by the machine's noise.
//!
//! `--measured-log FILE` takes them from the lines an earlier run printed
//! (e.g. one stopped before its summary).
//!
//! `--measured FILE` takes the measured times and peaks from an earlier run's
//! JSON and recomputes everything else (the model's estimates, the planner's
//! choice): how a recalibrated model is checked against the same steps.
//!
//! `--rows CSV` measures nothing: it writes the work terms and the modelled
//! times of step times measured elsewhere (docs/speed-cuda-rows.csv: the
//! H200's, for `--device cuda`), in the same JSON, for `scripts/fit-speed.py`.
//!
//! Writes the rows and the summary as JSON (`scripts/fit-speed.py` fits the
//! CPU throughputs of [`oomfix::speed::Throughput`] to it) and prints a
//! Markdown report (docs/sweep.md).

use oomfix::measure::measure_plan;
use oomfix::speed::{step_time, step_work};
use oomfix::strategies::{Attention, Checkpointing, OptimizerImpl, Plan, Precision};
use oomfix::track::CountingAlloc;
use oomfix::train::data::DataSource;
use oomfix::{
    Estimator, MemoryModel, ModelConfig, ModelSpec, Planner, Target, TrainOptions, Trainer,
};
use serde_json::{json, Value};

#[path = "common/args.rs"]
mod args;
use args::Args;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

const GLOBAL_BATCH: usize = 8;

/// The sequence length of the sweep on `target`.
fn seq_len(target: Target) -> usize {
    match target {
        Target::Cpu => 128,
        Target::Cuda(_) => 1024,
    }
}

fn models(target: Target) -> Vec<(&'static str, ModelConfig)> {
    if let Target::Cuda(_) = target {
        return vec![
            ("gpt2-small", ModelConfig::gpt2_small()),
            (
                "llama-160m",
                ModelConfig::llama(12, 768, 12, 4, 2048, 32000, false),
            ),
        ];
    }
    vec![
        (
            "gpt2-4l-128",
            ModelConfig {
                vocab: 2048,
                max_positions: 256,
                ..ModelConfig::gpt2(4, 128, 4)
            },
        ),
        (
            "llama-4l-128",
            ModelConfig {
                max_positions: 256,
                ..ModelConfig::llama(4, 128, 4, 2, 352, 2048, false)
            },
        ),
    ]
}

/// Every configuration of the space the pipeline searches on one device.
fn space(target: Target) -> Vec<Plan> {
    let base = Plan::baseline(GLOBAL_BATCH, seq_len(target));
    let mut plans = Vec::new();
    for micro in [1, 2, 4, 8] {
        for precision in [Precision::F32, Precision::Bf16] {
            for attention in [Attention::Composed, Attention::Flash] {
                for checkpoint in [Checkpointing::None, Checkpointing::Every(1)] {
                    for optimizer in [OptimizerImpl::CandleAdamW, OptimizerImpl::FusedAdamW] {
                        plans.push(Plan {
                            micro_batch: micro,
                            grad_accum: GLOBAL_BATCH / micro,
                            precision,
                            attention,
                            checkpoint,
                            optimizer,
                            ..base
                        });
                    }
                }
            }
        }
    }
    plans
}

/// The shortest wall time of `steps` optimizer steps after one warm-up step
/// (the least disturbed by other work on the machine).
fn time_steps(spec: &ModelSpec, plan: &Plan, steps: usize, target: Target) -> oomfix::Result<f64> {
    let device = match target {
        Target::Cpu => candle_core::Device::Cpu,
        Target::Cuda(n) => candle_core::Device::new_cuda(n)?,
    };
    let mut trainer = Trainer::new(&spec.config, *plan, &device, &TrainOptions::default())?;
    let mut data = DataSource::synthetic(0);
    trainer.step(&mut data)?;
    let times: Vec<f64> = (0..steps)
        .map(|_| trainer.step(&mut data).map(|s| s.seconds))
        .collect::<oomfix::Result<_>>()?;
    Ok(times.into_iter().fold(f64::INFINITY, f64::min))
}

/// One line this example prints per configuration, as `(model, plan,
/// measured seconds, measured peak bytes)`.
fn parse_logged(line: &str) -> Option<(String, String, f64, u64)> {
    let (name, rest) = line.split_once("  ")?;
    let (plan, rest) = rest.rsplit_once(": ")?;
    let ms: f64 = rest.split(" ms measured").next()?.parse().ok()?;
    let peak: u64 = rest
        .split("peak ")
        .nth(1)?
        .split(' ')
        .next()?
        .parse()
        .ok()?;
    Some((name.to_string(), plan.to_string(), ms / 1e3, peak))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return f64::NAN;
    }
    v[v.len() / 2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::from_env();
    let value = |option: &str| args.value(option);
    let steps: usize = value("--steps").map_or(Ok(5), |s| s.parse())?;
    let rounds: usize = value("--recheck").map_or(Ok(0), |s| s.parse())?;
    let out = value("--out").unwrap_or("docs/sweep.json".into());
    let only: Option<Vec<String>> =
        value("--models").map(|v| v.split(',').map(str::to_string).collect());
    let earlier: Vec<Value> = match value("--measured") {
        Some(path) => {
            let doc: Value = serde_json::from_str(&std::fs::read_to_string(path)?)?;
            doc["rows"].as_array().cloned().unwrap_or_default()
        }
        None => Vec::new(),
    };
    // `--measured-log FILE`: the per-configuration lines an earlier run printed.
    let logged: Vec<(String, String, f64, u64)> = match value("--measured-log") {
        Some(path) => std::fs::read_to_string(path)?
            .lines()
            .filter_map(parse_logged)
            .collect(),
        None => Vec::new(),
    };
    let measured_before = |name: &str, plan: &Plan| {
        let shown = plan.to_string();
        let from_log = logged.iter().find(|l| l.0 == name && l.1 == shown);
        if let Some((_, _, seconds, peak)) = from_log {
            return Some((Some(*peak), Some(*seconds)));
        }
        earlier.iter().find_map(|r| {
            let same = r["model"] == name
                && serde_json::from_value::<Plan>(r["plan"].clone()).ok() == Some(*plan);
            same.then(|| {
                (
                    r["measured_peak_bytes"].as_u64(),
                    r["measured_seconds"].as_f64(),
                )
            })
        })
    };
    let target: Target = value("--device").unwrap_or("cpu".into()).parse()?;
    // `--plans A+B`: only the configurations whose description contains every part.
    let plans = value("--plans");
    let keep = |p: &Plan| {
        plans
            .as_ref()
            .is_none_or(|f| f.split('+').all(|part| p.to_string().contains(part)))
    };
    if let Some(csv) = value("--rows") {
        return measured_elsewhere(&csv, &target, &out);
    }
    let mut rows = Vec::new();
    let mut summaries = Vec::new();
    let mut report = String::new();
    for (name, config) in models(target) {
        if only
            .as_ref()
            .is_some_and(|o| !o.iter().any(|p| name.starts_with(p.as_str())))
        {
            continue;
        }
        let spec = ModelSpec::from_config(name, config);
        let mut measured = Vec::new();
        for plan in space(target).into_iter().filter(|p| keep(p)) {
            let (peak, seconds) = match measured_before(name, &plan) {
                Some((Some(peak), Some(seconds))) => (peak, seconds),
                _ => (
                    // What the device must hold: on CUDA the pool's reserved peak.
                    measure_plan(&spec, &plan, target)
                        .map(|m| m.reserved_bytes.max(m.peak_bytes))?,
                    time_steps(&spec, &plan, steps, target)?,
                ),
            };
            let estimate = MemoryModel.estimate(&spec, &plan, &target);
            let modelled = step_time(&spec, &plan, oomfix::memory::builtins(), &target).total;
            eprintln!(
                "{name}  {plan}: {:.1} ms measured, {:.1} ms modelled, peak {peak} (estimated {})",
                seconds * 1e3,
                modelled * 1e3,
                estimate.peak
            );
            rows.push(json!({
                "model": name,
                "plan": plan,
                "measured_seconds": seconds,
                "estimated_seconds": modelled,
                "measured_peak_bytes": peak,
                "estimated_peak_bytes": estimate.peak,
                "work": step_work(&spec, &plan, oomfix::memory::builtins()),
            }));
            measured.push((plan, seconds, peak, modelled, estimate.peak));
        }
        // A budget that about half of the configurations fit.
        let budget = {
            let mut peaks: Vec<u64> = measured.iter().map(|m| m.2).collect();
            peaks.sort_unstable();
            peaks[peaks.len() / 2]
        };
        let fastest = measured
            .iter()
            .filter(|m| m.2 <= budget)
            .min_by(|a, b| a.1.total_cmp(&b.1))
            .expect("the budget is a measured peak");
        // The swept space computes the loss whole: so does the search.
        let mut pins = oomfix::Pins::default();
        pins.chunked_loss = Some(false);
        let result = Planner::new(budget)
            .global_batch(GLOBAL_BATCH)
            .seq_len(seq_len(target))
            .target(target)
            .pins(pins)
            .run(&spec)?;
        let headroom = result.headroom;
        let chosen = result.chosen().map(|a| a.plan);
        let chosen_row = chosen.and_then(|c| measured.iter().find(|m| m.0 == c));
        // Every configuration the planner would report as fitting.
        let reported: Vec<_> = measured
            .iter()
            .filter(|m| m.4 + headroom.bytes(m.4) <= budget)
            .collect();
        let over: Vec<_> = reported.iter().filter(|m| m.2 > budget).collect();
        let fastest_reported = reported.iter().min_by(|a, b| a.1.total_cmp(&b.1));
        let errors: Vec<f64> = measured.iter().map(|m| (m.3 / m.1 - 1.0).abs()).collect();
        let ratio = chosen_row.map(|c| c.1 / fastest.1);
        let recheck = match chosen_row {
            Some(c) if rounds > 0 && c.0 != fastest.0 => {
                let (mut a, mut b) = (f64::INFINITY, f64::INFINITY);
                for _ in 0..rounds {
                    a = a.min(time_steps(&spec, &c.0, steps, target)?);
                    b = b.min(time_steps(&spec, &fastest.0, steps, target)?);
                }
                Some((a, b))
            }
            _ => None,
        };
        let summary = json!({
            "model": name,
            "budget_bytes": budget,
            "configurations": measured.len(),
            "fitting_measured": measured.iter().filter(|m| m.2 <= budget).count(),
            "reported_fitting": reported.len(),
            "reported_fitting_over_budget": over.len(),
            "fastest": fastest.0,
            "fastest_seconds": fastest.1,
            "chosen": chosen,
            "chosen_seconds": chosen_row.map(|c| c.1),
            "chosen_over_fastest": ratio,
            "recheck_rounds": rounds,
            "rechecked_chosen_seconds": recheck.map(|r| r.0),
            "rechecked_fastest_seconds": recheck.map(|r| r.1),
            "fastest_reported_fitting": fastest_reported.map(|m| m.0),
            "fastest_reported_fitting_seconds": fastest_reported.map(|m| m.1),
            "time_error_median": median(errors.clone()),
            "time_error_max": errors.iter().copied().fold(0.0, f64::max),
        });
        report.push_str(&format!(
            "## {name}\n\nbudget {budget} bytes: {} of {} configurations fit when measured, \
             {} reported fitting by the estimate with the headroom, {} of those measured over the budget.\n\n\
             - fastest measured that fits: {} — {:.1} ms\n\
             - fastest measured of those the estimate reports fitting: {}\n\
             - chosen by oomfix: {} — {}\n{}\
             - step-time model |error|: median {:.1}%, max {:.1}%\n\n",
            summary["fitting_measured"],
            measured.len(),
            reported.len(),
            over.len(),
            fastest.0,
            fastest.1 * 1e3,
            fastest_reported.map_or("none".into(), |m| format!("{} — {:.1} ms", m.0, m.1 * 1e3)),
            chosen.map_or("nothing".into(), |c| c.to_string()),
            match (chosen_row, ratio) {
                (Some(c), Some(r)) => format!("{:.1} ms, {r:.3}× the fastest", c.1 * 1e3),
                _ => "not in the sweep".into(),
            },
            recheck.map_or(String::new(), |(a, b)| format!(
                "- timed again, alternately, {rounds} rounds: chosen {:.1} ms, fastest {:.1} ms, {:.3}×\n",
                a * 1e3,
                b * 1e3,
                a / b
            )),
            100.0 * median(errors.clone()),
            100.0 * errors.iter().copied().fold(0.0, f64::max),
        ));
        summaries.push(summary);
    }
    let doc: Value = json!({ "steps": steps, "global_batch": GLOBAL_BATCH, "seq_len": seq_len(target), "device": target.to_string(), "summaries": summaries, "rows": rows });
    std::fs::write(&out, serde_json::to_string_pretty(&doc)? + "\n")?;
    print!("{report}");
    Ok(())
}

/// `--rows`: the work terms and modelled times of step times measured
/// elsewhere, written as the sweep's JSON.
fn measured_elsewhere(
    csv: &str,
    target: &Target,
    out: &str,
) -> Result<(), Box<dyn std::error::Error>> {
    let mut rows = Vec::new();
    let mut errors = Vec::new();
    for line in std::fs::read_to_string(csv)?.lines() {
        if line.starts_with('#') || line.trim().is_empty() {
            continue;
        }
        let f: Vec<&str> = line.split(',').map(str::trim).collect();
        let [model, micro, seq, precision, checkpoint, attention, accum, ms] = f[..] else {
            return Err(format!("{csv}: `{line}` does not have 8 fields").into());
        };
        let config = match model {
            "gpt2" => ModelConfig::gpt2_small(),
            "gpt2-medium" => ModelConfig::gpt2_medium(),
            "tinyllama" => ModelConfig::tinyllama_1_1b(),
            _ => return Err(format!("{csv}: unknown model `{model}`").into()),
        };
        let spec = ModelSpec::from_config(model, config);
        let micro: usize = micro.parse()?;
        let accum: usize = accum.parse()?;
        let plan = Plan {
            micro_batch: micro,
            grad_accum: accum,
            precision: precision.parse()?,
            checkpoint: checkpoint.parse()?,
            attention: attention.parse()?,
            optimizer: OptimizerImpl::FusedAdamW,
            ..Plan::baseline(micro * accum, seq.parse()?)
        };
        let measured = ms.parse::<f64>()? / 1e3;
        let modelled = step_time(&spec, &plan, oomfix::memory::builtins(), target).total;
        errors.push((modelled / measured - 1.0).abs());
        println!(
            "{model} {plan}: {:.1} ms measured, {:.1} ms modelled",
            measured * 1e3,
            modelled * 1e3
        );
        rows.push(json!({
            "model": model,
            "plan": plan,
            "measured_seconds": measured,
            "estimated_seconds": modelled,
            "work": step_work(&spec, &plan, oomfix::memory::builtins()),
        }));
    }
    println!(
        "step-time model |error|: median {:.1}%, max {:.1}%",
        100.0 * median(errors.clone()),
        100.0 * errors.iter().copied().fold(0.0, f64::max)
    );
    let doc = json!({ "source": csv, "device": target.to_string(), "rows": rows });
    std::fs::write(out, serde_json::to_string_pretty(&doc)? + "\n")?;
    Ok(())
}
