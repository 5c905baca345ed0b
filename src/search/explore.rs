//! From the first plan that fits, the plans one fix's step away, and the
//! fastest of those that fit; the way to it recorded as attempts.

use super::{Run, Verify};
use crate::Result;
use oomfix_strategies::{Plan, SearchContext};

/// How many plans the search estimates at most while looking for the fastest.
const MAX_EXPLORED: usize = 4096;
/// The fraction of the step time a more quantized LoRA base must save over
/// the fastest plan with a less quantized one to be chosen (4 bits, or 8-bit
/// absmax values, change the model's function; a modelled difference
/// smaller than this is within the step-time model's error).
const QUANTIZED_BASE_MIN_GAIN: f64 = 0.05;
/// How many of the fastest candidates a verifier measures.
const VERIFIED_CANDIDATES: usize = 3;

/// A plan estimated while exploring.
#[derive(Debug, Clone)]
pub(super) struct Explored {
    fits: bool,
    seconds: f64,
    peak: u64,
    from: Option<(Plan, String)>,
}

impl Run<'_> {
    /// From the first fitting attempt (`first`), every plan a fix's step away
    /// from a fitting one, transitively (at most [`MAX_EXPLORED`]): the index
    /// of the attempt of the fastest that fits, the way to it recorded. With a
    /// verifier the [`VERIFIED_CANDIDATES`] fastest are recorded (and so
    /// measured), and the fastest measured attempt that fits is chosen.
    pub(super) fn fastest(&mut self, first: usize, ctx: &SearchContext) -> Result<Option<usize>> {
        let p = self.planner;
        let start = self.attempts[first].plan;
        let mut queue = std::collections::VecDeque::from([start]);
        self.explored.insert(
            start,
            Explored {
                fits: true,
                seconds: self.attempts[first].time.total,
                peak: self.attempts[first].estimate.peak,
                from: None,
            },
        );
        while let Some(plan) = queue.pop_front() {
            for s in self.usable.iter().rev() {
                let moves = [
                    (s.relax(&plan, ctx), format!("relax {}", s.name())),
                    (s.tighten(&plan, ctx), s.name().to_string()),
                ];
                for (next, label) in moves {
                    let Some(next) = next.filter(|n| p.pins.admit(n)) else {
                        continue;
                    };
                    if self.explored.contains_key(&next) || self.explored.len() >= MAX_EXPLORED {
                        continue;
                    }
                    let estimate = self.estimator.estimate(self.spec, &next, &p.target);
                    let fits = self.estimate_fits(&estimate);
                    let seconds = self.time(&next).total;
                    self.explored.insert(
                        next,
                        Explored {
                            fits,
                            seconds,
                            peak: estimate.peak,
                            from: Some((plan, label)),
                        },
                    );
                    if fits {
                        queue.push_back(next);
                    }
                }
            }
        }
        // Fastest first; equal times (ZeRO 1 and 2 move the same bytes, say)
        // go to the less quantized LoRA base, then to the lower
        // peak, then to the plan's encoding: the same search always chooses
        // the same plan.
        let mut candidates: Vec<(Plan, f64, u64, String)> = self
            .explored
            .iter()
            .filter(|(_, e)| e.fits)
            .map(|(plan, e)| {
                (
                    *plan,
                    e.seconds,
                    e.peak,
                    serde_json::to_string(plan).unwrap_or_default(),
                )
            })
            .collect();
        let base = |p: &Plan| p.lora.map(|l| l.base);
        // A more quantized base only where it buys the fit or a step
        // [`QUANTIZED_BASE_MIN_GAIN`] faster than the least quantized base's
        // fastest within reach of it.
        let fastest = candidates.iter().map(|c| c.1).fold(f64::INFINITY, f64::min);
        let least = candidates
            .iter()
            .filter(|c| c.1 <= fastest * (1.0 + QUANTIZED_BASE_MIN_GAIN))
            .map(|c| base(&c.0))
            .min();
        if let Some(least) = least {
            candidates.retain(|c| base(&c.0) <= least);
        }
        candidates.sort_by(|a, b| {
            a.1.total_cmp(&b.1)
                .then_with(|| base(&a.0).cmp(&base(&b.0)))
                .then_with(|| a.2.cmp(&b.2))
                .then_with(|| a.3.cmp(&b.3))
        });
        let measuring = p.verifier.is_some() && p.verify != Verify::Off;
        let tried = if measuring { VERIFIED_CANDIDATES } else { 1 };
        let mut modelled_best = None;
        for (plan, ..) in candidates.into_iter().take(tried) {
            if let Some(index) = self.record_way(plan)? {
                modelled_best = modelled_best.or(Some(index));
            }
        }
        // Measured, the fastest measured attempt that fits (the candidates'
        // and any other fitting attempt measured on the way) wins; times
        // measured and modelled are not compared with each other.
        let measured_best = self
            .attempts
            .iter()
            .enumerate()
            .filter(|(_, a)| a.fits)
            .filter_map(|(i, a)| Some((i, a.measured_seconds()?)))
            .min_by(|a, b| a.1.total_cmp(&b.1))
            .map(|(i, _)| i);
        Ok(measured_best.or(modelled_best).or(Some(first)))
    }

    /// Records the way from the first fit to `plan` as attempts (those not
    /// yet recorded), and returns the index of `plan`'s attempt; `None` when a
    /// plan on the way does not fit once measured.
    fn record_way(&mut self, plan: Plan) -> Result<Option<usize>> {
        let mut way = vec![];
        let mut at = plan;
        while let Some(e) = self.explored.get(&at) {
            let Some((from, label)) = e.from.clone() else {
                break;
            };
            way.push((at, label));
            at = from;
        }
        let mut index = self.attempts.iter().rposition(|a| a.plan == at);
        for (step, label) in way.into_iter().rev() {
            let i = match self.attempts.iter().position(|a| a.plan == step) {
                Some(i) => i,
                None => {
                    self.evaluate(&label, step)?;
                    self.attempts.len() - 1
                }
            };
            if !self.attempts[i].fits {
                return Ok(None);
            }
            index = Some(i);
        }
        Ok(index)
    }
}
