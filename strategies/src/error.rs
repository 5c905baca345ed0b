/// Errors from the strategies' mechanisms.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An error from candle.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    /// An invalid configuration (unknown strategy name, bad hyper-parameter, …).
    #[error("{0}")]
    Config(String),
    /// The operation is not implemented for this device, dtype or layout.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// A collective operation between ranks failed.
    #[error("communication failed: {0}")]
    Comm(String),
}

/// Result with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
