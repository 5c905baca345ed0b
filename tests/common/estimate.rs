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

/// Measurements share the process-wide allocator counters: one at a time,
/// and no other test of the same binary allocates while one runs (a planner
/// running beside a measured step adds its bytes to the measured peak).
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

/// A small BERT: 4 layers of 256, a vocabulary of 4096.
pub fn bert() -> ModelConfig {
    ModelConfig {
        max_positions: 256,
        ..ModelConfig::bert(4, 256, 4, 4096)
    }
}

/// Qwen3: a head size twice hidden / heads, and RMSNorm on each query and
/// key head (their outputs kept for backward).
pub fn qwen3() -> ModelConfig {
    let mut c = llama();
    c.settings.head_dim = Some(2 * c.head_dim());
    c.settings.qk_norm = true;
    c.settings.architecture = Some("Qwen3ForCausalLM".into());
    c
}

/// Phi-3: fused `qkv_proj` and `gate_up_proj` (their outputs' slices copied
/// by RoPE, the head split and SwiGLU).
pub fn phi3() -> ModelConfig {
    let mut c = llama();
    c.settings.fused_projections = true;
    c.settings.architecture = Some("Phi3ForCausalLM".into());
    c
}

/// Phi-4-mini: fused projections, RoPE on 3/4 of each head (the rotated
/// part copied, turned and joined to the rest), longrope scaling.
pub fn phi4_mini() -> ModelConfig {
    let mut c = phi3();
    c.settings.partial_rotary_factor = Some(0.75);
    c.settings.rope_scaling = Some("longrope".into());
    let pairs = c.rotary_dim() / 2;
    c.settings.rope = oomfix::RopeFactors {
        original_max_positions: Some(32),
        short_factor: Some(vec![1.5; pairs]),
        long_factor: Some(vec![4.0; pairs]),
        ..Default::default()
    };
    c
}

/// A Gemma-shaped model from the small Llama: GeLU-tanh MLP, head size 64
/// (hidden / heads is 32), a window of 32 on every other block, scores
/// scaled by 64^-1/2; `version` 2 soft-caps scores and logits, 3 norms q
/// and k and gives the sliding blocks their own RoPE base.
pub fn gemma(version: u8) -> ModelConfig {
    let mut c = llama();
    c.settings.head_dim = Some(64);
    c.settings.hidden_act = Some("gelu_pytorch_tanh".into());
    c.settings.sliding_window = Some(32);
    c.settings.qk_norm = version == 3;
    c.settings.architecture = Some(format!("Gemma{version}ForCausalLM"));
    c.settings.gemma = Some(oomfix::GemmaSettings {
        version,
        query_pre_attn_scalar: 64.0,
        attn_softcap: (version == 2).then_some(50.0),
        final_softcap: (version == 2).then_some(30.0),
        sliding_layers: vec![true, false, true, false],
        local_rope_theta: (version == 3).then_some(10_000.0),
    });
    c
}

/// `plain` made frugal: its two sequences accumulated one at a time, in
/// bf16, checkpointed, with fused AdamW.
pub fn frugal(plain: Plan) -> Plan {
    Plan {
        micro_batch: 1,
        grad_accum: 2,
        precision: Precision::Bf16,
        checkpoint: Checkpointing::Every(1),
        optimizer: OptimizerImpl::FusedAdamW,
        ..plain
    }
}

/// Checks three plans of `config` at 2 × 64 tokens: plain fp32, a
/// [`frugal`] one and flash attention.
pub fn check(name: &str, config: ModelConfig) {
    let plain = Plan::baseline(2, 64);
    let frugal = frugal(plain);
    let flash = Plan {
        attention: Attention::Flash,
        optimizer: OptimizerImpl::FusedAdamW,
        ..plain
    };
    check_plans(name, config, &[plain, frugal, flash]);
}

/// Estimates and measures each plan on `config`; fails above [`TOLERANCE`].
pub fn check_plans(name: &str, config: ModelConfig, plans: &[Plan]) {
    check_plans_within(name, config, plans, TOLERANCE);
}

/// [`check_plans`], failing also where the estimate is under the measured
/// peak by more than `under` (a fraction): an under-estimate is the
/// dangerous direction, a plan handed over that does not fit.
pub fn check_plans_within(name: &str, config: ModelConfig, plans: &[Plan], under: f64) {
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
            error.abs() <= TOLERANCE && error >= -under,
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

/// A mixture of experts from the small Llama: 8 experts of 128, two per
/// token, Qwen3-MoE's tensor names.
pub fn moe() -> ModelConfig {
    let mut c = llama();
    c.intermediate = 128;
    c.settings.moe = Some(oomfix::MoeSettings {
        experts: 8,
        top_k: 2,
        expert_intermediate: 128,
        mixtral_names: false,
        fused_experts: false,
    });
    c.settings.architecture = Some("Qwen3MoeForCausalLM".into());
    c
}

/// One small model of each family and variant the memory model tells apart.
pub fn families() -> Vec<(&'static str, ModelConfig)> {
    vec![
        ("gpt2", gpt2()),
        ("llama", llama()),
        ("qwen3", qwen3()),
        ("phi3", phi3()),
        ("phi4-mini", phi4_mini()),
        ("gemma2", gemma(2)),
        ("gemma3", gemma(3)),
        ("moe", moe()),
        ("bert", bert()),
    ]
}
