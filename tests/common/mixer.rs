//! A model oomfix has never seen, and the checks of planning it by
//! measurement on the CPU: shared by `tests/any_model.rs` (the workspace's
//! patched candle-core) and `tests/stock-candle` (candle-core as released),
//! which include this file. The including test crate installs
//! `oomfix::track::CountingAlloc` as its global allocator.

use candle_core::{DType, Device, Module, Tensor, Var};
use oomfix::anymodel::{MeasuredPlan, MeasuredPlanner, ProbeOutcome, Verification};
use oomfix::strategies::model::{self, Capabilities, Forward, MicroBatch, Model, Stages};
use oomfix::strategies::nn::loss::cross_entropy;
use oomfix::strategies::nn::ops::{gelu, GeluForm};
use oomfix::strategies::nn::{linear, Linear};
use oomfix::strategies::{Attention, Checkpointing, Plan, Precision};
use oomfix::{Planner, Target};

const TOKENS: usize = 128;
const WIDTH: usize = 128;
const BLOCKS: usize = 8;
const CLASSES: usize = 10;

/// A token-mixing-free "MLP mixer" over 128 positions: a stem projection,
/// eight residual MLP blocks, a classifier on the mean of the positions. Not
/// a GPT-2, Llama or BERT; fp32 only; computes no attention.
pub struct Mixer {
    stem: Linear,
    blocks: Vec<(Linear, Linear)>,
    head: Linear,
    vars: Vec<Var>,
    dtype: DType,
    device: Device,
}

/// Builds the mixer in `dtype` on `device`.
pub fn build(dtype: DType, device: &Device) -> candle_core::Result<Mixer> {
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

/// Plans the mixer by measurement under a budget that needs checkpointing
/// (a global batch of 8) and checks the outcome: the chosen plan's real
/// step is within 3% of its estimate, planning took at most 6 probe steps
/// (printed), every probe was measured, and the fixes the mixer cannot take
/// were skipped with their reasons (in the JSON report too). Returns the
/// chosen plan.
pub fn plan_and_check() -> Plan {
    let budget = 14 << 20;
    let planned = MeasuredPlanner::new(
        Planner::new(budget).global_batch(8).target(Target::Cpu),
        build,
    )
    .name("mixer")
    .run()
    .unwrap();
    check(&planned)
}

fn check(planned: &MeasuredPlan) -> Plan {
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
    println!(
        "{}: estimate {estimate} B, measured {peak_bytes} B ({:+.2}%), {} probe steps",
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
    assert_eq!(
        skipped,
        [
            "precision",
            "flash-attention",
            "chunked-loss",
            "offload-activations",
            "tiled-mlp"
        ]
    );
    assert!(result.skipped[0].reason.contains("bf16"));
    assert!(result.skipped[1].reason.contains("attention"));
    assert!(result.skipped[2].reason.contains("loss"));
    assert!(result.skipped[3].reason.contains("host"));
    assert!(result
        .attempts
        .iter()
        .all(|a| a.plan.precision == Precision::F32 && a.plan.attention == Attention::Composed));
    let json = planned.to_json();
    assert_eq!(json["skipped"][0]["strategy"], "precision");
    assert_eq!(json["probe_steps"], planned.probe_steps());
    assert_eq!(json["verification"]["status"], "measured");
    // The budget needs checkpointing: even one sample without it does not fit.
    assert_ne!(
        chosen.plan.checkpoint,
        Checkpointing::None,
        "{:#?}",
        result.attempts
    );
    chosen.plan
}
