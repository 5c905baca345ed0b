//! `train`'s progress: a bar on a terminal, else one line per step (text
//! logs) or the `step` events (JSON logs).

use super::logging;
use oomfix::train::{Evaluation, StepStats};

/// Where each step is shown.
pub struct Progress {
    bar: Option<indicatif::ProgressBar>,
    steps: u64,
}

/// A spinner with `message` while something long runs before the first
/// step (the model's build), on a terminal that is not carrying JSON logs;
/// cleared when dropped. Elsewhere nothing: the `ready to train` event
/// tells when it ended.
pub fn spinner(message: String) -> Option<Spinner> {
    shows_bars().then(|| {
        let bar = indicatif::ProgressBar::new_spinner().with_message(message);
        bar.enable_steady_tick(std::time::Duration::from_millis(120));
        Spinner(bar)
    })
}

/// Whether stderr is a terminal that is not carrying JSON logs: where bars
/// and spinners show.
fn shows_bars() -> bool {
    use std::io::IsTerminal;
    std::io::stderr().is_terminal() && !logging::stderr_json()
}

/// A spinner shown until dropped ([`spinner`]).
pub struct Spinner(indicatif::ProgressBar);

impl Drop for Spinner {
    fn drop(&mut self) {
        self.0.finish_and_clear();
    }
}

impl Progress {
    /// Progress towards `steps`, `done` already. A bar when stderr is a
    /// terminal that is not carrying JSON logs.
    pub fn new(steps: u64, done: u64) -> Progress {
        let bar = shows_bars().then(|| {
            let bar = indicatif::ProgressBar::new(steps).with_position(done);
            let style = indicatif::ProgressStyle::with_template(
                "{bar:30} step {pos}/{len} {elapsed_precise}  {msg}",
            )
            .expect("valid template");
            bar.set_style(style);
            bar
        });
        Progress { bar, steps }
    }

    /// Logs step `step` (a `step` event with its numbers) and shows it.
    pub fn step(&self, step: u64, s: &StepStats) {
        tracing::info!(
            step,
            total_steps = self.steps,
            loss = s.loss,
            lr = s.lr,
            grad_norm = s.grad_norm,
            tokens = s.tokens,
            seconds = s.seconds,
            forward_backward_peak_bytes = s.forward_backward_peak,
            optimizer_peak_bytes = s.optimizer_peak,
            skipped = s.skipped,
            collective_calls = s.collectives.calls,
            collective_bytes = s.collectives.bytes,
            collective_seconds = s.collectives.seconds,
            "step"
        );
        let msg = format!(
            "loss {:.4}  lr {:.3e}  grad norm {:.3}  {:.0} tok/s  peak {}{}",
            s.loss,
            s.lr,
            s.grad_norm,
            s.tokens as f64 / s.seconds,
            oomfix::units::format_bytes(s.peak()),
            if s.skipped {
                "  (skipped: fp16 overflow)"
            } else {
                ""
            }
        );
        match &self.bar {
            Some(bar) => {
                bar.set_message(msg);
                bar.inc(1);
            }
            None => logging::say(format_args!("step {step}/{}  {msg}", self.steps)),
        }
    }

    /// Logs an evaluation (an `eval` event) and shows it.
    pub fn eval(&self, e: &Evaluation) {
        tracing::info!(
            step = e.step,
            eval_loss = e.loss,
            perplexity = e.perplexity,
            batches = e.batches,
            tokens = e.tokens,
            seconds = e.seconds,
            peak_bytes = e.peak,
            "eval"
        );
        let msg = format!(
            "eval after step {}: loss {:.4}  perplexity {:.2}  ({} batches, peak {})",
            e.step,
            e.loss,
            e.perplexity,
            e.batches,
            oomfix::units::format_bytes(e.peak)
        );
        match &self.bar {
            Some(bar) => bar.println(msg),
            None => logging::say(format_args!("{msg}")),
        }
    }

    /// Leaves the bar at its last state.
    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish();
        }
    }
}
