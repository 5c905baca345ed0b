//! ZeRO-style naive sharding of optimizer state, gradients and parameters.

use crate::accumulate::divisors;
use crate::{Plan, SearchContext, Sharding, Strategy};

/// Planner half: spread training over `gpus` ranks, sharding optimizer state
/// (stage 1), then gradients (stage 2), then parameters (stage 3).
#[derive(Debug, Clone, Copy, Default)]
pub struct Shard;

fn with_stage(plan: &Plan, world_size: usize, stage: u8) -> Option<Plan> {
    let global = plan.global_batch();
    if global % world_size != 0 {
        return None;
    }
    let per_rank = global / world_size;
    // keep the micro-batch if it still divides the per-rank batch, else the largest that does
    let micro = divisors(per_rank).into_iter().filter(|&d| d <= plan.micro_batch).last()?;
    Some(Plan {
        micro_batch: micro,
        grad_accum: per_rank / micro,
        shard: Sharding { world_size, stage },
        ..*plan
    })
}

impl Strategy for Shard {
    fn name(&self) -> &'static str {
        "shard"
    }
    fn tighten(&self, plan: &Plan, ctx: &SearchContext) -> Option<Plan> {
        if ctx.gpus < 2 || plan.shard.stage >= 3 {
            return None;
        }
        with_stage(plan, ctx.gpus, plan.shard.stage + 1)
    }
    fn relax(&self, plan: &Plan, _ctx: &SearchContext) -> Option<Plan> {
        if plan.shard.stage <= 1 {
            return None;
        }
        with_stage(plan, plan.shard.world_size, plan.shard.stage - 1)
    }
}
