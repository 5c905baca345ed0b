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

use super::args::{InitArg, SeqLen, TrainArgs};
use super::job::{self, Joined};
use super::progress::Progress;
use super::signals::{self, StopSignals};
use super::{data, io_text, logging, plan, print_stdout, Exit, Failure, Outcome};
use oomfix::dist::Job;
use oomfix::report::TrainSummary;
use oomfix::train::data::DataSource;
use oomfix::train::saved::{self, ModelSource, TrainingState};
use oomfix::train::{TrainOptions, Trainer};
use oomfix::{Plan, Target};
use std::path::{Path, PathBuf};

/// Runs `oomfix train`: in this process; as one rank of a job (started by
/// `mpirun`, `torchrun` or this command's launcher); or, with `--gpus N` (N >
/// 1) outside a job, as the launcher of N ranks.
pub fn run(args: &TrainArgs) -> Outcome {
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
    let job = Job::from_env()?;
    let verified = verified_plan()?;
    if let (Some(_), Some(j), None) = (args.plan.opts.verify, &job, verified) {
        plan::refuse_verify_over_ranks(j.world_size)?;
    }
    let joined = match job {
        None if args.plan.opts.gpus > 1 => {
            super::launch::can_start(target)?;
            let env = match args.plan.opts.verify {
                Some(_) => match verify_before_launch(args, target)? {
                    Some(chosen) => vec![(VERIFIED_PLAN, plan_json(&chosen))],
                    None => return Ok(Exit::NothingFits),
                },
                None => Vec::new(),
            };
            return super::launch::run_with(args.plan.opts.gpus, target, &env);
        }
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
    let outcome = run_rank(args, init, target, defaulted, joined.as_ref(), verified);
    match joined {
        Some(_) => job::conclude(outcome),
        None => outcome,
    }
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

/// `train --gpus N --verify` outside a job: this process (the launcher)
/// searches, measuring candidates with N real ranks as `plan --gpus N
/// --verify` does, and prints the result (with `--json` only when nothing
/// fits: rank 0 prints the run's one object); the ranks then train the plan
/// it chose. `None` when nothing fits.
fn verify_before_launch(args: &TrainArgs, target: Target) -> Result<Option<Plan>, Failure> {
    let prepared = plan::prepare(&args.plan, target, &[])?;
    let (spec, result) = plan::search_quietly(&args.plan, prepared)?;
    let chosen = result.chosen().map(|a| a.plan);
    if !args.plan.json || chosen.is_none() {
        plan::print_result(&args.plan, &spec, &result)?;
    }
    Ok(chosen)
}

/// `train` in this process, alone or as one rank of `joined`.
fn run_rank(
    args: &TrainArgs,
    init: InitArg,
    target: Target,
    defaulted: bool,
    joined: Option<&Joined>,
    verified: Option<Plan>,
) -> Outcome {
    let o = &args.opts;
    let rank = joined.map_or(0, |j| j.job.rank);
    let mut plan_args = args.plan.clone();
    if let Some(j) = joined {
        plan_args.opts.gpus = j.job.world_size;
    }
    // The launcher measured the plans already: the ranks plan with its choice pinned.
    if let (Some(chosen), Some(_)) = (verified, joined) {
        plan::pin(&mut plan_args.opts, &chosen);
        plan_args.opts.verify = None;
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
    let data_inputs: Vec<&Path> = o
        .input
        .data
        .iter()
        .chain(&o.eval_data)
        .map(PathBuf::as_path)
        .collect();
    let prepared = plan::prepare(&plan_args, target, &data_inputs)?;
    if let (Some(j), true) = (joined, plan_args.opts.enforce_budget) {
        job::enforce_budget(j, prepared.budget)?;
    }
    // `--snapshot` and `--plot` (checked above) record the run's own first
    // steps, not a measurement of the plan apart.
    let record_to = plan_args.opts.clone();
    let (plot_format, budget) = (prepared.plot_format(), prepared.budget);
    let recorded = record_to.snapshot.is_some() || record_to.plot.is_some();
    plan_args.opts.snapshot = None;
    plan_args.opts.plot = None;
    let model_dir = args.plan.model.as_deref().map(data::model_dir);
    // What the family does not implement is refused before the data is read.
    let check = |seq_len: Option<SeqLen>| -> Result<(), Failure> {
        if let Some(dir) = &model_dir {
            // `longest`: the length is the search's; a sliding window it
            // exceeds is refused once it is known.
            let seq_len = match seq_len {
                Some(SeqLen::Tokens(n)) => n,
                Some(SeqLen::Longest) => 1,
                None => oomfix::Planner::new(1).seq_len_for(&prepared.spec),
            };
            oomfix::train::check_supported(
                &prepared.spec.config,
                seq_len,
                &dir.join("config.json"),
            )?;
        }
        Ok(())
    };
    check(plan_args.opts.seq_len)?;
    let mut data = data::data_source(
        &o.input,
        o.seed,
        &prepared.spec.config,
        model_dir.as_deref(),
    )?;
    if let (None, DataSource::Examples(examples)) = (plan_args.opts.seq_len, &data) {
        let seq_len = data::examples_seq_len(examples, &prepared.spec.config);
        if rank == 0 {
            logging::notice(format_args!(
                "sequence length {seq_len}: the longest example of {} is {} tokens{}; --seq-len sets it",
                examples.path().display(),
                examples.longest(),
                if seq_len + 1 < examples.longest() { ", beyond the model's context" } else { "" }
            ));
        }
        plan_args.opts.seq_len = Some(SeqLen::Tokens(seq_len));
        check(plan_args.opts.seq_len)?;
    }
    if let Some(path) = &o.resume {
        TrainingState::check(path)?;
    }
    let mut eval_data = match &o.eval_data {
        Some(path) => Some(data::load_data(
            &o.input,
            path,
            &prepared.spec.config,
            model_dir.as_deref(),
        )?),
        None => None,
    };
    if let Some(save) = &o.save {
        let mut inputs: Vec<&Path> = prepared.spec.files.iter().map(|p| p.as_path()).collect();
        inputs.extend(args.plan.model.as_deref());
        inputs.extend(o.input.data.as_deref());
        inputs.extend(o.eval_data.as_deref());
        // The checkpoint resumed, and the model when it is that checkpoint:
        // replacing them is the point.
        let mut replaceable: Vec<&Path> = o.resume.as_deref().into_iter().collect();
        let same = |a: &Path, b: &Path| a.canonicalize().ok() == b.canonicalize().ok();
        if let (Some(model), Some(resume)) = (args.plan.model.as_deref(), o.resume.as_deref()) {
            if same(model, resume) {
                replaceable.push(model);
                replaceable.extend(prepared.spec.files.iter().map(|p| p.as_path()));
            }
        }
        oomfix::output::check_output_dir(save, saved::STATE_FILE, &inputs, &replaceable)?;
        let parent = save
            .parent()
            .filter(|d| !d.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        tempfile::Builder::new()
            .prefix(".oomfix-write-check.")
            .tempdir_in(parent)
            .map_err(|e| {
                Failure::Usage(format!("cannot write {}: {}", save.display(), io_text(&e)))
            })?;
    }
    if rank == 0 && args.plan.model.is_none() && o.init_given().is_none() && o.resume.is_none() {
        logging::notice(
            "no model file given: the built-in GPT-2 small shape has no weights, training starts from a random initialisation",
        );
    }
    if defaulted && rank == 0 {
        logging::notice("no --device given and this build has no CUDA: training on the CPU");
    }
    // Rank 0 plans and prints the plan (with --json, at the end, with the
    // summary); the others take its choice.
    let (spec, searched) = if rank == 0 {
        let (spec, result) = plan::search_quietly(&plan_args, prepared)?;
        if !plan_args.json || result.chosen().is_none() {
            plan::print_result(&plan_args, &spec, &result)?;
        }
        (spec, Some(result))
    } else {
        (prepared.spec, None)
    };
    let chosen = searched.as_ref().and_then(|r| r.chosen().map(|a| a.plan));
    let chosen = match joined {
        Some(j) => job::share_plan(j.comm.as_ref(), chosen.as_ref())?,
        None => chosen,
    };
    let Some(chosen) = chosen else {
        return Ok(Exit::NothingFits);
    };
    if let (Some(SeqLen::Longest), Some(dir)) = (args.plan.opts.seq_len, &model_dir) {
        let config = dir.join("config.json");
        oomfix::train::check_supported(&spec.config, chosen.seq_len, &config)?;
    }
    if let Some(j) = joined {
        if chosen.shard.world_size != j.job.world_size {
            return Err(Failure::Usage(format!(
                "the plan chosen does not shard over the job's {} ranks (it fits one device); \
                 pin --zero-stage 1, 2 or 3 to train on {} ranks",
                j.job.world_size, j.job.world_size
            )));
        }
    }
    let lora = chosen.lora.is_some();
    let weights = match (init, &args.plan.model) {
        // A resumed run takes its weights from the checkpoint (a LoRA run
        // its adapters: the base comes from the model).
        (InitArg::Pretrained, Some(_)) if o.resume.is_none() || lora => Some(spec.files.clone()),
        _ => None,
    };
    let estimated_peak = searched
        .as_ref()
        .and_then(|r| r.chosen())
        .map_or(0, |a| a.estimate.peak);
    let (lr, lr_source) = match o.lr {
        Some(lr) => (lr, "--lr"),
        None if init == InitArg::Pretrained => (
            oomfix::train::PRETRAINED_LR,
            "the default from pretrained weights; --lr sets it",
        ),
        None => (
            oomfix::train::RANDOM_INIT_LR,
            "the default from a random initialisation; --lr sets it",
        ),
    };
    if rank == 0 && o.lr.is_none() {
        logging::notice(format_args!("learning rate {lr:e} ({lr_source})"));
    }
    let mut options = TrainOptions::default();
    options.adamw.lr = lr;
    options.adamw.weight_decay = o.weight_decay;
    options.schedule = oomfix::train::LrSchedule {
        warmup_steps: o.warmup_steps,
        decay: o.lr_schedule,
        total_steps: o.steps,
    };
    options.max_grad_norm = (o.max_grad_norm > 0.0).then_some(o.max_grad_norm);
    options.seed = o.seed;
    options.weights = weights;
    options.source = model_source(args, init, &spec, model_dir.as_deref());
    options.trim_between_phases = o.trim_between_phases;
    options.merge_lora = o.merge;
    let mut recording = recorded
        .then(|| oomfix::measure::RunRecording::start_on(&device))
        .transpose()?;
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
        let saved_plan = trainer.resume(path, &mut data)?;
        if rank == 0 {
            for line in oomfix::train::plan_changes(&saved_plan, trainer.plan()) {
                logging::notice(line);
            }
            logging::say(format_args!(
                "oomfix: resumed from {} at step {}",
                path.display(),
                trainer.steps()
            ));
        }
        tracing::info!(step = trainer.steps(), checkpoint = %path.display(), "resumed");
    }
    if (o.save.is_some() || o.resume.is_some()) && !trainer.saves_optimizer_state() {
        tracing::warn!(
            "the plan uses candle_nn::AdamW, whose moments cannot be read: checkpoints hold the weights, \
             step and data position but not the optimizer moments; a resumed run restarts them from zero"
        );
    }
    if let Some(r) = &mut recording {
        r.steps_start()?;
    }
    let first_step = trainer.steps();
    // Writes the recording of the steps taken so far (`--snapshot`, `--plot`).
    let write_recording = |recording: oomfix::measure::RunRecording,
                           trainer: &Trainer|
     -> Result<Option<oomfix::report::PoolSummary>, Failure> {
        let timeline = recording.finish(trainer)?;
        let title = format!(
            "{}: {}, steps {}-{}",
            spec.source,
            trainer.plan(),
            first_step + 1,
            trainer.steps()
        );
        let rank = joined.filter(|j| j.job.world_size > 1).map(|_| rank);
        plan::write_timeline(&record_to, plot_format, &timeline, budget, &title, rank)?;
        Ok(timeline
            .pool
            .as_ref()
            .map(oomfix::report::PoolSummary::from))
    };
    // The state on disk, as a step count: nothing to write again at that step.
    let mut saved_at = (o.save.is_some() && o.save == o.resume).then(|| trainer.steps());
    let save =
        |trainer: &Trainer, data: &DataSource, saved_at: &mut Option<u64>| -> Result<(), Failure> {
            let Some(path) = &o.save else {
                return Ok(());
            };
            if *saved_at != Some(trainer.steps()) {
                trainer.save(path, data)?;
                if rank == 0 {
                    tracing::info!(step = trainer.steps(), checkpoint = %path.display(), "saved");
                }
                *saved_at = Some(trainer.steps());
            }
            Ok(())
        };
    let signals = StopSignals::install()?;
    let progress = (rank == 0).then(|| Progress::new(o.steps, trainer.steps()));
    let mut summary = TrainSummary::new(estimated_peak);
    let evaluating = eval_data.is_some();
    summary.lr = Some((lr, lr_source.to_string()));
    // Evaluates on --eval-data from its start, and shows it.
    let mut evaluate = |trainer: &mut Trainer, summary: &mut TrainSummary| -> Result<(), Failure> {
        let Some(eval) = &mut eval_data else {
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
    if evaluating && trainer.steps() < o.steps {
        evaluate(&mut trainer, &mut summary)?;
        evaluated_at = Some(trainer.steps());
    }
    // Every rank stops at the same step boundary: a signal any rank received stops all.
    let mut stop = false;
    while trainer.steps() < o.steps && !stop {
        stop = trainer.any_rank(signals.received().is_some())?;
        if stop {
            break;
        }
        let stats = trainer.step(&mut data)?;
        if trainer.steps() - first_step >= o.snapshot_steps {
            if let Some(r) = recording.take() {
                summary.recorded_pool = write_recording(r, &trainer)?;
            }
        }
        summary.record_step(trainer.steps(), &stats);
        if let Some(p) = &progress {
            p.step(trainer.steps(), &stats);
        }
        if o.eval_every.is_some_and(|n| trainer.steps() % n == 0) {
            evaluate(&mut trainer, &mut summary)?;
            evaluated_at = Some(trainer.steps());
        }
        if o.save_every.is_some_and(|n| trainer.steps() % n == 0) {
            save(&trainer, &data, &mut saved_at)?;
        }
    }
    // A run stopped by a signal ends without the final evaluation.
    if !stop && evaluated_at != Some(trainer.steps()) {
        evaluate(&mut trainer, &mut summary)?;
    }
    if let Some(p) = &progress {
        p.finish();
    }
    // A run shorter than --snapshot-steps: its steps.
    if let Some(r) = recording.take() {
        summary.recorded_pool = write_recording(r, &trainer)?;
    }
    if let Some(comm) = trainer.comm() {
        summary.record_rank_peaks(rank_peaks(comm, summary.peak_bytes.unwrap_or(0))?);
    }
    save(&trainer, &data, &mut saved_at)?;
    if let Some(result) = &searched {
        if plan_args.json {
            let mut v = oomfix::report::search_json(&spec, result);
            v["training"] = oomfix::report::train_summary_json(&summary);
            print_stdout(&format!("{v:#}\n"))?;
        } else {
            print_stdout(&oomfix::report::train_summary_text(&summary))?;
        }
    }
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
    if rank == 0 {
        logging::notice(format_args!(
            "stopped by {} after step {}; {saved}",
            signals::name(stopped_by),
            trainer.steps()
        ));
    }
    Ok(Exit::Signal(stopped_by))
}

/// What a saved directory holds beside the weights: the dtype of the weights
/// the run starts from (f32 from a random initialisation), the model's
/// `config.json` and tokenizer files, and `--tokenizer` as `tokenizer.json`.
fn model_source(
    args: &TrainArgs,
    init: InitArg,
    spec: &oomfix::ModelSpec,
    model_dir: Option<&Path>,
) -> ModelSource {
    let dtype = match (init, spec.dtype.as_str()) {
        (InitArg::Random, _) => candle_core::DType::F32,
        (_, "BF16") => candle_core::DType::BF16,
        (_, "F16") => candle_core::DType::F16,
        _ => candle_core::DType::F32,
    };
    let mut source = match model_dir {
        Some(dir) => ModelSource::beside(dir, dtype),
        None => ModelSource {
            dtype,
            ..ModelSource::default()
        },
    };
    if let Some(t) = &args.opts.input.tokenizer {
        source.files.retain(|(n, _)| n != "tokenizer.json");
        source.files.push(("tokenizer.json".into(), t.clone()));
    }
    if let Some(t) = &args.opts.input.chat_template {
        let name = oomfix::train::chat::TEMPLATE_FILE;
        source.files.retain(|(n, _)| n != name);
        source.files.push((name.into(), t.clone()));
    }
    source
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
