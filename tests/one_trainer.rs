//! One trainer for every model: what a step of a model given as code does
//! over several in-process ranks is what it does for the Hugging Face
//! families (the tokens of every rank counted, the loss averaged over the
//! ranks, an fp16 overflow on one rank skipping the step on all, ZeRO-3's
//! parameters released after the step, the run's seed and micro-batch
//! numbers handed to the model).

mod common;

use std::ops::Range;
use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Tensor, Var};
use oomfix::strategies::model::{Capabilities, Forward, MicroBatch, Model};
use oomfix::strategies::{Plan, Precision, Sharding};
use oomfix::train::data::DataSource;
use oomfix::train::StepStats;
use oomfix::{Error, TrainOptions, Trainer};

/// The micro-batches a model was given: `(index, seed)`.
type Seen = Arc<Mutex<Vec<(u64, u64)>>>;

/// `(x·w + b)²` on inputs of one value: 50 for the micro-batches numbered
/// in `overflowing` (a loss that, times fp16's loss scale, overflows), 0.01
/// for the others (whose scaled gradients do not). Records the
/// micro-batches it is given.
struct Recorder {
    w: Var,
    b: Var,
    seen: Seen,
    overflowing: Range<u64>,
}

impl Model for Recorder {
    fn vars(&self) -> Vec<Var> {
        vec![self.w.clone(), self.b.clone()]
    }
    fn forward(&self, batch: &MicroBatch) -> candle_core::Result<Forward<'_>> {
        self.seen.lock().unwrap().push((batch.index, batch.seed));
        let value = if self.overflowing.contains(&batch.index) {
            50.0
        } else {
            0.01
        };
        let x = Tensor::full(value, (batch.size, 4), self.w.device())?.to_dtype(self.w.dtype())?;
        let pred = x
            .matmul(self.w.as_tensor())?
            .broadcast_add(self.b.as_tensor())?;
        Ok(Forward::Loss(pred.sqr()?.mean_all()?))
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities::NONE.with_half()
    }
}

/// A builder of the [`Recorder`] that records into `seen`.
fn recorder(
    seen: Seen,
    overflowing: Range<u64>,
) -> impl FnOnce(DType, &Device) -> candle_core::Result<Recorder> {
    move |dtype, device| {
        Ok(Recorder {
            w: Var::from_tensor(&Tensor::full(0.25f32, (4, 1), device)?.to_dtype(dtype)?)?,
            b: Var::from_tensor(&Tensor::zeros(1, dtype, device)?)?,
            seen,
            overflowing,
        })
    }
}

/// What one rank saw of its steps.
struct RankSteps {
    stats: Vec<StepStats>,
    seen: Vec<(u64, u64)>,
    /// Whether each var holds values after the steps (ZeRO-3 frees the
    /// parameters a rank does not own).
    readable: Vec<bool>,
}

/// `steps` steps of `plan` on each of 2 in-process ranks.
fn steps_on_two_ranks(
    plan: Plan,
    options: &TrainOptions,
    overflowing: Range<u64>,
    steps: usize,
) -> Vec<RankSteps> {
    common::on_thread_ranks(2, |comm| {
        let seen = Seen::default();
        let build = recorder(Arc::clone(&seen), overflowing.clone());
        let mut t = Trainer::of_model_sharded(build, plan, &Device::Cpu, options, comm).unwrap();
        let stats = (0..steps)
            .map(|_| t.step(&mut DataSource::ModelMade).unwrap())
            .collect();
        let readable = t
            .model()
            .vars()
            .iter()
            .map(|v| v.flatten_all().and_then(|t| t.to_vec1::<f32>()).is_ok())
            .collect();
        let seen = seen.lock().unwrap().clone();
        RankSteps {
            stats,
            seen,
            readable,
        }
    })
}

fn plan(precision: Precision, stage: u8) -> Plan {
    Plan {
        micro_batch: 2,
        grad_accum: 3,
        precision,
        shard: Sharding::new(2, stage),
        ..Plan::baseline(12, 5)
    }
}

