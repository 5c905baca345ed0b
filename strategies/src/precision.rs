//! Mixed precision: 16-bit compute, fp32 master weights, dynamic loss scaling.

use crate::{Plan, Precision, SearchContext, Strategy};

/// Planner half: switch fp32 compute to bf16 (or f16 with loss scaling where
/// the device has no bf16).
#[derive(Debug, Clone, Copy, Default)]
pub struct MixedPrecision;

impl Strategy for MixedPrecision {
    fn name(&self) -> &'static str {
        "precision"
    }
    fn tighten(&self, plan: &Plan, ctx: &SearchContext) -> Option<Plan> {
        if plan.precision != Precision::F32 {
            return None;
        }
        let precision = if ctx.supports_bf16 { Precision::Bf16 } else { Precision::F16 };
        Some(Plan { precision, ..*plan })
    }
}
