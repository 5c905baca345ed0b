//! Accuracy of the memory model against measured peaks.
//!
//! Runs real training steps (step 2, steady state) for a matrix of model
//! families × sizes × plans and compares each measured peak with the estimate:
//! on the CPU the heap high-water mark, on `cuda:N` the CUDA pool's used
//! high-water mark plus the device memory outside the pool. Writes
//! `accuracy.{json,md,svg}` (CPU) or `accuracy-gpu.{json,md,svg}` (CUDA;
//! GPU-sized models) into the output directory (default `docs/`) and prints
//! each row as it is measured.
//!
//! ```sh
//! cargo run --release --example accuracy -- [--quick] [--out DIR]
//! scripts/build-cuda.sh --features cuda --example accuracy   # then, on the GPU machine:
//! accuracy --device cuda:0 [--deadline SECONDS] [--resume docs/accuracy-gpu.json]
//! ```
//!
//! `--deadline` stops starting new measurements after that many seconds and
//! writes what was measured; `--resume FILE` starts from the rows of an earlier
//! run's JSON and measures only the configurations it lacks.

use oomfix::measure::{measure_plan, CountingAlloc};
use oomfix::strategies::{Attention, Checkpointing, OptimizerImpl, Plan, Precision, Sharding};
use oomfix::{Estimator, Family, MemoryModel, ModelConfig, ModelSpec, Target};
use std::fmt::Write as _;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

/// GPU-sized models: three sizes per family, up to TinyLlama-1.1B.
fn gpu_models() -> Vec<(&'static str, ModelConfig)> {
    vec![
        ("gpt2-6l", ModelConfig::gpt2(6, 768, 12)),
        ("gpt2-small", ModelConfig::gpt2_small()),
        ("gpt2-medium", ModelConfig::gpt2_medium()),
        (
            "llama-160m",
            ModelConfig::llama(12, 768, 12, 4, 2048, 32000, false),
        ),
        (
            "llama-400m",
            ModelConfig::llama(16, 1024, 16, 8, 2816, 32000, false),
        ),
        (
            "tinyllama-1.1b",
            ModelConfig::llama(22, 2048, 32, 4, 5632, 32000, false),
        ),
        ("bert-small", ModelConfig::bert(4, 512, 8, 30522)),
        ("bert-base", ModelConfig::bert_base()),
        ("bert-large", ModelConfig::bert(24, 1024, 16, 30522)),
    ]
}

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

