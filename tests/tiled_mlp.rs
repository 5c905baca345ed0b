//! The sequence-tiled MLP (`Execution::mlp_tile`): the loss and every
//! gradient equal the untiled block's in fp32 (within 1e-5 of the largest
//! value of each gradient), in every family of the reference fixtures of
//! `tests/train_models.rs`, with and without checkpointing, LoRA adapters
//! included; a tile that divides the tokens or not.

mod common;

use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};
use oomfix::strategies::lora::{BasePrecision, Lora};
use oomfix::strategies::{Checkpointing, Execution};
use oomfix::train::{build_model_with, HubModel, StepOutput, TokenBatch};
use oomfix::ModelSpec;

const FAMILIES: [&str; 9] = [
    "gpt2", "llama", "qwen2", "qwen3", "llama3", "phi3", "gemma2", "gemma3", "bert",
];

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/train")
}

fn spec(name: &str) -> ModelSpec {
    oomfix::inspect(&fixtures().join(name).join("model.safetensors")).unwrap()
}

fn model(spec: &ModelSpec, lora: Option<&Lora>) -> HubModel {
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

/// The fixture's reference batch.
fn batch(name: &str) -> TokenBatch {
    let r = candle_core::safetensors::load(
        fixtures().join(format!("{name}.ref.safetensors")),
        &Device::Cpu,
    )
    .unwrap();
    let ids = |t: &Tensor| t.to_dtype(DType::U32).unwrap();
    TokenBatch {
        input_ids: ids(&r["input_ids"]),
        targets: ids(&r["targets"]),
        loss_mask: Some(r["loss_mask"].clone()),
        attention_mask: r.get("attention_mask").map(ids),
        documents: None,
    }
}

fn step(
    model: &HubModel,
    batch: &TokenBatch,
    policy: Checkpointing,
    tile: Option<usize>,
) -> StepOutput {
    let exec = Execution::default().checkpoint(policy).mlp_tiles(tile);
    model.forward_backward(batch, &exec).unwrap()
}

fn max_abs(t: &Tensor) -> f32 {
    t.abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

fn assert_same(model: &HubModel, got: &StepOutput, want: &StepOutput, what: &str) {
    let rel = (got.loss - want.loss).abs() / want.loss.abs();
    assert!(rel < 1e-6, "{what}: loss {} vs {}", got.loss, want.loss);
    let largest = want.grads.iter().map(max_abs).fold(0f32, f32::max);
    for ((name, _), (g, w)) in model
        .named_vars()
        .iter()
        .zip(got.grads.iter().zip(&want.grads))
    {
        let scale = max_abs(w).max(1e-3 * largest);
        let diff = max_abs(&(g - w).unwrap());
        assert!(
            diff / scale < 1e-5,
            "{what}: gradient of {name} differs by {:e}",
            diff / scale
        );
    }
}

#[test]
fn a_tiled_mlp_gives_the_untiled_loss_and_gradients_in_every_family() {
    for name in FAMILIES {
        let spec = spec(name);
        let model = model(&spec, None);
        let batch = batch(name);
        let (b, s) = batch.input_ids.dims2().unwrap();
        for policy in [Checkpointing::None, Checkpointing::Every(1)] {
            let plain = step(&model, &batch, policy, None);
            // A tile that divides the tokens, one that does not, one row.
            for tile in [s, (b * s) / 3 + 1, 1] {
                let tiled = step(&model, &batch, policy, Some(tile));
                assert_same(
                    &model,
                    &tiled,
                    &plain,
                    &format!("{name} {policy:?} tile {tile}"),
                );
            }
        }
    }
}

#[test]
fn adapters_on_the_mlp_train_the_same_tiled() {
    for name in ["llama", "gpt2", "gemma3", "phi3"] {
        let spec = spec(name);
        let facts = oomfix::memory::model_facts(&spec);
        let lora = Lora::new(4, Some(8), None, BasePrecision::Bf16, &facts).unwrap();
        let model = model(&spec, Some(&lora));
        common::seeded_variables(&model);
        let batch = batch(name);
        let plain = step(&model, &batch, Checkpointing::Every(1), None);
        let tiled = step(&model, &batch, Checkpointing::Every(1), Some(5));
        assert_same(&model, &tiled, &plain, &format!("{name} with LoRA"));
    }
}

fn oomfix(args: &[&str]) -> std::process::Output {
    assert_cmd::Command::cargo_bin("oomfix")
        .unwrap()
        .env_remove("RUST_LOG")
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn mlp_tile_pins_the_tile_and_refuses_tiles_outside_the_sequence() {
    let out = oomfix(&[
        "--budget",
        "8GiB",
        "--seq-len",
        "1024",
        "--mlp-tile",
        "256",
        "--json",
    ]);
    common::assert_exit(&out, 0);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["plan"]["mlp_tile"], 256, "{v:#}");
    let out = oomfix(&[
        "--budget",
        "8GiB",
        "--seq-len",
        "1024",
        "--mlp-tile",
        "none",
        "--json",
    ]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v["plan"].get("mlp_tile").is_none(), "{v:#}");
    for (tile, says) in [
        ("0", "at least one token"),
        ("2048", "not within the sequence of 1024"),
        ("x", "a number of tokens"),
    ] {
        let out = oomfix(&["--budget", "8GiB", "--seq-len", "1024", "--mlp-tile", tile]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{tile}: {stderr}");
        assert!(stderr.contains(says), "{tile}: {stderr}");
        // One line: the error, nothing else.
        assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr}");
    }
}

/// A model that does not run its MLP in tiles (a model given as code
/// declares what it does) refuses a pinned tile; the search skips the fix.
#[test]
fn a_model_without_tiles_refuses_the_pin() {
    use oomfix::strategies::model::Capabilities;
    let spec = ModelSpec::default_model();
    let mut pins = oomfix::Pins::default();
    pins.mlp_tile = Some(Some(256));
    let planner = || {
        oomfix::Planner::new(8 << 30)
            .seq_len(1024)
            .model_capabilities(Capabilities::NONE.with_blocks(12))
    };
    let e = planner().pins(pins).run(&spec).unwrap_err().to_string();
    assert!(
        e.contains("--mlp-tile cannot be used for this model"),
        "{e}"
    );
    let result = planner().run(&spec).unwrap();
    assert!(result.skipped.iter().any(|s| s.strategy == "tiled-mlp"));
}
