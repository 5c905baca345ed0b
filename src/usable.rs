//! Whether a plan's fixes can run on a model and a device: each fix's own
//! rule ([`Strategy::unusable`]), asked for the fixes a plan uses. The
//! search asks it of the fields the user pins (a pin no fix can honour is
//! refused, naming its flag), the trainer of the plan it runs.

use oomfix_strategies::{Attention, Plan, Precision, SearchContext, Strategy};
use std::sync::Arc;

/// A fix a plan uses that may need the model's or the device's help.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct InUse {
    /// The fix's name ([`Strategy::name`]).
    pub fix: &'static str,
    /// The plan field it sets, as [`crate::Pins::names`] names it.
    pub field: &'static str,
    /// The command-line option that pins it.
    pub flag: String,
}

/// The fixes `plan` uses of those that may need help: 16-bit compute,
/// flash attention, the loss in chunks, checkpointing, the checkpointed
/// inputs on the host, the MLP in tiles.
pub(crate) fn in_use(plan: &Plan) -> Vec<InUse> {
    let uses = [
        (
            plan.precision.is_mixed(),
            "precision",
            "precision",
            format!("--precision {}", plan.precision),
        ),
        (
            plan.attention == Attention::Flash,
            "flash-attention",
            "attention",
            "--attention flash".into(),
        ),
        (
            plan.chunked_loss,
            "chunked-loss",
            "chunked_loss",
            "--loss chunked".into(),
        ),
        (
            !plan.checkpoint.segments(1).is_empty(),
            "checkpoint",
            "checkpoint",
            "--checkpoint".into(),
        ),
        (
            plan.offload_activations,
            "offload-activations",
            "offload_activations",
            "--activations host".into(),
        ),
        (
            plan.mlp_tile.is_some(),
            "tiled-mlp",
            "mlp_tile",
            "--mlp-tile".into(),
        ),
    ];
    uses.into_iter()
        .filter(|(used, ..)| *used)
        .map(|(_, fix, field, flag)| InUse { fix, field, flag })
        .collect()
}

/// The first fix `plan` uses (of those `asked` selects) that its rule in
/// `fixes` says cannot run in `ctx`, with the rule's reason: a predicate
/// ("needs a GPU: …") that follows the fix's name or flag. The 16-bit type
/// asked about is the plan's own.
pub(crate) fn first_unusable(
    plan: &Plan,
    ctx: &SearchContext,
    fixes: &[Arc<dyn Strategy>],
    asked: impl Fn(&InUse) -> bool,
) -> Option<(InUse, String)> {
    let mut ctx = *ctx;
    if plan.precision.is_mixed() {
        ctx.supports_bf16 = plan.precision == Precision::Bf16;
    }
    in_use(plan).into_iter().filter(asked).find_map(|used| {
        let fix = fixes.iter().find(|f| f.name() == used.fix)?;
        let reason = fix.unusable(&ctx)?;
        Some((used, reason))
    })
}
