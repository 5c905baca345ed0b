//! A fix that is not built in, registered from outside the crates: its
//! planner half, memory hook and execution hook all take part in a search and
//! a training step (the guide: strategies/README.md).

mod common;

use oomfix::strategies::{
    registered, Checkpointing, Execution, ModelFacts, Pipeline, Plan, SearchContext, StateBytes,
    Strategy,
};
use oomfix::train::data::DataSource;
use oomfix::train::{TrainOptions, Trainer};
use oomfix::{Estimator, Headroom, MemoryModel, ModelSpec, Planner, Target};

/// A toy tenth fix: keeps the optimizer's moments in half the bytes and
/// recomputes every block in backward. Its setting lives in the plan's
/// extensions under its name.
struct Squeeze;

const NAME: &str = "squeeze";

impl Strategy for Squeeze {
    fn name(&self) -> &'static str {
        NAME
    }
    fn tighten(&self, plan: &Plan, _ctx: &SearchContext) -> Option<Plan> {
        if plan.extensions.get(NAME).is_some() {
            return None;
        }
        let mut next = *plan;
        next.extensions.set(NAME, Some(1)).ok()?;
        Some(next)
    }
    fn memory(&self, plan: &Plan, _model: &ModelFacts, state: &mut StateBytes) {
        if plan.extensions.get(NAME).is_some() {
            state.optimizer_state /= 2;
        }
    }
    fn execution(&self, plan: &Plan, exec: &mut Execution) {
        if plan.extensions.get(NAME).is_some() {
            exec.checkpoint = Checkpointing::Every(1);
        }
    }
}

#[test]
fn a_fix_from_outside_takes_part_in_the_search() {
    let spec = ModelSpec::from_config("tiny", common::tiny_gpt2());
    let pipeline = Pipeline::new().with(Squeeze);
    let plain = Plan::baseline(4, 64);
    let squeezed = Squeeze
        .tighten(&plain, &search_context())
        .expect("one step to offer");
    let estimate = |p: &Plan| MemoryModel::registered(&pipeline).estimate(&spec, p, &Target::Cpu);
    // The memory hook halves the moments, and nothing else of the state.
    let (before, after) = (estimate(&plain), estimate(&squeezed));
    assert_eq!(after.optimizer_state * 2, before.optimizer_state);
    assert_eq!(after.weights, before.weights);
    assert!(after.peak < before.peak);
    // Without the hook registered, the extension changes nothing.
    assert_eq!(MemoryModel.estimate(&spec, &squeezed, &Target::Cpu), before);

    // A budget between the two: the baseline does not fit, the squeezed plan
    // does (no headroom: the budget is set from the estimates themselves).
    let budget = (before.peak + after.peak) / 2;
    let result = Planner::new(budget)
        .headroom(Headroom::NONE)
        .global_batch(4)
        .seq_len(64)
        .target(Target::Cpu)
        .pipeline(pipeline.clone())
        .run(&spec)
        .unwrap();
    let names: Vec<&str> = result
        .attempts
        .iter()
        .map(|a| a.strategy.as_str())
        .collect();
    assert_eq!(names, ["baseline", NAME]);
    let chosen = result.chosen().expect("the squeezed plan fits");
    assert_eq!(chosen.plan.extensions.get(NAME), Some(1));
    assert_eq!(chosen.estimate, after);

    // The plan's one encoding carries the setting, and reads back.
    let json = serde_json::to_string(&chosen.plan).unwrap();
    assert!(json.contains(r#""extensions":{"squeeze":1}"#), "{json}");
    assert_eq!(serde_json::from_str::<Plan>(&json).unwrap(), chosen.plan);
}

#[test]
fn a_fix_from_outside_changes_the_training_step() {
    let pipeline = Pipeline::default().with(Squeeze);
    let mut plan = Plan::baseline(2, 16);
    plan.extensions.set(NAME, Some(1)).unwrap();
    let exec = Execution::for_plan(&plan, &registered(&pipeline));
    assert_eq!(exec.checkpoint, Checkpointing::Every(1));
    assert_eq!(
        Execution::for_plan(&plan, &oomfix::strategies::builtins()).checkpoint,
        Checkpointing::None
    );

    let mut options = TrainOptions::default();
    options.fixes = registered(&pipeline);
    let device = candle_core::Device::Cpu;
    let mut trainer = Trainer::new(&common::tiny_gpt2(), plan, &device, &options).unwrap();
    assert_eq!(trainer.execution().checkpoint, Checkpointing::Every(1));
    let mut data = DataSource::synthetic(0);
    let stats = trainer.step(&mut data).unwrap();
    assert!(stats.loss.is_finite() && stats.loss > 0.0);

    // The same step without the fix's hook gives the same loss: recomputing
    // blocks changes memory, not the function.
    let mut plain = Trainer::new(
        &common::tiny_gpt2(),
        plan,
        &device,
        &TrainOptions::default(),
    )
    .unwrap();
    assert_eq!(plain.execution().checkpoint, Checkpointing::None);
    let plain_stats = plain.step(&mut DataSource::synthetic(0)).unwrap();
    assert!((plain_stats.loss - stats.loss).abs() < 1e-5);
}

fn search_context() -> SearchContext {
    let mut ctx = SearchContext::new(4, 2);
    ctx.supports_bf16 = false;
    ctx.host_offload = false;
    ctx
}

/// The fix's recomputation reaches every estimate as the built-in
/// checkpoint fix's does: the squeezed plan's activations and modelled step
/// time equal those of the plan checkpointed every block by the built-in
/// fix (the moments aside), and differ from the plain plan's.
#[test]
fn a_fix_from_outside_that_recomputes_every_block_is_estimated_as_checkpointing() {
    let spec = ModelSpec::from_config("tiny", common::tiny_gpt2());
    let pipeline = Pipeline::default().with(Squeeze);
    let model = MemoryModel::registered(&pipeline);
    let plain = Plan::baseline(4, 64);
    let mut squeezed = plain;
    squeezed.extensions.set(NAME, Some(1)).unwrap();
    let checkpointed = Plan {
        checkpoint: Checkpointing::Every(1),
        ..plain
    };
    for target in [Target::Cpu, Target::Cuda(0)] {
        let [p, s, c] =
            [&plain, &squeezed, &checkpointed].map(|x| model.estimate(&spec, x, &target));
        assert_eq!(s.activations, c.activations, "{target:?}");
        assert_eq!(s.backward_transient, c.backward_transient, "{target:?}");
        assert!(s.activations < p.activations, "{target:?}");
        let [tp, ts, tc] =
            [&plain, &squeezed, &checkpointed].map(|x| model.step_time(&spec, x, &target));
        assert_eq!(ts.compute, tc.compute, "{target:?}");
        assert!(
            ts.compute > tp.compute,
            "recomputation costs time on {target:?}"
        );
    }
}
