//! Logs, notices and the final error.
//!
//! Logs go to stderr (or `--log-file`), as text or, with `--log-format json`,
//! one JSON object per line. When JSON logs go to stderr, *everything* the
//! binary says there is such a line: notices ("no model given", "resumed",
//! "stopped by SIGTERM") are `info` events, `train`'s progress is its `step`
//! events, and the error that ends the run is an `error` event with an
//! `exit_code` field. Otherwise notices and the error are plain `oomfix: …`
//! lines on stderr, whatever the log level; with `--log-file` they are also
//! events in the file.
//!
//! Colours only when the logs go to a terminal and `NO_COLOR` is unset.

use super::args::{LogArgs, LogFormat};
use super::Failure;
use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use tracing_subscriber::prelude::*;
use tracing_subscriber::{fmt, EnvFilter, Layer, Registry};

/// Whether stderr carries JSON logs.
static STDERR_JSON: AtomicBool = AtomicBool::new(false);
/// Whether the logs go to a file.
static TO_FILE: AtomicBool = AtomicBool::new(false);
/// This process's rank in a job of several, or `usize::MAX`.
static RANK: AtomicUsize = AtomicUsize::new(usize::MAX);

/// Sets this process's rank in a job of several: `oomfix:` lines become
/// `oomfix[rank N]:` and the final error event carries a `rank` field (log
/// events carry it through the `rank` span the binary enters).
pub fn set_rank(rank: Option<usize>) {
    RANK.store(rank.unwrap_or(usize::MAX), Ordering::Relaxed);
}

fn rank() -> Option<usize> {
    Some(RANK.load(Ordering::Relaxed)).filter(|&r| r != usize::MAX)
}

/// Whether stderr carries JSON lines (`--log-format json` without `--log-file`).
pub fn stderr_json() -> bool {
    STDERR_JSON.load(Ordering::Relaxed)
}

fn to_file() -> bool {
    TO_FILE.load(Ordering::Relaxed)
}

type BoxedLayer = Box<dyn Layer<Registry> + Send + Sync>;

/// Sets up logging as `args` ask. The level is `warn` by default, `info` with
/// `-v` or when a log format or file is asked for, `debug` with `-vv`,
/// `error` with `-q`; `RUST_LOG` overrides. When the log file cannot be
/// created, logging is set up on stderr (to report that) and the error returned.
pub fn init(args: &LogArgs) -> Result<(), Failure> {
    let json = args.log_format == LogFormat::Json;
    let level = match (args.quiet, args.verbose) {
        (q, _) if q > 0 => "error",
        (_, 0) if args.log_file.is_some() || json => "info",
        (_, 0) => "warn",
        (_, 1) => "info",
        (_, 2) => "debug",
        _ => "trace",
    };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(level));
    let file = match &args.log_file {
        Some(path) => match std::fs::File::create(path) {
            Ok(f) => Some(f),
            Err(e) => {
                install(json, None, filter);
                return Err(Failure::Usage(format!(
                    "cannot create log file {}: {}",
                    path.display(),
                    super::io_text(&e)
                )));
            }
        },
        None => None,
    };
    install(json, file, filter);
    Ok(())
}

/// Logging for a usage error found before the arguments parsed: stderr, as
/// JSON lines when argv asked for them.
pub fn init_for_usage_error(json: bool) {
    install(json, None, EnvFilter::new("error"));
}

fn install(json: bool, file: Option<std::fs::File>, filter: EnvFilter) {
    let to_file = file.is_some();
    STDERR_JSON.store(json && !to_file, Ordering::Relaxed);
    TO_FILE.store(to_file, Ordering::Relaxed);
    let writer = match file {
        Some(f) => fmt::writer::BoxMakeWriter::new(std::sync::Mutex::new(f)),
        None => fmt::writer::BoxMakeWriter::new(std::io::stderr),
    };
    let layer: BoxedLayer = if json {
        // A rank's records list their spans too: the `rank` span is then in
        // every record, also those of a span inside it (an attempt's).
        fmt::layer()
            .json()
            .with_current_span(true)
            .with_span_list(rank().is_some())
            .with_target(false)
            .with_ansi(false)
            .with_writer(writer)
            .with_filter(filter)
            .boxed()
    } else {
        let ansi = !to_file
            && std::io::stderr().is_terminal()
            && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
        fmt::layer()
            .with_target(false)
            .with_ansi(ansi)
            .with_writer(writer)
            .with_filter(filter)
            .boxed()
    };
    // A second initialisation (never happens in the binary) keeps the first.
    let _ = tracing_subscriber::registry().with(layer).try_init();
}

/// Tells the user something: an `oomfix: {msg}` line on stderr, or an `info`
/// event when stderr carries JSON logs (also an event when logs go to a file).
pub fn notice(msg: impl std::fmt::Display) {
    if stderr_json() || to_file() {
        tracing::info!("{msg}");
    }
    say(format_args!("oomfix: {msg}"));
}

/// A line on stderr, unless stderr carries JSON logs: for messages that are
/// also a structured event. A failed write to stderr is ignored.
pub fn say(line: std::fmt::Arguments<'_>) {
    if !stderr_json() {
        let line = line.to_string();
        let line = match (rank(), line.strip_prefix("oomfix: ")) {
            (Some(r), Some(rest)) => format!("oomfix[rank {r}]: {rest}"),
            _ => line,
        };
        let _ = writeln!(std::io::stderr().lock(), "{line}");
    }
}

/// Reports the failure that ends the run and returns its exit code: an
/// `oomfix: …` line on stderr, or an `error` event with the exit code when
/// stderr carries JSON logs (also an event when logs go to a file).
pub fn report(failure: &Failure) -> u8 {
    let code = failure.code();
    tracing::debug!(?failure, "failed");
    let text = failure.to_string();
    let text = without_backtrace(&text);
    if stderr_json() || to_file() {
        match rank() {
            Some(rank) => tracing::error!(exit_code = code, rank, "{text}"),
            None => tracing::error!(exit_code = code, "{text}"),
        }
    }
    say(format_args!("oomfix: {text}"));
    code
}

/// `message` without the backtrace a library error may carry (candle's, when
/// `RUST_BACKTRACE` is set): the lines from the first numbered frame on.
pub fn without_backtrace(message: &str) -> &str {
    let frame = |line: &str| {
        let t = line.trim_start();
        line.len() > t.len()
            && t.split_once(": ")
                .is_some_and(|(n, _)| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
    };
    let mut end = message.len();
    let mut at = 0;
    for line in message.split_inclusive('\n') {
        if frame(line) {
            end = at;
            break;
        }
        at += line.len();
    }
    message[..end].trim_end()
}

#[cfg(test)]
mod tests {
    use super::without_backtrace;

    #[test]
    fn a_backtrace_is_cut_from_a_message() {
        let with = "DriverError(CUDA_ERROR_DEINITIALIZED, \"x\")\n   0: <unknown>\n   1: main\n             at src/main.rs:3";
        assert_eq!(
            without_backtrace(with),
            "DriverError(CUDA_ERROR_DEINITIALIZED, \"x\")"
        );
        for plain in [
            "one line",
            "two lines\nthe second: 3 of them",
            "step 2: loss NaN",
        ] {
            assert_eq!(without_backtrace(plain), plain);
        }
    }
}
