//! Accuracy of the memory model against measured CPU peaks.
//!
//! Runs real training steps (step 2, steady state) for a matrix of model
//! families × sizes × plans and compares each measured heap peak with the
//! estimate. Writes `accuracy.json`, `accuracy.md` and `accuracy.svg` (estimated
//! against measured, log-log) into the output directory (default `docs/`) and
//! prints the table.
//!
//! ```sh
//! cargo run --release --example accuracy -- [--quick] [--out DIR]
//! ```

use oomfix::measure::{measure_plan, CountingAlloc};
use oomfix::strategies::{Attention, Checkpointing, OptimizerImpl, Plan, Precision, Sharding};
use oomfix::{Estimator, MemoryModel, ModelConfig, ModelSpec, Target};
use std::fmt::Write as _;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

fn models(quick: bool) -> Vec<(&'static str, ModelConfig)> {
    let mut m = vec![
        (
            "gpt2-tiny",
            ModelConfig {
                vocab: 512,
                max_positions: 256,
                ..ModelConfig::gpt2(2, 64, 4)
            },
        ),
        (
            "llama-tiny",
            ModelConfig::llama(2, 64, 4, 2, 176, 512, false),
        ),
        (
            "bert-tiny",
            ModelConfig {
                max_positions: 256,
                ..ModelConfig::bert(2, 64, 4, 512)
            },
        ),
    ];
    if !quick {
        m.extend([
            (
                "gpt2-small-ish",
                ModelConfig {
                    vocab: 4096,
                    max_positions: 512,
                    ..ModelConfig::gpt2(4, 256, 4)
                },
            ),
            (
                "llama-small-ish",
                ModelConfig::llama(4, 256, 8, 2, 688, 4096, true),
            ),
            (
                "bert-small-ish",
                ModelConfig {
                    max_positions: 512,
                    ..ModelConfig::bert(4, 256, 4, 4096)
                },
            ),
            (
                "gpt2-mid",
                ModelConfig {
                    vocab: 8192,
                    max_positions: 512,
                    ..ModelConfig::gpt2(6, 512, 8)
                },
            ),
            (
                "llama-mid",
                ModelConfig::llama(6, 512, 8, 4, 1376, 8192, false),
            ),
            (
                "bert-mid",
                ModelConfig {
                    max_positions: 512,
                    ..ModelConfig::bert(6, 512, 8, 8192)
                },
            ),
        ]);
    }
    m
}

