//! The memory timeline of a measured step (`--snapshot`, `--plot`): module
//! paths, ops, phases and components of the recorded blocks.
//!
//! Recording is process-wide: it records every thread's allocations. So this
//! binary holds a single test, which records its steps one after another
//! (with more tests, the harness and the other tests would allocate during
//! a recording). The CLI side is in `timeline_cli.rs`.

mod common;

use common::tiny_gpt2;
use oomfix::measure::{record_plan, Timeline};
use oomfix::strategies::{Checkpointing, OptimizerImpl, Precision};
use oomfix::track::alloc::Phase::{self, Backward, Forward, OptimizerStep, Setup};
use oomfix::track::{Component, CountingAlloc};
use oomfix::{ModelConfig, ModelSpec, Plan, Target};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

fn plan(micro_batch: usize, grad_accum: usize) -> Plan {
    Plan {
        grad_accum,
        ..Plan::baseline(micro_batch, 16)
    }
}

fn record(config: ModelConfig, plan: Plan) -> (u64, Timeline) {
    let spec = ModelSpec::from_config("tiny", config);
    let (m, t) = record_plan(&spec, &plan, Target::Cpu).unwrap();
    assert!(!t.truncated);
    (m.peak_bytes, t)
}

/// Parameter count of `config`.
fn params(config: &ModelConfig) -> u64 {
    config
        .tensors()
        .iter()
        .map(|(_, s)| s.iter().product::<usize>() as u64)
        .sum()
}

/// The highest total of live bytes, replaying the changes without components.
fn replayed_peak(t: &Timeline) -> u64 {
    let mut live: u64 = t
        .blocks
        .iter()
        .filter(|b| b.alloc_ns.is_none())
        .map(|b| b.size)
        .sum();
    let mut peak = live;
    for c in &t.changes {
        let size = t.blocks[c.block].size;
        live = if c.alloc { live + size } else { live - size };
        peak = peak.max(live);
    }
    peak
}

/// The training state before the step: `weights` bytes per parameter of
/// weights, and AdamW's two fp32 moments 8 (each plus a little
/// bookkeeping).
fn assert_state(t: &Timeline, p: u64, weights: u64) {
    let start = t.initial_bytes();
    let near = |x: u64, want: u64| x >= want && (x as f64) < want as f64 * 1.05 + 65536.0;
    let w = weights * p;
    let held = start[Component::Weights as usize];
    assert!(near(held, w), "weights {start:?} vs {weights}P = {w}");
    let held = start[Component::OptimizerState as usize];
    assert!(near(held, 8 * p), "optimizer {start:?} vs 8P = {}", 8 * p);
}

/// The phases of the step, in order.
fn phases(t: &Timeline) -> Vec<Phase> {
    t.phases.iter().map(|p| p.1).collect()
}

/// Checks that a block of `t` is tagged with each of `wanted` (module path
/// and op).
fn assert_tagged(t: &Timeline, wanted: &[&str]) {
    let names: Vec<String> = t.blocks.iter().map(|b| b.tag.name()).collect();
    for want in wanted {
        assert!(names.iter().any(|n| n == want), "no block tagged {want}");
    }
}

