//! A slice of the accuracy matrix (`examples/accuracy.rs`): the memory model's
//! estimate against the measured heap peak of real training steps, one family
//! and plan at a time. Fails above 8% (the accuracy target's maximum); the full
//! matrix and its real figures are in `docs/accuracy.md`.

use oomfix::measure::measure_plan;
use oomfix::strategies::{Checkpointing, OptimizerImpl, Plan, Precision};
use oomfix::track::CountingAlloc;
use oomfix::{Estimator, MemoryModel, ModelConfig, ModelSpec, Target};

#[path = "common/estimate.rs"]
mod estimate;
use estimate::{check, check_plans, check_plans_within, LOCK};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

#[test]
fn gpt2_estimate_within_8_percent() {
    check("gpt2", estimate::gpt2());
}

#[test]
fn llama_estimate_within_8_percent() {
    check("llama", estimate::llama());
}

#[test]
fn bert_estimate_within_8_percent() {
    check("bert", estimate::bert());
}

/// Every family (GPT-2; Llama-style as Llama, Qwen3, Phi-3, Phi-4-mini,
/// Gemma 2 and Gemma 3; BERT) at
/// one and eight sequences of 128 tokens and at four of 256, with the whole
/// logits (plain fp32 and AdamW; at 8 × 128 also flash attention where the
/// family has it, and fused AdamW), so that a term right at one size and
/// wrong at another is caught. Beside the small models, a BERT whose 5,000-word masked-LM head
/// is 78 times its hidden size, as all-MiniLM-L6-v2's 30,522 words are of
/// its 384. None may be under by more than 2.5% (all-MiniLM-L6-v2 at 8 ×
/// 128 was 6.4% under before BERT's head gradient panel was counted; the
/// largest under-estimates here are Phi-4-mini's, −1.9%, and GPT-2's,
/// −1.6%, at 8 × 128).
#[test]
fn estimates_hold_across_micro_batches_and_sequence_lengths() {
    let shapes = [(1, 128), (8, 128), (4, 256)];
    let wide_bert = ModelConfig {
        max_positions: 256,
        ..ModelConfig::bert(2, 64, 4, 5000)
    };
    let models = [
        ("gpt2", estimate::gpt2()),
        ("llama", estimate::llama()),
        ("qwen3", estimate::qwen3()),
        ("phi3", estimate::phi3()),
        ("phi4-mini", estimate::phi4_mini()),
        ("gemma2", estimate::gemma(2)),
        ("gemma3", estimate::gemma(3)),
        ("bert", estimate::bert()),
        ("bert-wide-head", wide_bert),
    ];
    for (name, config) in models {
        let flash = config.flash_computes_it();
        let mut plans: Vec<Plan> = shapes.iter().map(|&(b, s)| Plan::baseline(b, s)).collect();
        plans.push(Plan {
            attention: if flash {
                oomfix::strategies::Attention::Flash
            } else {
                oomfix::strategies::Attention::Composed
            },
            optimizer: OptimizerImpl::FusedAdamW,
            ..Plan::baseline(8, 128)
        });
        check_plans_within(name, config, &plans, 0.025);
    }
}

/// A vocabulary far larger than the hidden size makes the loss's backward the
/// peak of a checkpointed step (the logits, their gradient, candle's zeros and
/// sum; for BERT also the decoder bias's broadcast gradient).
fn check_wide_vocabulary(name: &str, config: ModelConfig) {
    let plan = Plan {
        checkpoint: Checkpointing::Every(1),
        ..Plan::baseline(4, 128)
    };
    check_plans(name, config, &[plan]);
}

#[test]
fn large_vocabulary_head_estimate_within_8_percent() {
    check_wide_vocabulary(
        "gpt2-wide-vocab",
        ModelConfig {
            // Not a multiple of the head's alignment: the padded path.
            vocab: 16321,
            ..ModelConfig::gpt2(2, 32, 2)
        },
    );
}

#[test]
fn large_vocabulary_bert_head_estimate_within_8_percent() {
    check_wide_vocabulary(
        "bert-wide-vocab",
        ModelConfig {
            max_positions: 128,
            ..ModelConfig::bert(2, 32, 2, 16322)
        },
    );
}

