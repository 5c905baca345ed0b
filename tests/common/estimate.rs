//! The memory model's estimate against the measured heap peak of real
//! training steps, one model and plan at a time: shared by
//! `tests/accuracy.rs` (the workspace's patched candle-core) and
//! `tests/stock-candle` (candle-core as released), which include this file
//! and install `oomfix::track::CountingAlloc` as their global allocator.
#![allow(dead_code)] // each including crate uses a subset

use oomfix::measure::measure_plan;
use oomfix::strategies::{Attention, Checkpointing, OptimizerImpl, Plan, Precision};
use oomfix::{Estimator, MemoryModel, ModelConfig, ModelSpec, Target};

/// The largest error allowed, either way: the accuracy target's maximum.
pub const TOLERANCE: f64 = 0.08;

/// Measurements share the process-wide allocator counters: one at a time.
pub static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// A small GPT-2: 4 layers of 256, a vocabulary of 4096.
pub fn gpt2() -> ModelConfig {
    ModelConfig {
        vocab: 4096,
        max_positions: 256,
        ..ModelConfig::gpt2(4, 256, 4)
    }
}

/// A small Llama: 4 layers of 256, grouped-query attention (8 heads, 2 KV
/// heads), a tied vocabulary of 4096.
pub fn llama() -> ModelConfig {
    ModelConfig::llama(4, 256, 8, 2, 688, 4096, true)
}

/// Checks three plans of `config` at 2 × 64 tokens: plain fp32, a frugal one
/// (bf16, checkpointing, fused AdamW, accumulation) and flash attention.
pub fn check(name: &str, config: ModelConfig) {
    let plain = Plan::baseline(2, 64);
    let frugal = Plan {
        micro_batch: 1,
        grad_accum: 2,
        precision: Precision::Bf16,
        checkpoint: Checkpointing::Every(1),
        optimizer: OptimizerImpl::FusedAdamW,
        ..plain
    };
    let flash = Plan {
        attention: Attention::Flash,
        optimizer: OptimizerImpl::FusedAdamW,
        ..plain
    };
    check_plans(name, config, &[plain, frugal, flash]);
}

/// Estimates and measures each plan on `config`; fails above [`TOLERANCE`].
pub fn check_plans(name: &str, config: ModelConfig, plans: &[Plan]) {
    let _guard = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let spec = ModelSpec::from_config(name, config);
    for plan in plans {
        let estimated = MemoryModel.estimate(&spec, plan, &Target::Cpu).peak as f64;
        let measured = measure_plan(&spec, plan, Target::Cpu).unwrap().peak_bytes as f64;
        let error = estimated / measured - 1.0;
        eprintln!(
            "{name} {plan}: estimated {estimated} measured {measured} error {:+.1}%",
            100.0 * error
        );
        assert!(
            error.abs() <= TOLERANCE,
            "{name} {plan}: estimated {estimated}, measured {measured} ({:+.1}%)",
            100.0 * error
        );
    }
}

/// A sequence far longer than the hidden size makes the attention
/// probabilities (`[b,H,s,s]` per block) most of the activations: the
/// composed attention's kept and backward terms decide the estimate of a
/// GPT-2 and a Llama at 2 × 512 tokens, fp32 and bf16.
pub fn check_long_sequences() {
    let plans = [
        Plan::baseline(2, 512),
        Plan {
            precision: Precision::Bf16,
            ..Plan::baseline(2, 512)
        },
    ];
    let gpt2 = ModelConfig {
        vocab: 512,
        max_positions: 512,
        ..ModelConfig::gpt2(2, 64, 4)
    };
    check_plans("gpt2-long", gpt2, &plans);
    let llama = ModelConfig {
        max_positions: 512,
        ..ModelConfig::llama(2, 64, 4, 2, 128, 512, true)
    };
    check_plans("llama-long", llama, &plans);
}
