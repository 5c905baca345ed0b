//! The reference fixtures of `tests/fixtures/train` (tiny models of every
//! family with the values transformers computes on them, written by
//! `scripts/make-parity-fixtures.py`), and the comparisons of tensors the
//! tests against them make.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use oomfix::strategies::lora::{BasePrecision, Lora};
use oomfix::train::{build_model_with, HubModel, TokenBatch};
use oomfix::ModelSpec;

/// The fixtures: GPT-2; Llama with grouped-query attention and an untied
/// head; Qwen2 with q/k/v biases and a tied head; BERT masked-LM with
/// padding; Qwen3 (q/k norms, head size 16 ≠ hidden / heads); Llama
/// 3.2-style (llama3 RoPE, head size 16); Llamas with linear, dynamic and
/// yarn RoPE; Phi-3 (fused projections, untied head); Gemma 2 (soft-caps,
/// sliding windows) and Gemma 3 text (q/k norms, local and global RoPE
/// bases, sliding windows); Phi-3.5-style (longrope, short factors) and
/// Phi-4-mini-style (partial rotary, longrope's long factors, tied head).
/// All but the first four have their norm scales spread (Gemma's `1 + w`
/// too).
pub const FIXTURES: [&str; 14] = [
    "gpt2",
    "llama",
    "qwen2",
    "bert",
    "qwen3",
    "llama3",
    "llama-linear",
    "llama-dynamic",
    "llama-yarn",
    "phi3",
    "gemma2",
    "gemma3",
    "phi3-longrope",
    "phi4-mini",
];

/// The causal fixtures: all but BERT.
pub fn causal_fixtures() -> impl Iterator<Item = &'static str> {
    FIXTURES.into_iter().filter(|&name| name != "bert")
}

/// `tests/fixtures/train`.
pub fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/train")
}

/// `tests/fixtures/chat`: a tiny Llama with a chat template and chat data
/// in every format, with transformers' token ids and losses on them.
pub fn chat_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat")
}

/// `tests/fixtures/finetune`: a small pretrained GPT-2 with its tokenizer,
/// training and held-out text, and the reference values of fine-tuning it.
pub fn finetune_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/finetune")
}

/// The fixture `name`'s model, inspected.
pub fn fixture_spec(name: &str) -> ModelSpec {
    oomfix::inspect(&fixture_dir().join(name).join("model.safetensors")).unwrap()
}

/// The values of the fixture's file `name` (`gpt2.ref.safetensors`, ...).
pub fn fixture_values(name: &str) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(fixture_dir().join(name), &Device::Cpu).unwrap()
}

/// The batch of a fixture's reference values.
pub fn reference_batch(values: &HashMap<String, Tensor>) -> TokenBatch {
    let ids = |t: &Tensor| t.to_dtype(DType::U32).unwrap();
    TokenBatch {
        input_ids: ids(&values["input_ids"]),
        targets: ids(&values["targets"]),
        loss_mask: Some(values["loss_mask"].clone()),
        attention_mask: values.get("attention_mask").map(ids),
        documents: None,
    }
}

/// The model of `spec` with its weights, in f32 on the CPU, with `lora`'s
/// adapters (seed 0 for what the files do not hold).
pub fn fixture_model(spec: &ModelSpec, lora: Option<&Lora>) -> HubModel {
    build_model_with(
        &spec.config,
        Some(&spec.files),
        DType::F32,
        &Device::Cpu,
        0,
        lora,
    )
    .unwrap()
}

/// The fixture `name`'s model with LoRA adapters (rank 4, α 8, a bf16
/// base, on every linear projection of its blocks) drawn from N(0, 0.2²)
/// ([`seeded_variables`](super::seeded_variables)), so that every adapter
/// has a gradient.
pub fn adapted_fixture(name: &str) -> HubModel {
    let spec = fixture_spec(name);
    let facts = oomfix::memory::model_facts(&spec);
    let lora = Lora::new(4, Some(8), None, BasePrecision::Bf16, &facts).unwrap();
    let model = fixture_model(&spec, Some(&lora));
    super::seeded_variables(&model);
    model
}

/// The largest `|x|` of a tensor (of any float dtype).
pub fn max_abs(t: &Tensor) -> f32 {
    t.to_dtype(DType::F32)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar()
        .unwrap()
}

/// The largest `|a − b|`.
pub fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    let a = a.to_dtype(DType::F32).unwrap();
    let b = b.to_dtype(DType::F32).unwrap();
    max_abs(&(a - b).unwrap())
}

/// The largest `|a − b|` over the largest `|b|`.
pub fn rel_error(a: &Tensor, b: &Tensor) -> f32 {
    max_diff(a, b) / max_abs(b)
}
