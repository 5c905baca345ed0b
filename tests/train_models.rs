//! The trainable families on tiny shapes: gradients, checkpointing, loading and saving, dtypes.

use std::collections::HashMap;
use std::path::PathBuf;

mod common;

use candle_core::{DType, Device, Tensor};
use common::{
    fixture_spec, fixture_values, max_abs, max_diff, reference_batch, rel_error, values, FIXTURES,
};
use oomfix::strategies::{Attention, Checkpointing, Execution};
use oomfix::train::{build_model, synthetic_batch, HubModel, StepOutput, TokenBatch};
use oomfix::{Error, Family, ModelConfig};

const BATCH: usize = 2;
const SEQ: usize = 8;
const VOCAB: usize = 64;

fn tiny(family: Family) -> ModelConfig {
    ModelConfig {
        family,
        layers: 3,
        hidden: 32,
        heads: 4,
        kv_heads: if family == Family::Llama { 2 } else { 4 },
        intermediate: 48,
        vocab: VOCAB,
        max_positions: 16,
        tied_embeddings: true,
        qkv_bias: family == Family::Bert,
        settings: Default::default(),
    }
}

/// GPT-2, Llama (tied, no bias), Llama (untied, qkv bias), BERT.
fn configs() -> Vec<ModelConfig> {
    let untied = ModelConfig {
        tied_embeddings: false,
        qkv_bias: true,
        ..tiny(Family::Llama)
    };
    // Biases on every attention and MLP projection (`attention_bias`, `mlp_bias`).
    let biased = ModelConfig {
        settings: oomfix::ModelSettings {
            attention_bias: true,
            mlp_bias: true,
            ..Default::default()
        },
        ..tiny(Family::Llama)
    };
    vec![
        tiny(Family::Gpt2),
        tiny(Family::Llama),
        untied,
        biased,
        tiny(Family::Bert),
    ]
}

fn model(config: &ModelConfig, dtype: DType) -> HubModel {
    build_model(config, None, dtype, &Device::Cpu, 7).unwrap()
}

fn batch(config: &ModelConfig) -> TokenBatch {
    synthetic_batch(config.family, config.vocab, BATCH, SEQ, 11, &Device::Cpu).unwrap()
}

/// A forward and backward pass with composed attention and `policy`.
fn try_step(
    model: &HubModel,
    batch: &TokenBatch,
    policy: Checkpointing,
) -> oomfix::Result<StepOutput> {
    let exec = Execution::default()
        .checkpoint(policy)
        .attention(Attention::Composed);
    model.forward_backward(batch, &exec)
}

fn step(model: &HubModel, batch: &TokenBatch, policy: Checkpointing) -> StepOutput {
    try_step(model, batch, policy).unwrap()
}

/// Every gradient of `got` within `tol` of `want`'s, relative to the largest
/// value of the gradient (of all of `want`'s for one that vanishes
/// analytically).
fn assert_same_gradients(model: &HubModel, got: &[Tensor], want: &[Tensor], tol: f32, what: &str) {
    let largest = want.iter().map(max_abs).fold(0f32, f32::max);
    for ((name, _), (g, w)) in model.named_vars().iter().zip(got.iter().zip(want)) {
        let scale = if analytically_zero(name) {
            largest
        } else {
            max_abs(w)
        };
        let rel = max_diff(g, w) / scale;
        assert!(rel < tol, "{what}: gradient of {name} differs by {rel:e}");
    }
}

/// `got`'s loss within `loss_tol` of `want`'s (relative), and its
/// gradients as [`assert_same_gradients`] with `grad_tol`.
fn assert_same_step(
    model: &HubModel,
    got: &StepOutput,
    want: &StepOutput,
    (loss_tol, grad_tol): (f32, f32),
    what: &str,
) {
    let rel = (got.loss - want.loss).abs() / want.loss;
    assert!(rel < loss_tol, "{what}: loss {} vs {}", got.loss, want.loss);
    assert_same_gradients(model, &got.grads, &want.grads, grad_tol, what);
}

fn label(config: &ModelConfig) -> String {
    format!(
        "{} (tied {}, qkv bias {}, {:?})",
        config.family, config.tied_embeddings, config.qkv_bias, config.settings
    )
}

/// BERT's key bias adds the same amount to every score of a query's row, which the
/// softmax cancels: its true gradient is zero.
fn analytically_zero(name: &str) -> bool {
    name.ends_with("attention.self.key.bias")
}

#[test]
fn every_parameter_receives_a_finite_nonzero_gradient() {
    for config in configs() {
        let model = model(&config, DType::F32);
        let names: Vec<&str> = model.named_vars().iter().map(|(n, _)| n.as_str()).collect();
        let expected: Vec<String> = config.tensors().into_iter().map(|(n, _)| n).collect();
        assert_eq!(
            names,
            expected,
            "{}: vars follow ModelConfig::tensors",
            label(&config)
        );
        let out = step(&model, &batch(&config), Checkpointing::None);
        assert!(out.loss.is_finite());
        let largest = out.grads.iter().map(max_abs).fold(0f32, f32::max);
        for ((name, var), grad) in model.named_vars().iter().zip(&out.grads) {
            assert_eq!(grad.dims(), var.dims(), "{name}");
            assert!(
                values(grad).iter().all(|v| v.is_finite()),
                "{}: {name} not finite",
                label(&config)
            );
            let g = max_abs(grad);
            if analytically_zero(name) {
                assert!(g < 1e-4 * largest, "{name}: {g} should vanish");
            } else {
                assert!(
                    g > 1e-6 * largest,
                    "{}: {name} gets no gradient ({g})",
                    label(&config)
                );
            }
        }
    }
}

#[test]
fn initial_loss_is_about_log_vocab() {
    for config in configs() {
        let loss = step(
            &model(&config, DType::F32),
            &batch(&config),
            Checkpointing::None,
        )
        .loss;
        assert!(
            (loss - (VOCAB as f32).ln()).abs() < 0.1,
            "{}: {loss}",
            label(&config)
        );
    }
}

#[test]
fn checkpointed_gradients_equal_plain_gradients() {
    for config in configs() {
        let model = model(&config, DType::F32);
        let batch = batch(&config);
        let plain = step(&model, &batch, Checkpointing::None);
        // 3 blocks: Every(1) = three segments; Every(2) = blocks 0..2 and 2..3; Every(3) = one.
        for k in [1, 2, 3] {
            let ckpt = step(&model, &batch, Checkpointing::Every(k));
            assert_eq!(ckpt.loss, plain.loss, "{} Every({k})", label(&config));
            let what = format!("{} Every({k})", label(&config));
            assert_same_gradients(&model, &ckpt.grads, &plain.grads, 1e-5, &what);
        }
    }
}