fn plans(quick: bool) -> Vec<Plan> {
    let base = |mb: usize, s: usize| Plan {
        micro_batch: mb,
        grad_accum: 1,
        seq_len: s,
        ..Plan::baseline(mb, s)
    };
    let shapes: &[(usize, usize)] = if quick {
        &[(2, 64)]
    } else {
        &[(2, 64), (4, 128), (1, 256)]
    };
    let mut out = Vec::new();
    for &(mb, s) in shapes {
        let p = base(mb, s);
        let bf16 = Plan {
            precision: Precision::Bf16,
            ..p
        };
        let checkpointed = Plan {
            checkpoint: Checkpointing::Every(1),
            ..p
        };
        let frugal = Plan {
            precision: Precision::Bf16,
            checkpoint: Checkpointing::Every(1),
            optimizer: OptimizerImpl::FusedAdamW,
            grad_accum: 2,
            ..p
        };
        out.extend([
            p,
            Plan {
                micro_batch: (mb / 2).max(1),
                grad_accum: 2,
                ..p
            },
            bf16,
            checkpointed,
            Plan {
                optimizer: OptimizerImpl::FusedAdamW,
                ..p
            },
            frugal,
        ]);
        out.extend([p, bf16, checkpointed, frugal].map(|q| Plan {
            attention: Attention::Flash,
            ..q
        }));
    }
    out.iter()
        .map(|p| Plan {
            shard: Sharding::NONE,
            ..*p
        })
        .collect()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let out_dir = args
        .iter()
        .position(|a| a == "--out")
        .map(|i| args[i + 1].clone())
        .unwrap_or("docs".into());
    let mut rows = Vec::new();
    let mut md = String::from(
        "| model | params | plan | estimated | measured | error |\n|---|---:|---|---:|---:|---:|\n",
    );
    for (name, config) in models(quick) {
        let spec = ModelSpec::from_config(name, config);
        for plan in plans(quick) {
            if plan.seq_len > spec.config.max_positions
                && spec.config.family.has_learned_positions()
            {
                continue;
            }
            let est = MemoryModel.estimate(&spec, &plan, &Target::Cpu);
            let m = measure_plan(&spec, &plan, Target::Cpu)?;
            let err = est.peak as f64 / m.peak_bytes as f64 - 1.0;
            println!(
                "{name:<16} {plan}\n    est {:>12} meas {:>12} err {:+6.1}%  (est phase {})",
                est.peak,
                m.peak_bytes,
                100.0 * err,
                est.peak_phase
            );
            let _ = writeln!(
                md,
                "| {name} | {} | {plan} | {} | {} | {:+.1}% |",
                spec.parameters(),
                est.peak,
                m.peak_bytes,
                100.0 * err
            );
            rows.push(serde_json::json!({"model": name, "parameters": spec.parameters(), "plan": plan.to_string(),
                "estimated_bytes": est.peak, "measured_bytes": m.peak_bytes, "relative_error": err}));
        }
    }
    let mut errs: Vec<f64> = rows
        .iter()
        .map(|r| r["relative_error"].as_f64().unwrap().abs())
        .collect();
    errs.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let median = errs[errs.len() / 2];
    let max = errs.last().copied().unwrap_or(0.0);
    let summary = format!(
        "{} configurations: median |error| {:.1}%, max {:.1}%",
        errs.len(),
        100.0 * median,
        100.0 * max
    );
    println!("{summary}");
    std::fs::create_dir_all(&out_dir)?;
    let header = "# Memory model accuracy (CPU)\n\nCommand: `cargo run --release --example accuracy`. Measured: the heap \
        high-water mark of the second (steady-state) training step above the heap before the model was built, \
        from a counting allocator. Error = estimated / measured - 1.";
    std::fs::write(
        format!("{out_dir}/accuracy.md"),
        format!("{header}\n\n{summary}\n\n{md}"),
    )?;
    scatter(&format!("{out_dir}/accuracy.svg"), &rows, &summary)?;
    std::fs::write(
        format!("{out_dir}/accuracy.json"),
        serde_json::to_string_pretty(
            &serde_json::json!({"median_abs_error": median, "max_abs_error": max, "rows": rows}),
        )?,
    )?;
    Ok(())
}

/// Estimated against measured peaks, log-log, with the y = x line.
fn scatter(
    path: &str,
    rows: &[serde_json::Value],
    title: &str,
) -> Result<(), Box<dyn std::error::Error>> {
    use plotters::prelude::*;
    let points: Vec<(f64, f64, &str)> = rows
        .iter()
        .map(|r| {
            let mib = |k: &str| r[k].as_f64().unwrap() / (1u64 << 20) as f64;
            (
                mib("measured_bytes"),
                mib("estimated_bytes"),
                r["model"].as_str().unwrap(),
            )
        })
        .collect();
    let hi = points.iter().map(|p| p.0.max(p.1)).fold(1.0, f64::max) * 1.3;
    let lo = points.iter().map(|p| p.0.min(p.1)).fold(f64::MAX, f64::min) / 1.3;
    let root = SVGBackend::new(path, (720, 640)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 16))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d((lo..hi).log_scale(), (lo..hi).log_scale())?;
    chart
        .configure_mesh()
        .x_desc("measured peak (MiB)")
        .y_desc("estimated peak (MiB)")
        .draw()?;
    chart.draw_series(LineSeries::new([(lo, lo), (hi, hi)], &BLACK.mix(0.4)))?;
    for (family, color) in [("gpt2", RED), ("llama", BLUE), ("bert", GREEN)] {
        chart
            .draw_series(
                points
                    .iter()
                    .filter(|p| p.2.starts_with(family))
                    .map(|p| Circle::new((p.0, p.1), 3, color.filled())),
            )?
            .label(family)
            .legend(move |(x, y)| Circle::new((x, y), 3, color.filled()));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE)
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}
