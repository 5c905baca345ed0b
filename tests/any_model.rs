//! A model oomfix has never seen, defined here: planned by measurement on
//! the CPU, verified with a real step, trained by the plan's fixes.

use candle_core::{DType, Device, Module, Tensor, Var};
use oomfix::anymodel::{
    AnyTrainer, MeasuredModel, MeasuredPlanner, Probe, ProbeOutcome, Prober, Setting, Verification,
};
use oomfix::strategies::model::{self, Capabilities, Forward, MicroBatch, Model, Stages};
use oomfix::strategies::nn::loss::cross_entropy;
use oomfix::strategies::nn::ops::{gelu, GeluForm};
use oomfix::strategies::nn::{linear, Linear};
use oomfix::track::CountingAlloc;
use oomfix::{Estimator, ModelSpec, Plan, Planner, Target, TrainOptions};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

/// The heap is counted process-wide: tests that measure run one at a time.
static MEASURING: std::sync::Mutex<()> = std::sync::Mutex::new(());

const TOKENS: usize = 128;
const WIDTH: usize = 128;
const BLOCKS: usize = 8;
const CLASSES: usize = 10;

/// A token-mixing-free "MLP mixer" over 128 positions: a stem projection,
/// eight residual MLP blocks, a classifier on the mean of the positions. Not
/// a GPT-2, Llama or BERT; fp32 only; computes no attention.
struct Mixer {
    stem: Linear,
    blocks: Vec<(Linear, Linear)>,
    head: Linear,
    vars: Vec<Var>,
    dtype: DType,
    device: Device,
}

fn build(dtype: DType, device: &Device) -> candle_core::Result<Mixer> {
    let varmap = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&varmap, dtype, device);
    let stem = linear(32, WIDTH, vb.pp("stem"))?;
    let blocks = (0..BLOCKS)
        .map(|i| {
            let vb = vb.pp(format!("block{i}"));
            Ok((
                linear(WIDTH, 2 * WIDTH, vb.pp("up"))?,
                linear(2 * WIDTH, WIDTH, vb.pp("down"))?,
            ))
        })
        .collect::<candle_core::Result<_>>()?;
    let head = linear(WIDTH, CLASSES, vb.pp("head"))?;
    Ok(Mixer {
        stem,
        blocks,
        head,
        vars: model::vars_of(&varmap),
        dtype,
        device: device.clone(),
    })
}

impl Model for Mixer {
    fn vars(&self) -> Vec<Var> {
        self.vars.clone()
    }
    fn forward(&self, batch: &MicroBatch) -> candle_core::Result<Forward<'_>> {
        let b = batch.size;
        let x = Tensor::randn(0f32, 1.0, (b * TOKENS, 32), &self.device)?.to_dtype(self.dtype)?;
        let labels: Vec<u32> = (0..b).map(|i| ((3 * i) % CLASSES) as u32).collect();
        let labels = Tensor::new(labels, &self.device)?;
        let stem = self.stem.forward(&x)?;
        let blocks = self
            .blocks
            .iter()
            .map(|(up, down)| {
                Box::new(move |h: &Tensor| {
                    h + down.forward(&gelu(&up.forward(h)?, GeluForm::Tanh)?)?
                }) as _
            })
            .collect();
        let head = Box::new(move |h: &Tensor| {
            let pooled = h.reshape((b, TOKENS, WIDTH))?.mean(1)?;
            let logits = self.head.forward(&pooled)?;
            cross_entropy(&logits, &labels, None)
        });
        Ok(Forward::Stages(Stages { stem, blocks, head }))
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities::NONE.with_blocks(BLOCKS)
    }
}

