//! Training benchmark on the CPU: measured peak memory and step time of each
//! memory fix, and two focused comparisons.
//!
//! For a GPT-2-shaped and a Llama-shaped model (global batch 8) it runs real
//! training steps of the baseline plan, of each fix alone (micro-batch 1 × 8
//! accumulation, bf16, checkpoint every block, fused AdamW) and of the plan the
//! pipeline chooses for a budget the baseline does not fit in. Then it compares
//! fused AdamW with `candle_nn::AdamW` on ~50M f32 parameters, and a checkpointed
//! (every block) forward+backward pass with a plain one.
//!
//! Variants run interleaved (one step of each in turn, round after round) so
//! that noise on a shared machine hits them alike; the first round is a warm-up
//! and is not counted; figures are medians over the remaining rounds.
//!
//! Peaks are heap bytes counted by [`CountingAlloc`]. A trainer's peak is the
//! heap its construction and earlier steps left allocated (weights, optimizer
//! state, master weights) plus the high-water mark of a step above the heap
//! just before it: what the trainer would show alone, measured while the other
//! variants sit idle. Markdown goes to stdout, progress to stderr.
//!
//! ```sh
//! cargo run --release --example bench_train -- [--seq N] [--rounds N] [--quick]
//! ```

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{AdamW, Optimizer};
use oomfix::measure::measure_plan;
use oomfix::strategies::adamw::FusedAdamW;
use oomfix::strategies::{Checkpointing, OptimizerImpl, Plan, Precision};
use oomfix::track::{alloc, CountingAlloc};
use oomfix::train::data::DataSource;
use oomfix::train::{build_model, synthetic_batch, TrainOptions, Trainer};
use oomfix::{Estimator, MemoryModel, ModelConfig, ModelSpec, Planner, Target};
use std::fmt::Write as _;
use std::time::Instant;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

type Res<T> = std::result::Result<T, Box<dyn std::error::Error>>;

const GLOBAL_BATCH: usize = 8;

/// Command-line settings.
struct Args {
    seq: usize,
    /// Rounds of interleaved steps, the first one a warm-up.
    rounds: usize,
    quick: bool,
}

fn parse_args() -> Res<Args> {
    let mut args = Args {
        seq: 128,
        rounds: 5,
        quick: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let mut value = |name: &str| -> Res<usize> {
            let v = it.next().ok_or(format!("{name} needs a value"))?;
            Ok(v.parse()
                .map_err(|_| format!("{name}: `{v}` is not a number"))?)
        };
        match a.as_str() {
            "--seq" => args.seq = value("--seq")?,
            "--rounds" => args.rounds = value("--rounds")?,
            "--quick" => args.quick = true,
            _ => {
                return Err(format!(
                    "unknown argument `{a}` (expected --seq N, --rounds N, --quick)"
                )
                .into())
            }
        }
    }
    if args.rounds < 4 {
        return Err("--rounds must be at least 4 (one warm-up, three measured)".into());
    }
    if args.quick {
        args.seq = args.seq.min(32);
    }
    Ok(args)
}

