//! The block description (`oomfix::block`) against the code it describes:
//! on the CPU, for every family, the bytes a real step keeps for the
//! backward in each block (the recorded timeline's *activations* tagged
//! with that block's modules) equal the description's kept bytes within
//! the estimate's 8%; with the MLP in tiles too, where the description
//! keeps two `[n, h]` in place of the row-wise part's tensors.

use oomfix::block::Block;
use oomfix::measure::record_plan;
use oomfix::strategies::{Execution, Plan};
use oomfix::track::{Component, CountingAlloc};
use oomfix::{ModelSpec, Target};
use std::collections::BTreeMap;

#[path = "common/estimate.rs"]
mod estimate;
use estimate::{families, LOCK, TOLERANCE};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

/// The block a module path belongs to: its first all-digit component
/// (`h.3.attn`, `model.layers.3.mlp`, `bert.encoder.layer.3.output`).
fn block_of(path: &str) -> Option<usize> {
    path.split('.').find_map(|p| p.parse().ok())
}

/// Measured kept bytes per block of one step of `plan`.
fn kept_per_block(spec: &ModelSpec, plan: &Plan) -> BTreeMap<usize, u64> {
    let (_, timeline) = record_plan(spec, plan, Target::Cpu).unwrap();
    let mut out = BTreeMap::new();
    for b in &timeline.blocks {
        if b.component != Component::Activations {
            continue;
        }
        if let Some(l) = block_of(b.tag.module().path()) {
            *out.entry(l).or_insert(0) += b.size;
        }
    }
    out
}

fn check(plan: Plan) {
    let _guard = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    // A mixture of experts is planned, not trained.
    for (name, config) in families().into_iter().filter(|(n, _)| *n != "moe") {
        let spec = ModelSpec::from_config(name, config);
        let exec = Execution::for_plan(&plan, oomfix::facts::builtins());
        let described = Block::describe(&spec, &plan, &exec).kept_bytes(4);
        let measured = kept_per_block(&spec, &plan);
        assert_eq!(measured.len(), spec.config.layers, "{name}: {measured:?}");
        for (l, bytes) in measured {
            let error = described as f64 / bytes as f64 - 1.0;
            eprintln!(
                "{name} {plan} block {l}: described {described} measured {bytes} ({:+.1}%)",
                100.0 * error
            );
            assert!(
                error.abs() <= TOLERANCE,
                "{name} {plan} block {l}: described {described}, measured {bytes} ({:+.1}%)",
                100.0 * error
            );
        }
    }
}

#[test]
fn each_blocks_kept_bytes_are_the_descriptions() {
    check(Plan::baseline(2, 64));
}

#[test]
fn each_tiled_blocks_kept_bytes_are_the_descriptions() {
    check(Plan {
        mlp_tile: Some(32),
        ..Plan::baseline(2, 64)
    });
}