/// The loss in chunks of tokens (`chunked-loss`) on vocabularies whose
/// logits span several chunks of [`CHUNK_BYTES`] at 4 × 256 tokens: the
/// head keeps no logits, and the loss's working set is one chunk's logits
/// and gradient beside the hidden states' gradient and the head weight's.
/// Checkpointed (where the loss's backward would be the peak unchunked) and
/// not, fp32 and bf16; GPT-2 (tied, padded), Llama (untied) and BERT
/// (tied, a decoder bias).
///
/// [`CHUNK_BYTES`]: oomfix::strategies::chunked_loss::CHUNK_BYTES
#[test]
fn chunked_loss_estimate_within_8_percent() {
    let gpt2 = ModelConfig {
        vocab: 32705,
        max_positions: 256,
        ..ModelConfig::gpt2(2, 32, 2)
    };
    let llama = ModelConfig {
        max_positions: 256,
        ..ModelConfig::llama(2, 32, 4, 2, 64, 32768, false)
    };
    let bert = ModelConfig {
        max_positions: 256,
        ..ModelConfig::bert(2, 32, 2, 32768)
    };
    let chunked = Plan {
        chunked_loss: true,
        ..Plan::baseline(4, 256)
    };
    let plans = [
        chunked,
        Plan {
            checkpoint: Checkpointing::Every(1),
            ..chunked
        },
        Plan {
            precision: Precision::Bf16,
            checkpoint: Checkpointing::Every(1),
            ..chunked
        },
    ];
    check_plans("gpt2-chunked-loss", gpt2, &plans);
    check_plans("llama-chunked-loss", llama, &plans);
    check_plans("bert-chunked-loss", bert, &plans);
}

/// A sequence far longer than the hidden size makes the attention
/// probabilities (`[b,H,s,s]` per block) most of the activations: the
/// composed attention's kept and backward terms decide the estimate.
#[test]
fn long_sequence_composed_attention_estimate_within_8_percent() {
    estimate::check_long_sequences();
}

#[test]
fn an_offloaded_plan_on_the_cpu_needs_the_peak_and_the_host_bytes() {
    // On the CPU the host memory the offloaded optimizer moves state to is the
    // same memory: the estimate's peak holds its `host` bytes.
    let _guard = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let spec = ModelSpec::from_config("llama", estimate::llama());
    for precision in [Precision::F32, Precision::Bf16] {
        let plan = Plan {
            micro_batch: 1,
            grad_accum: 2,
            precision,
            checkpoint: Checkpointing::Every(1),
            optimizer: OptimizerImpl::OffloadedAdamW,
            ..Plan::baseline(2, 64)
        };
        let estimate = MemoryModel.estimate(&spec, &plan, &Target::Cpu);
        assert!(estimate.host > 0);
        let estimated = estimate.peak as f64;
        let measured = measure_plan(&spec, &plan, Target::Cpu).unwrap().peak_bytes as f64;
        let error = estimated / measured - 1.0;
        eprintln!(
            "{plan}: estimated {estimated} measured {measured} error {:+.1}%",
            100.0 * error
        );
        assert!(
            error.abs() <= estimate::TOLERANCE,
            "{plan}: {:+.1}%",
            100.0 * error
        );
    }
}

/// Qwen3: a head size twice hidden / heads, and RMSNorm on each query and
/// key head (their outputs kept for backward).
#[test]
fn qwen3_estimate_within_8_percent() {
    check("qwen3", estimate::qwen3());
}

/// Llama 3.x: the `llama3` RoPE scaling changes the tables' values only.
#[test]
fn llama3_estimate_within_8_percent() {
    let mut c = estimate::llama();
    c.settings.rope_scaling = Some("llama3".into());
    c.settings.rope = oomfix::RopeFactors {
        factor: Some(32.0),
        low_freq_factor: Some(1.0),
        high_freq_factor: Some(4.0),
        original_max_positions: Some(16),
        ..Default::default()
    };
    c.settings.rope_theta = Some(500_000.0);
    check("llama3", c);
}

/// Phi-3: fused `qkv_proj` and `gate_up_proj` (their outputs' slices copied
/// by RoPE, the head split and SwiGLU).
#[test]
fn phi3_estimate_within_8_percent() {
    check("phi3", estimate::phi3());
}

/// Phi-4-mini: fused projections, RoPE on 3/4 of each head (the rotated
/// part copied, turned and joined to the rest), longrope scaling.
#[test]
fn phi4_mini_estimate_within_8_percent() {
    check("phi4-mini", estimate::phi4_mini());
}

/// Gemma's plans: no flash attention (the planner never chooses it for
/// Gemma), plain and frugal at 2 × 64, and plain fp32 and bf16 at 2 × 256,
/// where the composed attention's score-sized tensors dominate.
fn check_gemma(name: &str, config: ModelConfig) {
    let plain = Plan::baseline(2, 64);
    let frugal = estimate::frugal(plain);
    let long = Plan::baseline(2, 256);
    let long_bf16 = Plan {
        precision: Precision::Bf16,
        ..long
    };
    check_plans(
        name,
        ModelConfig {
            max_positions: 256,
            ..config
        },
        &[plain, frugal, long, long_bf16],
    );
}

/// Gemma 2: four norms per block, composed attention with soft-capped
/// scores and sliding windows, soft-capped logits.
#[test]
fn gemma2_estimate_within_8_percent() {
    check_gemma("gemma2", estimate::gemma(2));
}

/// Gemma 3: Gemma 2's blocks without soft-caps, with q/k norms and two
/// kinds of RoPE tables.
#[test]
fn gemma3_estimate_within_8_percent() {
    check_gemma("gemma3", estimate::gemma(3));
}