fn models(quick: bool) -> Vec<(&'static str, ModelConfig)> {
    if quick {
        return vec![
            (
                "GPT-2 (quick)",
                ModelConfig {
                    vocab: 512,
                    max_positions: 64,
                    ..ModelConfig::gpt2(2, 64, 4)
                },
            ),
            (
                "Llama (quick)",
                ModelConfig::llama(2, 64, 4, 2, 176, 512, false),
            ),
        ];
    }
    vec![
        (
            "GPT-2",
            ModelConfig {
                vocab: 8192,
                max_positions: 256,
                ..ModelConfig::gpt2(6, 384, 6)
            },
        ),
        ("Llama", ModelConfig::llama(6, 384, 6, 2, 1024, 8192, false)),
    ]
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn mb(bytes: f64) -> String {
    format!("{:.1} MB", bytes / 1e6)
}

/// Live heap bytes now, signed for differences.
fn heap() -> i64 {
    alloc::current() as i64
}

/// One plan under test: its trainer, the heap it holds, and its measured steps.
struct Variant {
    label: String,
    plan: Plan,
    trainer: Trainer,
    data: DataSource,
    /// Heap held by this trainer between steps.
    resident: i64,
    /// The heap when the trainer was built, which its step peaks are above.
    base: i64,
    peaks: Vec<f64>,
    seconds: Vec<f64>,
    loss: f32,
}

impl Variant {
    fn new(label: &str, config: &ModelConfig, plan: Plan) -> Res<Self> {
        let before = heap();
        let trainer = Trainer::new(config, plan, &Device::Cpu, &TrainOptions::default())?;
        let resident = heap() - before;
        let label = label.to_string();
        Ok(Variant {
            label,
            plan,
            trainer,
            data: DataSource::synthetic(0),
            resident,
            base: before,
            peaks: vec![],
            seconds: vec![],
            loss: 0.0,
        })
    }

    /// One optimizer step; recorded unless `warm_up`.
    fn step(&mut self, warm_up: bool) -> Res<()> {
        let before = heap();
        let stats = self.trainer.step(&mut self.data)?;
        // The step's high-water mark, less what other variants hold.
        let peak = self.resident + (self.base + stats.peak() as i64 - before);
        self.resident += heap() - before;
        self.loss = stats.loss;
        if !warm_up {
            self.peaks.push(peak as f64);
            self.seconds.push(stats.seconds);
        }
        Ok(())
    }
}

/// Runs one step of every plan on a tiny model of the same family, so that
/// process-wide state allocated on first use (thread pools, caches) exists
/// before any variant is measured.
fn warm_up(config: &ModelConfig, plans: &[Plan]) -> Res<()> {
    let tiny = ModelConfig {
        layers: 1,
        hidden: 32,
        heads: 2,
        kv_heads: if config.kv_heads < config.heads { 1 } else { 2 },
        intermediate: 64,
        vocab: 256,
        max_positions: 16,
        ..config.clone()
    };
    let spec = ModelSpec::from_config("warm-up", tiny);
    for p in plans {
        measure_plan(
            &spec,
            &Plan {
                micro_batch: 1,
                grad_accum: p.grad_accum.min(2),
                seq_len: 8,
                ..*p
            },
            Target::Cpu,
        )?;
    }
    Ok(())
}

/// The plan with every fix the pipeline can apply on one CPU.
fn all_fixes(seq: usize) -> Plan {
    Plan {
        micro_batch: 1,
        grad_accum: GLOBAL_BATCH,
        precision: Precision::Bf16,
        checkpoint: Checkpointing::Every(1),
        optimizer: OptimizerImpl::FusedAdamW,
        ..Plan::baseline(GLOBAL_BATCH, seq)
    }
}

/// A budget that the baseline does not fit in but every fix together does
/// (by the memory model): 10% above the estimate with every fix.
fn forcing_budget(spec: &ModelSpec, seq: usize) -> u64 {
    let est = MemoryModel
        .estimate(spec, &all_fixes(seq), &Target::Cpu)
        .peak;
    est + est / 10
}

/// The fixes in `plan` relative to the baseline, named.
fn fixes_in(plan: &Plan) -> String {
    let mut f = Vec::new();
    if plan.grad_accum > 1 {
        f.push(format!(
            "accumulate {}×{}",
            plan.micro_batch, plan.grad_accum
        ));
    }
    if plan.precision != Precision::F32 {
        f.push(plan.precision.to_string());
    }
    if plan.checkpoint != Checkpointing::None {
        f.push(format!("checkpoint {}", plan.checkpoint));
    }
    if plan.optimizer == OptimizerImpl::FusedAdamW {
        f.push("fused AdamW".into());
    }
    if f.is_empty() {
        "none".into()
    } else {
        f.join(" + ")
    }
}

/// The table of fixes for one model.
fn fix_table(name: &str, config: &ModelConfig, args: &Args, md: &mut String) -> Res<()> {
    let spec = ModelSpec::from_config(name, config.clone());
    let seq = args.seq;
    let base = Plan::baseline(GLOBAL_BATCH, seq);
    let budget = forcing_budget(&spec, seq);
    let search = Planner::new(budget)
        .global_batch(GLOBAL_BATCH)
        .seq_len(seq)
        .target(Target::Cpu)
        .run(&spec)?;
    let chosen = search
        .chosen()
        .ok_or(format!("{name}: no plan fits {budget} bytes"))?
        .plan;
    let plans = [
        ("baseline", base),
        (
            "accumulate (micro-batch 1 × 8)",
            Plan {
                micro_batch: 1,
                grad_accum: GLOBAL_BATCH,
                ..base
            },
        ),
        (
            "bf16",
            Plan {
                precision: Precision::Bf16,
                ..base
            },
        ),
        (
            "checkpoint every block",
            Plan {
                checkpoint: Checkpointing::Every(1),
                ..base
            },
        ),
        (
            "fused AdamW",
            Plan {
                optimizer: OptimizerImpl::FusedAdamW,
                ..base
            },
        ),
        ("pipeline's choice", chosen),
    ];
    eprintln!("{name}: warm-up");
    warm_up(config, &plans.map(|(_, p)| p))?;
    let mut variants = plans
        .iter()
        .map(|(l, p)| Variant::new(l, config, *p))
        .collect::<Res<Vec<_>>>()?;
    for round in 0..args.rounds {
        for v in &mut variants {
            eprintln!("{name}: round {}/{} {}", round + 1, args.rounds, v.label);
            v.step(round == 0)?;
        }
    }

    let c = config;
    let _ = writeln!(
        md,
        "## {name}: {} layers, hidden {}, {} heads ({} KV), MLP {}, vocab {}, {:.1}M parameters; seq {seq}, global batch {GLOBAL_BATCH}\n",
        c.layers, c.hidden, c.heads, c.kv_heads, c.intermediate, c.vocab, spec.parameters() as f64 / 1e6
    );
    let (p0, t0) = (
        median(variants[0].peaks.clone()),
        median(variants[0].seconds.clone()),
    );
    md.push_str("| variant | fixes | estimated peak | measured peak | peak vs baseline | step time | time vs baseline | loss (last step) |\n|---|---|---:|---:|---:|---:|---:|---:|\n");
    for v in &variants {
        let (p, t) = (median(v.peaks.clone()), median(v.seconds.clone()));
        let est = MemoryModel.estimate(&spec, &v.plan, &Target::Cpu).peak;
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {:.2}× | {:.2} s | {:.2}× | {:.3} |",
            v.label,
            fixes_in(&v.plan),
            mb(est as f64),
            mb(p),
            p / p0,
            t,
            t / t0,
            v.loss
        );
    }
    let base_measured = p0;
    let chosen_measured = median(variants[5].peaks.clone());
    let _ = writeln!(
        md,
        "\nPipeline budget {} (the memory model's estimate with every fix, +10%): the search made {} attempts \
         and chose `{chosen}`. Measured: baseline {} ({} the budget), chosen plan {} ({} the budget).\n",
        mb(budget as f64),
        search.attempts.len(),
        mb(base_measured),
        if base_measured > budget as f64 { "over" } else { "within" },
        mb(chosen_measured),
        if chosen_measured > budget as f64 { "over" } else { "within" },
    );
    Ok(())
}

