//! The training loop: steps until `--steps` or a signal, evaluations on
//! `--eval-data`, checkpoints every `--save-every` steps, the recording of
//! the first `--snapshot-steps` steps, and progress.

use super::load::{Inputs, Loaded};
use super::plan::{Planned, Recording};
use super::save::Checkpoints;
use super::Setup;
use crate::cli::progress::Progress;
use crate::cli::signals::StopSignals;
use crate::cli::timeline::write_timeline;
use crate::cli::Failure;
use oomfix::measure::RunRecording;
use oomfix::report::{PoolSummary, Startup, TrainSummary};
use oomfix::train::data::DataSource;
use oomfix::train::Trainer;

/// What the loop did.
pub(super) struct Trained {
    /// The trainer, after its last step.
    pub trainer: Trainer,
    /// The steps' and evaluations' summary.
    pub summary: TrainSummary,
    /// The checkpoints written so far.
    pub checkpoints: Checkpoints,
    /// Whether a signal (on any rank) stopped the loop.
    pub stopped: bool,
    /// The signals this process listens to.
    pub signals: StopSignals,
}

/// Trains the loaded trainer to `--steps` (or until a signal), evaluating
/// before the first step, every `--eval-every` steps and after the last.
pub(super) fn train(
    setup: &Setup,
    planned: &Planned,
    loaded: Loaded,
    inputs: &mut Inputs,
) -> Result<Trained, Failure> {
    let o = &setup.args.opts;
    let Loaded {
        mut trainer,
        recording,
        lr: (lr, lr_source),
        build_seconds,
    } = loaded;
    let mut recording = recording
        .map(|r| -> Result<StepRecording, Failure> {
            let mut r = StepRecording::new(r, setup, planned, trainer.steps());
            r.recording.steps_start()?;
            Ok(r)
        })
        .transpose()?;
    let first_step = trainer.steps();
    let mut checkpoints = Checkpoints::new(setup, trainer.steps());
    let signals = StopSignals::install()?;
    let progress = (setup.rank() == 0).then(|| Progress::new(o.steps, trainer.steps()));
    let mut summary = TrainSummary::new(planned.estimated_peak());
    summary.lr = Some((lr, lr_source.to_string()));
    // Evaluates on --eval-data from its start, and shows it.
    let evaluate = |trainer: &mut Trainer,
                    eval_data: &mut Option<DataSource>,
                    summary: &mut TrainSummary|
     -> Result<(), Failure> {
        let Some(eval) = eval_data else {
            return Ok(());
        };
        eval.rewind();
        let windows = eval.windows_per_pass(trainer.plan().seq_len).unwrap_or(1);
        let batches = windows
            .div_ceil(trainer.plan().micro_batch)
            .min(usize::try_from(o.eval_batches).unwrap_or(usize::MAX));
        let e = trainer.evaluate(eval, batches)?;
        if let Some(p) = &progress {
            p.eval(&e);
        }
        summary.record_eval(&e);
        Ok(())
    };
    // The baseline: the model as it starts, before the first step of this run.
    let mut evaluated_at = None;
    if inputs.eval_data.is_some() && trainer.steps() < o.steps {
        evaluate(&mut trainer, &mut inputs.eval_data, &mut summary)?;
        evaluated_at = Some(trainer.steps());
    }
    let startup = Startup {
        seconds: crate::cli::started().elapsed().as_secs_f64(),
        build_seconds,
    };
    tracing::info!(seconds = startup.seconds, build_seconds, "ready to train");
    summary.startup = Some(startup);
    // Every rank stops at the same step boundary: a signal any rank received stops all.
    let mut stopped = false;
    while trainer.steps() < o.steps && !stopped {
        stopped = trainer.any_rank(signals.received().is_some())?;
        if stopped {
            break;
        }
        let stats = trainer.step(&mut inputs.data)?;
        if trainer.steps() - first_step >= o.snapshot_steps {
            if let Some(r) = recording.take() {
                summary.recorded_pool = r.write(&trainer)?;
            }
        }
        summary.record_step(trainer.steps(), &stats);
        if let Some(p) = &progress {
            p.step(trainer.steps(), &stats);
        }
        if o.eval_every.is_some_and(|n| trainer.steps() % n == 0) {
            evaluate(&mut trainer, &mut inputs.eval_data, &mut summary)?;
            evaluated_at = Some(trainer.steps());
        }
        if o.save_every.is_some_and(|n| trainer.steps() % n == 0) {
            checkpoints.save(&trainer, &inputs.data)?;
        }
    }
    // A run stopped by a signal ends without the final evaluation.
    if !stopped && evaluated_at != Some(trainer.steps()) {
        evaluate(&mut trainer, &mut inputs.eval_data, &mut summary)?;
    }
    if let Some(p) = &progress {
        p.finish();
    }
    // A run shorter than --snapshot-steps: its steps.
    if let Some(r) = recording.take() {
        summary.recorded_pool = r.write(&trainer)?;
    }
    if let Some(comm) = trainer.comm() {
        summary.record_rank_peaks(rank_peaks(comm, summary.peak_bytes.unwrap_or(0))?);
    }
    Ok(Trained {
        trainer,
        summary,
        checkpoints,
        stopped,
        signals,
    })
}

/// The recording of the run's first steps, and where it goes.
struct StepRecording<'a> {
    recording: RunRecording,
    to: &'a Recording,
    /// The plot's title before the plan and the steps: the model.
    model: &'a str,
    first_step: u64,
    /// The rank whose files these are, in a job of several.
    rank: Option<usize>,
}

impl<'a> StepRecording<'a> {
    fn new(recording: RunRecording, setup: &Setup, planned: &'a Planned, first_step: u64) -> Self {
        StepRecording {
            recording,
            to: &planned.recording,
            model: &planned.spec.source,
            first_step,
            rank: setup
                .joined
                .as_ref()
                .filter(|j| j.job.world_size > 1)
                .map(|j| j.job.rank),
        }
    }

    /// Writes the recording of the steps taken so far (`--snapshot`, `--plot`).
    fn write(self, trainer: &Trainer) -> Result<Option<PoolSummary>, Failure> {
        let timeline = self.recording.finish(trainer)?;
        let title = format!(
            "{}: {}, steps {}-{}",
            self.model,
            trainer.plan(),
            self.first_step + 1,
            trainer.steps()
        );
        let to = self.to;
        write_timeline(
            &to.to,
            to.plot_format,
            &timeline,
            to.budget,
            &title,
            self.rank,
        )?;
        Ok(timeline.pool.as_ref().map(PoolSummary::from))
    }
}

/// Every rank's `peak` (collective), by rank.
fn rank_peaks(comm: &dyn oomfix::strategies::shard::Comm, peak: u64) -> Result<Vec<u64>, Failure> {
    let collect = || -> oomfix::Result<Vec<u64>> {
        let mine = candle_core::Tensor::new(&[peak as i64], &candle_core::Device::Cpu)?;
        comm.all_gather(&mine)?
            .iter()
            .map(|t| Ok(t.to_vec1::<i64>()?[0] as u64))
            .collect()
    };
    Ok(collect()?)
}
