//! SIGINT and SIGTERM during `train`: stop at the next step boundary (after
//! writing the checkpoint with `--save`); a second signal exits at once.

use super::Failure;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

/// The first stop signal received, if any.
pub struct StopSignals {
    which: Arc<AtomicUsize>,
}

impl StopSignals {
    /// Installs the handlers: the first SIGINT or SIGTERM is recorded, a
    /// second one exits the process at once with 128 + its number.
    pub fn install() -> Result<StopSignals, Failure> {
        use signal_hook::{consts, flag};
        let which = Arc::new(AtomicUsize::new(0));
        let pending = Arc::new(AtomicBool::new(false));
        let io = |e: std::io::Error| {
            Failure::Run(format!(
                "installing signal handlers: {}",
                super::io_text(&e)
            ))
        };
        for sig in [consts::SIGINT, consts::SIGTERM] {
            // In this order: exit if one is already pending, else record it.
            flag::register_conditional_shutdown(sig, 128 + sig, Arc::clone(&pending))
                .map_err(io)?;
            flag::register_usize(sig, Arc::clone(&which), sig as usize).map_err(io)?;
            flag::register(sig, Arc::clone(&pending)).map_err(io)?;
        }
        Ok(StopSignals { which })
    }

    /// The signal received (its number), if any.
    pub fn received(&self) -> Option<i32> {
        match self.which.load(Ordering::SeqCst) {
            0 => None,
            sig => Some(sig as i32),
        }
    }
}

/// A stop signal's name.
pub fn name(sig: i32) -> &'static str {
    match sig {
        signal_hook::consts::SIGINT => "SIGINT",
        signal_hook::consts::SIGTERM => "SIGTERM",
        _ => "a signal",
    }
}
