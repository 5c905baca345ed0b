//! The `oomfix` command: parse arguments, call the library, map outcomes to exit codes
//! (0: a plan fits, 1: nothing fits, 2: usage or input error).

use anyhow::Context;
use clap::Parser;
use oomfix::cli::{Cli, Command, HalfArg, LogArgs, LogFormat, PlanArgs, VerifyArg};
use oomfix::{inspect, report, ModelSpec, Pipeline, Planner, Verify};
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
        Some(Command::Plan(args)) => plan(&args),
        None => plan(&cli.plan),
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

/// Runs the search and prints its result; `Ok(fits)`.
fn plan(args: &PlanArgs) -> oomfix::Result<bool> {
    let budget = args.budget.ok_or_else(|| {
        oomfix::Error::Usage("a budget is required, e.g. --budget 8GiB (see --help)".into())
    })?;
    let spec = match &args.model {
        Some(path) => inspect::inspect(path)?,
        None => ModelSpec::default_model(),
    };
    if args.model.is_none() && !args.json {
        eprintln!("oomfix: no model given; planning for the {}", spec.source);
    }
    let pipeline = Pipeline::from_names(&args.strategies).map_err(|e| oomfix::Error::Usage(e.to_string()))?;
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
        let _ = (mode, Verify::All, VerifyArg::All);
        return Err(oomfix::Error::Usage("--verify is not built yet".into()));
    }
    let result = planner.run(&spec)?;
    if args.json {
        println!("{:#}", report::search_json(&spec, &result));
    } else {
        print!("{}", report::search_table(&spec, &result));
    }
    Ok(result.fits())
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