/// The families' batches, plus a BERT batch whose last three positions
/// are padding; each with its label.
fn batches_with_padding() -> Vec<(String, ModelConfig, TokenBatch)> {
    let mut cases: Vec<_> = configs()
        .into_iter()
        .map(|c| (c.clone(), batch(&c)))
        .collect();
    let bert = tiny(Family::Bert);
    let mut padded = batch(&bert);
    let keep: Vec<u32> = (0..BATCH * SEQ)
        .map(|i| u32::from(i % SEQ < SEQ - 3))
        .collect();
    padded.attention_mask = Some(Tensor::from_vec(keep, (BATCH, SEQ), &Device::Cpu).unwrap());
    cases.push((bert, padded));
    let label = |(c, b): (ModelConfig, TokenBatch)| {
        let padded = b.attention_mask.is_some();
        (format!("{} (padded {padded})", label(&c)), c, b)
    };
    cases.into_iter().map(label).collect()
}

#[test]
fn flash_attention_gives_the_composed_loss_and_gradients() {
    for (label, config, batch) in batches_with_padding() {
        let model = model(&config, DType::F32);
        let composed = step(&model, &batch, Checkpointing::None);
        for policy in [
            Checkpointing::None,
            Checkpointing::Every(1),
            Checkpointing::Every(2),
        ] {
            let flash = model
                .forward_backward(
                    &batch,
                    &Execution::default()
                        .checkpoint(policy)
                        .attention(Attention::Flash),
                )
                .unwrap();
            let what = format!("{label} {policy}");
            assert_same_step(&model, &flash, &composed, (1e-4, 1e-4), &what);
        }
    }
}

/// Bytes of `rows` rows of `config`'s padded logits in f32: a chunk bound
/// that splits the tiny batches into several chunks, the last one shorter.
fn chunk_of(config: &ModelConfig, rows: usize) -> u64 {
    (rows * config.vocab.next_multiple_of(64) * 4) as u64
}

/// The LM loss in chunks of 3 tokens (of 16: the last chunk holds 1) gives
/// the unchunked loss and gradients (hidden states, tied or untied head,
/// BERT's decoder bias) on every family, plain and checkpointed, with
/// composed and flash attention, and with a loss scale.
#[test]
fn chunked_loss_gives_the_unchunked_loss_and_gradients() {
    for (label, config, batch) in batches_with_padding() {
        let model = model(&config, DType::F32);
        for (policy, attention, scale) in [
            (Checkpointing::None, Attention::Composed, 1.0),
            (Checkpointing::Every(1), Attention::Composed, 1.0),
            (Checkpointing::Every(2), Attention::Flash, 1.0),
            (Checkpointing::None, Attention::Flash, 512.0),
        ] {
            let exec = Execution::default()
                .checkpoint(policy)
                .attention(attention)
                .loss_scale(scale);
            let whole = model.forward_backward(&batch, &exec).unwrap();
            let chunked = model
                .forward_backward(&batch, &exec.loss_chunks(Some(chunk_of(&config, 3))))
                .unwrap();
            let what = format!("{label} {policy} {attention}");
            assert_same_step(&model, &chunked, &whole, (1e-6, 1e-5), &what);
            // The forward-only loss is the same, in chunks or not.
            let forward_only = model
                .loss(&batch, &exec.loss_chunks(Some(chunk_of(&config, 3))))
                .unwrap();
            assert!(
                (forward_only - whole.loss).abs() <= 1e-6 * whole.loss,
                "{label}"
            );
        }
    }
}

/// In bf16 and f16 (with a loss scale) the chunked loss's gradients are as
/// close to the unchunked ones as 16 bits allow: each chunk's share of the
/// head's gradient is rounded once more when summed.
#[test]
fn sixteen_bit_chunked_gradients_are_close_to_the_unchunked_ones() {
    for config in configs() {
        let batch = batch(&config);
        for dtype in [DType::BF16, DType::F16] {
            let model = model(&config, dtype);
            let exec = Execution::default().loss_scale(1024.0);
            let whole = model.forward_backward(&batch, &exec).unwrap();
            let chunked = model
                .forward_backward(&batch, &exec.loss_chunks(Some(chunk_of(&config, 5) / 2)))
                .unwrap();
            assert!(
                (chunked.loss - whole.loss).abs() <= 1e-3 * whole.loss,
                "{} {dtype:?}",
                label(&config)
            );
            let largest = whole.grads.iter().map(max_abs).fold(0f32, f32::max);
            for ((name, _), (c, w)) in model
                .named_vars()
                .iter()
                .zip(chunked.grads.iter().zip(&whole.grads))
            {
                assert_eq!(c.dtype(), dtype);
                let rel = max_diff(c, w) / largest;
                assert!(
                    rel < 0.02,
                    "{} {dtype:?}: gradient of {name} differs by {rel:e} of the largest",
                    label(&config)
                );
            }
        }
    }
}

#[test]
fn loss_scale_multiplies_the_gradients_only() {
    let config = tiny(Family::Llama);
    let model = model(&config, DType::F32);
    let batch = batch(&config);
    let plain = step(&model, &batch, Checkpointing::None);
    let scaled = model
        .forward_backward(
            &batch,
            &Execution::default()
                .checkpoint(Checkpointing::Every(1))
                .loss_scale(256.0),
        )
        .unwrap();
    assert_eq!(scaled.loss, plain.loss);
    for (s, p) in scaled.grads.iter().zip(&plain.grads) {
        assert!(max_diff(&(s / 256.0).unwrap(), p) <= 1e-5 * max_abs(p));
    }
}

#[test]
fn gradient_descent_lowers_the_loss() {
    for config in configs() {
        let model = model(&config, DType::F32);
        let batch = batch(&config);
        let first = step(&model, &batch, Checkpointing::Every(2));
        let mut last = first.loss;
        for _ in 0..10 {
            let out = step(&model, &batch, Checkpointing::Every(2));
            for ((_, var), grad) in model.named_vars().iter().zip(&out.grads) {
                var.set(&(var.as_tensor() - (grad * 0.1).unwrap()).unwrap())
                    .unwrap();
            }
            last = out.loss;
        }
        assert!(
            last < first.loss - 0.05,
            "{}: {} -> {last}",
            label(&config),
            first.loss
        );
    }
}

#[test]
fn causal_models_do_not_see_the_future() {
    for config in configs().into_iter().filter(|c| c.family != Family::Bert) {
        let model = model(&config, DType::F32);
        let mut batch = batch(&config);
        // Count all positions but the last; then change only the last input token.
        let mut keep = vec![1f32; BATCH * SEQ];
        keep.iter_mut()
            .skip(SEQ - 1)
            .step_by(SEQ)
            .for_each(|k| *k = 0.0);
        batch.loss_mask = Some(Tensor::from_vec(keep, (BATCH, SEQ), &Device::Cpu).unwrap());
        let before = step(&model, &batch, Checkpointing::None).loss;
        let mut ids: Vec<u32> = values(&batch.input_ids).iter().map(|&v| v as u32).collect();
        ids.iter_mut()
            .skip(SEQ - 1)
            .step_by(SEQ)
            .for_each(|t| *t = (*t + 1) % VOCAB as u32);
        batch.input_ids = Tensor::from_vec(ids, (BATCH, SEQ), &Device::Cpu).unwrap();
        let after = step(&model, &batch, Checkpointing::None).loss;
        assert_eq!(before, after, "{}", label(&config));
    }
}

