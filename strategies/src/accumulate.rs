//! Smaller micro-batches with gradient accumulation, global batch held constant.

use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};

use crate::{Error, Plan, Result, SearchContext, Strategy};

/// Planner half: step the micro-batch down through the divisors of the per-rank
/// batch, raising the accumulation count so the global batch stays the same.
#[derive(Debug, Clone, Copy, Default)]
pub struct Accumulate;

/// Sequences each rank processes per optimizer step.
pub fn per_rank_batch(plan: &Plan) -> usize {
    plan.micro_batch * plan.grad_accum
}

/// Divisors of `n` in ascending order.
pub fn divisors(n: usize) -> Vec<usize> {
    (1..=n).filter(|d| n % d == 0).collect()
}

fn with_micro_batch(plan: &Plan, micro: usize) -> Plan {
    let per_rank = per_rank_batch(plan);
    Plan { micro_batch: micro, grad_accum: per_rank / micro, ..*plan }
}

impl Strategy for Accumulate {
    fn name(&self) -> &'static str {
        "accumulate"
    }
    fn tighten(&self, plan: &Plan, _ctx: &SearchContext) -> Option<Plan> {
        let next = divisors(per_rank_batch(plan)).into_iter().rev().find(|&d| d < plan.micro_batch)?;
        Some(with_micro_batch(plan, next))
    }
    fn relax(&self, plan: &Plan, _ctx: &SearchContext) -> Option<Plan> {
        let next = divisors(per_rank_batch(plan)).into_iter().find(|&d| d > plan.micro_batch)?;
        Some(with_micro_batch(plan, next))
    }
}

// ---------------------------------------------------------------------------
// Mechanism: gradient accumulation.

/// The gradients of `vars` from a [`GradStore`], detached (so they do not pin
/// the forward graph once the store and the loss are dropped), in the order of
/// `vars`. A var without a gradient is an error naming its position.
pub fn collect_grads(store: &GradStore, vars: &[Var]) -> Result<Vec<Tensor>> {
    vars.iter()
        .enumerate()
        .map(|(i, v)| {
            store
                .get(v.as_tensor())
                .map(Tensor::detach)
                .ok_or_else(|| Error::Config(format!("var {i} (shape {:?}) received no gradient", v.shape())))
        })
        .collect()
}
