//! A fused, in-place AdamW step.

use crate::{OptimizerImpl, Plan, SearchContext, Strategy};

/// Planner half: replace `candle_nn::AdamW` with the fused in-place step.
#[derive(Debug, Clone, Copy, Default)]
pub struct FusedAdamWStrategy;

impl Strategy for FusedAdamWStrategy {
    fn name(&self) -> &'static str {
        "fused-adamw"
    }
    fn tighten(&self, plan: &Plan, _ctx: &SearchContext) -> Option<Plan> {
        (plan.optimizer != OptimizerImpl::FusedAdamW)
            .then_some(Plan { optimizer: OptimizerImpl::FusedAdamW, ..*plan })
    }
}
