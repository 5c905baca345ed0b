//! The end-of-run summary of `oomfix train`, as text and as JSON.

use crate::measure::timeline::PoolTrace;
use crate::train::{Evaluation, StepStats};
use crate::units::{format_bytes, group_digits};
use serde_json::{json, Value};

/// What a training run did, gathered step by step.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TrainSummary {
    /// Optimizer steps taken by this run (a resumed run's earlier steps are
    /// not counted).
    pub steps: u64,
    /// The trainer's step count at the end (with the resumed steps).
    pub last_step: u64,
    /// Tokens trained on by this run (all ranks).
    pub tokens: u64,
    /// Wall time of the steps and evaluations, in seconds.
    pub seconds: f64,
    /// The training loss of the first and of the last step of this run.
    pub first_loss: Option<f32>,
    /// See [`first_loss`](Self::first_loss).
    pub last_loss: Option<f32>,
    /// The peak learning rate and where it came from (`--lr`, or which
    /// default).
    pub lr: Option<(f64, String)>,
    /// The first evaluation of this run (before its first step, when
    /// there is evaluation data).
    pub first_eval: Option<Evaluation>,
    /// The last evaluation.
    pub eval: Option<Evaluation>,
    /// The highest measured peak of a step or an evaluation (`None` when
    /// nothing was measured: no counting allocator).
    pub peak_bytes: Option<u64>,
    /// The plan's estimated peak.
    pub estimated_peak_bytes: u64,
    /// With several ranks: each rank's highest measured peak, by rank
    /// ([`peak_bytes`](Self::peak_bytes) is then the largest).
    pub rank_peak_bytes: Vec<u64>,
    /// The CUDA pool over the steps `--snapshot` / `--plot` recorded (this
    /// rank's).
    pub recorded_pool: Option<PoolSummary>,
    /// How long the run took to reach its first step.
    pub startup: Option<Startup>,
}

/// A run's start-up: from the process's start to its first step (the
/// first step's own one-off costs, such as compiling GPU kernels, are in
/// the step).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Startup {
    /// Seconds from the process's start to the first step.
    pub seconds: f64,
    /// Of those, the seconds the trainer took to build: the model's weights
    /// read or drawn, quantized and moved to the device.
    pub build_seconds: f64,
}

/// The CUDA pool over recorded steps: its peaks and the fragmentation at
/// the allocated peak.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolSummary {
    /// The highest used (allocated) bytes.
    pub allocated_peak: u64,
    /// Reserved bytes at that moment.
    pub reserved_at_peak: u64,
    /// The highest reserved bytes.
    pub reserved_peak: u64,
    /// Device memory outside the pool (context, modules, cuBLAS).
    pub outside: u64,
}

impl PoolSummary {
    /// Reserved minus allocated at the allocated peak: the pool's cached,
    /// free memory then.
    pub fn fragmentation(&self) -> u64 {
        self.reserved_at_peak.saturating_sub(self.allocated_peak)
    }
}

impl From<&PoolTrace> for PoolSummary {
    fn from(p: &PoolTrace) -> Self {
        let at = p.at_used_peak();
        PoolSummary {
            allocated_peak: at.used,
            reserved_at_peak: at.reserved,
            reserved_peak: p.reserved_peak(),
            outside: p.outside,
        }
    }
}

impl TrainSummary {
    /// An empty summary of a run of a plan whose estimated peak is
    /// `estimated_peak_bytes`.
    pub fn new(estimated_peak_bytes: u64) -> Self {
        TrainSummary {
            estimated_peak_bytes,
            ..Default::default()
        }
    }

    /// Adds step `step` (the trainer's count after it).
    pub fn record_step(&mut self, step: u64, s: &StepStats) {
        self.steps += 1;
        self.last_step = step;
        self.tokens += s.tokens as u64;
        self.seconds += s.seconds;
        self.first_loss.get_or_insert(s.loss);
        self.last_loss = Some(s.loss);
        self.record_peak(s.peak());
    }

    /// Adds an evaluation.
    pub fn record_eval(&mut self, e: &Evaluation) {
        self.seconds += e.seconds;
        self.first_eval.get_or_insert(*e);
        self.eval = Some(*e);
        self.record_peak(e.peak);
    }

    /// Takes every rank's highest peak (by rank): the run's peak is the largest.
    pub fn record_rank_peaks(&mut self, peaks: Vec<u64>) {
        self.peak_bytes = peaks.iter().copied().filter(|&p| p > 0).max();
        self.rank_peak_bytes = peaks;
    }

    fn record_peak(&mut self, peak: u64) {
        if peak > 0 {
            self.peak_bytes = Some(self.peak_bytes.map_or(peak, |p| p.max(peak)));
        }
    }

    /// Training tokens per second of step time.
    pub fn tokens_per_second(&self) -> f64 {
        if self.seconds > 0.0 {
            self.tokens as f64 / self.seconds
        } else {
            0.0
        }
    }
}

