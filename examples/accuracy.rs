//! Accuracy of the memory model against measured CPU peaks.
//!
//! Runs real training steps (step 2, steady state) for a matrix of model
//! families × sizes × plans and compares each measured heap peak with the
//! estimate. Writes `accuracy.json`, `accuracy.md` and `accuracy.svg` (estimated
//! against measured, log-log) into the output directory (default `docs/`) and
//! prints the table.
//!
//! ```sh
//! cargo run --release --example accuracy -- [--quick] [--out DIR] [--models A,B] [--plans TEXT] [--explain]
//! ```
//!
//! `--models` keeps the models whose names start with one of the comma-separated
//! prefixes, `--plans` the plans whose description contains every `+`-separated
//! part (e.g. `bf16+checkpoint every`); `--cache FILE` reuses the measured
//! peaks stored in FILE and stores new ones there. A filtered or cached run
//! prints its table but writes no files. `--shapes 2x64,1x256` replaces the
//! micro-batch × sequence shapes the plans are made from. `--explain` also records each measured step's allocation
//! timeline and prints the phase and moment of the measured peak with the
//! largest allocations alive then.

use oomfix::measure::{measure_plan, record_plan, CountingAlloc, Timeline};
use oomfix::strategies::{Attention, Checkpointing, OptimizerImpl, Plan, Precision, Sharding};
use oomfix::{Estimator, MemoryModel, ModelConfig, ModelSpec, Target};
use std::fmt::Write as _;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

fn models(quick: bool) -> Vec<(&'static str, ModelConfig)> {
    let mut m = vec![
        ("gpt2-tiny", ModelConfig { vocab: 512, max_positions: 256, ..ModelConfig::gpt2(2, 64, 4) }),
        ("llama-tiny", ModelConfig::llama(2, 64, 4, 2, 176, 512, false)),
        ("bert-tiny", ModelConfig { max_positions: 256, ..ModelConfig::bert(2, 64, 4, 512) }),
    ];
    if !quick {
        m.extend([
            ("gpt2-small-ish", ModelConfig { vocab: 4096, max_positions: 512, ..ModelConfig::gpt2(4, 256, 4) }),
            ("llama-small-ish", ModelConfig::llama(4, 256, 8, 2, 688, 4096, true)),
            ("bert-small-ish", ModelConfig { max_positions: 512, ..ModelConfig::bert(4, 256, 4, 4096) }),
            ("gpt2-mid", ModelConfig { vocab: 8192, max_positions: 512, ..ModelConfig::gpt2(6, 512, 8) }),
            ("llama-mid", ModelConfig::llama(6, 512, 8, 4, 1376, 8192, false)),
            ("bert-mid", ModelConfig { max_positions: 512, ..ModelConfig::bert(6, 512, 8, 8192) }),
        ]);
    }
    m
}

fn plans(quick: bool, shapes: Option<&[(usize, usize)]>) -> Vec<Plan> {
    let base = |mb: usize, s: usize| Plan { micro_batch: mb, grad_accum: 1, seq_len: s, ..Plan::baseline(mb, s) };
    let shapes: &[(usize, usize)] = match shapes {
        Some(s) => s,
        None if quick => &[(2, 64)],
        None => &[(2, 64), (4, 128), (1, 256)],
    };
    let mut out = Vec::new();
    for &(mb, s) in shapes {
        let p = base(mb, s);
        let bf16 = Plan { precision: Precision::Bf16, ..p };
        let checkpointed = Plan { checkpoint: Checkpointing::Every(1), ..p };
        let frugal = Plan {
            precision: Precision::Bf16,
            checkpoint: Checkpointing::Every(1),
            optimizer: OptimizerImpl::FusedAdamW,
            grad_accum: 2,
            ..p
        };
        out.extend([
            p,
            Plan { micro_batch: (mb / 2).max(1), grad_accum: 2, ..p },
            bf16,
            checkpointed,
            Plan { optimizer: OptimizerImpl::FusedAdamW, ..p },
            frugal,
        ]);
        out.extend([p, bf16, checkpointed, frugal].map(|q| Plan { attention: Attention::Flash, ..q }));
    }
    out.iter().map(|p| Plan { shard: Sharding::NONE, ..*p }).collect()
}

