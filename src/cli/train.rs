//! `oomfix train`: plan, then run real steps with the chosen plan, and the
//! loop's policy: checkpoints at the end, every `--save-every` steps and when
//! stopped by a signal; `--resume`; progress.
//!
//! Every option and input is checked before the plan is printed: the model,
//! `--pretrained` without one, the `--data` file (read and checked against the
//! model's vocabulary), `--save` (writable, not an input), `--resume` (readable).

use super::args::TrainArgs;
use super::job::{self, Joined};
use super::progress::Progress;
use super::signals::{self, StopSignals};
use super::{check_writable, io_text, logging, plan, Exit, Failure, Outcome};
use oomfix::dist::Job;
use oomfix::train::data::{DataSource, TokenWidth};
use oomfix::train::{TrainOptions, Trainer};
use oomfix::Target;
use std::path::Path;

/// Runs `oomfix train`: in this process; as one rank of a job (started by
/// `mpirun`, `torchrun` or this command's launcher); or, with `--gpus N` (N >
/// 1) outside a job, as the launcher of N ranks.
pub fn run(args: &TrainArgs) -> Outcome {
    let o = &args.opts;
    if o.pretrained && args.plan.model.is_none() {
        return Err(Failure::Usage(
            "--pretrained needs a model file (the built-in default has no weights)".into(),
        ));
    }
    let (target, defaulted) = match args.plan.opts.device {
        Some(t) => (t, false),
        None if cfg!(feature = "cuda") => (Target::Cuda(0), false),
        None => (Target::Cpu, true),
    };
    let job = Job::from_env()?;
    let several = job.as_ref().is_some_and(|j| j.world_size > 1)
        || (job.is_none() && args.plan.opts.gpus > 1);
    if several && (o.save.is_some() || o.resume.is_some()) {
        return Err(Failure::Usage(
            "--save and --resume are not supported with several ranks yet".into(),
        ));
    }
    let joined = match job {
        None if args.plan.opts.gpus > 1 => return super::launch::run(args.plan.opts.gpus, target),
        Some(job) if job.world_size > 1 => {
            let gpus = args.plan.opts.gpus;
            if gpus != 1 && gpus != job.world_size {
                return Err(Failure::Usage(format!(
                    "--gpus {gpus}, but the job has {} ranks (WORLD_SIZE)",
                    job.world_size
                )));
            }
            Some(job::join(job, target)?)
        }
        _ => None,
    };
    let outcome = run_rank(args, target, defaulted, joined.as_ref());
    if outcome.is_ok() {
        job::finish();
    }
    outcome
}

