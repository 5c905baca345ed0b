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
//! `--deadline` stops starting new measurements after that many seconds (rows
//! known from `--resume` or `--cache` are still estimated) and writes what was measured; `--resume FILE` takes the peaks an earlier run's
//! JSON measured (recomputing their estimates) and measures only the
//! configurations it lacks.
//!
//! To study the model on part of the matrix: `--models A,B` keeps the models
//! whose names start with one of the prefixes, `--plans TEXT` the plans whose
//! description contains every `+`-separated part (e.g. `bf16+checkpoint
//! every`), `--shapes 2x64,1x256` replaces the micro-batch × sequence shapes;
//! `--cache FILE` reuses the measured peaks stored in FILE (`model`, `plan`,
//! bytes per line, tab-separated) and stores new ones there, so the estimates
//! can be recomputed without measuring again; a FILE ending in `.json` is an
//! earlier run's output, read only (`--cache-only`: skip the
//! configurations FILE lacks, e.g. to re-estimate GPU rows on a machine
//! without one). A filtered or `--cache-only` run prints its rows but
//! writes no files. `--explain` (CPU) also records each step's allocation
//! timeline and prints the phase and moment of the measured peak, the
//! estimate's moments and the largest allocations alive at the peak.

use oomfix::measure::{measure_plan, record_plan, Timeline};
use oomfix::strategies::{Attention, Checkpointing, OptimizerImpl, Plan, Precision, Sharding};
use oomfix::track::{Component, CountingAlloc};
use oomfix::{Estimator, Family, MemoryModel, ModelConfig, ModelSpec, Target};
use std::fmt::Write as _;

#[path = "common/args.rs"]
mod args;
use args::Args;

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

/// A GPT-2 of `layers` × `hidden` (`heads` heads), a vocabulary of `vocab`
/// and `positions` learned positions.
fn gpt2(shape: (usize, usize, usize), vocab: usize, positions: usize) -> ModelConfig {
    let (layers, hidden, heads) = shape;
    ModelConfig {
        vocab,
        max_positions: positions,
        ..ModelConfig::gpt2(layers, hidden, heads)
    }
}

/// A BERT of `layers` × `hidden` (`heads` heads), a vocabulary of `vocab`
/// and `positions` learned positions.
fn bert(shape: (usize, usize, usize), vocab: usize, positions: usize) -> ModelConfig {
    let (layers, hidden, heads) = shape;
    ModelConfig {
        max_positions: positions,
        ..ModelConfig::bert(layers, hidden, heads, vocab)
    }
}

