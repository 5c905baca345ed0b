//! The sequence-tiled MLP (`Execution::mlp_tile`): the loss and every
//! gradient equal the untiled block's in fp32 (within 1e-5 of the largest
//! value of each gradient), in every family of the reference fixtures of
//! `tests/train_models.rs`, with and without checkpointing, LoRA adapters
//! included; a tile that divides the tokens or not.

mod common;

use common::{
    adapted_fixture, fixture_model, fixture_spec, fixture_values, json_of, max_abs, oomfix,
    reference_batch, stderr_of,
};
use oomfix::strategies::{Checkpointing, Execution};
use oomfix::train::{HubModel, StepOutput, TokenBatch};
use oomfix::ModelSpec;

const FAMILIES: [&str; 9] = [
    "gpt2", "llama", "qwen2", "qwen3", "llama3", "phi3", "gemma2", "gemma3", "bert",
];

/// The fixture's reference batch.
fn batch(name: &str) -> TokenBatch {
    reference_batch(&fixture_values(&format!("{name}.ref.safetensors")))
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
        let model = fixture_model(&fixture_spec(name), None);
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
        let model = adapted_fixture(name);
        let batch = batch(name);
        let plain = step(&model, &batch, Checkpointing::Every(1), None);
        let tiled = step(&model, &batch, Checkpointing::Every(1), Some(5));
        assert_same(&model, &tiled, &plain, &format!("{name} with LoRA"));
    }
}

#[test]
fn mlp_tile_pins_the_tile_and_refuses_tiles_outside_the_sequence() {
    let plan = |tile: &str| {
        let mut cmd = oomfix();
        cmd.args(["--budget", "8GiB", "--seq-len", "1024", "--mlp-tile", tile]);
        cmd
    };
    let v = json_of(plan("256").arg("--json"), 0);
    assert_eq!(v["plan"]["mlp_tile"], 256, "{v:#}");
    let v = json_of(plan("none").arg("--json"), 0);
    assert!(v["plan"].get("mlp_tile").is_none(), "{v:#}");
    for (tile, says) in [
        ("0", "at least one token"),
        ("2048", "not within the sequence of 1024"),
        ("x", "a number of tokens"),
    ] {
        let stderr = stderr_of(&mut plan(tile), 2);
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
