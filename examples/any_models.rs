//! Two models oomfix does not know, written with `oomfix_strategies::nn`'s
//! layers (`examples/common/models.rs`), planned under a budget by measurement, verified with a real
//! step and trained a few steps through the library, on the CPU:
//!
//! * a small ViT image classifier (patches → pre-LN attention blocks →
//!   mean-pooled classifier), which takes every fix: blocks to checkpoint,
//!   attention as the plan says (composed or flash), bf16;
//! * a small gated causal-convolution language model (Mamba/H3-style
//!   blocks without attention), planned again with the optimizer offloaded
//!   and with ZeRO sharding over two in-process ranks.
//!
//! `cargo run --release --example any_models` (a few seconds).

use candle_core::{DType, Device};
use oomfix::anymodel::{MeasuredPlan, MeasuredPlanner, Verification};
use oomfix::strategies::model::Model;
use oomfix::strategies::shard::{Comm, ThreadComm};
use oomfix::strategies::OptimizerImpl;
use oomfix::train::data::DataSource;
use oomfix::{Pins, Planner, Target, TrainOptions, Trainer};

#[global_allocator]
static ALLOC: oomfix::track::CountingAlloc = oomfix::track::CountingAlloc;

#[path = "common/models.rs"]
mod models;
use models::{conv_lm, vit};

// ---------------------------------------------------------------------------

/// Prints a measured plan: the plan, its estimate against the real step,
/// the probes, the fixes skipped.
fn show(name: &str, planned: &MeasuredPlan) {
    let r = &planned.result;
    println!("{name}: {} parameters", planned.spec.parameters());
    for s in &r.skipped {
        println!("  skipped {}: {}", s.strategy, s.reason);
    }
    match (r.chosen(), planned.verification) {
        (Some(a), Verification::Measured { peak_bytes, .. }) => println!(
            "  plan {}\n  estimate {} B, measured {} B ({:+.2}%), {} probe steps + 1 verifying step",
            a.plan,
            a.estimate.peak,
            peak_bytes,
            100.0 * (a.estimate.peak as f64 / peak_bytes as f64 - 1.0),
            planned.probe_steps()
        ),
        (Some(a), Verification::NotRun) => println!(
            "  plan {} (estimate {} B per rank, not verified in process), {} probe steps",
            a.plan,
            a.estimate.peak,
            planned.probe_steps()
        ),
        (None, _) => println!("  nothing fits: {:?}", r.advice),
    }
}

/// Plans the model `build` makes by measurement with `planner` (named
/// `name`, shown as `label`), trains three steps of the plan it chose and
/// prints their losses.
fn plan_and_train<M, B>(planner: Planner, build: B, name: &str, label: &str) -> oomfix::Result<()>
where
    M: Model + Send + 'static,
    B: Fn(DType, &Device) -> candle_core::Result<M> + Copy + Send + Sync + 'static,
{
    let planned = MeasuredPlanner::new(planner, build).name(name).run()?;
    show(label, &planned);
    let chosen = planned.result.chosen();
    let plan = chosen
        .unwrap_or_else(|| panic!("{label}: nothing fits"))
        .plan;
    let mut trainer = Trainer::of_model(build, plan, &Device::Cpu, &TrainOptions::default())?;
    for step in 0..3 {
        println!(
            "  step {step}: loss {:.4}",
            trainer.step(&mut DataSource::ModelMade)?.loss
        );
    }
    Ok(())
}

fn main() -> oomfix::Result<()> {
    let options = TrainOptions::default();

    // The ViT under 24 MiB with a global batch of 32 images.
    let planner = Planner::new(24 << 20).global_batch(32).target(Target::Cpu);
    plan_and_train(planner, vit, "vit", "vit")?;

    // The convolution LM under 24 MiB, 16 sequences of 128 tokens.
    let lm = || {
        Planner::new(24 << 20)
            .global_batch(16)
            .seq_len(128)
            .target(Target::Cpu)
    };
    plan_and_train(lm(), conv_lm, "conv-lm", "conv-lm")?;

    // The same with the optimizer offloaded (pinned: the planner does not
    // offload on the CPU, whose "host" memory is the device's; the
    // estimate adds the host bytes to the peak there).
    let mut pins = Pins::default();
    pins.optimizer = Some(OptimizerImpl::OffloadedAdamW);
    let label = "conv-lm, optimizer offloaded";
    plan_and_train(lm().pins(pins), conv_lm, "conv-lm offloaded", label)?;

    // Sharded over two in-process ranks (ZeRO stage 2 pinned), half the budget each.
    let mut pins = Pins::default();
    pins.shard_stage = Some(2);
    let planner = Planner::new(16 << 20)
        .global_batch(16)
        .seq_len(128)
        .gpus(2)
        .target(Target::Cpu)
        .pins(pins);
    let planned = MeasuredPlanner::new(planner, conv_lm)
        .name("conv-lm sharded")
        .run()?;
    show("conv-lm, ZeRO-2 over 2 ranks", &planned);
    let plan = planned.result.chosen().expect("the sharded LM fits").plan;
    let options = &options;
    let losses = std::thread::scope(|s| {
        let ranks: Vec<_> = ThreadComm::group(2)
            .into_iter()
            .map(|comm| {
                s.spawn(move || -> oomfix::Result<Vec<f32>> {
                    let rank = comm.rank();
                    let mut t = Trainer::of_model_sharded(
                        conv_lm,
                        plan,
                        &Device::Cpu,
                        options,
                        Box::new(comm),
                    )?;
                    let losses = (0..3)
                        .map(|_| Ok(t.step(&mut DataSource::ModelMade)?.loss))
                        .collect::<oomfix::Result<Vec<f32>>>()?;
                    println!("  rank {rank}: losses {losses:?}");
                    Ok(losses)
                })
            })
            .collect();
        ranks
            .into_iter()
            .map(|h| h.join().expect("a rank panicked"))
            .collect::<oomfix::Result<Vec<_>>>()
    })?;
    assert_eq!(losses.len(), 2);
    Ok(())
}