#[test]
fn bert_ignores_padded_tokens() {
    let config = tiny(Family::Bert);
    let model = model(&config, DType::F32);
    let mut batch = batch(&config);
    // The last three positions of each sequence are padding, kept out of the loss.
    let keep: Vec<u32> = (0..BATCH * SEQ)
        .map(|i| u32::from(i % SEQ < SEQ - 3))
        .collect();
    let loss_mask: Vec<f32> = values(batch.loss_mask.as_ref().unwrap())
        .iter()
        .zip(&keep)
        .map(|(&m, &k)| m * k as f32)
        .collect();
    let loss_mask = if loss_mask.contains(&1.0) {
        loss_mask
    } else {
        keep.iter().map(|&k| k as f32).collect()
    };
    batch.loss_mask = Some(Tensor::from_vec(loss_mask, (BATCH, SEQ), &Device::Cpu).unwrap());
    batch.attention_mask =
        Some(Tensor::from_vec(keep.clone(), (BATCH, SEQ), &Device::Cpu).unwrap());
    let before = step(&model, &batch, Checkpointing::Every(1));
    let ids: Vec<u32> = values(&batch.input_ids)
        .iter()
        .zip(&keep)
        .map(|(&v, &k)| if k == 1 { v as u32 } else { 5 })
        .collect();
    batch.input_ids = Tensor::from_vec(ids, (BATCH, SEQ), &Device::Cpu).unwrap();
    let after = step(&model, &batch, Checkpointing::Every(1));
    assert!(
        (before.loss - after.loss).abs() < 1e-6,
        "{} vs {}",
        before.loss,
        after.loss
    );
    // Without the padding mask the padded tokens do change the loss.
    batch.attention_mask = None;
    let unmasked = step(&model, &batch, Checkpointing::Every(1));
    assert!((unmasked.loss - after.loss).abs() > 1e-6);
}

fn temp_file(dir: &tempfile::TempDir, name: &str) -> PathBuf {
    dir.path().join(name)
}

fn assert_same_params(a: &HubModel, b: &HubModel) {
    assert_eq!(a.named_vars().len(), b.named_vars().len());
    for ((na, va), (nb, vb)) in a.named_vars().iter().zip(b.named_vars()) {
        assert_eq!(na, nb);
        assert_eq!(va.dtype(), vb.dtype(), "{na}");
        assert_eq!(values(va.as_tensor()), values(vb.as_tensor()), "{na}");
    }
}

#[test]
fn save_then_load_gives_identical_tensors_and_loss() {
    let dir = tempfile::tempdir().unwrap();
    for (i, config) in configs().into_iter().enumerate() {
        for dtype in [DType::F32, DType::BF16] {
            let original = model(&config, dtype);
            let path = temp_file(&dir, &format!("{i}-{dtype:?}.safetensors"));
            original.save(&path).unwrap();
            let loaded = build_model(&config, Some(&[path]), dtype, &Device::Cpu, 99).unwrap();
            assert_same_params(&original, &loaded);
            let batch = batch(&config);
            let (a, b) = (
                step(&original, &batch, Checkpointing::None),
                step(&loaded, &batch, Checkpointing::None),
            );
            assert_eq!(a.loss, b.loss, "{}", label(&config));
        }
    }
}

#[test]
fn random_init_is_reproducible_from_the_seed() {
    let config = tiny(Family::Gpt2);
    let a = build_model(&config, None, DType::F32, &Device::Cpu, 3).unwrap();
    let b = build_model(&config, None, DType::F32, &Device::Cpu, 3).unwrap();
    let c = build_model(&config, None, DType::F32, &Device::Cpu, 4).unwrap();
    assert_same_params(&a, &b);
    assert_ne!(
        values(a.named_vars()[0].1.as_tensor()),
        values(c.named_vars()[0].1.as_tensor())
    );
    let (name, norm) = &a.named_vars()[2];
    assert_eq!(name, "h.0.ln_1.weight");
    assert!(values(norm.as_tensor()).iter().all(|&v| v == 1.0));
}

/// Writes `model`'s parameters under names rewritten by `rename`, plus `extra` tensors,
/// split over `files` shards.
fn write_renamed(
    model: &HubModel,
    dir: &tempfile::TempDir,
    files: usize,
    rename: impl Fn(&str) -> String,
    extra: &[(&str, Tensor)],
) -> Vec<PathBuf> {
    let mut shards: Vec<HashMap<String, Tensor>> = vec![HashMap::new(); files];
    for (i, (name, var)) in model.named_vars().iter().enumerate() {
        shards[i % files].insert(rename(name), var.as_tensor().clone());
    }
    for (name, t) in extra {
        shards[0].insert(name.to_string(), t.clone());
    }
    shards
        .iter()
        .enumerate()
        .map(|(i, shard)| {
            let path = temp_file(dir, &format!("shard-{i}-of-{files}.safetensors"));
            candle_core::safetensors::save(shard, &path).unwrap();
            path
        })
        .collect()
}

#[test]
fn loads_gpt2_with_the_transformer_prefix_and_buffers() {
    let dir = tempfile::tempdir().unwrap();
    let config = tiny(Family::Gpt2);
    let original = model(&config, DType::F32);
    let wte = original.named_vars()[0].1.as_tensor().clone();
    let buffer = Tensor::ones((1, 1, 16, 16), DType::F32, &Device::Cpu).unwrap();
    let extra = [
        ("transformer.h.0.attn.bias", buffer),
        ("lm_head.weight", wte),
    ];
    let paths = write_renamed(&original, &dir, 1, |n| format!("transformer.{n}"), &extra);
    let loaded = build_model(&config, Some(&paths), DType::F32, &Device::Cpu, 0).unwrap();
    assert_same_params(&original, &loaded);
}

#[test]
fn loads_bert_without_prefix_and_with_gamma_beta_names() {
    let dir = tempfile::tempdir().unwrap();
    let config = tiny(Family::Bert);
    let original = model(&config, DType::F32);
    let rename = |n: &str| {
        let n = n.strip_prefix("bert.").unwrap_or(n);
        let n = n
            .replace("LayerNorm.weight", "LayerNorm.gamma")
            .replace("LayerNorm.bias", "LayerNorm.beta");
        n.to_string()
    };
    let pooler = Tensor::zeros((32, 32), DType::F32, &Device::Cpu).unwrap();
    let paths = write_renamed(
        &original,
        &dir,
        1,
        rename,
        &[("pooler.dense.weight", pooler)],
    );
    let loaded = build_model(&config, Some(&paths), DType::F32, &Device::Cpu, 0).unwrap();
    assert_same_params(&original, &loaded);
}