/// The summary as lines under the plan's table (`trained`, `loss`, `eval`,
/// `peak`).
pub fn train_summary_text(s: &TrainSummary) -> String {
    let mut out = format!(
        "\ntrained {} steps, {} tokens in {:.2} s ({:.0} tokens/s)\n",
        group_digits(s.steps),
        group_digits(s.tokens),
        s.seconds,
        s.tokens_per_second()
    );
    if let Some(start) = &s.startup {
        out += &format!(
            "start   {:.1} s to the first step (the model built in {:.1} s)\n",
            start.seconds, start.build_seconds
        );
    }
    if let Some((lr, source)) = &s.lr {
        out += &format!("lr      {lr:e} ({source})\n");
    }
    if let (Some(first), Some(last)) = (s.first_loss, s.last_loss) {
        out += &format!(
            "loss    {first:.4} at step {} -> {last:.4} at step {}\n",
            s.last_step + 1 - s.steps,
            s.last_step
        );
    }
    if let Some(e) = &s.eval {
        let from = match &s.first_eval {
            Some(f) if f.step != e.step => format!(
                "{:.4} (perplexity {:.2}) at step {} -> ",
                f.loss, f.perplexity, f.step
            ),
            _ => String::new(),
        };
        out += &format!(
            "eval    loss {from}{:.4}, perplexity {:.2} after step {} ({} batches, {} tokens)\n",
            e.loss,
            e.perplexity,
            e.step,
            e.batches,
            group_digits(e.tokens as u64)
        );
    }
    if let Some(peak) = s.peak_bytes {
        let (ranks, per_rank) = if s.rank_peak_bytes.len() > 1 {
            let each: Vec<String> = s.rank_peak_bytes.iter().map(|&p| format_bytes(p)).collect();
            (
                format!(" (the largest rank's; by rank: {})", each.join(", ")),
                " per rank",
            )
        } else {
            (String::new(), "")
        };
        out += &format!(
            "peak    {} measured{ranks}, {} estimated{per_rank} ({:.0}%)\n",
            format_bytes(peak),
            format_bytes(s.estimated_peak_bytes),
            100.0 * peak as f64 / s.estimated_peak_bytes.max(1) as f64
        );
    }
    if let Some(p) = &s.recorded_pool {
        out += &format!(
            "pool    recorded steps: allocated peak {}, reserved then {}, fragmentation {} \
             (largest free block not reported by CUDA); reserved peak {}; outside the pool {}\n",
            format_bytes(p.allocated_peak),
            format_bytes(p.reserved_at_peak),
            format_bytes(p.fragmentation()),
            format_bytes(p.reserved_peak),
            format_bytes(p.outside)
        );
    }
    out
}

/// The summary as the `training` object of `train --json`.
pub fn train_summary_json(s: &TrainSummary) -> Value {
    json!({
        "steps": s.steps,
        "last_step": s.last_step,
        "tokens": s.tokens,
        "seconds": s.seconds,
        "tokens_per_second": s.tokens_per_second(),
        "startup_seconds": s.startup.map(|s| s.seconds),
        "build_seconds": s.startup.map(|s| s.build_seconds),
        "lr": s.lr.as_ref().map(|l| l.0),
        "lr_source": s.lr.as_ref().map(|l| l.1.as_str()),
        "first_loss": s.first_loss,
        "last_loss": s.last_loss,
        "first_eval": s.first_eval.as_ref().map(eval_json),
        "eval": s.eval.as_ref().map(eval_json),
        "peak_bytes": s.peak_bytes,
        "rank_peak_bytes": (s.rank_peak_bytes.len() > 1).then_some(&s.rank_peak_bytes),
        "estimated_peak_bytes": s.estimated_peak_bytes,
        "recorded_pool": s.recorded_pool.map(|p| json!({
            "allocated_peak_bytes": p.allocated_peak,
            "reserved_at_peak_bytes": p.reserved_at_peak,
            "fragmentation_bytes": p.fragmentation(),
            "reserved_peak_bytes": p.reserved_peak,
            "outside_pool_bytes": p.outside,
        })),
    })
}

fn eval_json(e: &Evaluation) -> Value {
    json!({
        "step": e.step,
        "loss": e.loss,
        "perplexity": e.perplexity,
        "batches": e.batches,
        "tokens": e.tokens,
        "peak_bytes": (e.peak > 0).then_some(e.peak),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_recorded_pool_is_in_the_text_and_the_json() {
        let mut s = TrainSummary::new(1 << 30);
        assert!(!train_summary_text(&s).contains("pool"));
        assert!(train_summary_json(&s)["recorded_pool"].is_null());
        let trace = PoolTrace {
            samples: vec![(0, 100, 100), (5, 700, 800), (9, 300, 900)],
            used_high: 700,
            reserved_high: 900,
            outside: 50,
        };
        s.recorded_pool = Some(PoolSummary::from(&trace));
        let text = train_summary_text(&s);
        assert!(
            text.contains("allocated peak 700 B, reserved then 800 B, fragmentation 100 B"),
            "{text}"
        );
        assert!(
            text.contains("reserved peak 900 B; outside the pool 50 B"),
            "{text}"
        );
        let j = train_summary_json(&s);
        assert_eq!(j["recorded_pool"]["fragmentation_bytes"], 100);
        assert_eq!(j["recorded_pool"]["reserved_peak_bytes"], 900);
    }
}