fn models(quick: bool) -> Vec<(&'static str, ModelConfig)> {
    let llama = ModelConfig::llama;
    let mut m = vec![
        ("gpt2-tiny", gpt2((2, 64, 4), 512, 256)),
        ("llama-tiny", llama(2, 64, 4, 2, 176, 512, false)),
        ("bert-tiny", bert((2, 64, 4), 512, 256)),
    ];
    if !quick {
        m.extend([
            ("gpt2-small-ish", gpt2((4, 256, 4), 4096, 512)),
            ("llama-small-ish", llama(4, 256, 8, 2, 688, 4096, true)),
            ("bert-small-ish", bert((4, 256, 4), 4096, 512)),
            ("gpt2-mid", gpt2((6, 512, 8), 8192, 512)),
            ("llama-mid", llama(6, 512, 8, 4, 1376, 8192, false)),
            ("bert-mid", bert((6, 512, 8), 8192, 512)),
            // A masked-LM head 78 times the hidden size, as all-MiniLM-L6-v2's
            // 30,522 words are of its 384.
            ("bert-wide-head", bert((2, 64, 4), 5000, 256)),
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
    let args = Args::from_env();
    let value = |option: &str| args.value(option);
    let quick = args.has("--quick");
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
    let model_prefixes: Option<Vec<String>> =
        value("--models").map(|v| v.split(',').map(str::to_string).collect());
    let plan_parts: Option<Vec<String>> =
        value("--plans").map(|v| v.split('+').map(str::to_string).collect());
    let custom_shapes = match value("--shapes") {
        Some(v) => {
            let shape = |t: &str| {
                let (b, s) = t.split_once('x')?;
                Some((b.parse().ok()?, s.parse().ok()?))
            };
            let parsed: Option<Vec<(usize, usize)>> = v.split(',').map(shape).collect();
            Some(parsed.ok_or_else(|| format!("--shapes {v}: expected MBxSEQ,..."))?)
        }
        None => None,
    };
    let shapes = custom_shapes.as_deref().unwrap_or(shapes);
    let explain = args.has("--explain") && !gpu;
    let cache_path = value("--cache");
    let cache_only = args.has("--cache-only");
    // A filtered run, or one that skips what its cache lacks, writes no files.
    let partial =
        model_prefixes.is_some() || plan_parts.is_some() || custom_shapes.is_some() || cache_only;
    let keeps = |model: &str, plan: &Plan| {
        let plan = plan.to_string();
        model_prefixes
            .as_ref()
            .is_none_or(|m| m.iter().any(|p| model.starts_with(p.as_str())))
            && plan_parts
                .as_ref()
                .is_none_or(|parts| parts.iter().all(|p| plan.contains(p.as_str())))
    };
    // Measured peaks of earlier runs, to recompute estimates without measuring:
    // a tab-separated file this option wrote, or an earlier run's JSON (read only).
    let cache_json = cache_path.as_ref().is_some_and(|p| p.ends_with(".json"));
    let cache: std::collections::HashMap<String, u64> = match &cache_path {
        Some(path) if cache_json => json_peaks(path)?
            .into_iter()
            .filter_map(|(key, peak)| Some((key, peak?)))
            .collect(),
        Some(path) => std::fs::read_to_string(path)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| {
                let (key, bytes) = l.rsplit_once('\t')?;
                Some((key.to_string(), bytes.parse().ok()?))
            })
            .collect(),
        None => Default::default(),
    };
    if explain {
        // The recording buffer is allocated on first use: make it now, so that
        // it is part of every recorded step's baseline.
        oomfix::track::alloc::start_recording(oomfix::measure::MAX_EVENTS);
        oomfix::track::alloc::stop_recording();
    }
    // `--resume FILE`: the peaks an earlier run's JSON measured (`None`: out of
    // memory) are taken as measured; their estimates are recomputed.
    let resumed = match value("--resume") {
        Some(path) => json_peaks(&path)?,
        None => Default::default(),
    };
    // The configurations, resumed ones first, then composed attention before
    // flash, so that a deadline cuts the least informative rows.
    let mut todo: Vec<(&str, ModelSpec, Plan)> = Vec::new();
    for (name, config) in models {
        let spec = ModelSpec::from_config(name, config);
        for plan in plans(shapes) {
            let family = spec.config.family;
            // GPU: sequence 256 only for BERT, whose positions stop at 512.
            if !(plan.seq_len > spec.config.max_positions && family.has_learned_positions()
                || plan.attention == Attention::Flash
                    && !target.has_flash_attention(spec.config.head_dim())
                || gpu && plan.seq_len == 256 && family != Family::Bert
                || !keeps(name, &plan))
            {
                todo.push((name, spec.clone(), plan));
            }
        }
    }
    let known = |key: &String| resumed.contains_key(key) || cache.contains_key(key);
    todo.sort_by_key(|(name, _, plan)| {
        (
            !known(&format!("{name}\t{plan}")),
            plan.attention == Attention::Flash,
        )
    });
    let mut rows: Vec<serde_json::Value> = Vec::new();
    let mut measured_here = 0;
    let started = std::time::Instant::now();
    let mut past_deadline = false;
    for (name, spec, plan) in todo {
        let key = format!("{name}\t{plan}");
        let earlier = resumed.get(&key).copied();
        // Past the deadline, configurations that need a measurement are skipped.
        if !known(&key) && started.elapsed().as_secs_f64() > deadline {
            if !past_deadline {
                println!("deadline of {deadline} s reached: measuring nothing more (continue with --resume)");
                past_deadline = true;
            }
            continue;
        }
        if cache_only && !cache.contains_key(&key) {
            continue;
        }
        let breakdown = MemoryModel.estimate(&spec, &plan, &target);
        // The measured figure is live bytes plus memory outside the pool: compare
        // the estimate without the pool's slack.
        let est_peak = breakdown.allocated_peak();
        let measured = |peak_bytes| oomfix::search::Measurement {
            peak_bytes,
            reserved_bytes: peak_bytes,
            out_of_memory: false,
            step_seconds: None,
        };
        // The pool's reserved peak is known for configurations measured here only.
        let mut reserved = None;
        let m = match (earlier, cache.get(&key)) {
            (Some(Some(peak_bytes)), _) | (None, Some(&peak_bytes)) => measured(peak_bytes),
            (Some(None), _) => oomfix::search::Measurement {
                out_of_memory: true,
                ..measured(0)
            },
            (None, None) => {
                measured_here += 1;
                let m = measure_plan(&spec, &plan, target)?;
                reserved = (gpu && !m.out_of_memory).then_some(m.reserved_bytes);
                m
            }
        };
        if let Some(path) = cache_path
            .as_ref()
            .filter(|_| !cache_json && !cache.contains_key(&key))
        {
            use std::io::Write as _;
            let mut f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)?;
            writeln!(f, "{key}\t{}", m.peak_bytes)?;
        }
        let err = (!m.out_of_memory).then(|| est_peak as f64 / m.peak_bytes as f64 - 1.0);
        match err {
            Some(err) => println!(
                "{name:<16} {plan}\n    est {:>12} meas {:>12} err {:+6.1}%  (est phase {})",
                est_peak,
                m.peak_bytes,
                100.0 * err,
                breakdown.peak_phase
            ),
            None => println!("{name:<16} {plan}\n    est {:>12} out of memory", est_peak),
        }
        if explain {
            print_moments(&spec, &plan, &breakdown);
            let (_, timeline) = record_plan(&spec, &plan, target)?;
            explain_peak(&timeline);
        }
        rows.push(serde_json::json!({"model": name, "parameters": spec.parameters(), "plan": plan.to_string(),
            "estimated_bytes": est_peak, "measured_bytes": (!m.out_of_memory).then_some(m.peak_bytes),
            "relative_error": err, "measured_reserved_bytes": reserved}));
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
    let above = errs.iter().filter(|&&e| e > 0.08).count();
    let summary = format!(
        "{} configurations on {target}: median |error| {:.1}%, max {:.1}% ({above} above 8%; \
        {out_of_memory} out of memory, not counted)",
        errs.len(),
        100.0 * median,
        100.0 * max
    );
    println!("{summary}");
    if partial {
        return Ok(());
    }
    std::fs::create_dir_all(&out_dir)?;
    let run = |cmd: &str, args: &[&str]| {
        std::process::Command::new(cmd)
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map_or_else(
                || "unknown".to_string(),
                |o| String::from_utf8_lossy(&o.stdout).trim().to_string(),
            )
    };
    let commit = run("git", &["rev-parse", "--short", "HEAD"]);
    let date = run("date", &["-u", "+%F"]);
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let (stem, header) = if gpu {
        ("accuracy-gpu", format!("# Memory model accuracy (GPU)\n\nCommand: `accuracy --device cuda:0` (built with \
            `scripts/build-cuda.sh --features cuda --example accuracy`), commit {commit}, {date}. Measured: the CUDA \
            pool's used high-water mark over the second (steady-state) training step plus the device memory outside \
            the pool (context, modules, cuBLAS workspace), as `--verify` measures it. Error = estimated / measured - 1."))
    } else {
        ("accuracy", format!("# Memory model accuracy (CPU)\n\nCommand: `cargo run --release --example accuracy` \
            (writes this file, `accuracy.json` and `accuracy.svg`), commit {commit}, {date}, {cores} cores. \
            Measured: the heap high-water mark of the second (steady-state) training step above the heap before the \
            model was built, from a counting allocator; process-wide state made on first use (the thread pool and \
            its threads' matrix-kernel buffers) is created before the first measurement. \
            Error = estimated / measured - 1."))
    };
    let reused = rows.len() - measured_here;
    let provenance = if reused > 0 {
        format!(
            " Estimates are this commit's; {reused} of the {} measured peaks come from an earlier run \
             (`--resume`/`--cache`), {measured_here} were measured at this commit.",
            rows.len()
        )
    } else {
        String::new()
    };
    std::fs::write(
        format!("{out_dir}/{stem}.md"),
        format!("{header}{provenance}\n\n{summary}\n\n{md}"),
    )?;
    scatter(&format!("{out_dir}/{stem}.svg"), &rows, &summary)?;
    std::fs::write(
        format!("{out_dir}/{stem}.json"),
        serde_json::to_string_pretty(&serde_json::json!({"target": target.to_string(),
            "median_abs_error": median, "max_abs_error": max, "rows": rows}))?,
    )?;
    Ok(())
}

/// Prints the estimate's moments: what is alive besides the activations, and
/// each backward moment's total (activations + working set).
fn print_moments(spec: &ModelSpec, plan: &Plan, est: &oomfix::memory::Breakdown) {
    let a = oomfix::memory::activation_bytes(spec, plan, &oomfix::memory::builtin_execution(plan));
    let state = est.weights + est.master_weights + est.optimizer_state + est.accumulated_gradients;
    let stem_grads = oomfix::memory::stem_only_parameters(spec) * plan.precision.compute_bytes();
    let mb = |x: u64| format!("{:.2}", x as f64 / 1e6);
    let moment = |m: oomfix::memory::Moment, grads: u64| {
        format!(
            "{} ({} + {})",
            mb(state + grads + m.total()),
            mb(m.activations),
            mb(m.transient)
        )
    };
    println!(
        "    estimate MB: state {} grads {} | loss {} | blocks {} | embedding {} | step {}",
        mb(state),
        mb(est.gradients),
        moment(a.loss, 0),
        moment(a.blocks, est.gradients - stem_grads),
        moment(a.embedding, est.gradients),
        mb(est.weights
            + est.master_weights
            + est.optimizer_state
            + est.gradients
            + est.optimizer_transient),
    );
}

/// Prints where a recorded step's peak is: its phase, the position in the
/// event stream, the peak per phase, and the largest blocks alive at the peak
/// grouped by size.
fn explain_peak(t: &Timeline) {
    let (at, components) = t.peak();
    println!(
        "    measured peak {} at {:.1} ms ({}){}: {}",
        components.iter().sum::<u64>(),
        at as f64 / 1e6,
        t.phase_at(at).as_str(),
        if t.truncated { ", truncated" } else { "" },
        Component::ALL
            .iter()
            .map(|c| format!("{} {}", c.as_str(), components[*c as usize]))
            .collect::<Vec<_>>()
            .join(", ")
    );
    // What is alive at the peak, grouped by module/op tag and component.
    let mut groups = std::collections::HashMap::<(String, &str), (u64, usize)>::new();
    for b in &t.blocks {
        if b.alloc_ns.is_none_or(|a| a <= at) && b.free_ns.is_none_or(|f| f > at) {
            let g = groups
                .entry((b.tag.name(), b.component.as_str()))
                .or_default();
            g.0 += b.size;
            g.1 += 1;
        }
    }
    let mut groups: Vec<_> = groups.into_iter().collect();
    groups.sort_by_key(|(_, (bytes, _))| std::cmp::Reverse(*bytes));
    println!("    largest groups alive at the peak (tag, component: bytes in blocks):");
    for ((tag, component), (bytes, count)) in groups.iter().take(12) {
        println!("      {tag:<40} {component:<16} {bytes:>12} in {count}");
    }
    let mut alive: Vec<_> = t
        .blocks
        .iter()
        .filter(|b| b.alloc_ns.is_some_and(|a| a <= at) && b.free_ns.is_none_or(|f| f > at))
        .collect();
    alive.sort_by_key(|b| std::cmp::Reverse(b.size));
    println!("    largest blocks allocated during the step and alive at the peak:");
    for b in alive.iter().take(12) {
        println!(
            "      {:>12} {:<40} {} at {:.1} ms",
            b.size,
            b.tag.name(),
            b.component.as_str(),
            b.alloc_ns.unwrap_or(0) as f64 / 1e6
        );
    }
}

/// The measured peaks of an earlier run's JSON by `model\tplan` (`None`: out of memory).
fn json_peaks(
    path: &str,
) -> Result<std::collections::HashMap<String, Option<u64>>, Box<dyn std::error::Error>> {
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path)?)?;
    Ok(json["rows"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|r| {
            let key = format!("{}\t{}", r["model"].as_str()?, r["plan"].as_str()?);
            Some((key, r["measured_bytes"].as_u64()))
        })
        .collect())
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
