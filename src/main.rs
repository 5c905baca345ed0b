//! The `oomfix` command: parse arguments, call the library, map outcomes to exit codes:
//!
//! * 0: done (a plan fits; `train` ran all its steps);
//! * 1: nothing fits the budget;
//! * 2: a usage or input error (bad option, unreadable model or data file, a
//!   corrupt checkpoint or one of another model or plan);
//! * 3: a failure while running: training stopped on a NaN or infinite loss, a
//!   write failed, a device error;
//! * 130, 143: `train` stopped by SIGINT or SIGTERM at a step boundary (after
//!   writing its checkpoint with `--save`), as shells report a death by those
//!   signals; a second signal exits at once with the same code.

use anyhow::Context;
use clap::Parser;
use oomfix::cli::{
    Cli, Command, HalfArg, LogArgs, LogFormat, MeasureStepArgs, PlanArgs, TrainArgs, VerifyArg,
};
use oomfix::measure::StepVerifier;
use oomfix::track::CountingAlloc;
use oomfix::train::data::{DataSource, TokenWidth};
use oomfix::train::{StepStats, TrainOptions, Trainer};
use oomfix::{inspect, report, Error, ModelSpec, Pipeline, Planner, SearchResult, Target, Verify};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;
use std::path::Path;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use tracing_subscriber::{fmt, EnvFilter};

/// Exit code of success: a plan fits, training ran all its steps.
const SUCCESS: u8 = 0;
/// Exit code when nothing fits.
const NOTHING_FITS: u8 = 1;

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Err(err) = init_logging(&cli.log) {
        eprintln!("oomfix: {err:#}");
        return ExitCode::from(2);
    }
    let fits = |fits: bool| if fits { SUCCESS } else { NOTHING_FITS };
    let outcome = match cli.command {
        Some(Command::Inspect(args)) => inspect::inspect(&args.model).map(|spec| {
            let text = if args.json {
                format!("{:#}\n", report::inspect_json(&spec))
            } else {
                report::inspect_text(&spec)
            };
            print!("{text}");
            SUCCESS
        }),
        Some(Command::Plan(args)) => plan(&args).map(|(_, result)| fits(result.fits())),
        Some(Command::Train(args)) => train(&args),
        Some(Command::MeasureStep(args)) => measure_step(&args).map(fits),
        None => plan(&cli.plan).map(|(_, result)| fits(result.fits())),
    };
    match outcome {
        Ok(code) => ExitCode::from(code),
        Err(err) => {
            tracing::debug!(?err, "failed");
            eprintln!("oomfix: {err}");
            ExitCode::from(if err.is_input() { 2 } else { 3 })
        }
    }
}

/// Runs the search and prints its result.
fn plan(args: &PlanArgs) -> oomfix::Result<(ModelSpec, SearchResult)> {
    let budget = args.budget.ok_or_else(|| {
        Error::Usage("a budget is required, e.g. --budget 8GiB (see --help)".into())
    })?;
    if let Some(path) = &args.plot {
        report::PlotFormat::from_path(path).map_err(Error::Usage)?;
    }
    let spec = match &args.model {
        Some(path) => inspect::inspect(path)?,
        None => ModelSpec::default_model(),
    };
    if args.model.is_none() && !args.json {
        eprintln!("oomfix: no model given; planning for the {}", spec.source);
    }
    if args.enforce_budget {
        enforce_budget(args.device, budget)?;
    }
    let pipeline =
        Pipeline::from_names(&args.strategies).map_err(|e| Error::Usage(e.to_string()))?;
    let mut planner = Planner::new(budget)
        .global_batch(args.global_batch)
        .target(args.device)
        .gpus(args.gpus)
        .pipeline(pipeline)
        .pins(pins(args));
    if let Some(h) = args.headroom {
        planner = planner.headroom(h);
    }
    if let Some(bytes) = args.host_budget.or_else(oomfix::units::available_memory) {
        planner = planner.host_budget(bytes);
    }
    if let Some(n) = args.seq_len {
        planner = planner.seq_len(n);
    }
    if let Some(mode) = args.verify {
        let verifier = match args.device {
            Target::Cpu => {
                let exe = std::env::current_exe().map_err(|e| Error::Io {
                    context: "locating oomfix".into(),
                    source: e,
                })?;
                StepVerifier::isolated(args.device, exe, budget)
            }
            Target::Cuda(_) => StepVerifier::in_process(args.device),
        };
        let mode = match mode {
            VerifyArg::Fitting => Verify::Fitting,
            VerifyArg::All => Verify::All,
        };
        planner = planner.verify_with(verifier, mode);
    }
    let result = planner.run(&spec)?;
    if args.snapshot.is_some() || args.plot.is_some() {
        timeline_outputs(args, &spec, &result, budget)?;
    }
    if args.json {
        println!("{:#}", report::search_json(&spec, &result));
    } else {
        print!("{}", report::search_table(&spec, &result));
    }
    Ok((spec, result))
}