/// Result of the AdamW comparison, for the summary.
struct AdamwResult {
    time_ratio: f64,
    fused_transient_pct: f64,
}

/// Fused AdamW vs `candle_nn::AdamW` on the tensors of a GPT-2-shaped model.
fn adamw_comparison(args: &Args, md: &mut String) -> Res<AdamwResult> {
    let config = if args.quick {
        ModelConfig {
            vocab: 1024,
            ..ModelConfig::gpt2(2, 128, 4)
        }
    } else {
        ModelConfig {
            vocab: 8192,
            ..ModelConfig::gpt2(6, 768, 12)
        }
    };
    let dev = Device::Cpu;
    let shapes: Vec<Vec<usize>> = config.tensors().into_iter().map(|(_, s)| s).collect();
    let params: usize = shapes.iter().map(|s| s.iter().product::<usize>()).sum();
    let largest: usize = shapes
        .iter()
        .map(|s| s.iter().product::<usize>())
        .max()
        .unwrap_or(0);
    let init: Vec<Tensor> = shapes
        .iter()
        .map(|s| Tensor::randn(0f32, 0.02, s.as_slice(), &dev))
        .collect::<Result<_, _>>()?;
    let grads: Vec<Tensor> = shapes
        .iter()
        .map(|s| Tensor::randn(0f32, 1e-3, s.as_slice(), &dev))
        .collect::<Result<_, _>>()?;
    let copy_vars = || {
        init.iter()
            .map(|t| Var::from_tensor(&t.copy()?))
            .collect::<Result<Vec<_>, _>>()
    };
    let hp = TrainOptions::default().adamw;
    let candle_vars = copy_vars()?;
    let mut candle = AdamW::new(candle_vars.clone(), hp.clone())?;
    let mut store = Tensor::new(0f32, &dev)?.backward()?;
    for (v, g) in candle_vars.iter().zip(&grads) {
        store.insert(v.as_tensor(), g.clone());
    }
    let mut fused = FusedAdamW::new(copy_vars()?, hp)?;

    let measure = |f: &mut dyn FnMut() -> Res<()>| -> Res<(f64, f64)> {
        let before = alloc::reset_peak();
        let t = Instant::now();
        f()?;
        let secs = t.elapsed().as_secs_f64();
        Ok((secs, (alloc::peak() - before) as f64))
    };
    let rounds = 2 * args.rounds;
    let (mut ct, mut cp, mut ft, mut fp) = (vec![], vec![], vec![], vec![]);
    for round in 0..rounds {
        eprintln!("AdamW: round {}/{rounds}", round + 1);
        let c = measure(&mut || Ok(candle.step(&store)?))?;
        let f = measure(&mut || Ok(fused.step(&grads)?))?;
        if round > 0 {
            ct.push(c.0);
            cp.push(c.1);
            ft.push(f.0);
            fp.push(f.1);
        }
    }
    let pbytes = 4.0 * params as f64;
    let (ct, cp, ft, fp) = (median(ct), median(cp), median(ft), median(fp));
    let _ = writeln!(
        md,
        "## Fused AdamW vs candle_nn::AdamW\n\n{:.1}M f32 parameters in {} tensors (the tensors of a GPT-2 of {} layers, hidden {}, vocab {}; \
         largest {:.1}M elements), parameter bytes {}; one optimizer step over all of them with the same gradients, \
         {} measured steps each, interleaved. Transient = heap high-water during the step minus the heap before it.\n",
        params as f64 / 1e6, shapes.len(), config.layers, config.hidden, config.vocab, largest as f64 / 1e6, mb(pbytes), rounds - 1
    );
    md.push_str("| optimizer | step time | time vs candle_nn | transient | transient / parameter bytes |\n|---|---:|---:|---:|---:|\n");
    let _ = writeln!(
        md,
        "| candle_nn::AdamW | {:.3} s | 1.00× | {} | {:.1}% |",
        ct,
        mb(cp),
        100.0 * cp / pbytes
    );
    let _ = writeln!(
        md,
        "| fused AdamW | {:.3} s | {:.2}× | {} ({} bytes) | {:.4}% |\n",
        ft,
        ft / ct,
        mb(fp),
        fp,
        100.0 * fp / pbytes
    );
    Ok(AdamwResult {
        time_ratio: ft / ct,
        fused_transient_pct: 100.0 * fp / pbytes,
    })
}

