//! The margin a plan must leave below the budget: its parsing, printing
//! and the defaults measured on each device.

use crate::memory::Target;
use serde::Serialize;

/// How much of the budget a plan must leave unused: the estimate's margin of
/// error, so that a plan reported as fitting does not run out of memory. A
/// fixed part and a part proportional to the estimated peak, as the
/// estimate's misses are: a few allocations it does not model (the same
/// size whatever the model) and a fraction of what it does.
///
/// ```
/// use oomfix::Headroom;
///
/// let h: Headroom = "1MiB+1%".parse().unwrap();
/// assert_eq!(h, Headroom { fixed: 1 << 20, fraction: 0.01 });
/// assert_eq!(h.bytes(100 << 20), 2 << 20);
/// assert_eq!("5%".parse::<Headroom>().unwrap(), Headroom::fraction(0.05));
/// assert_eq!("512MiB".parse::<Headroom>().unwrap(), Headroom::fixed(512 << 20));
/// assert_eq!(h.to_string(), "1.00 MiB + 1%");
/// assert_eq!("7%".parse::<Headroom>().unwrap().to_string(), "7%");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Headroom {
    /// Bytes kept whatever the estimate.
    pub fixed: u64,
    /// A fraction of the estimated peak kept besides (0.05: 5%).
    pub fraction: f64,
}

/// The default headroom of CPU plans, from docs/accuracy.md's 270
/// configurations: the estimate's largest misses are a fixed amount (at
/// most 1.33 MB below the measured peak, from 11 MB to 570 MB estimates;
/// 7.1% of the smallest), so 1% of the estimate leaves at most 0.70 MiB
/// uncovered, rounded up to 1 MiB.
pub const CPU_HEADROOM: Headroom = Headroom {
    fixed: 1 << 20,
    fraction: 0.01,
};

/// The default headroom of CUDA plans, from what the device held beyond the
/// estimate: the pool's *reserved* peak plus the memory outside it, against
/// this model's estimates, over 254 H200 steps (the accuracy matrix measured
/// twice, docs/pool-reserve-gpu.md; the GPT-2 small and Llama-160M sweeps,
/// docs/sweep.md). The pool's reserve varies from run to run (one
/// configuration reserved 368 MiB beyond its live bytes in one run, 656 MiB
/// in the next): 192 MiB + 3% of the estimate covers every step but two
/// (GPT-2 small at 4 × 2 in fp32, composed attention and every block
/// checkpointed, which reserved 635 MiB more than estimated, 11%).
pub const CUDA_HEADROOM: Headroom = Headroom {
    fixed: 192 << 20,
    fraction: 0.03,
};

impl Headroom {
    /// No headroom: the estimate itself must fit.
    pub const NONE: Headroom = Headroom {
        fixed: 0,
        fraction: 0.0,
    };

    /// A headroom of `bytes` whatever the estimate.
    pub fn fixed(bytes: u64) -> Headroom {
        Headroom {
            fixed: bytes,
            ..Headroom::NONE
        }
    }

    /// A headroom of `fraction` of the estimated peak (0.05: 5%).
    pub fn fraction(fraction: f64) -> Headroom {
        Headroom {
            fraction,
            ..Headroom::NONE
        }
    }

    /// The headroom taken when none is set: measured from the estimate's
    /// error on `target` ([`CPU_HEADROOM`], [`CUDA_HEADROOM`]).
    pub fn default_for(target: &Target) -> Headroom {
        match target {
            Target::Cpu => CPU_HEADROOM,
            Target::Cuda(_) => CUDA_HEADROOM,
        }
    }

    /// Bytes to keep free above an estimated peak of `peak` bytes.
    pub fn bytes(&self, peak: u64) -> u64 {
        let proportional = (peak as f64 * self.fraction.max(0.0)).ceil() as u64;
        self.fixed.saturating_add(proportional)
    }
}

impl std::fmt::Display for Headroom {
    /// `1.00 MiB + 1%`, `5%`, `512.00 MiB`, `0`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let pct = format!("{}%", (self.fraction * 1e4).round() / 100.0);
        match (self.fixed, self.fraction > 0.0) {
            (0, false) => f.write_str("0"),
            (0, true) => f.write_str(&pct),
            (b, false) => f.write_str(&crate::units::format_bytes(b)),
            (b, true) => write!(f, "{} + {pct}", crate::units::format_bytes(b)),
        }
    }
}

impl std::str::FromStr for Headroom {
    type Err = String;
    /// `5%`, `0.5GiB`, `512MiB`, a number of bytes, `0`, or a size and a
    /// percentage joined by `+` (`64MiB+1%`).
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let invalid = || {
            format!(
                "`{s}` is not a headroom (a percentage from 0% to below 100%, a size, \
                 or both joined by `+`, e.g. 64MiB+1%)"
            )
        };
        let mut headroom = Headroom::NONE;
        let (mut sized, mut pct) = (false, false);
        for term in s.split('+').map(str::trim) {
            if let Some(p) = term.strip_suffix('%') {
                match p.trim().parse::<f64>() {
                    Ok(p) if !pct && p.is_finite() && (0.0..100.0).contains(&p) => {
                        headroom.fraction = p / 100.0;
                        pct = true;
                    }
                    _ => return Err(invalid()),
                }
            } else if !sized {
                headroom.fixed = crate::units::parse_bytes(term).map_err(|_| invalid())?;
                sized = true;
            } else {
                return Err(invalid());
            }
        }
        Ok(headroom)
    }
}