/// Planned by measurement under a budget that needs checkpointing: the
/// chosen plan's real step is within 3% of its estimate, the plan took at
/// most 6 probes, and the fixes the model cannot take were skipped with
/// their reasons.
#[test]
fn a_model_given_as_code_is_planned_by_measurement() {
    let _one_at_a_time = MEASURING.lock().unwrap_or_else(|e| e.into_inner());
    let budget = 14 << 20;
    let planned = MeasuredPlanner::new(
        Planner::new(budget).global_batch(8).target(Target::Cpu),
        build,
    )
    .name("mixer")
    .run()
    .unwrap();
    let result = &planned.result;
    let Some(chosen) = result.chosen() else {
        panic!("nothing fits: {:#}", planned.to_json())
    };
    assert_eq!(chosen.plan.global_batch(), 8);
    let Verification::Measured {
        peak_bytes, fits, ..
    } = planned.verification
    else {
        panic!(
            "the chosen plan was not verified: {:?}",
            planned.verification
        )
    };
    assert!(fits);
    assert_eq!(chosen.measured.map(|m| m.peak_bytes), Some(peak_bytes));
    let estimate = chosen.estimate.peak as f64;
    let error = (estimate - peak_bytes as f64).abs() / peak_bytes as f64;
    eprintln!(
        "{}: estimate {estimate} B, measured {peak_bytes} B ({:+.2}%), {} probes",
        chosen.plan,
        100.0 * (estimate / peak_bytes as f64 - 1.0),
        planned.probe_steps()
    );
    assert!(
        error <= 0.03,
        "estimate {estimate} vs measured {peak_bytes}: {:.1}% off ({})",
        100.0 * error,
        chosen.plan
    );
    assert!(
        planned.probe_steps() <= 6,
        "{} probes: {:?}",
        planned.probe_steps(),
        planned.probes
    );
    // Every probe is one pass, measured.
    assert!(planned
        .probes
        .iter()
        .all(|p| matches!(p.outcome, ProbeOutcome::Measured { bytes, .. } if bytes > 0)));
    // The fixes it cannot take: skipped, with the reason, in the JSON too.
    let skipped: Vec<&str> = result.skipped.iter().map(|s| s.strategy.as_str()).collect();
    assert_eq!(skipped, ["precision", "flash-attention"]);
    assert!(result.skipped[0].reason.contains("bf16"));
    assert!(result.skipped[1].reason.contains("attention"));
    assert!(result
        .attempts
        .iter()
        .all(|a| a.plan.precision == oomfix::strategies::Precision::F32
            && a.plan.attention == oomfix::strategies::Attention::Composed));
    let json = planned.to_json();
    assert_eq!(json["skipped"][0]["strategy"], "precision");
    assert_eq!(json["probe_steps"], planned.probe_steps());
    assert_eq!(json["verification"]["status"], "measured");
    // The budget needs checkpointing: even one sample without it does not fit.
    assert_ne!(
        chosen.plan.checkpoint,
        oomfix::strategies::Checkpointing::None,
        "{:#?}",
        result.attempts
    );

    // And the plan trains.
    let mut trainer =
        AnyTrainer::new(build, chosen.plan, &Device::Cpu, &TrainOptions::default()).unwrap();
    for _ in 0..2 {
        assert!(trainer.step().unwrap().loss.is_finite());
    }
}

/// A prober that measures a made-up line and runs out of memory from a
/// micro-batch of 2 on under checkpointing.
struct Fake(Vec<(Setting, usize)>);

impl Prober for Fake {
    fn probe(&mut self, setting: Setting, micro_batch: usize) -> oomfix::Result<ProbeOutcome> {
        self.0.push((setting, micro_batch));
        if setting.checkpoint != oomfix::strategies::Checkpointing::None && micro_batch >= 2 {
            return Ok(ProbeOutcome::OutOfMemory);
        }
        Ok(ProbeOutcome::Measured {
            bytes: 1000 + 100 * micro_batch as u64,
            seconds: 0.01 * micro_batch as f64,
        })
    }
}

/// A probe that runs out of memory is one recorded failed probe: plans of
/// that micro-batch or more do not fit, smaller ones use what was measured.
#[test]
fn a_probe_out_of_memory_is_a_recorded_failure() {
    let _one_at_a_time = MEASURING.lock().unwrap_or_else(|e| e.into_inner());
    let facts = oomfix::strategies::ModelFacts::new(10, 10, 2);
    let measured = MeasuredModel::new(
        facts,
        Box::new(Fake(Vec::new())),
        [1, 2],
        oomfix::strategies::builtins(),
    )
    .unwrap();
    let spec = ModelSpec::default_model();
    let plain = Plan::baseline(4, 1);
    let fit = |plan: &Plan| measured.estimate(&spec, plan, &Target::Cpu).peak;
    // Affine: 100 bytes a sample on top of the state.
    let at = |mb: usize| {
        fit(&Plan {
            micro_batch: mb,
            grad_accum: 4 / mb,
            ..plain
        })
    };
    assert_eq!(at(2) - at(1), 100);
    let ckpt = Plan {
        checkpoint: oomfix::strategies::Checkpointing::Every(1),
        ..plain
    };
    assert_eq!(fit(&ckpt), u64::MAX, "4 samples: above the failed probe");
    let one = Plan {
        micro_batch: 1,
        grad_accum: 4,
        ..ckpt
    };
    assert!(fit(&one) < u64::MAX);
    let probes: Vec<Probe> = measured.probes();
    // Two probes for the plain setting, two (the second failed) for checkpointing.
    assert_eq!(probes.len(), 4);
    assert_eq!(probes[3].outcome, ProbeOutcome::OutOfMemory);
    assert_eq!(measured.fits().len(), 2);
}