#[test]
fn loads_sharded_llama_into_another_dtype() {
    let dir = tempfile::tempdir().unwrap();
    let config = ModelConfig {
        tied_embeddings: false,
        ..tiny(Family::Llama)
    };
    let original = model(&config, DType::F32);
    let paths = write_renamed(&original, &dir, 3, str::to_string, &[]);
    let loaded = build_model(&config, Some(&paths), DType::BF16, &Device::Cpu, 0).unwrap();
    for ((name, a), (_, b)) in original.named_vars().iter().zip(loaded.named_vars()) {
        assert_eq!(b.dtype(), DType::BF16);
        let expected = a.as_tensor().to_dtype(DType::BF16).unwrap();
        assert_eq!(values(&expected), values(b.as_tensor()), "{name}");
    }
}

#[test]
fn bad_weight_files_are_input_errors_naming_the_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let config = tiny(Family::Gpt2);
    let original = model(&config, DType::F32);
    let missing = write_renamed(
        &original,
        &dir,
        1,
        |n| n.replace("h.1.ln_2.bias", "unrelated"),
        &[],
    );
    assert_refused(&config, &missing, "h.1.ln_2.bias");

    let bigger = ModelConfig {
        hidden: 64,
        ..config.clone()
    };
    assert_refused(&bigger, &missing, "shape");

    // A tensor the model has no parameter for: the checkpoint is refused.
    let extra = Tensor::ones(32, DType::F32, &Device::Cpu).unwrap();
    let sub = tempfile::tempdir().unwrap();
    let unused = write_renamed(
        &original,
        &sub,
        1,
        str::to_string,
        &[("h.0.attn.q_norm.weight", extra)],
    );
    assert_refused(&config, &unused, "would not use: h.0.attn.q_norm.weight");

    let not_safetensors = temp_file(&dir, "garbage.safetensors");
    std::fs::write(&not_safetensors, b"not a safetensors file").unwrap();
    assert_refused(&config, &[not_safetensors], "");
}

/// Checks that building `config` from `files` is an input error that says
/// `says`.
fn assert_refused(config: &ModelConfig, files: &[PathBuf], says: &str) {
    let err = build_model(config, Some(files), DType::F32, &Device::Cpu, 0)
        .err()
        .unwrap();
    let input = matches!(err, Error::Input { .. });
    assert!(input && err.to_string().contains(says), "{err}");
}

#[test]
fn unusable_requests_are_usage_errors() {
    let generic = ModelConfig {
        family: Family::Generic,
        ..tiny(Family::Gpt2)
    };
    assert!(matches!(
        build_model(&generic, None, DType::F32, &Device::Cpu, 0),
        Err(Error::Usage(_))
    ));
    let odd = ModelConfig {
        heads: 5,
        ..tiny(Family::Gpt2)
    };
    assert!(matches!(
        build_model(&odd, None, DType::F32, &Device::Cpu, 0),
        Err(Error::Usage(_))
    ));
    assert!(matches!(
        build_model(&tiny(Family::Gpt2), None, DType::U32, &Device::Cpu, 0),
        Err(Error::Usage(_))
    ));

    let config = tiny(Family::Gpt2);
    let model = model(&config, DType::F32);
    let long = synthetic_batch(Family::Gpt2, VOCAB, 1, 17, 0, &Device::Cpu).unwrap();
    let err = try_step(&model, &long, Checkpointing::None).err().unwrap();
    assert!(matches!(err, Error::Usage(_)), "{err}");
    let mut mismatched = batch(&config);
    mismatched.targets = mismatched.targets.narrow(1, 0, 4).unwrap();
    assert!(matches!(
        try_step(&model, &mismatched, Checkpointing::None),
        Err(Error::Usage(_))
    ));
}

#[test]
fn synthetic_batches_follow_the_family() {
    let causal = synthetic_batch(Family::Llama, VOCAB, BATCH, SEQ, 5, &Device::Cpu).unwrap();
    let (ids, targets) = (values(&causal.input_ids), values(&causal.targets));
    for row in 0..BATCH {
        assert_eq!(
            ids[row * SEQ + 1..(row + 1) * SEQ],
            targets[row * SEQ..(row + 1) * SEQ - 1]
        );
    }
    assert!(causal.loss_mask.is_none());

    let bert = synthetic_batch(Family::Bert, 200, BATCH, 32, 5, &Device::Cpu).unwrap();
    let (ids, targets, mask) = (
        values(&bert.input_ids),
        values(&bert.targets),
        values(bert.loss_mask.as_ref().unwrap()),
    );
    for i in 0..BATCH * 32 {
        if mask[i] == 1.0 {
            assert_eq!(ids[i], 103.0);
        } else {
            assert_eq!(ids[i], targets[i]);
        }
    }
    let masked = mask.iter().filter(|&&m| m == 1.0).count();
    assert!(
        (1..=24).contains(&masked),
        "{masked} of 64 positions masked"
    );
}

#[test]
fn sixteen_bit_losses_are_close_to_f32() {
    for config in configs() {
        let batch = batch(&config);
        let reference = step(&model(&config, DType::F32), &batch, Checkpointing::None).loss;
        for dtype in [DType::BF16, DType::F16] {
            let model = model(&config, dtype);
            for (policy, attention) in [
                (Checkpointing::None, Attention::Composed),
                (Checkpointing::Every(1), Attention::Composed),
                (Checkpointing::None, Attention::Flash),
                (Checkpointing::Every(1), Attention::Flash),
            ] {
                let out = model
                    .forward_backward(
                        &batch,
                        &Execution::default().checkpoint(policy).attention(attention),
                    )
                    .unwrap();
                let rel = (out.loss - reference).abs() / reference;
                assert!(
                    rel < 0.01,
                    "{} {dtype:?} {policy} {attention}: {} vs {reference}",
                    label(&config),
                    out.loss
                );
                for grad in &out.grads {
                    assert_eq!(grad.dtype(), dtype);
                    assert!(values(grad).iter().all(|v| v.is_finite()));
                }
            }
        }
    }
}

/// A fixture of `scripts/make-parity-fixtures.py`: the model as oomfix reads
/// its directory (weights and `config.json`), the reference values
/// transformers computed, and their batch.
struct Reference {
    name: &'static str,
    spec: oomfix::ModelSpec,
    values: HashMap<String, Tensor>,
    /// The same model and batch computed by transformers in bf16.
    bf16: HashMap<String, Tensor>,
    batch: TokenBatch,
}

impl Reference {
    /// The model in compute dtype `dtype`, built as the trainer builds it.
    fn model(&self, dtype: DType) -> HubModel {
        self.build(&self.spec.config, dtype).unwrap()
    }