/// Checkpointed (every block) vs plain forward+backward on one model; returns the time ratio.
fn checkpoint_comparison(
    name: &str,
    config: &ModelConfig,
    args: &Args,
    md: &mut String,
) -> Res<f64> {
    let dev = Device::Cpu;
    let before_model = heap();
    let model = build_model(config, None, DType::F32, &dev, 0)?;
    let weights = (heap() - before_model) as f64;
    let grads = 4.0 * config.parameter_count() as f64;
    let batch = synthetic_batch(config.family, config.vocab, GLOBAL_BATCH, args.seq, 0, &dev)?;
    let policies = [Checkpointing::None, Checkpointing::Every(1)];
    let mut time = [vec![], vec![]];
    let mut peak = [vec![], vec![]];
    for round in 0..args.rounds {
        for (i, policy) in policies.iter().enumerate() {
            eprintln!(
                "{name} checkpointing: round {}/{} {policy}",
                round + 1,
                args.rounds
            );
            let before = alloc::reset_peak();
            let t = Instant::now();
            let out = model.forward_backward(
                &batch,
                &oomfix::strategies::Execution::default().checkpoint(*policy),
            )?;
            let secs = t.elapsed().as_secs_f64();
            let p = (alloc::peak() - before) as f64;
            drop(out);
            if round > 0 {
                time[i].push(secs);
                peak[i].push(p);
            }
        }
    }
    let t = time.map(median);
    let p = peak.map(median);
    let _ = writeln!(
        md,
        "### {name}: weights {}, gradients {}; micro-batch {GLOBAL_BATCH}, seq {}\n",
        mb(weights),
        mb(grads),
        args.seq
    );
    md.push_str("| forward+backward | time | time vs plain | peak above weights | peak vs plain | activation memory (peak − weights − gradients) | activations vs plain |\n|---|---:|---:|---:|---:|---:|---:|\n");
    for (i, label) in ["plain", "checkpoint every block"].iter().enumerate() {
        let _ = writeln!(
            md,
            "| {label} | {:.2} s | {:.2}× | {} | {:.2}× | {} | {:.2}× |",
            t[i],
            t[i] / t[0],
            mb(p[i]),
            p[i] / p[0],
            mb(p[i] - grads),
            (p[i] - grads) / (p[0] - grads)
        );
    }
    md.push('\n');
    Ok(t[1] / t[0])
}

