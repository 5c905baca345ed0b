//! Activation checkpointing: keep block inputs, recompute the block in backward.

use crate::{Checkpointing, Plan, SearchContext, Strategy};

/// Planner half: checkpoint every 4th block, then every 2nd, then every block.
#[derive(Debug, Clone, Copy, Default)]
pub struct Checkpoint;

/// The intervals tried, from least to most frugal.
const INTERVALS: [usize; 3] = [4, 2, 1];

fn intervals(layers: usize) -> impl Iterator<Item = usize> {
    INTERVALS.into_iter().filter(move |&k| k == 1 || k < layers)
}

impl Strategy for Checkpoint {
    fn name(&self) -> &'static str {
        "checkpoint"
    }
    fn tighten(&self, plan: &Plan, ctx: &SearchContext) -> Option<Plan> {
        let next = match plan.checkpoint {
            Checkpointing::None => intervals(ctx.layers).next()?,
            Checkpointing::Every(k) => intervals(ctx.layers).find(|&j| j < k)?,
        };
        Some(Plan { checkpoint: Checkpointing::Every(next), ..*plan })
    }
    fn relax(&self, plan: &Plan, ctx: &SearchContext) -> Option<Plan> {
        let Checkpointing::Every(k) = plan.checkpoint else { return None };
        let checkpoint = match intervals(ctx.layers).filter(|&j| j > k).last() {
            Some(j) => Checkpointing::Every(j),
            None => Checkpointing::None,
        };
        Some(Plan { checkpoint, ..*plan })
    }
}
