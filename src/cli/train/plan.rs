//! The plan of a `train` run: the options checked and the model inspected
//! before any input is read ([`prepare`]), then, once the inputs are
//! checked, the plan chosen by rank 0 and shared with the other ranks
//! ([`choose`]).

use super::Setup;
use crate::cli::args::{PlanArgs, PlanOptions, SeqLen, TrainArgs};
use crate::cli::plan::{self as planning, Prepared};
use crate::cli::{job, Failure};
use oomfix::report::PlotFormat;
use oomfix::{ModelSpec, Plan, SearchResult, Target};
use std::path::{Path, PathBuf};

/// A rank's planning before the plan is chosen.
pub(super) struct Planning {
    /// The plan options of this rank: the job's ranks as `--gpus`, the
    /// launcher's verified plan pinned, no `--snapshot` or `--plot` (the
    /// run records its own steps, not a measurement of the plan apart).
    pub args: PlanArgs,
    /// The options checked and the model inspected.
    pub prepared: Prepared,
    /// The recording the run makes of its own first steps.
    pub recording: Recording,
}

/// Where and how the run records its own first steps (`--snapshot`,
/// `--plot`).
pub(super) struct Recording {
    /// The options naming the files.
    pub to: PlanOptions,
    /// The format of `--plot`, checked.
    pub plot_format: Option<PlotFormat>,
    /// The budget the plot shows.
    pub budget: u64,
}

impl Recording {
    /// Whether the run records its steps.
    pub fn wanted(&self) -> bool {
        self.to.snapshot.is_some() || self.to.plot.is_some()
    }
}

/// The plan chosen, and what it was chosen from.
pub(super) struct Planned {
    /// The plan options the search ran with.
    pub args: PlanArgs,
    /// The model.
    pub spec: ModelSpec,
    /// The search's result (rank 0 only: the others take its choice).
    pub searched: Option<SearchResult>,
    /// The plan every rank trains.
    pub chosen: Plan,
    /// The recording the run makes of its own first steps.
    pub recording: Recording,
}

impl Planned {
    /// The chosen plan's estimated peak (0 on the ranks that did not search).
    pub fn estimated_peak(&self) -> u64 {
        self.searched
            .as_ref()
            .and_then(|r| r.chosen())
            .map_or(0, |a| a.estimate.peak)
    }
}

/// This rank's plan options, checked, and the model inspected; the budget
/// enforced on a rank's GPU (`--enforce-budget`).
pub(super) fn prepare(setup: &Setup) -> Result<Planning, Failure> {
    let args = setup.args;
    let o = &args.opts;
    let mut plan_args = args.plan.clone();
    if let Some(j) = &setup.joined {
        plan_args.opts.gpus = j.job.world_size;
    }
    // The launcher measured the plans already: the ranks plan with its choice pinned.
    if let (Some(chosen), Some(_)) = (setup.verified, &setup.joined) {
        planning::pin(&mut plan_args.opts, &chosen);
        plan_args.opts.verify = None;
    }
    let data_inputs: Vec<&Path> = o
        .input
        .data
        .iter()
        .chain(&o.eval_data)
        .map(PathBuf::as_path)
        .collect();
    let prepared = planning::prepare(&plan_args, setup.target, &data_inputs)?;
    if let (Some(j), true) = (&setup.joined, plan_args.opts.enforce_budget) {
        job::enforce_budget(j, prepared.budget)?;
    }
    let recording = Recording {
        to: plan_args.opts.clone(),
        plot_format: prepared.plot_format(),
        budget: prepared.budget,
    };
    plan_args.opts.snapshot = None;
    plan_args.opts.plot = None;
    Ok(Planning {
        args: plan_args,
        prepared,
        recording,
    })
}

/// The plan of the run: rank 0 searches and prints the result (with
/// `--json`, at the end, with the summary); the other ranks take its
/// choice. `None` when nothing fits.
pub(super) fn choose(setup: &Setup, planning: Planning) -> Result<Option<Planned>, Failure> {
    let Planning {
        args,
        prepared,
        recording,
    } = planning;
    let (spec, searched) = if setup.rank() == 0 {
        let (spec, result) = planning::search_quietly(&args, prepared)?;
        if !args.json || result.chosen().is_none() {
            planning::print_result(&args, &spec, &result)?;
        }
        (spec, Some(result))
    } else {
        (prepared.spec, None)
    };
    let chosen = searched.as_ref().and_then(|r| r.chosen().map(|a| a.plan));
    let chosen = match &setup.joined {
        Some(j) => job::share_plan(j.comm.as_ref(), chosen.as_ref())?,
        None => chosen,
    };
    let Some(chosen) = chosen else {
        return Ok(None);
    };
    if let Some(SeqLen::Longest) = setup.args.plan.opts.seq_len {
        refuse_unsupported(setup, &spec, chosen.seq_len)?;
    }
    if let Some(j) = &setup.joined {
        if chosen.shard.world_size != j.job.world_size {
            return Err(Failure::Usage(format!(
                "the plan chosen does not shard over the job's {} ranks (it fits one device); \
                 pin --zero-stage 1, 2 or 3 to train on {} ranks",
                j.job.world_size, j.job.world_size
            )));
        }
    }
    Ok(Some(Planned {
        args,
        spec,
        searched,
        chosen,
        recording,
    }))
}

/// Refuses what the model's family does not implement at `seq_len` tokens
/// (a model file's `config.json`; the built-in model has none to refuse).
pub(super) fn refuse_unsupported(
    setup: &Setup,
    spec: &ModelSpec,
    seq_len: usize,
) -> Result<(), Failure> {
    if let Some(dir) = &setup.model_dir {
        oomfix::train::check_supported(&spec.config, seq_len, &dir.join("config.json"))?;
    }
    Ok(())
}

/// `train --gpus N --verify` outside a job: this process (the launcher)
/// searches, measuring candidates with N real ranks as `plan --gpus N
/// --verify` does, and prints the result (with `--json` only when nothing
/// fits: rank 0 prints the run's one object); the ranks then train the plan
/// it chose. `None` when nothing fits.
pub(super) fn verify_before_launch(
    args: &TrainArgs,
    target: Target,
) -> Result<Option<Plan>, Failure> {
    let prepared = planning::prepare(&args.plan, target, &[])?;
    let (spec, result) = planning::search_quietly(&args.plan, prepared)?;
    let chosen = result.chosen().map(|a| a.plan);
    if !args.plan.json || chosen.is_none() {
        planning::print_result(&args.plan, &spec, &result)?;
    }
    Ok(chosen)
}

/// `train --verify` in a job another launcher started (`mpirun`,
/// `torchrun`): rank 0 plans inside the job and cannot start the ranks that
/// measuring a plan of `ranks` > 1 needs.
pub(super) fn refuse_verify_over_ranks(ranks: usize) -> Result<(), Failure> {
    if ranks > 1 {
        return Err(Failure::Usage(
            "train --verify cannot measure plans inside a job of several ranks started by another launcher: \
             run `oomfix train --gpus N --verify` (it measures before it starts the ranks), or measure with \
             `oomfix plan --gpus N --verify` and train the plan it prints with its fields pinned"
                .into(),
        ));
    }
    Ok(())
}
