//! The learning rate over a run: a linear warmup, then constant, linear or
//! cosine decay to zero at the last step (the Hugging Face Trainer's
//! `lr_scheduler_type` names; nanoGPT's warmup).

/// The peak learning rate `oomfix train` uses from a random initialisation
/// (`--lr` not given): nanoGPT's and the GPT-2/3 papers' order for small
/// models trained from scratch.
pub const RANDOM_INIT_LR: f64 = 3e-4;

/// The peak learning rate `oomfix train` uses when it starts from
/// pretrained weights (`--lr` not given): the Hugging Face Trainer's
/// default, which keeps a fine-tune near the weights it starts from (at
/// [`RANDOM_INIT_LR`] a few steps overwrite what the model knew).
pub const PRETRAINED_LR: f64 = 5e-5;

/// The default peak learning rate for a run that starts from pretrained
/// weights (`pretrained`) or from a random initialisation.
pub fn default_lr(pretrained: bool) -> f64 {
    if pretrained {
        PRETRAINED_LR
    } else {
        RANDOM_INIT_LR
    }
}

/// How the learning rate falls after the warmup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Decay {
    /// It stays at the peak.
    #[default]
    Constant,
    /// Linearly to 0 at the last step.
    Linear,
    /// Along half a cosine to 0 at the last step.
    Cosine,
}

impl std::str::FromStr for Decay {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "constant" => Ok(Decay::Constant),
            "linear" => Ok(Decay::Linear),
            "cosine" => Ok(Decay::Cosine),
            _ => Err(format!(
                "unknown schedule `{s}` (expected constant, linear or cosine)"
            )),
        }
    }
}

/// A learning-rate schedule as a factor of the peak rate.
///
/// ```
/// use oomfix::train::{Decay, LrSchedule};
/// let s = LrSchedule { warmup_steps: 2, decay: Decay::Linear, total_steps: 6 };
/// let factors: Vec<f64> = (0..6).map(|step| s.factor(step)).collect();
/// // warmup (step + 1) / (warmup + 1), then linear from 1 down to 0 at the end
/// assert_eq!(factors, [1.0 / 3.0, 2.0 / 3.0, 1.0, 0.75, 0.5, 0.25]);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LrSchedule {
    /// Steps of linear warmup from `peak / (warmup + 1)` to the peak.
    pub warmup_steps: u64,
    /// How the rate falls afterwards.
    pub decay: Decay,
    /// The run's optimizer steps (the decay reaches 0 after the last).
    pub total_steps: u64,
}

impl LrSchedule {
    /// The factor of the peak rate at optimizer step `step` (0-based: the
    /// step about to be taken).
    pub fn factor(&self, step: u64) -> f64 {
        if step < self.warmup_steps {
            return (step + 1) as f64 / (self.warmup_steps + 1) as f64;
        }
        let span = self.total_steps.saturating_sub(self.warmup_steps).max(1) as f64;
        let progress = ((step - self.warmup_steps) as f64 / span).clamp(0.0, 1.0);
        match self.decay {
            Decay::Constant => 1.0,
            Decay::Linear => 1.0 - progress,
            Decay::Cosine => 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()),
        }
    }

    /// The learning rate at optimizer step `step` for a peak rate of `peak`.
    pub fn rate(&self, peak: f64, step: u64) -> f64 {
        peak * self.factor(step)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cosine_starts_at_the_peak_and_ends_near_zero() {
        let s = LrSchedule {
            warmup_steps: 0,
            decay: Decay::Cosine,
            total_steps: 100,
        };
        assert_eq!(s.factor(0), 1.0);
        assert!((s.factor(50) - 0.5).abs() < 1e-12);
        assert!(s.factor(99) < 0.001);
        let constant = LrSchedule::default();
        assert!((0..10).all(|i| constant.factor(i) == 1.0));
        assert!("triangle".parse::<Decay>().is_err());
    }
}
