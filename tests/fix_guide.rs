//! The guide "A fix that changes what a block keeps" of strategies/README.md,
//! followed for a toy fix: each block's attention part dropped after the
//! forward and recomputed just before its backward. The fix is this file's
//! `RecomputeAttention` (one file) and the `.with(RecomputeAttention)` of
//! [`pipeline`] (one line); the memory and step-time models see it through
//! the block's description, on every family.
//!
//! The families' code does not run such a plan (no built-in fix asks for a
//! recomputed attention part), so only the models are checked here.

#[path = "common/estimate.rs"]
mod estimate;

use estimate::families;
use oomfix::block::{Block, Extent};
use oomfix::memory::activation_bytes;
use oomfix::memory::{Estimator, MemoryModel};
use oomfix::speed::step_work;
use oomfix::strategies::{
    Execution, Part, PartRun, Pipeline, Plan, Precision, SearchContext, Strategy,
};
use oomfix::{Headroom, ModelSpec, Planner, Target};

/// The toy fix: its setting is an extension of the plan.
struct RecomputeAttention;

const NAME: &str = "recompute-attention";

impl Strategy for RecomputeAttention {
    fn name(&self) -> &'static str {
        NAME
    }
    fn tighten(&self, plan: &Plan, _ctx: &SearchContext) -> Option<Plan> {
        let mut next = *plan;
        next.extensions.set(NAME, Some(1)).ok()?;
        (plan.extensions.get(NAME).is_none()).then_some(next)
    }
    fn relax(&self, plan: &Plan, _ctx: &SearchContext) -> Option<Plan> {
        let mut next = *plan;
        next.extensions.set(NAME, None).ok()?;
        plan.extensions.get(NAME).is_some().then_some(next)
    }
    fn execution(&self, plan: &Plan, exec: &mut Execution) {
        if plan.extensions.get(NAME).is_some() {
            exec.parts.attention = PartRun::Recomputed;
        }
    }
}

/// The built-in fixes and the toy one.
fn pipeline() -> Pipeline {
    Pipeline::default().with(RecomputeAttention)
}

fn toy(plan: &Plan) -> Plan {
    RecomputeAttention
        .tighten(plan, &SearchContext::new(plan.micro_batch, 2))
        .unwrap()
}

/// The attention part's tensors and products in the block's description
/// of `plan` (which keeps them).
fn attention_part(spec: &ModelSpec, plan: &Plan) -> (u64, u64, u64) {
    let exec = Execution::for_plan(plan, pipeline().strategies());
    let block = Block::describe(spec, plan, &exec);
    assert!(!block.recomputes(Part::Attention));
    let c = plan.precision.compute_bytes();
    let part = block.kept.iter().filter(|t| t.part == Part::Attention);
    let bytes = part.clone().map(|t| t.bytes(c)).sum();
    let elements = part
        .filter(|t| t.extent == Extent::Tokens)
        .map(|t| t.elements)
        .sum();
    let macs = block
        .products
        .iter()
        .filter(|p| p.part == Part::Attention)
        .map(|p| p.rows * p.inputs * p.outputs)
        .sum();
    (bytes, elements, macs)
}

#[test]
fn the_memory_model_keeps_two_outputs_in_place_of_the_attention_part() {
    for (name, config) in families() {
        let spec = ModelSpec::from_config(name, config);
        let layers = spec.config.layers as u64;
        let plain = Plan {
            precision: Precision::Bf16,
            ..Plan::baseline(2, 128)
        };
        let fixes = pipeline();
        let kept = |plan: &Plan| {
            activation_bytes(&spec, plan, &Execution::for_plan(plan, fixes.strategies())).kept
        };
        let (part_bytes, _, _) = attention_part(&spec, &plain);
        let n_h = 2 * 128 * spec.config.hidden as u64 * 2;
        let expected = kept(&plain) - layers * part_bytes + layers * 2 * n_h;
        assert_eq!(kept(&toy(&plain)), expected, "{name}");
        // Without the fix's line in the pipeline the setting means nothing.
        let builtins = Pipeline::default();
        let exec = Execution::for_plan(&toy(&plain), builtins.strategies());
        assert_eq!(
            activation_bytes(&spec, &toy(&plain), &exec).kept,
            kept(&plain),
            "{name}"
        );
    }
}

#[test]
fn the_step_time_model_runs_the_attention_part_once_more() {
    for (name, config) in families() {
        let spec = ModelSpec::from_config(name, config);
        let layers = spec.config.layers as f64;
        let plain = Plan::baseline(2, 128);
        let fixes = pipeline();
        let before = step_work(&spec, &plain, fixes.strategies());
        let after = step_work(&spec, &toy(&plain), fixes.strategies());
        let (_, elements, macs) = attention_part(&spec, &plain);
        let more = after.matmul_flops - before.matmul_flops;
        assert!(
            (more - 2.0 * layers * macs as f64).abs() <= 1e-6 * more,
            "{name}: {more} more flops for {macs} multiply-adds a block"
        );
        // Composed attention's two products run forward and twice in
        // backward; recomputed, once more.
        let ratio = after.attention_flops / before.attention_flops;
        assert!(
            (ratio - 4.0 / 3.0).abs() < 1e-9,
            "{name}: attention x{ratio}"
        );
        let bytes = after.elementwise_bytes - before.elementwise_bytes;
        assert_eq!(bytes, 4.0 * 2.0 * layers * elements as f64, "{name}");
    }
}

#[test]
fn the_planner_tightens_with_the_toy_fix_when_nothing_else_fits() {
    let (name, config) = families().into_iter().next().unwrap();
    let spec = ModelSpec::from_config(name, config);
    let plain = Plan::baseline(16, 256);
    let model = MemoryModel::registered(&pipeline());
    let target = Target::Cpu;
    let full = model.estimate(&spec, &plain, &target).peak;
    let recomputed = model.estimate(&spec, &toy(&plain), &target).peak;
    assert!(recomputed < full, "{recomputed} < {full}");
    let only_toy = Pipeline::new().with(RecomputeAttention);
    let result = Planner::new((recomputed + full) / 2)
        .pipeline(only_toy)
        .target(target)
        .global_batch(16)
        .seq_len(256)
        .headroom(Headroom {
            fixed: 0,
            fraction: 0.0,
        })
        .run(&spec)
        .unwrap();
    let chosen = result.chosen().expect("the toy fix makes it fit").plan;
    assert_eq!(chosen.extensions.get(NAME), Some(1));
}
