//! The memory estimate and the modelled step time of a fixed set of plans,
//! pinned: every family the memory model tells apart, every built-in fix on
//! its own and a frugal combination, for the CPU and a CUDA device. A change
//! to either model shows here as a changed line of
//! `tests/snapshots/estimates_pinned__estimates.snap`; a refactor must leave
//! it as it is, a fix to a term changes it in its own commit that says which
//! term and by how much. Review a change with `cargo insta review`, or
//! accept it with `INSTA_UPDATE=always cargo test --test estimates_pinned`.
//!
//! The CPU rows include the matrix kernel's packing panel
//! (`memory::activations::cpu_matmul_workspace`), which follows the
//! machine's caches; at these sizes (at most 256 tokens, a vocabulary of
//! 4096) it is the whole operand on any machine with an L3 cache of 5 MB or
//! more, so the rows are the same there.

use oomfix::speed::{step_work, Throughput};
use oomfix::strategies::lora::{BasePrecision, Lora};
use oomfix::strategies::{Attention, Checkpointing, OptimizerImpl, Plan, Precision, Sharding};
use oomfix::{Estimator, MemoryModel, ModelSpec, Target};
use std::fmt::Write;

#[path = "common/estimate.rs"]
mod estimate;

/// The plans of one model: 4 sequences of 64 tokens a step.
fn plans(spec: &ModelSpec) -> Vec<(&'static str, Plan)> {
    let base = Plan::baseline(4, 64);
    let fused = Plan {
        optimizer: OptimizerImpl::FusedAdamW,
        ..base
    };
    let facts = oomfix::memory::model_facts(spec);
    let lora = |base_precision| Plan {
        precision: Precision::Bf16,
        lora: Some(Lora::new(8, None, None, base_precision, &facts).unwrap()),
        ..fused
    };
    let shard = |stage| Plan {
        shard: Sharding::new(2, stage),
        ..fused
    };
    vec![
        ("baseline", base),
        (
            "accumulate",
            Plan {
                micro_batch: 2,
                grad_accum: 2,
                ..base
            },
        ),
        (
            "bf16",
            Plan {
                precision: Precision::Bf16,
                ..base
            },
        ),
        (
            "fp16",
            Plan {
                precision: Precision::F16,
                ..base
            },
        ),
        (
            "flash",
            Plan {
                attention: Attention::Flash,
                ..base
            },
        ),
        (
            "chunked-loss",
            Plan {
                chunked_loss: true,
                ..base
            },
        ),
        (
            "checkpoint",
            Plan {
                checkpoint: Checkpointing::Every(1),
                ..base
            },
        ),
        ("fused-adamw", fused),
        (
            "tiled-mlp",
            Plan {
                mlp_tile: Some(64),
                ..base
            },
        ),
        ("zero1", shard(1)),
        ("zero2", shard(2)),
        ("zero3", shard(3)),
        (
            "offload",
            Plan {
                optimizer: OptimizerImpl::OffloadedAdamW,
                ..base
            },
        ),
        ("lora", lora(BasePrecision::Bf16)),
        ("qlora", lora(BasePrecision::Nf4)),
        (
            "frugal",
            Plan {
                micro_batch: 1,
                grad_accum: 4,
                precision: Precision::Bf16,
                attention: Attention::Flash,
                checkpoint: Checkpointing::Every(1),
                chunked_loss: true,
                ..fused
            },
        ),
    ]
}

/// One line per model, plan and target: the estimate's components and peak,
/// the step's work and its modelled seconds.
fn table() -> String {
    let mut out = String::new();
    for (name, config) in estimate::families() {
        let spec = ModelSpec::from_config(name, config);
        for (fix, plan) in plans(&spec) {
            for target in [Target::Cpu, Target::Cuda(0)] {
                let estimate = MemoryModel.estimate(&spec, &plan, &target);
                let work = step_work(&spec, &plan, oomfix::facts::builtins());
                let time = Throughput::of(&target).seconds(&work);
                write!(out, "{name} {fix} {target}: peak {}", estimate.peak).unwrap();
                for (component, bytes) in estimate.components() {
                    write!(out, " {component} {bytes}").unwrap();
                }
                let w = serde_json::to_value(work).unwrap();
                for (term, value) in w.as_object().unwrap() {
                    if let Some(v) = value.as_f64() {
                        write!(out, " {term} {v:.6e}").unwrap();
                    }
                }
                writeln!(out, " seconds {:.6e}", time.total).unwrap();
            }
        }
    }
    out
}

#[test]
fn estimates() {
    insta::assert_snapshot!(table());
}
