//! The `oomfix` binary's own code (not part of the library's API): the
//! command line, logging, the commands, the training loop's policy (saving,
//! resuming, signals, progress) and the mapping of outcomes to exit codes.
//!
//! * [`args`]: clap types and the parse (options before or after the subcommand);
//! * [`logging`]: `tracing` setup, notices and the final error, as text or JSON lines;
//! * [`plan`], [`inspect`], [`train`], [`measure`]: one module per command;
//! * [`job`], [`launch`]: `train` as one rank of several, and as their launcher;
//! * [`signals`], [`progress`]: what `train` does on SIGINT/SIGTERM and how it shows progress;
//! * [`data`], [`timeline`]: the data files `train` reads; the `--snapshot` and `--plot` files.

pub mod args;
pub mod data;
pub mod inspect;
pub mod job;
pub mod launch;
pub mod logging;
pub mod measure;
pub mod plan;
pub mod progress;
pub mod signals;
pub mod timeline;
pub mod train;

use std::fmt;
use std::io::Write;
use std::path::Path;
use std::process::ExitCode;
use std::sync::OnceLock;
use std::time::Instant;

static STARTED: OnceLock<Instant> = OnceLock::new();

/// The process's start, as `main` first marks it: `train` reports its
/// start-up from there.
pub fn started() -> Instant {
    *STARTED.get_or_init(Instant::now)
}

/// How a command that ran to its end finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// A plan fits; `inspect` succeeded; `train` ran all its steps (0).
    Done,
    /// Nothing fits the budget (1).
    NothingFits,
    /// `train` stopped by this signal at a step boundary (128 + the signal).
    Signal(i32),
}

/// Exit code of a usage or input error.
pub const USAGE: u8 = 2;
/// Exit code of a failure while running.
pub const FAILURE: u8 = 3;

impl Exit {
    /// [`Exit::Done`] when `fits`, else [`Exit::NothingFits`].
    pub fn fits(fits: bool) -> Exit {
        if fits {
            Exit::Done
        } else {
            Exit::NothingFits
        }
    }

    /// The process exit code.
    pub fn code(self) -> u8 {
        match self {
            Exit::Done => 0,
            Exit::NothingFits => 1,
            Exit::Signal(sig) => (128 + sig) as u8,
        }
    }
}

impl From<Exit> for ExitCode {
    fn from(e: Exit) -> ExitCode {
        ExitCode::from(e.code())
    }
}

/// Why a command did not run to its end.
#[derive(Debug)]
pub enum Failure {
    /// A bad option or combination of options (exit 2).
    Usage(String),
    /// A failure while running, outside the library (exit 3).
    Run(String),
    /// Writing a result failed (exit 3).
    Write {
        /// What was being written.
        what: String,
        /// Why it failed.
        source: std::io::Error,
    },
    /// The library's error: an input or usage error (exit 2) or a failure
    /// while running (exit 3), as [`oomfix::Error::is_input`] says.
    Lib(oomfix::Error),
}

impl Failure {
    /// The process exit code.
    pub fn code(&self) -> u8 {
        match self {
            Failure::Usage(_) => USAGE,
            Failure::Run(_) | Failure::Write { .. } => FAILURE,
            Failure::Lib(e) if e.is_input() => USAGE,
            Failure::Lib(_) => FAILURE,
        }
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::Usage(msg) | Failure::Run(msg) => f.write_str(msg),
            Failure::Write { what, source } => write!(f, "writing {what}: {}", io_text(source)),
            Failure::Lib(e) => write!(f, "{e}"),
        }
    }
}

impl From<oomfix::Error> for Failure {
    fn from(e: oomfix::Error) -> Failure {
        Failure::Lib(e)
    }
}

/// The result of a command.
pub type Outcome = Result<Exit, Failure>;

/// An I/O error as one lower-case phrase: `no such file or directory`.
pub fn io_text(e: &std::io::Error) -> String {
    let text = e.to_string();
    let text = match text.find(" (os error") {
        Some(i) => &text[..i],
        None => &text,
    };
    let mut chars = text.chars();
    match chars.next() {
        Some(c) => c.to_lowercase().chain(chars).collect(),
        None => String::new(),
    }
}

/// Writes a command's result to stdout. A closed pipe (`oomfix … | head`) is
/// not an error: the rest is dropped and the exit code stays the command's.
/// Any other failure (a full disk) is exit 3.
pub fn print_stdout(text: &str) -> Result<(), Failure> {
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        Err(e) => Err(Failure::Write {
            what: "the result to stdout".into(),
            source: e,
        }),
    }
}

/// Checks, before any work, that `output` can be written: not one of
/// `inputs`, in an existing directory ([`oomfix::output::check_output`]), and
/// that a file can be created in that directory ([`check_can_create`]).
pub fn check_writable(output: &Path, inputs: &[&Path]) -> Result<(), Failure> {
    oomfix::output::check_output(output, inputs)?;
    check_can_create(output, false)
}

/// Checks that a file (`dir`: a directory) can be created beside `output`,
/// so that a read-only or special directory is refused now, not after the
/// run.
pub fn check_can_create(output: &Path, dir: bool) -> Result<(), Failure> {
    let parent = output
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let mut check = tempfile::Builder::new();
    check.prefix(".oomfix-write-check.");
    let created = if dir {
        check.tempdir_in(parent).map(drop)
    } else {
        check.tempfile_in(parent).map(drop)
    };
    created.map_err(|e| {
        Failure::Usage(format!(
            "cannot write {}: {}",
            output.display(),
            io_text(&e)
        ))
    })
}