/// LoRA (a frozen 16-bit base) and QLoRA (an NF4 base, one projection
/// dequantized at a time): the frozen weights without gradients or
/// optimizer state, the adapters' weights, gradients and moments, fp32 and
/// bf16 compute, a Llama and a GPT-2 (its `Conv1D` weights frozen
/// transposed).
#[test]
fn lora_and_qlora_estimates_within_8_percent() {
    use oomfix::strategies::lora::{BasePrecision, Lora};
    for (name, config) in [("llama", estimate::llama()), ("gpt2", estimate::gpt2())] {
        let facts = oomfix::memory::model_facts(&ModelSpec::from_config(name, config.clone()));
        let lora = |base| Some(Lora::new(8, None, None, base, &facts).unwrap());
        let plain = Plan::baseline(2, 64);
        let plans = [
            Plan {
                lora: lora(BasePrecision::Bf16),
                ..plain
            },
            Plan {
                lora: lora(BasePrecision::Nf4),
                optimizer: OptimizerImpl::FusedAdamW,
                ..plain
            },
            Plan {
                lora: lora(BasePrecision::Nf4Double),
                precision: Precision::Bf16,
                optimizer: OptimizerImpl::FusedAdamW,
                ..plain
            },
            Plan {
                lora: lora(BasePrecision::Nf4Double),
                checkpoint: Checkpointing::Every(1),
                optimizer: OptimizerImpl::FusedAdamW,
                ..plain
            },
            Plan {
                lora: lora(BasePrecision::Nf4Double),
                precision: Precision::Bf16,
                checkpoint: Checkpointing::Every(1),
                optimizer: OptimizerImpl::FusedAdamW,
                ..plain
            },
        ];
        check_plans(&format!("{name}-lora"), config, &plans);
    }
}

/// LoRA at a long sequence with every block checkpointed: the adapters'
/// gradients are small and the loss runs in chunks, so the peak is the
/// backward of the last block, the first one recomputed, while every other
/// block's checkpointed input is still alive (on an H100, Llama-3.1-8B's
/// shape at 49,640 tokens held 31 of them, 11.7 GiB, beside the recompute).
#[test]
fn long_checkpointed_lora_peaks_at_the_last_segments_recompute() {
    use oomfix::memory::PeakMoment;
    use oomfix::strategies::lora::{BasePrecision, Lora};
    let config = ModelConfig {
        max_positions: 2048,
        ..ModelConfig::llama(8, 256, 8, 2, 688, 512, true)
    };
    let spec = ModelSpec::from_config("llama-8-blocks", config.clone());
    let facts = oomfix::memory::model_facts(&spec);
    let plan = Plan {
        lora: Some(Lora::new(8, None, None, BasePrecision::Bf16, &facts).unwrap()),
        checkpoint: Checkpointing::Every(1),
        attention: oomfix::strategies::Attention::Flash,
        chunked_loss: true,
        optimizer: OptimizerImpl::FusedAdamW,
        ..Plan::baseline(1, 2048)
    };
    let estimate = MemoryModel.estimate(&spec, &plan, &Target::Cpu);
    assert_eq!(estimate.peak_phase, PeakMoment::SegmentRecompute);
    check_plans("llama-8-blocks-lora", config, &[plan]);
}

/// The sequence-tiled MLP (`Plan::mlp_tile`): a Llama whose MLP is 4× its
/// hidden size and a GPT-2, at 1 × 1024 tokens in tiles of 128, with every
/// block kept and with every block recomputed: the estimate holds, and the
/// tiled plan's measured peak is below the untiled one's.
#[test]
fn a_tiled_mlp_keeps_one_tiles_intermediates() {
    let llama = ModelConfig {
        max_positions: 1024,
        ..ModelConfig::llama(4, 128, 4, 2, 512, 512, true)
    };
    let gpt2 = ModelConfig {
        max_positions: 1024,
        vocab: 512,
        ..ModelConfig::gpt2(4, 128, 4)
    };
    for (name, config) in [("llama-tiled", llama), ("gpt2-tiled", gpt2)] {
        let spec = ModelSpec::from_config(name, config.clone());
        for checkpoint in [Checkpointing::None, Checkpointing::Every(1)] {
            let plain = Plan {
                checkpoint,
                attention: oomfix::strategies::Attention::Flash,
                ..Plan::baseline(1, 1024)
            };
            let tiled = Plan {
                mlp_tile: Some(128),
                ..plain
            };
            check_plans(name, config.clone(), &[plain, tiled]);
            // Measured alone: the allocator's peak is the process's.
            let _guard = LOCK.lock().unwrap_or_else(|e| e.into_inner());
            let measured = |p: &Plan| measure_plan(&spec, p, Target::Cpu).unwrap().peak_bytes;
            assert!(
                measured(&tiled) < measured(&plain),
                "{name} {checkpoint:?}: tiling lowers the peak"
            );
        }
    }
}