fn gpt2_components_add_up_and_match_the_training_state() {
    let config = tiny_gpt2();
    let p = params(&config);
    // Micro-batch 8: enough activations that the backward, not the optimizer
    // step, holds the peak.
    let (measured, t) = record(config, plan(8, 1));
    let (_, at_peak) = t.peak();
    let total: u64 = at_peak.iter().sum();
    assert_eq!(
        total,
        replayed_peak(&t),
        "per-component bytes at the peak sum to the live total"
    );
    // The tracked total is the allocator's measurement, give or take a few blocks.
    let diff = total.abs_diff(measured) as f64 / measured as f64;
    assert!(diff < 0.02, "tracked peak {total} vs measured {measured}");
    let start = t.initial_bytes();
    let [weights, grads, optim, acts, temps] = [
        Component::Weights,
        Component::Gradients,
        Component::OptimizerState,
        Component::Activations,
        Component::Temporaries,
    ]
    .map(|c| at_peak[c as usize]);
    // fp32: 4 bytes per parameter.
    assert_state(&t, p, 4);
    assert_eq!(
        start[Component::Gradients as usize],
        0,
        "no gradient outlives a step"
    );
    assert_eq!(start[Component::Activations as usize], 0);
    assert_eq!(
        (weights, optim),
        (start[0], start[2]),
        "state does not move during the step"
    );
    assert!(
        grads > 0 && grads <= 2 * 4 * p,
        "gradients at the peak: {grads}"
    );
    assert!(acts > 0 && temps > 0, "{at_peak:?}");
    // Every component appears among the step's blocks.
    for c in Component::ALL {
        assert!(t.blocks.iter().any(|b| b.component == c), "{c:?} missing");
    }
    // Activations are forward blocks; gradients are parameter-shaped.
    let activations = || {
        t.blocks
            .iter()
            .filter(|b| b.component == Component::Activations)
    };
    assert!(activations()
        .all(|b| b.phase == Phase::Forward && b.alloc_ns.is_some() && b.free_ns.is_some()));
    let c_attn = 32 * 96 * 4;
    assert!(t
        .blocks
        .iter()
        .any(|b| b.component == Component::Gradients && b.size == c_attn));
    // Module paths and ops, and parameter names.
    assert_tagged(
        &t,
        &[
            "h.0.attn.matmul",
            "h.1.attn.softmax",
            "h.0.mlp.gelu",
            "h.0.ln_1.layer_norm",
            "ln_f.layer_norm",
            "lm_head.matmul",
            "loss.loss",
            "backward",
            "optimizer.adamw",
        ],
    );
    assert!(t
        .blocks
        .iter()
        .any(|b| b.name.as_deref() == Some("h.0.attn.c_attn.weight") && b.size == c_attn));
    // Phases in order.
    assert_eq!(phases(&t), [Setup, Forward, Backward, OptimizerStep, Setup]);
}

fn llama_mixed_precision_checkpointing_and_fused_adamw() {
    let config = ModelConfig::llama(2, 32, 4, 2, 64, 256, false);
    let p = params(&config);
    let plan = Plan {
        precision: Precision::Bf16,
        checkpoint: Checkpointing::Every(1),
        optimizer: OptimizerImpl::FusedAdamW,
        ..plan(1, 2)
    };
    let (_, t) = record(config, plan);
    // bf16 weights 2P + fp32 masters 4P.
    assert_state(&t, p, 6);
    assert!(t
        .blocks
        .iter()
        .any(|b| b.name.as_deref() == Some("master.model.layers.0.self_attn.q_proj.weight")));
    assert_tagged(
        &t,
        &[
            "model.layers.0.self_attn.rope",
            "model.layers.1.mlp.silu",
            "model.norm.rms_norm",
            "optimizer.weight_sync",
        ],
    );
    // Checkpointed blocks are recomputed during backward, under their own module.
    assert!(t.blocks.iter().any(
        |b| b.phase == Phase::Backward && b.tag.name().starts_with("model.layers.0.self_attn")
    ));
    // A forward and a backward for each micro-batch.
    assert_eq!(
        phases(&t),
        [
            Setup,
            Forward,
            Backward,
            Forward,
            Backward,
            OptimizerStep,
            Setup
        ]
    );
    let (_, at_peak) = t.peak();
    assert_eq!(at_peak.iter().sum::<u64>(), replayed_peak(&t));
}

fn bert_blocks_carry_encoder_paths() {
    let (_, t) = record(
        ModelConfig {
            max_positions: 64,
            ..ModelConfig::bert(1, 32, 2, 256)
        },
        plan(2, 1),
    );
    assert_tagged(
        &t,
        &[
            "bert.encoder.layer.0.attention.matmul",
            "bert.encoder.layer.0.intermediate.gelu",
            "cls.predictions.decoder.matmul",
        ],
    );
}

#[test]
fn recorded_steps_of_three_families() {
    gpt2_components_add_up_and_match_the_training_state();
    llama_mixed_precision_checkpointing_and_fused_adamw();
    bert_blocks_carry_encoder_paths();
}