fn main() -> Res<()> {
    let args = parse_args()?;
    if !alloc::installed() {
        return Err("CountingAlloc is not the global allocator".into());
    }
    let mut md = String::new();
    let models = models(args.quick);
    for (name, config) in &models {
        fix_table(name, config, &args, &mut md)?;
    }
    let adamw = adamw_comparison(&args, &mut md)?;
    md.push_str("## Checkpointed (every block) vs plain forward+backward\n\n\
        One model, one batch, the two passes interleaved. Peak above weights = heap high-water during the pass \
        minus the heap before it (activations, gradients, backward working set).\n\n");
    let mut ck = Vec::new();
    for (name, config) in &models {
        ck.push((*name, checkpoint_comparison(name, config, &args, &mut md)?));
    }
    md.push_str("## Targets\n\n");
    let met = |ok: bool| if ok { "met" } else { "NOT met" };
    let _ = writeln!(
        md,
        "- fused AdamW no slower than candle_nn::AdamW: {:.2}× the time — {}",
        adamw.time_ratio,
        met(adamw.time_ratio <= 1.0)
    );
    let _ = writeln!(
        md,
        "- fused AdamW transient < 1% of parameter bytes: {:.4}% — {}",
        adamw.fused_transient_pct,
        met(adamw.fused_transient_pct < 1.0)
    );
    for (name, r) in ck {
        let _ = writeln!(
            md,
            "- {name}: checkpointed forward+backward ≤ 1.4× plain: {r:.2}× — {}",
            met(r <= 1.4)
        );
    }
    print!("{md}");
    Ok(())
}