/// Command-line options.
struct Options {
    quick: bool,
    out_dir: String,
    models: Option<Vec<String>>,
    cache: Option<String>,
    shapes: Option<Vec<(usize, usize)>>,
    plans: Option<Vec<String>>,
    explain: bool,
}

impl Options {
    fn parse() -> Result<Options, String> {
        let mut o = Options { quick: false, out_dir: "docs".into(), models: None, cache: None, shapes: None, plans: None, explain: false };
        let mut args = std::env::args().skip(1);
        while let Some(a) = args.next() {
            let mut value = || args.next().ok_or_else(|| format!("{a} needs a value"));
            match a.as_str() {
                "--quick" => o.quick = true,
                "--explain" => o.explain = true,
                "--out" => o.out_dir = value()?,
                "--cache" => o.cache = Some(value()?),
                "--shapes" => {
                    let v = value()?;
                    let shape = |t: &str| t.split_once('x').and_then(|(b, s)| Some((b.parse().ok()?, s.parse().ok()?)));
                    let shapes: Option<Vec<_>> = v.split(',').map(shape).collect();
                    o.shapes = Some(shapes.ok_or_else(|| format!("--shapes {v}: expected MBxSEQ,..."))?);
                }
                "--models" => o.models = Some(value()?.split(',').map(str::to_string).collect()),
                "--plans" => o.plans = Some(value()?.split('+').map(str::to_string).collect()),
                _ => return Err(format!("unknown argument `{a}`")),
            }
        }
        Ok(o)
    }

    fn filtered(&self) -> bool {
        self.models.is_some() || self.plans.is_some() || self.cache.is_some() || self.shapes.is_some()
    }