fn plans(shapes: &[(usize, usize)]) -> Vec<Plan> {
    let base = |mb: usize, s: usize| Plan {
        micro_batch: mb,
        grad_accum: 1,
        seq_len: s,
        ..Plan::baseline(mb, s)
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
    let value = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let quick = args.iter().any(|a| a == "--quick");
    let out_dir = value("--out").unwrap_or("docs".into());
    let target: Target = value("--device").unwrap_or("cpu".into()).parse()?;
    let deadline = value("--deadline")
        .map(|s| s.parse::<f64>())
        .transpose()?
        .unwrap_or(f64::INFINITY);
    let gpu = target != Target::Cpu;
    let (models, shapes): (_, &[(usize, usize)]) = match (gpu, quick) {
        (true, _) => (gpu_models(), &[(8, 512), (4, 1024), (16, 256)]),
        (false, true) => (models(true), &[(2, 64)]),
        (false, false) => (models(false), &[(2, 64), (4, 128), (1, 256)]),
    };
    // `--resume FILE`: keep the rows of an earlier run's JSON and measure only the rest.
    let mut rows: Vec<serde_json::Value> = match value("--resume") {
        Some(path) => serde_json::from_str::<serde_json::Value>(&std::fs::read_to_string(path)?)?
            ["rows"]
            .as_array()
            .cloned()
            .unwrap_or_default(),
        None => Vec::new(),
    };
    let started = std::time::Instant::now();
    'matrix: for (name, config) in models {
        let spec = ModelSpec::from_config(name, config);
        for plan in plans(shapes) {
            let family = spec.config.family;
            // GPU: sequence 256 only for BERT, whose positions stop at 512.
            if plan.seq_len > spec.config.max_positions && family.has_learned_positions()
                || plan.attention == Attention::Flash && !target.has_flash_attention()
                || gpu && plan.seq_len == 256 && family != Family::Bert
                || rows
                    .iter()
                    .any(|r| r["model"] == name && r["plan"] == plan.to_string())
            {
                continue;
            }
            if started.elapsed().as_secs_f64() > deadline {
                println!("deadline of {deadline} s reached: stopping (continue with --resume)");
                break 'matrix;
            }
            let est = MemoryModel.estimate(&spec, &plan, &target);
            let m = measure_plan(&spec, &plan, target)?;
            let err = (!m.out_of_memory).then(|| est.peak as f64 / m.peak_bytes as f64 - 1.0);
            match err {
                Some(err) => println!(
                    "{name:<16} {plan}\n    est {:>12} meas {:>12} err {:+6.1}%  (est phase {})",
                    est.peak,
                    m.peak_bytes,
                    100.0 * err,
                    est.peak_phase
                ),
                None => println!("{name:<16} {plan}\n    est {:>12} out of memory", est.peak),
            }
            rows.push(serde_json::json!({"model": name, "parameters": spec.parameters(), "plan": plan.to_string(),
                "estimated_bytes": est.peak, "measured_bytes": (!m.out_of_memory).then_some(m.peak_bytes),
                "relative_error": err}));
        }
    }
    let mut md = String::from(
        "| model | params | plan | estimated | measured | error |\n|---|---:|---|---:|---:|---:|\n",
    );
    for r in &rows {
        let (measured, error) = match r["relative_error"].as_f64() {
            Some(e) => (
                r["measured_bytes"].to_string(),
                format!("{:+.1}%", 100.0 * e),
            ),
            None => ("out of memory".into(), String::new()),
        };
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {measured} | {error} |",
            r["model"].as_str().unwrap_or("?"),
            r["parameters"],
            r["plan"].as_str().unwrap_or("?"),
            r["estimated_bytes"]
        );
    }
    let mut errs: Vec<f64> = rows
        .iter()
        .filter_map(|r| r["relative_error"].as_f64())
        .map(f64::abs)
        .collect();
    let out_of_memory = rows.len() - errs.len();
    errs.sort_by(f64::total_cmp);
    let median = errs.get(errs.len() / 2).copied().unwrap_or(0.0);
    let max = errs.last().copied().unwrap_or(0.0);
    let summary = format!(
        "{} configurations on {target}: median |error| {:.1}%, max {:.1}% ({out_of_memory} out of memory, not counted)",
        errs.len(),
        100.0 * median,
        100.0 * max
    );
    println!("{summary}");
    std::fs::create_dir_all(&out_dir)?;
    let (stem, header) = if gpu {
        ("accuracy-gpu", "# Memory model accuracy (GPU)\n\nCommand: `accuracy --device cuda:0` (built with \
            `scripts/build-cuda.sh --features cuda --example accuracy`). Measured: the CUDA pool's used high-water \
            mark over the second (steady-state) training step plus the device memory outside the pool (context, \
            modules, cuBLAS workspace), as `--verify` measures it. Error = estimated / measured - 1.")
    } else {
        ("accuracy", "# Memory model accuracy (CPU)\n\nCommand: `cargo run --release --example accuracy`. Measured: \
            the heap high-water mark of the second (steady-state) training step above the heap before the model was \
            built, from a counting allocator. Error = estimated / measured - 1.")
    };
    std::fs::write(
        format!("{out_dir}/{stem}.md"),
        format!("{header}\n\n{summary}\n\n{md}"),
    )?;
    scatter(&format!("{out_dir}/{stem}.svg"), &rows, &summary)?;
    std::fs::write(
        format!("{out_dir}/{stem}.json"),
        serde_json::to_string_pretty(&serde_json::json!({"target": target.to_string(),
            "median_abs_error": median, "max_abs_error": max, "rows": rows}))?,
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
    // Out-of-memory rows have no measured peak and are left out.
    let points: Vec<(f64, f64, &str)> = rows
        .iter()
        .filter_map(|r| {
            let mib = |k: &str| Some(r[k].as_f64()? / (1u64 << 20) as f64);
            Some((
                mib("measured_bytes")?,
                mib("estimated_bytes")?,
                r["model"].as_str()?,
            ))
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
