//! Activation checkpointing: keep segment inputs, recompute segments in backward.

use crate::{Checkpointing, Plan, SearchContext, Strategy};

/// Planner half: checkpoint every block (keep only each block's input).
///
/// Every block is recomputed once in backward whatever the segment length, so
/// the only setting the search needs is per-block checkpointing, the most
/// frugal one when blocks dominate; relaxing removes checkpointing again.
/// Longer segments ([`Checkpointing::Every`] with `k > 1`) stay available to
/// library users.
#[derive(Debug, Clone, Copy, Default)]
pub struct Checkpoint;

impl Strategy for Checkpoint {
    fn name(&self) -> &'static str {
        "checkpoint"
    }
    fn tighten(&self, plan: &Plan, _ctx: &SearchContext) -> Option<Plan> {
        (plan.checkpoint == Checkpointing::None)
            .then_some(Plan { checkpoint: Checkpointing::Every(1), ..*plan })
    }
    fn relax(&self, plan: &Plan, _ctx: &SearchContext) -> Option<Plan> {
        (plan.checkpoint != Checkpointing::None).then_some(Plan { checkpoint: Checkpointing::None, ..*plan })
    }
}