    /// A model of `config` (the fixture's, some settings changed) on the
    /// fixture's weights.
    fn build(&self, config: &ModelConfig, dtype: DType) -> oomfix::Result<HubModel> {
        build_model(config, Some(&self.spec.files), dtype, &Device::Cpu, 0)
    }

    /// Why a model of `config` on the fixture's weights is refused.
    fn refusal(&self, config: &ModelConfig) -> String {
        let err = self.build(config, DType::F32).err();
        err.expect("refused").to_string()
    }

    /// Checks that the loss of `model`, which leaves out `what`, is not the
    /// fixture's (it moves by more than 1e-4).
    fn assert_moves(&self, model: &HubModel, what: &str) {
        let (want, other) = (
            self.loss(),
            step(model, &self.batch, Checkpointing::None).loss,
        );
        let rel = (other - want).abs() / want;
        eprintln!("{}: {what}: the loss moves by {rel:.2e}", self.name);
        assert!(rel > 1e-4, "{} {what}: {other} vs {want}", self.name);
    }

    fn loss(&self) -> f32 {
        values(&self.values["loss"])[0]
    }
}

fn references() -> Vec<Reference> {
    FIXTURES
        .into_iter()
        .map(|name| {
            let values = fixture_values(&format!("{name}.ref.safetensors"));
            Reference {
                spec: fixture_spec(name),
                bf16: fixture_values(&format!("{name}.bf16.safetensors")),
                batch: reference_batch(&values),
                name,
                values,
            }
        })
        .collect()
}

#[test]
fn the_reference_fixtures_are_the_families_they_stand_for() {
    let refs = references();
    let found: Vec<_> = refs
        .iter()
        .map(|r| {
            let c = &r.spec.config;
            let s = &c.settings;
            (
                r.name,
                c.family,
                c.kv_heads,
                c.tied_embeddings,
                c.qkv_bias,
                (
                    c.head_dim(),
                    s.qk_norm,
                    s.rope_scaling.as_deref().unwrap_or("-"),
                ),
            )
        })
        .collect();
    // The RoPE scaling of each (`-`: none).
    let l = Family::Llama;
    assert_eq!(
        found,
        [
            ("gpt2", Family::Gpt2, 4, true, false, (8, false, "-")),
            ("llama", l, 2, false, false, (8, false, "-")),
            ("qwen2", l, 2, true, true, (8, false, "-")),
            ("bert", Family::Bert, 4, true, true, (8, false, "-")),
            ("qwen3", l, 2, true, false, (16, true, "-")),
            ("llama3", l, 2, true, false, (16, false, "llama3")),
            ("llama-linear", l, 2, true, false, (8, false, "linear")),
            ("llama-dynamic", l, 2, true, false, (8, false, "dynamic")),
            ("llama-yarn", l, 2, true, false, (8, false, "yarn")),
            ("phi3", l, 2, false, false, (8, false, "-")),
            ("gemma2", l, 2, true, false, (16, false, "-")),
            ("gemma3", l, 2, true, false, (16, true, "linear")),
            ("phi3-longrope", l, 2, false, false, (8, false, "longrope")),
            ("phi4-mini", l, 2, true, false, (8, false, "longrope")),
        ]
    );
    for r in &refs[4..] {
        assert_eq!(
            r.spec.config.settings.architecture.as_deref(),
            Some(match r.name {
                "qwen3" => "Qwen3ForCausalLM",
                "phi3" | "phi3-longrope" | "phi4-mini" => "Phi3ForCausalLM",
                "gemma2" => "Gemma2ForCausalLM",
                "gemma3" => "Gemma3ForCausalLM",
                _ => "LlamaForCausalLM",
            })
        );
        let gemma = r.spec.config.settings.gemma.as_ref();
        assert_eq!(
            gemma.map(|g| (
                g.version,
                g.query_pre_attn_scalar,
                g.attn_softcap,
                g.final_softcap,
                g.sliding_layers.clone(),
                g.local_rope_theta
            )),
            match r.name {
                "gemma2" => Some((2, 12.0, Some(1.0), Some(3.0), vec![true, false, true], None)),
                "gemma3" => Some((3, 32.0, None, None, vec![true, false, true], Some(10_000.0))),
                _ => None,
            },
            "{}",
            r.name
        );
        assert_eq!(
            r.spec.config.settings.fused_projections,
            r.name.starts_with("phi"),
            "{}",
            r.name
        );
        assert_eq!(
            r.spec.config.rotary_dim(),
            if r.name == "phi4-mini" {
                6
            } else {
                r.spec.config.head_dim()
            },
            "{}",
            r.name
        );
    }
}

/// Loss and gradients agree with Hugging Face transformers (f32, eager
/// attention) on tiny models with random weights, biases and norm scales.
#[test]
fn losses_and_gradients_match_hugging_face_transformers() {
    for r in references() {
        let (name, expected_loss) = (r.name, r.loss());
        let model = r.model(DType::F32);
        let chunk = chunk_of(&r.spec.config, 5);
        let chunked = r.spec.config.chunked_loss_computes_it();
        if !chunked {
            // A soft-capped head (Gemma 2): the chunks do not cap, so they refuse.
            let exec = Execution::default().loss_chunks(Some(chunk));
            assert!(model.forward_backward(&r.batch, &exec).is_err(), "{name}");
        }
        for (policy, chunks) in [
            (Checkpointing::None, None),
            (Checkpointing::Every(1), None),
            (Checkpointing::None, Some(chunk)),
            (Checkpointing::Every(1), Some(chunk)),
        ] {
            if chunks.is_some() && !chunked {
                continue;
            }
            let exec = Execution::default().checkpoint(policy).loss_chunks(chunks);
            let out = model.forward_backward(&r.batch, &exec).unwrap();
            let policy = match chunks {
                None => policy.to_string(),
                Some(_) => format!("{policy}, chunked loss"),
            };
            assert!(
                (out.loss - expected_loss).abs() < 1e-5 * expected_loss,
                "{name}: {} vs {expected_loss}",
                out.loss
            );
            let expected: Vec<&Tensor> = model
                .named_vars()
                .iter()
                .map(|(n, _)| &r.values[&format!("grad.{n}")])
                .collect();
            let largest = expected.iter().map(|g| max_abs(g)).fold(0f32, f32::max);
            let worst = model
                .named_vars()
                .iter()
                .zip(&out.grads)
                .zip(&expected)
                .filter(|(((n, _), _), _)| !analytically_zero(n))
                .map(|((_, got), want)| rel_error(got, want))
                .fold(0f32, f32::max);
            eprintln!(
                "{name} F32 {policy}: loss {:.2e}, gradients up to {worst:.2e}",
                (out.loss - expected_loss).abs() / expected_loss
            );
            for (((n, _), got), want) in model.named_vars().iter().zip(&out.grads).zip(expected) {
                let scale = if analytically_zero(n) {
                    largest
                } else {
                    max_abs(want)
                };
                let rel = max_diff(got, want) / scale;
                assert!(
                    rel < 1e-5,
                    "{name} {policy}: gradient of {n} differs by {rel:e}"
                );
            }
        }
    }
}