    fn keeps(&self, model: &str, plan: &Plan) -> bool {
        let plan = plan.to_string();
        self.models.as_ref().is_none_or(|m| m.iter().any(|p| model.starts_with(p.as_str())))
            && self.plans.as_ref().is_none_or(|parts| parts.iter().all(|p| plan.contains(p.as_str())))
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let opts = Options::parse().unwrap_or_else(|e| {
        eprintln!("accuracy: {e}");
        std::process::exit(2)
    });
    if opts.explain {
        // The recording buffer is allocated once, on first use: make it now so
        // that it is part of every recorded step's baseline.
        oomfix::measure::alloc::start_recording(oomfix::measure::MAX_EVENTS);
        oomfix::measure::alloc::stop_recording();
    }
    // Measured peaks from earlier runs (`model \t plan \t bytes` lines), to
    // iterate on the model without measuring again.
    let cache: std::collections::HashMap<String, u64> = match &opts.cache {
        Some(path) => std::fs::read_to_string(path)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.rsplit_once('\t').and_then(|(k, v)| Some((k.to_string(), v.parse().ok()?))))
            .collect(),
        None => Default::default(),
    };
    let mut rows = Vec::new();
    let mut md = String::from("| model | params | plan | estimated | measured | error |\n|---|---:|---|---:|---:|---:|\n");
    for (name, config) in models(opts.quick) {
        let spec = ModelSpec::from_config(name, config);
        for plan in plans(opts.quick, opts.shapes.as_deref()) {
            if plan.seq_len > spec.config.max_positions && spec.config.family.has_learned_positions() {
                continue;
            }
            if !opts.keeps(name, &plan) {
                continue;
            }
            let est = MemoryModel.estimate(&spec, &plan, &Target::Cpu);
            let key = format!("{name}\t{plan}");
            let m = match cache.get(&key) {
                Some(&peak_bytes) => oomfix::search::Measurement { peak_bytes, reserved_bytes: peak_bytes, out_of_memory: false },
                None => measure_plan(&spec, &plan, Target::Cpu)?,
            };
            if let Some(path) = &opts.cache {
                if !cache.contains_key(&key) {
                    use std::io::Write as _;
                    let mut f = std::fs::OpenOptions::new().create(true).append(true).open(path)?;
                    writeln!(f, "{key}\t{}", m.peak_bytes)?;
                }
            }
            let err = est.peak as f64 / m.peak_bytes as f64 - 1.0;
            println!("{name:<16} {plan}\n    est {:>12} meas {:>12} err {:+6.1}%  (est phase {})", est.peak, m.peak_bytes, 100.0 * err, est.peak_phase);
            if opts.explain {
                let a = oomfix::memory::activation_bytes(&spec, &plan);
                let state = est.weights + est.master_weights + est.optimizer_state + est.accumulated_gradients;
                let blocks_grads = est.gradients - oomfix::memory::stem_only_parameters(&spec) * plan.precision.compute_bytes();
                let mb = |x: u64| format!("{:.2}", x as f64 / 1e6);
                println!(
                    "    estimate MB: state {} grads {} | loss {} ({} + {}) | blocks {} ({} + {}) | embedding {} ({} + {}) | step {}",
                    mb(state), mb(est.gradients),
                    mb(state + a.loss.total()), mb(a.loss.activations), mb(a.loss.transient),
                    mb(state + blocks_grads + a.blocks.total()), mb(a.blocks.activations), mb(a.blocks.transient),
                    mb(state + est.gradients + a.embedding.total()), mb(a.embedding.activations), mb(a.embedding.transient),
                    mb(est.weights + est.master_weights + est.optimizer_state + est.gradients + est.optimizer_transient),
                );
                let (_, timeline) = record_plan(&spec, &plan, Target::Cpu)?;
                explain(&timeline, (spec.config.vocab * spec.config.hidden) as u64 * plan.precision.compute_bytes());
            }
            let _ = writeln!(md, "| {name} | {} | {plan} | {} | {} | {:+.1}% |", spec.parameters(), est.peak, m.peak_bytes, 100.0 * err);
            rows.push(serde_json::json!({"model": name, "parameters": spec.parameters(), "plan": plan.to_string(),
                "estimated_bytes": est.peak, "measured_bytes": m.peak_bytes, "relative_error": err}));
        }
    }
    let mut errs: Vec<f64> = rows.iter().map(|r| r["relative_error"].as_f64().unwrap().abs()).collect();
    errs.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let Some(&max) = errs.last() else {
        println!("no configuration matches the filters");
        return Ok(());
    };
    let median = errs[errs.len() / 2];
    let above = errs.iter().filter(|&&e| e > 0.08).count();
    let summary = format!(
        "{} configurations: median |error| {:.1}%, max {:.1}% ({above} above 8%)",
        errs.len(),
        100.0 * median,
        100.0 * max
    );
    println!("{summary}");
    if opts.filtered() {
        return Ok(());
    }
    let out_dir = &opts.out_dir;
    std::fs::create_dir_all(out_dir)?;
    let run = |cmd: &str, args: &[&str]| {
        std::process::Command::new(cmd)
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map_or_else(|| "unknown".to_string(), |o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    let (commit, date) = (run("git", &["rev-parse", "--short", "HEAD"]), run("date", &["-u", "+%F"]));
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let header = format!(
        "# Memory model accuracy (CPU)\n\nCommand: `cargo run --release --example accuracy` (writes this file, \
        `accuracy.json` and `accuracy.svg`), commit {commit}, {date}, {cores} cores. Measured: the heap \
        high-water mark of the second (steady-state) training step above the heap before the model was built, \
        from a counting allocator; process-wide state made on first use (the thread pool and its threads' \
        matrix-kernel buffers) is created before the first measurement. Error = estimated / measured - 1."
    );
    std::fs::write(format!("{out_dir}/accuracy.md"), format!("{header}\n\n{summary}\n\n{md}"))?;
    scatter(&format!("{out_dir}/accuracy.svg"), &rows, &summary)?;
    std::fs::write(format!("{out_dir}/accuracy.json"), serde_json::to_string_pretty(&serde_json::json!({"median_abs_error": median, "max_abs_error": max, "rows": rows}))?)?;
    Ok(())
}

/// Prints where a recorded step's peak is: its phase, the position in the
/// event stream, the peak per phase, and the largest blocks alive at the peak
/// grouped by size.
fn explain(t: &Timeline, embedding_bytes: u64) {
    let live = |e: &oomfix::measure::alloc::Event| e.live.saturating_sub(t.baseline);
    let Some((at, peak)) = t.events.iter().enumerate().max_by_key(|(_, e)| live(e)) else { return };
    let mut by_phase = std::collections::BTreeMap::new();
    for e in &t.events {
        let m = by_phase.entry(e.phase.as_str()).or_insert(0u64);
        *m = (*m).max(live(e));
    }
    println!(
        "    measured peak {} in {} at event {at}/{} (phase peaks {by_phase:?}{})",
        live(peak),
        peak.phase.as_str(),
        t.events.len(),
        if t.truncated { ", truncated" } else { "" }
    );
    // The live bytes over the step: the highest value in each of 48 stretches of events.
    let stretch = t.events.len().div_ceil(48).max(1);
    let highs: Vec<String> = t.events.chunks(stretch).map(|c| format!("{:.1}", c.iter().map(live).max().unwrap_or(0) as f64 / 1e6)).collect();
    println!("    live MB over the step: {}", highs.join(" "));
    // The stretches between allocations of embedding-sized tensors (the head's
    // weight gradient, the embedding backward's tensors, the optimizer's).
    let marks: Vec<usize> = t.events.iter().enumerate().filter(|(_, e)| e.alloc && e.size == embedding_bytes).map(|(i, _)| i).collect();
    let mut from = 0;
    let mut parts = Vec::new();
    for &m in marks.iter().chain([&t.events.len()]) {
        let high = t.events[from..m].iter().map(live).max().unwrap_or(0);
        parts.push(format!("[{from}..{m}) max {:.2}", high as f64 / 1e6));
        from = m;
    }
    if parts.len() <= 40 {
        println!("    between embedding-sized allocations: {}", parts.join(", "));
    }
    // Blocks allocated during the step and alive at the peak.
    let mut alive = std::collections::HashMap::new();
    for (i, e) in t.events[..=at].iter().enumerate() {
        if e.alloc {
            alive.insert(e.addr, (e.size, i));
        } else {
            alive.remove(&e.addr);
        }
    }
    let mut sizes = std::collections::BTreeMap::<u64, Vec<usize>>::new();
    for &(s, i) in alive.values() {
        sizes.entry(s).or_default().push(i);
    }
    let mut sizes: Vec<_> = sizes.into_iter().map(|(s, at)| (s * at.len() as u64, s, at)).collect();
    sizes.sort_by_key(|x| std::cmp::Reverse(x.0));
    let new: u64 = alive.values().map(|a| a.0).sum();
    println!("    allocated in the step and alive at the peak: {new} bytes; largest groups (size x count: events of the last 8 allocations):");
    for (total, s, at) in sizes.iter_mut().take(12) {
        at.sort_unstable();
        let shown = if std::env::var("EXPLAIN_SIZE").is_ok_and(|v| v == s.to_string()) { at.len() } else { 8 };
        let last = &at[at.len().saturating_sub(shown)..];
        println!("      {s:>10} x {:<4} = {total:<10} {last:?}", at.len());
    }
}

/// Estimated against measured peaks, log-log, with the y = x line.
fn scatter(path: &str, rows: &[serde_json::Value], title: &str) -> Result<(), Box<dyn std::error::Error>> {
    use plotters::prelude::*;
    let points: Vec<(f64, f64, &str)> = rows
        .iter()
        .map(|r| {
            let mib = |k: &str| r[k].as_f64().unwrap() / (1u64 << 20) as f64;
            (mib("measured_bytes"), mib("estimated_bytes"), r["model"].as_str().unwrap())
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
    chart.configure_mesh().x_desc("measured peak (MiB)").y_desc("estimated peak (MiB)").draw()?;
    chart.draw_series(LineSeries::new([(lo, lo), (hi, hi)], &BLACK.mix(0.4)))?;
    for (family, color) in [("gpt2", RED), ("llama", BLUE), ("bert", GREEN)] {
        chart
            .draw_series(points.iter().filter(|p| p.2.starts_with(family)).map(|p| Circle::new((p.0, p.1), 3, color.filled())))?
            .label(family)
            .legend(move |(x, y)| Circle::new((x, y), 3, color.filled()));
    }
    chart.configure_series_labels().background_style(WHITE).border_style(BLACK).draw()?;
    root.present()?;
    Ok(())
}