#[test]
fn a_step_over_ranks_counts_every_rank_and_averages_the_loss() {
    let mut options = TrainOptions::default();
    options.seed = 1234;
    let ranks = steps_on_two_ranks(plan(Precision::F32, 3), &options, 0..0, 1);
    for (r, rank) in ranks.iter().enumerate() {
        // Every rank's tokens: 2 ranks × 3 micro-batches × 2 samples × 5.
        assert_eq!(rank.stats[0].tokens, 2 * 3 * 2 * 5);
        // The same mean loss on both ranks.
        assert_eq!(rank.stats[0].loss, ranks[0].stats[0].loss);
        // Rank r's micro-batches of step 0 are numbered 3r, 3r + 1, 3r + 2,
        // each with the run's seed.
        let want: Vec<(u64, u64)> = (0..3).map(|k| (3 * r as u64 + k, 1234)).collect();
        assert_eq!(rank.seen, want, "rank {r}");
    }
    // ZeRO-3 frees a parameter on every rank but its owner after the step:
    // each of the two vars is whole on exactly one rank.
    for var in 0..2 {
        let whole: Vec<bool> = ranks.iter().map(|r| r.readable[var]).collect();
        assert_eq!(
            whole.iter().filter(|&&w| w).count(),
            1,
            "var {var}: {whole:?}"
        );
    }
}

#[test]
fn an_fp16_overflow_on_one_rank_skips_the_step_on_every_rank() {
    // The second step: the first is skipped on every rank anyway (this
    // model's loss is f16, and the initial scale, 65536, is above f16's
    // largest value; the scale then halves). Micro-batches 6, 7 and 8 are
    // rank 0's of the second step: they overflow, rank 1's (9, 10, 11) do
    // not; alone it would take the step.
    let options = TrainOptions::default();
    let overflowed = steps_on_two_ranks(plan(Precision::F16, 1), &options, 6..9, 2);
    let control = steps_on_two_ranks(plan(Precision::F16, 1), &options, 0..0, 2);
    for r in 0..2 {
        assert!(overflowed[r].stats[1].skipped, "rank {r} skips the step");
        assert!(overflowed[r].stats[1].loss.is_finite());
        assert!(
            !control[r].stats[1].skipped,
            "rank {r}: no overflow, no skip"
        );
    }
}

#[test]
fn a_model_given_as_code_takes_no_weights_files_and_makes_its_own_batches() {
    let plan = Plan::baseline(2, 1);
    let mut options = TrainOptions::default();
    options.weights = Some(vec!["model.safetensors".into()]);
    let err = Trainer::of_model(
        recorder(Seen::default(), 0..0),
        plan,
        &Device::Cpu,
        &options,
    )
    .err()
    .unwrap();
    assert!(matches!(err, Error::Usage(_)), "{err}");
    let options = TrainOptions::default();
    let mut t = Trainer::of_model(
        recorder(Seen::default(), 0..0),
        plan,
        &Device::Cpu,
        &options,
    )
    .unwrap();
    let err = t.step(&mut DataSource::synthetic(0)).err().unwrap();
    assert!(matches!(err, Error::Usage(_)), "{err}");
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("saved");
    let err = t.save(&out, &DataSource::ModelMade).err().unwrap();
    assert!(matches!(err, Error::Usage(_)), "{err}");
    assert!(!out.exists());
    assert!(t.step(&mut DataSource::ModelMade).unwrap().loss.is_finite());
}

/// On a CUDA device the trainer lets the pool keep what it has taken across
/// the step's synchronisations, so that each phase does not map its memory
/// again. Skipped where no device is.
#[cfg(feature = "cuda")]
#[test]
fn a_trainer_on_cuda_lets_the_pool_keep_its_reserve() {
    use oomfix::track::cuda::release_threshold;
    let Ok(device) = Device::new_cuda(0) else {
        eprintln!("no CUDA device: skipped");
        return;
    };
    let cuda = device.as_cuda_device().unwrap();
    let mut t = Trainer::of_model(
        recorder(Seen::default(), 0..0),
        Plan::baseline(2, 1),
        &device,
        &TrainOptions::default(),
    )
    .unwrap();
    assert_eq!(release_threshold(cuda).unwrap(), u64::MAX);
    t.step(&mut DataSource::ModelMade).unwrap();
    assert_eq!(release_threshold(cuda).unwrap(), u64::MAX);
}
