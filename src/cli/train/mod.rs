//! `oomfix train`: plan, then run real steps with the chosen plan, and the
//! loop's policy: checkpoints at the end, every `--save-every` steps and when
//! stopped by a signal; `--resume`; progress.
//!
//! Training starts from the model file's weights (`--init pretrained`, the
//! default with a model file) or a random initialisation (`--init random`,
//! and the built-in default model, which has no weights).
//!
//! Every option and input is checked before the plan is printed: the model,
//! `--init pretrained` without one, the `--data` file (read and checked against the
//! model's vocabulary), `--save` (writable, not an input), `--resume` (readable).
//!
//! A run is one pipeline, each stage a module: the command line checked
//! and the process placed ([`Setup`]: alone, one rank of a job, or the
//! launcher of the ranks); [`plan`]: the options checked and the model
//! inspected, then the plan chosen; [`load`]: the data, then the model
//! and its trainer; [`steps`]: the training loop; [`save`]: the
//! checkpoints; [`report`]: the summary and how the run ended.

mod load;
mod plan;
mod report;
mod save;
mod steps;

use super::args::{InitArg, TrainArgs};
use super::job::{self, Joined};
use super::{data, Exit, Failure, Outcome};
use candle_core::Device;
use oomfix::dist::Job;
use oomfix::{Plan, Target};
use std::path::PathBuf;

/// Runs `oomfix train`: in this process; as one rank of a job (started by
/// `mpirun`, `torchrun` or this command's launcher); or, with `--gpus N` (N >
/// 1) outside a job, as the launcher of N ranks.
pub fn run(args: &TrainArgs) -> Outcome {
    let (init, target, defaulted) = check_options(args)?;
    let job = Job::from_env()?;
    let verified = verified_plan()?;
    if let (Some(_), Some(j), None) = (args.plan.opts.verify, &job, verified) {
        plan::refuse_verify_over_ranks(j.world_size)?;
    }
    let joined = match job {
        None if args.plan.opts.gpus > 1 => return launch(args, target),
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
    // Fails outside a job only (a rank's device is the job's).
    let device = device(joined.as_ref(), target)?;
    let setup = Setup {
        args,
        init,
        target,
        defaulted,
        joined,
        verified,
        device,
        model_dir: args.plan.model.as_deref().map(data::model_dir),
    };
    let outcome = run_rank(&setup);
    // The job's communicator outlives the report of the outcome: closing it
    // first (MPI's finalisation) would wait for ranks that are stopping.
    match setup.joined {
        Some(_) => job::conclude(outcome),
        None => outcome,
    }
}

/// `train` in this process, alone or as one rank of a job: its stages in
/// order.
fn run_rank(setup: &Setup) -> Outcome {
    let mut planning = plan::prepare(setup)?;
    let mut inputs = load::inputs(setup, &mut planning)?;
    let Some(planned) = plan::choose(setup, planning)? else {
        return Ok(Exit::NothingFits);
    };
    let loaded = load::trainer(setup, &planned, &mut inputs)?;
    let mut trained = steps::train(setup, &planned, loaded, &mut inputs)?;
    trained.checkpoints.save(&trained.trainer, &inputs.data)?;
    report::report(setup, &planned, &trained)
}

/// What the command line asks for, checked, and where this process runs
/// it: what every stage of a rank reads.
struct Setup<'a> {
    args: &'a TrainArgs,
    /// Where the weights come from.
    init: InitArg,
    /// The device asked for (or taken by default).
    target: Target,
    /// No `--device` was given and this build has no CUDA: the CPU.
    defaulted: bool,
    /// This rank's side of a job of several.
    joined: Option<Joined>,
    /// The plan the launcher measured (`--gpus N --verify`).
    verified: Option<Plan>,
    /// The device this process trains on.
    device: Device,
    /// The model's directory (its `config.json`, tokenizer and template).
    model_dir: Option<PathBuf>,
}

impl Setup<'_> {
    /// This process's rank (0 outside a job).
    fn rank(&self) -> usize {
        self.joined.as_ref().map_or(0, |j| j.job.rank)
    }
}

/// The device this process trains on: its rank's in a job, else the one
/// `target` names.
fn device(joined: Option<&Joined>, target: Target) -> Result<Device, Failure> {
    Ok(match (joined, target) {
        (Some(j), _) => j.device.clone(),
        (None, Target::Cpu) => Device::Cpu,
        (None, Target::Cuda(i)) => Device::new_cuda(i).map_err(|e| {
            Failure::Usage(format!(
                "cannot use cuda:{i}: {e}{}",
                if cfg!(feature = "cuda") {
                    ""
                } else {
                    " (this build needs --features cuda)"
                }
            ))
        })?,
    })
}

/// The options only `train` takes, checked against each other: where the
/// weights come from, and the device (`defaulted`: the CPU, as no
/// `--device` was given and this build has no CUDA).
fn check_options(args: &TrainArgs) -> Result<(InitArg, Target, bool), Failure> {
    let o = &args.opts;
    if o.merge && args.plan.opts.lora.is_none() {
        return Err(Failure::Usage(
            "--merge adds LoRA adapters into the base weights: it needs --lora RANK".into(),
        ));
    }
    if o.merge && o.save.is_none() {
        return Err(Failure::Usage(
            "--merge says what --save writes: it needs --save DIR".into(),
        ));
    }
    let init = match (o.init_given(), &args.plan.model) {
        (Some(InitArg::Pretrained), None) => {
            return Err(Failure::Usage(
                "--init pretrained needs a model file (the built-in default has no weights)".into(),
            ))
        }
        (Some(init), _) => init,
        (None, Some(_)) => InitArg::Pretrained,
        (None, None) => InitArg::Random,
    };
    let (target, defaulted) = match args.plan.opts.device {
        Some(t) => (t, false),
        None if cfg!(feature = "cuda") => (Target::Cuda(0), false),
        None => (Target::Cpu, true),
    };
    if o.trim_between_phases && target == Target::Cpu {
        return Err(Failure::Usage(
            "--trim-between-phases trims a CUDA device's memory pool; the CPU has none (use --device cuda:N)"
                .into(),
        ));
    }
    Ok((init, target, defaulted))
}

/// `--gpus N` outside a job: starts the N ranks and waits for them (with
/// `--verify`, once this process measured the plan they then train).
fn launch(args: &TrainArgs, target: Target) -> Outcome {
    super::launch::can_start(target)?;
    let env = match args.plan.opts.verify {
        Some(_) => match plan::verify_before_launch(args, target)? {
            Some(chosen) => vec![(VERIFIED_PLAN, plan_json(&chosen))],
            None => return Ok(Exit::NothingFits),
        },
        None => Vec::new(),
    };
    super::launch::run_with(args.plan.opts.gpus, target, &env)
}

/// The variable through which `train --gpus N --verify`'s launcher hands
/// the ranks the plan it verified (JSON).
const VERIFIED_PLAN: &str = "OOMFIX_VERIFIED_PLAN";

/// The plan this rank's launcher verified, if it did.
fn verified_plan() -> Result<Option<Plan>, Failure> {
    std::env::var(VERIFIED_PLAN)
        .ok()
        .map(|json| {
            serde_json::from_str(&json)
                .map_err(|e| Failure::Usage(format!("{VERIFIED_PLAN} is not a plan ({e}): {json}")))
        })
        .transpose()
}

fn plan_json(plan: &Plan) -> String {
    serde_json::to_string(plan).expect("a plan serialises")
}
