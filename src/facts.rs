//! What the fixes' hooks know of a model and a plan ([`ModelFacts`]), the
//! training state and the optimizer step they make of it, and the built-in
//! fixes: read by the memory model ([`crate::memory`]) and the time model
//! ([`crate::speed`]) alike.

use crate::spec::{Family, ModelSpec};
use oomfix_strategies::{Execution, ModelFacts, Plan, StateBytes, StepCost, Strategy};
use std::sync::{Arc, OnceLock};

/// The built-in fixes ([`oomfix_strategies::builtins`]), made once.
pub fn builtins() -> &'static [Arc<dyn Strategy>] {
    static BUILTINS: OnceLock<Vec<Arc<dyn Strategy>>> = OnceLock::new();
    BUILTINS.get_or_init(oomfix_strategies::builtins)
}

/// What the built-in fixes' execution hooks make a pass of `plan` do
/// ([`Execution::for_plan`]).
pub fn builtin_execution(plan: &Plan) -> Execution {
    Execution::for_plan(plan, builtins())
}

/// What the fixes' hooks know of `spec` before any fix: every parameter
/// trained, and the linear projections of its first block (2-D `.weight`
/// tensors, named by their module, the last part of the path before
/// `weight`; GPT-2's `Conv1D` weights are `[in, out]`, the others `[out, in]`).
pub fn model_facts(spec: &ModelSpec) -> ModelFacts {
    let c = &spec.config;
    let mut facts = ModelFacts::new(spec.parameters(), spec.largest_tensor(), c.layers)
        .with_block_parameters(c.block_parameters())
        .with_looked_up(c.looked_up_embedding());
    for t in &spec.tensors {
        let module = t
            .name
            .strip_suffix(".weight")
            .and_then(|m| m.rsplit('.').next());
        let (Some(module), &[rows, cols]) = (module, t.shape.as_slice()) else {
            continue;
        };
        if crate::spec::ModelConfig::block_of(&t.name) != Some(0) {
            continue;
        }
        let (inputs, outputs) = match spec.config.family {
            Family::Gpt2 => (rows, cols),
            _ => (cols, rows),
        };
        facts = facts.with_linear(module, inputs as u64, outputs as u64);
    }
    facts
}

/// The training state's bytes of `plan` on one rank: the unfixed state,
/// changed by each of `fixes`' memory hooks in order.
pub fn state_bytes(spec: &ModelSpec, plan: &Plan, fixes: &[Arc<dyn Strategy>]) -> StateBytes {
    trained_state(spec, plan, fixes).1
}

/// The facts of what `plan` trains of `spec` (every parameter, or under
/// `lora` the adapters) and the training state's bytes
/// ([`oomfix_strategies::memory::state_of`]).
pub fn trained_state(
    spec: &ModelSpec,
    plan: &Plan,
    fixes: &[Arc<dyn Strategy>],
) -> (ModelFacts, StateBytes) {
    oomfix_strategies::memory::state_of(plan, &model_facts(spec), fixes)
}

/// What `plan`'s optimizer step costs on one rank: the unfixed step,
/// changed by each of `fixes`' time hooks in order.
pub fn step_cost(spec: &ModelSpec, plan: &Plan, fixes: &[Arc<dyn Strategy>]) -> StepCost {
    let facts = trained_facts(spec, plan, fixes);
    let mut cost = StepCost::unfixed(plan, &facts);
    for fix in fixes {
        fix.time(plan, &facts, &mut cost);
    }
    cost
}

/// What the fixes' hooks know of what `plan` trains of `spec`: every
/// parameter, or under `lora` the adapters (the base model frozen).
pub fn trained_facts(spec: &ModelSpec, plan: &Plan, fixes: &[Arc<dyn Strategy>]) -> ModelFacts {
    let mut facts = model_facts(spec);
    for fix in fixes {
        fix.facts(plan, &mut facts);
    }
    facts
}