/// The logits (every position, padding included) and the loss agree with
/// transformers' f32 values: within 1e-4 relative in f32 compute; in bf16
/// compute (the weights rounded to bf16, as `--precision bf16` trains)
/// within 2⁻⁵ (3.1%) of the largest logit and 0.5% of the loss. bf16 keeps 8
/// significant bits, so each rounding errs by up to 2⁻⁹ (0.2%) of its value;
/// the weights, the activations between ops and the outputs of 2 blocks and
/// the head are each rounded, and the errors pass on through the following
/// products: 2⁻⁵ allows 16 such roundings in a row (about 5 are measured). The
/// loss, a mean over the positions, averages the logits' errors. A logit's
/// error is relative to the largest logit (one near zero has no relative
/// precision to speak of).
#[test]
fn logits_and_losses_match_hugging_face_transformers_in_f32_and_bf16() {
    for r in references() {
        let want = &r.values["logits"];
        let (largest, expected_loss) = (max_abs(want), r.loss());
        for (dtype, logits_tol, loss_tol) in
            [(DType::F32, 1e-4, 1e-4), (DType::BF16, 1.0 / 32.0, 5e-3)]
        {
            let model = r.model(dtype);
            if !r.spec.config.flash_computes_it() {
                // Gemma: flash attention is refused, not computed as another function.
                let exec = Execution::default().attention(Attention::Flash);
                let err = model.logits(&r.batch, &exec).unwrap_err().to_string();
                assert!(err.contains("Gemma"), "{}: {err}", r.name);
            }
            let kinds: &[Attention] = if r.spec.config.flash_computes_it() {
                &[Attention::Composed, Attention::Flash]
            } else {
                &[Attention::Composed]
            };
            for &attention in kinds {
                let exec = Execution::default().attention(attention);
                let got = model.logits(&r.batch, &exec).unwrap();
                assert_eq!(got.dims(), want.dims(), "{}", r.name);
                assert_eq!(got.dtype(), DType::F32);
                let logits_rel = max_diff(&got, want) / largest;
                let loss = model.forward_backward(&r.batch, &exec).unwrap().loss;
                let forward_only = model.loss(&r.batch, &exec).unwrap();
                assert!(
                    (forward_only - loss).abs() <= 1e-5 * loss.abs(),
                    "{} {dtype:?} {attention}: forward-only loss {forward_only} vs {loss}",
                    r.name
                );
                let loss_rel = (loss - expected_loss).abs() / expected_loss;
                if r.spec.config.chunked_loss_computes_it() {
                    let chunked = exec.loss_chunks(Some(chunk_of(&r.spec.config, 5)));
                    let chunked_loss = model.forward_backward(&r.batch, &chunked).unwrap().loss;
                    assert!(
                        (chunked_loss - loss).abs() <= 1e-5 * loss.abs(),
                        "{} {dtype:?} {attention}: chunked loss {chunked_loss} vs {loss}",
                        r.name
                    );
                }
                eprintln!(
                    "{} {dtype:?} {attention}: logits {logits_rel:.2e}, loss {loss_rel:.2e}",
                    r.name
                );
                assert!(
                    logits_rel < logits_tol,
                    "{} {dtype:?} {attention}: logits differ by {logits_rel:e} of the largest",
                    r.name
                );
                assert!(
                    loss_rel < loss_tol,
                    "{} {dtype:?} {attention}: loss {loss} vs {expected_loss}",
                    r.name
                );
            }
        }
    }
}

/// In bf16 compute (weights rounded to bf16, as `--precision bf16` trains)
/// the loss and every gradient are as close to transformers' f32 values as
/// transformers' own bf16 step is: each gradient's error (largest
/// difference over its largest element) within twice the largest error of
/// transformers' bf16 gradients on the same model, plus 1% (bf16 keeps 8
/// significant bits: two computations that round in different places
/// differ by a few of its steps), and the loss within 0.5%.
#[test]
fn bf16_losses_and_gradients_are_as_close_to_f32_as_transformers_bf16() {
    for r in references() {
        let model = r.model(DType::BF16);
        let out = step(&model, &r.batch, Checkpointing::None);
        let (want, theirs) = (r.loss(), values(&r.bf16["loss"])[0]);
        let loss_rel = (out.loss - want).abs() / want;
        let mut worst_theirs = 0f32;
        let mut errors = Vec::new();
        for ((n, _), got) in model.named_vars().iter().zip(&out.grads) {
            if analytically_zero(n) {
                continue;
            }
            let truth = &r.values[&format!("grad.{n}")];
            let theirs = rel_error(&r.bf16[&format!("grad.{n}")], truth);
            let ours = rel_error(&got.to_dtype(DType::F32).unwrap(), truth);
            worst_theirs = worst_theirs.max(theirs);
            errors.push((n.clone(), ours, theirs));
        }
        let worst_ours = errors.iter().map(|e| e.1).fold(0f32, f32::max);
        eprintln!(
            "{} bf16: loss {loss_rel:.2e} (transformers {:.2e}), gradients up to {worst_ours:.2e} (transformers {worst_theirs:.2e})",
            r.name,
            (theirs - want).abs() / want
        );
        assert!(
            loss_rel < 5e-3,
            "{}: bf16 loss {} vs {want}",
            r.name,
            out.loss
        );
        for (n, ours, _) in errors {
            assert!(
                ours < 2.0 * worst_theirs + 0.01,
                "{}: bf16 gradient of {n} errs by {ours:e} (transformers' bf16 by at most {worst_theirs:e})",
                r.name
            );
        }
    }
}

