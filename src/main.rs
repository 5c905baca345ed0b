//! The `oomfix` command: parse arguments, call the library, map outcomes to exit codes
//! (0: a plan fits, 1: nothing fits, 2: usage or input error).

use anyhow::Context;
use clap::Parser;
use oomfix::cli::{Cli, Command, HalfArg, LogArgs, LogFormat, MeasureStepArgs, PlanArgs, TrainArgs, VerifyArg};
use oomfix::measure::{CountingAlloc, StepVerifier};
use oomfix::train::data::{DataSource, TokenWidth};
use oomfix::train::{TrainOptions, Trainer};
use oomfix::{inspect, report, Error, ModelSpec, Pipeline, Planner, SearchResult, Target, Verify};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;
use std::process::ExitCode;
use tracing_subscriber::{fmt, EnvFilter};

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Err(err) = init_logging(&cli.log) {
        eprintln!("oomfix: {err:#}");
        return ExitCode::from(2);
    }
    let outcome = match cli.command {
        Some(Command::Inspect(args)) => inspect::inspect(&args.model).map(|spec| {
            let text = if args.json {
                format!("{:#}\n", report::inspect_json(&spec))
            } else {
                report::inspect_text(&spec)
            };
            print!("{text}");
            true
        }),
        Some(Command::Plan(args)) => plan(&args).map(|(_, result)| result.fits()),
        Some(Command::Train(args)) => train(&args),
        Some(Command::MeasureStep(args)) => measure_step(&args),
        None => plan(&cli.plan).map(|(_, result)| result.fits()),
    };
    match outcome {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(err) => {
            tracing::debug!(?err, "failed");
            eprintln!("oomfix: {err}");
            ExitCode::from(2)
        }
    }
}

