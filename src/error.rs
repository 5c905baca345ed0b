//! The library's error type.

use std::path::PathBuf;

/// Everything that can go wrong in oomfix's library.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A weights file, directory or index that cannot be used; names the path and the problem.
    #[error("{}: {msg}", path.display())]
    Input {
        /// The offending file or directory.
        path: PathBuf,
        /// What is wrong with it, in one line.
        msg: String,
    },
    /// An invalid option or combination of options (the message names no
    /// command-line flag: a command line adds its own hint).
    #[error("{0}")]
    Usage(String),
    /// A failure while running that is not the input's fault: a measurement
    /// that failed, an output that could not be written or rendered.
    #[error("{0}")]
    Runtime(String),
    /// A failure in a strategy's mechanism.
    #[error(transparent)]
    Strategy(#[from] oomfix_strategies::Error),
    /// A failure inside candle.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    /// Training produced a NaN or infinite loss.
    #[error("step {step}: the loss is {loss}; training stopped")]
    NonFinite {
        /// The 1-based optimizer step.
        step: u64,
        /// The loss value.
        loss: f32,
    },
    /// An I/O failure not tied to an input file (writing outputs, …).
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The underlying error.
        source: std::io::Error,
    },
}

impl Error {
    /// An input error for `path`.
    pub fn input(path: impl Into<PathBuf>, msg: impl Into<String>) -> Self {
        Error::Input {
            path: path.into(),
            msg: msg.into(),
        }
    }
    /// Whether this error is the user's input or usage (exit code 2) rather
    /// than a failure while running (exit code 3): a bad file, a bad option,
    /// a pipeline naming an unknown fix.
    pub fn is_input(&self) -> bool {
        matches!(
            self,
            Error::Input { .. }
                | Error::Usage(_)
                | Error::Strategy(oomfix_strategies::Error::Config(_))
        )
    }
}

/// Result with oomfix's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
