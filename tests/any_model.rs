//! A model oomfix has never seen, defined here: planned by measurement on
//! the CPU, verified with a real step, trained by the plan's fixes.

use candle_core::Device;
use oomfix::anymodel::{MeasuredModel, Probe, ProbeOutcome, Prober, Setting};
use oomfix::track::CountingAlloc;
use oomfix::train::data::DataSource;
use oomfix::train::{Decay, LrSchedule};
use oomfix::{Estimator, ModelSpec, Plan, Target, TrainOptions, Trainer};

mod common;
#[path = "common/mixer.rs"]
mod mixer;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

/// The heap is counted process-wide: tests that measure run one at a time.
static MEASURING: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Planned by measurement under a budget that needs checkpointing (the
/// checks: `common/mixer.rs`), then trained with the chosen plan.
#[test]
fn a_model_given_as_code_is_planned_by_measurement() {
    let _one_at_a_time = MEASURING.lock().unwrap_or_else(|e| e.into_inner());
    let plan = mixer::plan_and_check();
    let mut trainer =
        Trainer::of_model(mixer::build, plan, &Device::Cpu, &TrainOptions::default()).unwrap();
    for _ in 0..2 {
        assert!(trainer
            .step(&mut DataSource::ModelMade)
            .unwrap()
            .loss
            .is_finite());
    }
}

/// Trainer follows the learning-rate schedule of the options: linear
/// decay over two steps gives the peak, half of it, then 0, which leaves
/// the weights as they were.
#[test]
fn a_model_given_as_code_follows_the_learning_rate_schedule() {
    let _one_at_a_time = MEASURING.lock().unwrap_or_else(|e| e.into_inner());
    let mut options = TrainOptions::default();
    options.schedule = LrSchedule {
        warmup_steps: 0,
        decay: Decay::Linear,
        total_steps: 2,
    };
    let peak = options.adamw.lr;
    let plan = Plan::baseline(2, 1);
    let mut trainer = Trainer::of_model(mixer::build, plan, &Device::Cpu, &options).unwrap();
    let weights = |t: &Trainer| -> Vec<Vec<f32>> {
        let vars = t.model().vars();
        vars.iter()
            .map(|v| v.flatten_all().unwrap().to_vec1().unwrap())
            .collect()
    };
    let mut rates = Vec::new();
    let mut before = weights(&trainer);
    for _ in 0..3 {
        rates.push(trainer.step(&mut DataSource::ModelMade).unwrap().lr);
        let after = weights(&trainer);
        assert_eq!(
            after == before,
            *rates.last().unwrap() == 0.0,
            "rates {rates:?}"
        );
        before = after;
    }
    assert_eq!(rates, [peak, peak / 2.0, 0.0]);
}

/// Trainer clips by global norm as `train` does. AdamW's first update is
/// about `lr` per weight whatever the gradients' scale, unless they are
/// clipped down to the size of its epsilon: a limit far above the norm
/// leaves the first step's mean change at about `lr`, a limit of 1e-12
/// shrinks it. (Each run starts from its own random weights.)
#[test]
fn a_model_given_as_code_has_its_gradients_clipped_by_global_norm() {
    let _one_at_a_time = MEASURING.lock().unwrap_or_else(|e| e.into_inner());
    let lr = 1e-2;
    let first_step = |max_grad_norm: Option<f64>| {
        let mut options = TrainOptions::default();
        options.adamw.lr = lr;
        options.max_grad_norm = max_grad_norm;
        let mut trainer =
            Trainer::of_model(mixer::build, Plan::baseline(2, 1), &Device::Cpu, &options).unwrap();
        let weights = |t: &Trainer| -> Vec<f32> {
            let vars = t.model().vars();
            vars.iter()
                .flat_map(|v| v.flatten_all().unwrap().to_vec1::<f32>().unwrap())
                .collect()
        };
        let before = weights(&trainer);
        let norm = trainer.step(&mut DataSource::ModelMade).unwrap().grad_norm;
        let after = weights(&trainer);
        let change = before
            .iter()
            .zip(&after)
            .map(|(a, b)| f64::from((a - b).abs()))
            .sum::<f64>()
            / before.len() as f64;
        (norm, change / lr)
    };
    let (free_norm, free) = first_step(None);
    let (loose_norm, loose) = first_step(Some(1e9));
    let (tight_norm, tight) = first_step(Some(1e-12));
    for norm in [free_norm, loose_norm, tight_norm] {
        assert!(
            norm.is_finite() && norm > 1e-3,
            "the norm before clipping: {norm}"
        );
    }
    assert!(
        free > 0.5 && loose > 0.5,
        "unclipped: {free}, {loose} of lr"
    );
    assert!(
        tight < 0.1 * free,
        "clipped to 1e-12: {tight} of lr (unclipped {free})"
    );
}

/// A prober that measures a made-up line and runs out of memory from a
/// micro-batch of 2 on under checkpointing.
struct Fake(Vec<(Setting, usize)>);

impl Prober for Fake {
    fn probe(&mut self, setting: Setting, micro_batch: usize) -> oomfix::Result<ProbeOutcome> {
        self.0.push((setting, micro_batch));
        if setting.exec.checkpoint != oomfix::strategies::Checkpointing::None && micro_batch >= 2 {
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

/// A regression whose data is a function of the micro-batch's index (the
/// same micro-batches on one rank as on several): a weight matrix, which
/// decays, and a bias, which does not.
struct Regression {
    w: candle_core::Var,
    b: candle_core::Var,
}

impl oomfix::strategies::model::Model for Regression {
    fn vars(&self) -> Vec<candle_core::Var> {
        vec![self.w.clone(), self.b.clone()]
    }
    fn forward(
        &self,
        batch: &oomfix::strategies::model::MicroBatch,
    ) -> candle_core::Result<oomfix::strategies::model::Forward<'_>> {
        let (n, device) = (batch.size, self.w.device());
        let at = (batch.index as usize * n * 4) as f32;
        let x = ((candle_core::Tensor::arange(at, at + (n * 4) as f32, device)? * 0.37)?
            .sin()?
            .reshape((n, 4)))?;
        let y = (x.sum_keepdim(1)? * 0.5)?.cos()?;
        let pred = x
            .matmul(self.w.as_tensor())?
            .broadcast_add(self.b.as_tensor())?;
        let loss = (pred - y)?.sqr()?.mean_all()?;
        Ok(oomfix::strategies::model::Forward::Loss(loss))
    }
}

/// A model given as code, sharded over 2 in-process ranks at ZeRO 1-3 with 2
/// micro-batches each, takes the steps of one rank with the same global
/// batch: the mean of the ranks' losses is the one rank's loss, step by
/// step (stages 2 and 3 reduce each micro-batch's gradients to their
/// owners at once; the weight and the bias have different owners).
#[test]
fn a_model_given_as_code_sharded_takes_the_one_rank_steps() {
    use candle_core::{DType, Tensor, Var};
    use oomfix::strategies::Sharding;
    let _one_at_a_time = MEASURING.lock().unwrap_or_else(|e| e.into_inner());
    let build = |dtype: DType, device: &Device| {
        let w = Tensor::new(&[[0.3f32], [-0.2], [0.1], [0.4]], device)?.to_dtype(dtype)?;
        let b = Tensor::new(&[0.05f32], device)?.to_dtype(dtype)?;
        Ok(Regression {
            w: Var::from_tensor(&w)?,
            b: Var::from_tensor(&b)?,
        })
    };
    let mut options = TrainOptions::default();
    options.adamw.lr = 5e-2;
    let plan = Plan {
        micro_batch: 2,
        grad_accum: 4,
        ..Plan::baseline(8, 1)
    };
    let mut one = Trainer::of_model(build, plan, &Device::Cpu, &options).unwrap();
    let want: Vec<f32> = (0..4)
        .map(|_| one.step(&mut DataSource::ModelMade).unwrap().loss)
        .collect();
    assert!(want[3] < want[0] * 0.9, "the steps train: {want:?}");
    for stage in 1..=3 {
        let per_rank = Plan {
            grad_accum: 2,
            shard: Sharding::new(2, stage),
            ..plan
        };
        let losses: Vec<Vec<f32>> = common::on_thread_ranks(2, |comm| {
            let mut t =
                Trainer::of_model_sharded(build, per_rank, &Device::Cpu, &options, comm).unwrap();
            (0..4)
                .map(|_| t.step(&mut DataSource::ModelMade).unwrap().loss)
                .collect()
        });
        for (k, w) in want.iter().enumerate() {
            let got = (losses[0][k] + losses[1][k]) / 2.0;
            assert!(
                ((got - w) / w).abs() < 1e-5,
                "stage {stage}, step {k}: {got} vs {w} ({losses:?})"
            );
        }
    }
}