/// The plan fields the command line pins.
fn pins(args: &PlanArgs) -> oomfix::Pins {
    use oomfix::strategies::Precision;
    let mut pins = oomfix::Pins::default();
    pins.precision = match args.precision {
        HalfArg::Auto => None,
        HalfArg::Fp32 => Some(Precision::F32),
        HalfArg::Bf16 => Some(Precision::Bf16),
        HalfArg::Fp16 => Some(Precision::F16),
    };
    pins.micro_batch = args.micro_batch;
    pins.grad_accum = args.grad_accum;
    pins.checkpoint = args.checkpoint;
    pins.attention = args.attention;
    pins.optimizer = args.optimizer;
    pins.shard_stage = args.zero_stage;
    pins
}

/// `--enforce-budget`: leaves only `budget` bytes of the CUDA device usable by
/// this process until it exits.
fn enforce_budget(target: Target, budget: u64) -> oomfix::Result<()> {
    let Target::Cuda(ordinal) = target else {
        return Err(Error::Usage(
            "--enforce-budget limits a CUDA device's memory; with --device cpu there is nothing to limit \
             (use --verify, which measures CPU plans in a child process limited to the budget)"
                .into(),
        ));
    };
    enforce_cuda(ordinal, budget)
}

#[cfg(feature = "cuda")]
fn enforce_cuda(ordinal: usize, budget: u64) -> oomfix::Result<()> {
    let device = candle_core::Device::new_cuda(ordinal)
        .map_err(|e| Error::Usage(format!("--enforce-budget: cannot use cuda:{ordinal}: {e}")))?;
    let cuda = device.as_cuda_device()?;
    let done = oomfix::track::cuda::enforce_budget(cuda, budget)
        .map_err(|e| Error::Usage(format!("--enforce-budget: {e}")))?;
    tracing::info!(
        ballast_bytes = done.ballast,
        already_used_bytes = done.already_used,
        free_after_bytes = done.free_after,
        "budget enforced"
    );
    eprintln!(
        "oomfix: enforcing the budget on cuda:{ordinal}: {} held back, {} free for this process \
         (it already holds {})",
        oomfix::units::format_bytes(done.ballast),
        oomfix::units::format_bytes(done.free_after),
        oomfix::units::format_bytes(done.already_used)
    );
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn enforce_cuda(_: usize, _: u64) -> oomfix::Result<()> {
    Err(Error::Usage(
        "--enforce-budget on CUDA needs a build with --features cuda".into(),
    ))
}

/// Measures the chosen (or closest) plan with its allocations recorded and
/// writes `--snapshot` and `--plot`.
fn timeline_outputs(
    args: &PlanArgs,
    spec: &ModelSpec,
    result: &SearchResult,
    budget: u64,
) -> oomfix::Result<()> {
    if args.device != Target::Cpu {
        return Err(Error::Usage(
            "--snapshot and --plot record host allocations: use --device cpu".into(),
        ));
    }
    let inputs: Vec<&Path> = spec
        .files
        .iter()
        .map(|f| f.as_path())
        .chain(args.model.as_deref())
        .collect();
    for out in [&args.snapshot, &args.plot].into_iter().flatten() {
        oomfix::output::check_output(out, &inputs)?;
    }
    let plot_format = args
        .plot
        .as_deref()
        .map(report::PlotFormat::from_path)
        .transpose()
        .map_err(Error::Usage)?;
    let attempt = result.chosen().unwrap_or_else(|| result.closest());
    let (m, timeline) = oomfix::measure::record_plan(spec, &attempt.plan, Target::Cpu)?;
    if timeline.truncated {
        tracing::warn!(
            "the recording filled its {} events; the timeline ends early",
            oomfix::measure::MAX_EVENTS
        );
    }
    tracing::info!(
        measured_bytes = m.peak_bytes,
        blocks = timeline.blocks.len(),
        changes = timeline.changes.len(),
        "recorded {}",
        attempt.plan
    );
    if let Some(path) = &args.snapshot {
        let bytes = report::snapshot_pickle(&timeline);
        oomfix::output::write_atomic(path, |f| write_all(f, path, &bytes))?;
    }
    if let (Some(path), Some(format)) = (&args.plot, plot_format) {
        let title = format!("{}: {}", spec.source, attempt.plan);
        let image =
            report::timeline_plot(&timeline, budget, &title, format).map_err(Error::Runtime)?;
        oomfix::output::write_atomic(path, |f| write_all(f, path, &image))?;
    }
    Ok(())
}

fn write_all(f: &mut std::fs::File, path: &Path, bytes: &[u8]) -> oomfix::Result<()> {
    use std::io::Write;
    f.write_all(bytes).map_err(|e| Error::Io {
        context: format!("writing {}", path.display()),
        source: e,
    })
}

/// Plans, then trains the chosen plan; returns the exit code (0, 1 when nothing
/// fits, 128 + the signal when stopped by one).
fn train(args: &TrainArgs) -> oomfix::Result<u8> {
    let device = match args.plan.device {
        Target::Cpu => candle_core::Device::Cpu,
        Target::Cuda(i) => candle_core::Device::new_cuda(i).map_err(|e| {
            Error::Usage(format!(
                "cannot use cuda:{i}: {e} (this build needs --features cuda)"
            ))
        })?,
    };
    let (spec, result) = plan(&args.plan)?;
    let Some(chosen) = result.chosen() else {
        return Ok(NOTHING_FITS);
    };
    if let Some(save) = &args.save {
        // The resume file is not among the inputs: replacing it is the point.
        let mut inputs: Vec<&Path> = spec.files.iter().map(|p| p.as_path()).collect();
        inputs.extend(args.plan.model.as_deref());
        inputs.extend(args.data.as_deref());
        oomfix::output::check_output(save, &inputs)?;
    }
    let weights = match (&args.pretrained, &args.plan.model) {
        // A resumed run takes its weights from the checkpoint.
        (true, Some(_)) if args.resume.is_none() => Some(spec.files.clone()),
        (true, None) => return Err(Error::Usage("--pretrained needs a model file".into())),
        _ => None,
    };
    let mut options = TrainOptions::default();
    options.adamw.lr = args.lr;
    options.seed = args.seed;
    options.weights = weights;
    let mut trainer = Trainer::new(&spec.config, chosen.plan, &device, &options)?;
    let mut data = data_source(args, spec.config.vocab)?;
    if let Some(path) = &args.resume {
        trainer.resume(path, &mut data)?;
        tracing::info!(step = trainer.steps(), checkpoint = %path.display(), "resumed");
        eprintln!(
            "oomfix: resumed from {} at step {}",
            path.display(),
            trainer.steps()
        );
    }
    if (args.save.is_some() || args.resume.is_some()) && !trainer.saves_optimizer_state() {
        tracing::warn!(
            "the plan uses candle_nn::AdamW, whose moments cannot be read: checkpoints hold the weights, \
             step and data position but not the optimizer moments; a resumed run restarts them from zero"
        );
    }
    // The state on disk, as a step count: nothing to write again at that step.
    let mut saved_at = (args.save.is_some() && args.save == args.resume).then(|| trainer.steps());
    let save =
        |trainer: &Trainer, data: &DataSource, saved_at: &mut Option<u64>| -> oomfix::Result<()> {
            let Some(path) = &args.save else {
                return Ok(());
            };
            if *saved_at != Some(trainer.steps()) {
                trainer.save(path, data)?;
                tracing::info!(step = trainer.steps(), checkpoint = %path.display(), "saved");
                *saved_at = Some(trainer.steps());
            }
            Ok(())
        };
    let signal = stop_signals()?;
    let bar = progress_bar(args.steps, trainer.steps());
    while trainer.steps() < args.steps {
        if signal.load(Ordering::SeqCst) != 0 {
            break;
        }
        let stats = trainer.step(&mut data)?;
        report_step(&trainer, &stats, args.steps, bar.as_ref());
        if args.save_every.is_some_and(|n| trainer.steps() % n == 0) {
            save(&trainer, &data, &mut saved_at)?;
        }
    }
    if let Some(bar) = bar {
        bar.finish();
    }
    save(&trainer, &data, &mut saved_at)?;
    let stopped_by = signal.load(Ordering::SeqCst);
    if stopped_by == 0 || trainer.steps() >= args.steps {
        return Ok(SUCCESS);
    }
    let name = if stopped_by == signal_hook::consts::SIGINT as usize {
        "SIGINT"
    } else {
        "SIGTERM"
    };
    let saved = match &args.save {
        Some(path) => format!("checkpoint written to {}", path.display()),
        None => "no checkpoint written (no --save)".into(),
    };
    eprintln!(
        "oomfix: stopped by {name} after step {}; {saved}",
        trainer.steps()
    );
    Ok(128 + stopped_by as u8)
}

/// The training data `args` ask for.
fn data_source(args: &TrainArgs, vocab: usize) -> oomfix::Result<DataSource> {
    match &args.data {
        Some(path) => {
            let width = if args.u32_tokens {
                TokenWidth::U32
            } else {
                TokenWidth::U16
            };
            DataSource::from_file(path, width, vocab)
        }
        None => Ok(DataSource::synthetic(args.seed)),
    }
}

/// Makes SIGINT and SIGTERM stop training at the next step boundary: the
/// returned value becomes the signal's number. A second one exits at once with
/// 128 + its number.
fn stop_signals() -> oomfix::Result<Arc<AtomicUsize>> {
    use signal_hook::{consts, flag};
    let which = Arc::new(AtomicUsize::new(0));
    let pending = Arc::new(AtomicBool::new(false));
    let io = |e| Error::Io {
        context: "installing signal handlers".into(),
        source: e,
    };
    for sig in [consts::SIGINT, consts::SIGTERM] {
        // In this order: exit if one is already pending, else record it.
        flag::register_conditional_shutdown(sig, 128 + sig, Arc::clone(&pending)).map_err(io)?;
        flag::register_usize(sig, Arc::clone(&which), sig as usize).map_err(io)?;
        flag::register(sig, Arc::clone(&pending)).map_err(io)?;
    }
    Ok(which)
}

/// Logs a step and shows it on the progress bar (or as a line without one).
fn report_step(trainer: &Trainer, s: &StepStats, steps: u64, bar: Option<&indicatif::ProgressBar>) {
    let msg = format!(
        "loss {:.4}  {:.0} tok/s  peak {}{}",
        s.loss,
        s.tokens as f64 / s.seconds,
        oomfix::units::format_bytes(s.peak()),
        if s.skipped {
            "  (skipped: fp16 overflow)"
        } else {
            ""
        }
    );
    tracing::info!(
        step = trainer.steps(),
        loss = s.loss,
        tokens = s.tokens,
        seconds = s.seconds,
        forward_backward_peak_bytes = s.forward_backward_peak,
        optimizer_peak_bytes = s.optimizer_peak,
        skipped = s.skipped,
        "step"
    );
    match bar {
        Some(bar) => {
            bar.set_message(msg);
            bar.inc(1);
        }
        None => eprintln!("step {}/{steps}  {msg}", trainer.steps()),
    }
}

/// A progress bar at `done` of `steps` on a terminal; `None` otherwise (plain lines instead).
fn progress_bar(steps: u64, done: u64) -> Option<indicatif::ProgressBar> {
    use std::io::IsTerminal;
    if !std::io::stderr().is_terminal() {
        return None;
    }
    let bar = indicatif::ProgressBar::new(steps).with_position(done);
    let style = indicatif::ProgressStyle::with_template(
        "{bar:30} step {pos}/{len} {elapsed_precise}  {msg}",
    )
    .expect("valid template");
    bar.set_style(style);
    Some(bar)
}

/// The hidden `measure-step` command: measure one plan, print its peak bytes.
fn measure_step(args: &MeasureStepArgs) -> oomfix::Result<bool> {
    if let Some(limit) = args.address_space {
        oomfix::measure::limit_address_space(limit)?;
    }
    let plan: oomfix::Plan = serde_json::from_str(&args.plan)
        .map_err(|e| Error::Usage(format!("--plan is not a plan ({e}): {}", args.plan)))?;
    let config: oomfix::ModelConfig =
        serde_json::from_str(&args.config).map_err(|e| Error::Usage(format!("--config: {e}")))?;
    let spec = ModelSpec::from_config("measured", config);
    let m = oomfix::measure::measure_plan(&spec, &plan, Target::Cpu)?;
    println!("{} {}", m.peak_bytes, m.step_seconds.unwrap_or(f64::NAN));
    Ok(true)
}

/// Logs go to stderr (or `--log-file`), as text or JSON lines. The level is
/// `warn` by default, `info` with `-v` or when a log format or file is asked
/// for, `debug` with `-vv`, `error` with `-q`; `RUST_LOG` overrides.
fn init_logging(args: &LogArgs) -> anyhow::Result<()> {
    let level = match (args.quiet, args.verbose) {
        (q, _) if q > 0 => "error",
        (_, 0) if args.log_file.is_some() || args.log_format == LogFormat::Json => "info",
        (_, 0) => "warn",
        (_, 1) => "info",
        (_, 2) => "debug",
        _ => "trace",
    };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(level));
    let writer = match &args.log_file {
        Some(path) => {
            let file = std::fs::File::create(path)
                .with_context(|| format!("cannot create log file {}", path.display()))?;
            fmt::writer::BoxMakeWriter::new(std::sync::Mutex::new(file))
        }
        None => fmt::writer::BoxMakeWriter::new(std::io::stderr),
    };
    let builder = fmt()
        .with_env_filter(filter)
        .with_writer(writer)
        .with_target(false);
    match args.log_format {
        LogFormat::Json => builder
            .json()
            .with_current_span(true)
            .with_span_list(false)
            .init(),
        LogFormat::Pretty => builder.with_ansi(args.log_file.is_none()).init(),
    }
    Ok(())
}