/// Runs the search and prints its result.
fn plan(args: &PlanArgs) -> oomfix::Result<(ModelSpec, SearchResult)> {
    let budget = args.budget.ok_or_else(|| Error::Usage("a budget is required, e.g. --budget 8GiB (see --help)".into()))?;
    let spec = match &args.model {
        Some(path) => inspect::inspect(path)?,
        None => ModelSpec::default_model(),
    };
    if args.model.is_none() && !args.json {
        eprintln!("oomfix: no model given; planning for the {}", spec.source);
    }
    let pipeline = Pipeline::from_names(&args.strategies).map_err(|e| Error::Usage(e.to_string()))?;
    let mut planner = Planner::new(budget)
        .global_batch(args.global_batch)
        .target(args.device)
        .gpus(args.gpus)
        .pipeline(pipeline)
        .half_precision(match args.precision {
            HalfArg::Auto => None,
            HalfArg::Bf16 => Some(oomfix::strategies::Precision::Bf16),
            HalfArg::Fp16 => Some(oomfix::strategies::Precision::F16),
        });
    if let Some(n) = args.seq_len {
        planner = planner.seq_len(n);
    }
    if let Some(mode) = args.verify {
        let verifier = match args.device {
            Target::Cpu => {
                let exe = std::env::current_exe().map_err(|e| Error::Io { context: "locating oomfix".into(), source: e })?;
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

/// Measures the chosen (or closest) plan with its allocations recorded and
/// writes `--snapshot` and `--plot`.
fn timeline_outputs(args: &PlanArgs, spec: &ModelSpec, result: &SearchResult, budget: u64) -> oomfix::Result<()> {
    if args.device != Target::Cpu {
        return Err(Error::Usage("--snapshot and --plot record host allocations: use --device cpu".into()));
    }
    for out in [&args.snapshot, &args.plot].into_iter().flatten() {
        if args.model.as_deref().is_some_and(|m| same_file(m, out)) {
            return Err(Error::Usage(format!("refusing to write over the model file {}", out.display())));
        }
    }
    let attempt = result.chosen().unwrap_or_else(|| result.closest());
    let (m, timeline) = oomfix::measure::record_plan(spec, &attempt.plan, Target::Cpu)?;
    if timeline.truncated {
        tracing::warn!("the step made more than {} allocations; the timeline is cut", oomfix::measure::MAX_EVENTS);
    }
    tracing::info!(measured_bytes = m.peak_bytes, events = timeline.events.len(), "recorded {}", attempt.plan);
    if let Some(path) = &args.snapshot {
        oomfix::output::write_atomic(path, &report::snapshot_pickle(&timeline))?;
    }
    if let Some(path) = &args.plot {
        let title = format!("{}: {}", spec.source, attempt.plan);
        let svg = report::timeline_svg(&timeline, budget, &title).map_err(Error::Usage)?;
        oomfix::output::write_atomic(path, svg.as_bytes())?;
    }
    Ok(())
}

fn same_file(a: &std::path::Path, b: &std::path::Path) -> bool {
    matches!((a.canonicalize(), b.canonicalize()), (Ok(x), Ok(y)) if x == y)
}

/// Plans, then trains the chosen plan; `Ok(false)` when nothing fits.
fn train(args: &TrainArgs) -> oomfix::Result<bool> {
    let device = match args.plan.device {
        Target::Cpu => candle_core::Device::Cpu,
        Target::Cuda(i) => candle_core::Device::new_cuda(i)
            .map_err(|e| Error::Usage(format!("cannot use cuda:{i}: {e} (this build needs --features cuda)")))?,
    };
    let (spec, result) = plan(&args.plan)?;
    let Some(chosen) = result.chosen() else { return Ok(false) };
    let weights = match (&args.pretrained, &args.plan.model) {
        (true, Some(_)) => Some(spec.files.clone()),
        (true, None) => return Err(Error::Usage("--pretrained needs a model file".into())),
        (false, _) => None,
    };
    let options = TrainOptions {
        adamw: candle_nn::ParamsAdamW { lr: args.lr, ..Default::default() },
        seed: args.seed,
        weights,
    };
    let mut trainer = Trainer::new(&spec.config, chosen.plan, &device, &options)?;
    let mut data = match &args.data {
        Some(path) => {
            let width = if args.u32_tokens { TokenWidth::U32 } else { TokenWidth::U16 };
            DataSource::from_file(path, width, spec.config.vocab)?
        }
        None => DataSource::synthetic(args.seed),
    };
    let bar = progress_bar(args.steps);
    for _ in 0..args.steps {
        let s = trainer.step(&mut data)?;
        let msg = format!(
            "loss {:.4}  {:.0} tok/s  peak {}{}",
            s.loss,
            s.tokens as f64 / s.seconds,
            oomfix::units::format_bytes(s.peak()),
            if s.skipped { "  (skipped: fp16 overflow)" } else { "" }
        );
        tracing::info!(step = trainer.steps(), loss = s.loss, tokens = s.tokens, seconds = s.seconds,
                       forward_backward_peak_bytes = s.forward_backward_peak,
                       optimizer_peak_bytes = s.optimizer_peak, skipped = s.skipped, "step");
        match &bar {
            Some(bar) => {
                bar.set_message(msg);
                bar.inc(1);
            }
            None => eprintln!("step {}/{}  {msg}", trainer.steps(), args.steps),
        }
    }
    if let Some(bar) = bar {
        bar.finish();
    }
    Ok(true)
}

/// A progress bar on a terminal; `None` otherwise (plain lines instead).
fn progress_bar(steps: u64) -> Option<indicatif::ProgressBar> {
    use std::io::IsTerminal;
    if !std::io::stderr().is_terminal() {
        return None;
    }
    let bar = indicatif::ProgressBar::new(steps);
    let style = indicatif::ProgressStyle::with_template("{bar:30} step {pos}/{len} {elapsed_precise}  {msg}")
        .expect("valid template");
    bar.set_style(style);
    Some(bar)
}

/// The hidden `measure-step` command: measure one plan, print its peak bytes.
fn measure_step(args: &MeasureStepArgs) -> oomfix::Result<bool> {
    if let Some(limit) = args.address_space {
        oomfix::measure::limit_address_space(limit)?;
    }
    let plan = oomfix::measure::parse_plan_arg(&args.plan)?;
    let config: oomfix::ModelConfig =
        serde_json::from_str(&args.config).map_err(|e| Error::Usage(format!("--config: {e}")))?;
    let spec = ModelSpec::from_config("measured", config);
    let m = oomfix::measure::measure_plan(&spec, &plan, Target::Cpu)?;
    println!("{}", m.peak_bytes);
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
    let builder = fmt().with_env_filter(filter).with_writer(writer).with_target(false);
    match args.log_format {
        LogFormat::Json => builder.json().with_current_span(true).with_span_list(false).init(),
        LogFormat::Pretty => builder.with_ansi(args.log_file.is_none()).init(),
    }
    Ok(())
}