/// The new fixtures tell their family's maths apart: computed without it
/// (RoPE unscaled; Qwen3's q/k norm scales at 1), the loss moves by more
/// than ten times the f32 parity tolerance (1e-5); and Qwen3's checkpoint
/// read as a plain Llama is refused, naming its q/k norms.
#[test]
fn the_fixtures_fail_a_model_without_the_familys_maths() {
    // The fixtures with a scaled RoPE (Gemma's are below) and Qwen3.
    let scaled = |s: &oomfix::ModelSettings| s.rope_scaling.is_some() && s.gemma.is_none();
    for r in references()
        .into_iter()
        .filter(|r| scaled(&r.spec.config.settings) || r.name == "qwen3")
    {
        let model = if r.name == "qwen3" {
            let model = r.model(DType::F32);
            for (n, var) in model.named_vars() {
                if n.ends_with("q_norm.weight") || n.ends_with("k_norm.weight") {
                    var.set(&var.ones_like().unwrap()).unwrap();
                }
            }
            model
        } else {
            let mut config = r.spec.config.clone();
            config.settings.rope_scaling = None;
            r.build(&config, DType::F32).unwrap()
        };
        r.assert_moves(&model, "without the family's maths");
    }
    // Gemma: each part of its maths left out in turn moves the loss: the
    // soft-caps (Gemma 2), the sliding windows, the sliding blocks' own RoPE
    // base (Gemma 3), the query scale; and its weights read as a Llama's
    // are refused (the feed-forward norms unused).
    for r in references()
        .into_iter()
        .filter(|r| r.name.starts_with("gemma"))
    {
        let g = r.spec.config.settings.gemma.clone().unwrap();
        let mut variants: Vec<(&str, oomfix::GemmaSettings)> = vec![
            (
                "no sliding window",
                oomfix::GemmaSettings {
                    sliding_layers: vec![false; g.sliding_layers.len()],
                    ..g.clone()
                },
            ),
            (
                "query scale 1/√head_dim",
                oomfix::GemmaSettings {
                    query_pre_attn_scalar: r.spec.config.head_dim() as f64,
                    ..g.clone()
                },
            ),
        ];
        if g.version == 2 {
            variants.push((
                "no attention soft-cap",
                oomfix::GemmaSettings {
                    attn_softcap: None,
                    ..g.clone()
                },
            ));
            variants.push((
                "no final soft-cap",
                oomfix::GemmaSettings {
                    final_softcap: None,
                    ..g.clone()
                },
            ));
        } else {
            variants.push((
                "the global RoPE base everywhere",
                oomfix::GemmaSettings {
                    local_rope_theta: None,
                    ..g.clone()
                },
            ));
        }
        for (what, settings) in variants {
            let mut config = r.spec.config.clone();
            config.settings.gemma = Some(settings);
            r.assert_moves(&r.build(&config, DType::F32).unwrap(), what);
        }
        // Norm scales w rather than 1 + w.
        let model = r.model(DType::F32);
        for (n, var) in model.named_vars() {
            if n.ends_with("norm.weight") {
                var.set(&(var.as_tensor() - 1.0).unwrap()).unwrap();
            }
        }
        r.assert_moves(&model, "norm scales w");
        let mut plain = r.spec.config.clone();
        plain.settings.gemma = None;
        plain.settings.hidden_act = Some("silu".into());
        let err = r.refusal(&plain);
        assert!(
            err.contains("would not use") && err.contains("pre_feedforward_layernorm"),
            "{err}"
        );
    }
    // Phi-3's fused projections read as separate ones: refused, naming the
    // separate projection it lacks.
    let phi3 = references().into_iter().find(|r| r.name == "phi3").unwrap();
    let mut plain = phi3.spec.config.clone();
    plain.settings.fused_projections = false;
    let err = phi3.refusal(&plain);
    assert!(
        err.contains("missing tensor `model.layers.0.self_attn.q_proj.weight`"),
        "{err}"
    );
    let qwen3 = references().into_iter().nth(4).unwrap();
    let mut plain = qwen3.spec.config.clone();
    plain.settings.qk_norm = false;
    let err = qwen3.refusal(&plain);
    assert!(
        err.contains("would not use") && err.contains("model.layers.0.self_attn.q_norm.weight"),
        "{err}"
    );
}

#[test]
fn out_of_vocabulary_ids_are_errors_not_panics() {
    let config = tiny(Family::Gpt2);
    let model = model(&config, DType::F32);
    let too_big = Tensor::full(VOCAB as u32, (BATCH, SEQ), &Device::Cpu).unwrap();
    let mut batch = batch(&config);
    batch.input_ids = too_big.clone();
    let err = try_step(&model, &batch, Checkpointing::None).err().unwrap();
    assert!(err.to_string().contains("index"), "{err}");
    let mut batch = self::batch(&config);
    batch.targets = too_big;
    assert!(try_step(&model, &batch, Checkpointing::None).is_err());
}

/// The whole model's gradient against a central finite difference of the loss
/// along a direction mixing the gradient and a random vector (all parameters
/// moved at once; the gradient part keeps the difference far above f32
/// rounding): checks every op's backward end to end, the fused norms and
/// linears included. A vocabulary of 61 takes the padded LM-head path
/// (logits over 64 columns, the last three masked out of the loss).
#[test]
fn gradients_match_finite_differences() {
    let padded = [Family::Gpt2, Family::Llama, Family::Bert].map(|f| ModelConfig {
        vocab: 61,
        ..tiny(f)
    });
    // The biased Llama's o_proj and down_proj biases have gradients ~100x the
    // others: along the gradient the loss curves too much for this step;
    // `llama_biases_match_finite_differences` checks them element by element.
    let unbiased = configs().into_iter().filter(|c| !c.settings.mlp_bias);
    for config in unbiased.chain(padded) {
        let m = model(&config, DType::F32);
        let b = batch(&config);
        let out = step(&m, &b, Checkpointing::None);
        let vars: Vec<_> = m.named_vars().iter().map(|(_, v)| v.clone()).collect();
        let start: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().copy().unwrap()).collect();
        let dirs: Vec<Tensor> = start
            .iter()
            .zip(&out.grads)
            .map(|(t, g)| ((g * 50.0).unwrap() + t.randn_like(0.0, 1e-2).unwrap()).unwrap())
            .collect();
        // The sum of the elements of `a · b`, over all the tensors.
        let dot = |a: &[Tensor], b: &[Tensor]| -> f64 {
            let product = |(x, y): (&Tensor, &Tensor)| {
                let sum = (x * y).unwrap().sum_all().unwrap();
                f64::from(sum.to_scalar::<f32>().unwrap())
            };
            a.iter().zip(b).map(product).sum()
        };
        let norm = dot(&dirs, &dirs).sqrt();
        let predicted = dot(&out.grads, &dirs) / norm;
        let eps = 1e-2;
        let loss_at = |t: f64| {
            for ((v, s), d) in vars.iter().zip(&start).zip(&dirs) {
                v.set(&(s + (d * (t / norm)).unwrap()).unwrap()).unwrap();
            }
            step(&m, &b, Checkpointing::None).loss as f64
        };
        let measured = (loss_at(eps) - loss_at(-eps)) / (2.0 * eps);
        loss_at(0.0);
        let error = (measured - predicted).abs() / predicted.abs().max(1e-3);
        assert!(
            error < 2e-2,
            "{}: directional derivative {predicted:.5e}, finite difference {measured:.5e} ({error:.1e})",
            label(&config)
        );
    }
}

/// The loss of `config` (random weights, seed 7) on the synthetic batch.
fn loss_of(config: &ModelConfig) -> f32 {
    step(
        &model(config, DType::F32),
        &batch(config),
        Checkpointing::None,
    )
    .loss
}