/// `train` in this process, alone or as one rank of `joined`.
fn run_rank(args: &TrainArgs, target: Target, defaulted: bool, joined: Option<&Joined>) -> Outcome {
    let o = &args.opts;
    let rank = joined.map_or(0, |j| j.job.rank);
    let mut plan_args = args.plan.clone();
    if let Some(j) = joined {
        plan_args.opts.gpus = j.job.world_size;
    }
    let device = match (joined, target) {
        (Some(j), _) => j.device.clone(),
        (None, Target::Cpu) => candle_core::Device::Cpu,
        (None, Target::Cuda(i)) => candle_core::Device::new_cuda(i).map_err(|e| {
            Failure::Usage(format!(
                "cannot use cuda:{i}: {e}{}",
                if cfg!(feature = "cuda") {
                    ""
                } else {
                    " (this build needs --features cuda)"
                }
            ))
        })?,
    };
    let data_inputs: Vec<&Path> = o.data.as_deref().into_iter().collect();
    let prepared = plan::prepare(&plan_args, target, &data_inputs)?;
    let mut data = data_source(args, prepared.spec.config.vocab)?;
    if let Some(save) = &o.save {
        // The resume file is not among the inputs: replacing it is the point.
        let mut inputs: Vec<&Path> = prepared.spec.files.iter().map(|p| p.as_path()).collect();
        inputs.extend(args.plan.model.as_deref());
        inputs.extend(o.data.as_deref());
        check_writable(save, &inputs)?;
    }
    if let Some(path) = &o.resume {
        std::fs::File::open(path).map_err(|e| {
            Failure::input(path, format!("cannot read checkpoint: {}", io_text(&e)))
        })?;
    }
    if defaulted && rank == 0 {
        logging::notice("no --device given and this build has no CUDA: training on the CPU");
    }
    // Rank 0 plans and prints the plan; the others take its choice.
    let (spec, chosen) = if rank == 0 {
        let (spec, result) = plan::search(&plan_args, prepared)?;
        (spec, result.chosen().map(|a| a.plan))
    } else {
        (prepared.spec, None)
    };
    let chosen = match joined {
        Some(j) => job::share_plan(j.comm.as_ref(), chosen.as_ref())?,
        None => chosen,
    };
    let Some(chosen) = chosen else {
        return Ok(Exit::NothingFits);
    };
    if let Some(j) = joined {
        if chosen.shard.world_size != j.job.world_size {
            return Err(Failure::Usage(format!(
                "the plan chosen does not shard over the job's {} ranks (it fits one device); \
                 pin --zero-stage 1, 2 or 3 to train on {} ranks",
                j.job.world_size, j.job.world_size
            )));
        }
    }
    let weights = match (o.pretrained, &args.plan.model) {
        // A resumed run takes its weights from the checkpoint.
        (true, Some(_)) if o.resume.is_none() => Some(spec.files.clone()),
        _ => None,
    };
    let mut options = TrainOptions::default();
    options.adamw.lr = o.lr;
    options.seed = o.seed;
    options.weights = weights;
    let mut trainer = match joined {
        Some(j) => Trainer::new_sharded(
            &spec.config,
            chosen,
            &device,
            &options,
            Box::new(std::sync::Arc::clone(&j.comm)),
        )?,
        None => Trainer::new(&spec.config, chosen, &device, &options)?,
    };
    if let Some(path) = &o.resume {
        trainer.resume(path, &mut data)?;
        tracing::info!(step = trainer.steps(), checkpoint = %path.display(), "resumed");
        logging::say(format_args!(
            "oomfix: resumed from {} at step {}",
            path.display(),
            trainer.steps()
        ));
    }
    if (o.save.is_some() || o.resume.is_some()) && !trainer.saves_optimizer_state() {
        tracing::warn!(
            "the plan uses candle_nn::AdamW, whose moments cannot be read: checkpoints hold the weights, \
             step and data position but not the optimizer moments; a resumed run restarts them from zero"
        );
    }
    // The state on disk, as a step count: nothing to write again at that step.
    let mut saved_at = (o.save.is_some() && o.save == o.resume).then(|| trainer.steps());
    let save =
        |trainer: &Trainer, data: &DataSource, saved_at: &mut Option<u64>| -> Result<(), Failure> {
            let Some(path) = &o.save else {
                return Ok(());
            };
            if *saved_at != Some(trainer.steps()) {
                trainer.save(path, data)?;
                tracing::info!(step = trainer.steps(), checkpoint = %path.display(), "saved");
                *saved_at = Some(trainer.steps());
            }
            Ok(())
        };
    let signals = StopSignals::install()?;
    let progress = (rank == 0).then(|| Progress::new(o.steps, trainer.steps()));
    // Every rank stops at the same step boundary: a signal any rank received stops all.
    let mut stop = false;
    while trainer.steps() < o.steps && !stop {
        stop = trainer.any_rank(signals.received().is_some())?;
        if stop {
            break;
        }
        let stats = trainer.step(&mut data)?;
        if let Some(p) = &progress {
            p.step(trainer.steps(), &stats);
        }
        if o.save_every.is_some_and(|n| trainer.steps() % n == 0) {
            save(&trainer, &data, &mut saved_at)?;
        }
    }
    if let Some(p) = &progress {
        p.finish();
    }
    save(&trainer, &data, &mut saved_at)?;
    let stopped_by = match signals.received() {
        Some(sig) if trainer.steps() < o.steps => sig,
        // Stopped because another rank received a signal.
        None if stop => signal_hook::consts::SIGTERM,
        _ => return Ok(Exit::Done),
    };
    let saved = match &o.save {
        Some(path) => format!("checkpoint written to {}", path.display()),
        None => "no checkpoint written (no --save)".into(),
    };
    logging::notice(format_args!(
        "stopped by {} after step {}; {saved}",
        signals::name(stopped_by),
        trainer.steps()
    ));
    Ok(Exit::Signal(stopped_by))
}

/// The training data `args` ask for, checked against the model's vocabulary.
fn data_source(args: &TrainArgs, vocab: usize) -> Result<DataSource, Failure> {
    let o = &args.opts;
    match &o.data {
        Some(path) => {
            let width = if o.u32_tokens {
                TokenWidth::U32
            } else {
                TokenWidth::U16
            };
            Ok(DataSource::from_file(path, width, vocab)?)
        }
        None => Ok(DataSource::synthetic(o.seed)),
    }
}