#[test]
fn the_checkpoints_norm_epsilon_rope_base_and_activation_are_used() {
    use oomfix::ModelSettings;
    let with = |family, settings: ModelSettings| ModelConfig {
        settings,
        ..tiny(family)
    };
    for family in [Family::Gpt2, Family::Llama, Family::Bert] {
        let base = loss_of(&tiny(family));
        // The family's default epsilon written out gives the same loss.
        let same = with(
            family,
            ModelSettings {
                norm_eps: Some(tiny(family).norm_eps()),
                ..Default::default()
            },
        );
        assert_eq!(loss_of(&same), base, "{family}");
        // A large epsilon changes every norm.
        let eps = with(
            family,
            ModelSettings {
                norm_eps: Some(0.5),
                ..Default::default()
            },
        );
        assert_ne!(loss_of(&eps), base, "{family}: norm_eps is used");
    }
    let llama = loss_of(&tiny(Family::Llama));
    let theta = with(
        Family::Llama,
        ModelSettings {
            rope_theta: Some(1.0),
            ..Default::default()
        },
    );
    assert_ne!(loss_of(&theta), llama, "rope_theta is used");
    // GPT-2 with erf GELU, BERT with the tanh approximation. With small random
    // weights the two forms differ by less than the loss's f32 resolution for
    // BERT: the gradients show it.
    let grads_of = |config: &ModelConfig| -> Vec<f32> {
        let out = step(
            &model(config, DType::F32),
            &batch(config),
            Checkpointing::None,
        );
        out.grads.iter().flat_map(values).collect()
    };
    for (family, act) in [(Family::Gpt2, "gelu"), (Family::Bert, "gelu_new")] {
        let other = with(
            family,
            ModelSettings {
                hidden_act: Some(act.into()),
                ..Default::default()
            },
        );
        assert_ne!(grads_of(&other), grads_of(&tiny(family)), "{family} {act}");
    }
}

#[test]
fn what_the_families_do_not_implement_is_refused() {
    use oomfix::ModelSettings;
    let cases = [
        (
            Family::Llama,
            ModelSettings {
                rope_scaling: Some("mrope".into()),
                ..Default::default()
            },
            "rope_scaling is \"mrope\"",
        ),
        (
            Family::Llama,
            ModelSettings {
                hidden_act: Some("gelu".into()),
                ..Default::default()
            },
            "hidden_act is \"gelu\"",
        ),
        (
            Family::Gpt2,
            ModelSettings {
                hidden_act: Some("relu".into()),
                ..Default::default()
            },
            "activation_function is \"relu\"",
        ),
    ];
    for (family, settings, says) in cases {
        let config = ModelConfig {
            settings,
            ..tiny(family)
        };
        let err = build_model(&config, None, DType::F32, &Device::Cpu, 0)
            .err()
            .expect("refused")
            .to_string();
        assert!(err.contains(says), "{err}");
    }
    // A sliding window is refused only when the sequence is longer.
    let windowed = ModelConfig {
        settings: ModelSettings {
            sliding_window: Some(SEQ),
            ..Default::default()
        },
        ..tiny(Family::Llama)
    };
    assert!(windowed.unsupported(SEQ).is_none());
    let (field, value, _) = windowed.unsupported(SEQ + 1).unwrap();
    assert_eq!((field, value), ("sliding_window", SEQ.to_string()));
}

/// Every bias of a Llama with `attention_bias` and `mlp_bias`: the gradient of
/// its largest-gradient element against a central finite difference.
#[test]
fn llama_biases_match_finite_differences() {
    let config = configs()
        .into_iter()
        .find(|c| c.settings.mlp_bias && c.settings.attention_bias)
        .unwrap();
    let m = model(&config, DType::F32);
    let b = batch(&config);
    let out = step(&m, &b, Checkpointing::None);
    let mut checked = 0;
    for ((name, var), grad) in m.named_vars().iter().zip(&out.grads) {
        if !name.ends_with(".bias") {
            continue;
        }
        let start = values(var.as_tensor());
        let g = values(grad);
        let k = (0..g.len())
            .max_by(|&a, &b| g[a].abs().total_cmp(&g[b].abs()))
            .unwrap();
        let h = 1e-2f32;
        let loss_at = |d: f32| {
            let mut v = start.clone();
            v[k] += d;
            var.set(&Tensor::from_vec(v, var.dims(), &Device::Cpu).unwrap())
                .unwrap();
            step(&m, &b, Checkpointing::None).loss
        };
        let measured = (loss_at(h) - loss_at(-h)) / (2.0 * h);
        loss_at(0.0);
        // f32 losses of ~4 differ by ~1e-6 at best: an absolute floor of 1e-4.
        assert!(
            (measured - g[k]).abs() <= 0.02 * g[k].abs() + 1e-4,
            "{name}[{k}]: gradient {:e}, finite difference {measured:e}",
            g[k]
        );
        checked += 1;
    }
    // q, k, v, o and gate, up, down per layer.
    assert_eq!(checked, 7 * config.layers);
}

/// The trainer with the plan's `chunked-loss` (micro-batches accumulated,
/// fp16 with the loss scaler, every block checkpointed): the same losses
/// and weights, step after step, as without it.
#[test]
fn a_trainer_with_the_chunked_loss_trains_as_without_it() {
    use oomfix::strategies::{OptimizerImpl, Plan, Precision};
    use oomfix::train::data::DataSource;
    use oomfix::{TrainOptions, Trainer};
    for config in [tiny(Family::Gpt2), tiny(Family::Llama)] {
        let plan = Plan {
            micro_batch: 1,
            grad_accum: 2,
            precision: Precision::F16,
            checkpoint: Checkpointing::Every(1),
            optimizer: OptimizerImpl::FusedAdamW,
            ..Plan::baseline(2, SEQ)
        };
        let run = |chunked_loss| {
            let plan = Plan {
                chunked_loss,
                ..plan
            };
            let options = TrainOptions::default();
            let mut t = Trainer::new(&config, plan, &Device::Cpu, &options).unwrap();
            let mut data = DataSource::synthetic(5);
            let stats: Vec<_> = (0..3).map(|_| t.step(&mut data).unwrap()).collect();
            // The loss scaler starts high: at least one step must be taken.
            assert!(stats.iter().any(|s| !s.skipped), "{}", label(&config));
            let losses: Vec<f32> = stats.iter().map(|s| s.loss).collect();
            let weights: Vec<Tensor> = t
                .model()
                .vars()
                .iter()
                .map(|v| v.as_tensor().clone())
                .collect();
            (losses, weights)
        };
        let (whole, whole_weights) = run(false);
        let (chunked, chunked_weights) = run(true);
        for (c, w) in chunked.iter().zip(&whole) {
            assert!(
                (c - w).abs() <= 1e-3 * w,
                "{}: {chunked:?} vs {whole:?}",
                label(&config)
            );
        }
        for (c, w) in chunked_weights.iter().zip(&whole_weights) {
            assert!(
                max_diff(c, w) <= 1e-2 * max_abs(w).max(1e-3),
                "{}",
                label(&config)
            );
        }
    }
}
