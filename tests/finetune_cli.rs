//! Fine-tuning a model file through the real binary: where the weights start
//! (`--init`), text data with the model's tokenizer, the checkpoint's own
//! configuration and the training loop's schedule, clipping and evaluation.

mod common;

use assert_cmd::Command;
use candle_core::{Device, Tensor};
use oomfix::train::StateFile;
use oomfix::{Family, ModelConfig};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// A 2-layer GPT-2 of hidden 64 (one head), vocabulary 64, 32 positions.
fn tiny_config() -> ModelConfig {
    let mut c = ModelConfig::gpt2(2, 64, 1);
    c.vocab = 64;
    c.max_positions = 32;
    c.intermediate = 128;
    c
}

/// Writes `config`'s tensors to `path` (matrices of seeded normal values of
/// standard deviation 0.02, norm scales 1.5, biases 0.25); gives them back by name.
fn write_weights(path: &Path, config: &ModelConfig, seed: u64) -> HashMap<String, Tensor> {
    use rand::SeedableRng;
    use rand_distr::Distribution;
    let dev = Device::Cpu;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let normal = rand_distr::Normal::new(0f32, 0.02).unwrap();
    let tensors: HashMap<String, Tensor> = config
        .tensors()
        .into_iter()
        .map(|(name, shape)| {
            let t = if shape.len() >= 2 {
                let n = shape.iter().product();
                let v: Vec<f32> = (0..n).map(|_| normal.sample(&mut rng)).collect();
                Tensor::from_vec(v, shape, &dev).unwrap()
            } else if name.ends_with(".weight") {
                Tensor::full(1.5f32, shape, &dev).unwrap()
            } else {
                Tensor::full(0.25f32, shape, &dev).unwrap()
            };
            (name, t)
        })
        .collect();
    candle_core::safetensors::save(&tensors, path).unwrap();
    tensors
}

/// A directory holding a model and data files.
struct Dir {
    dir: tempfile::TempDir,
}

impl Dir {
    fn new() -> Dir {
        Dir {
            dir: tempfile::tempdir().unwrap(),
        }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn write(&self, name: &str, bytes: impl AsRef<[u8]>) {
        std::fs::write(self.path(name), bytes).unwrap();
    }

    /// `oomfix ARGS` in this directory, on the CPU, fp32, with small batches.
    fn oomfix(&self, args: &[&str]) -> Command {
        let mut cmd = Command::cargo_bin("oomfix").unwrap();
        cmd.current_dir(self.dir.path())
            .env_remove("RUST_LOG")
            .args(args)
            .args([
                "--device",
                "cpu",
                "--budget",
                "1GiB",
                "--precision",
                "fp32",
                "--global-batch",
                "2",
            ]);
        cmd
    }
}

/// u16 token ids as nanoGPT writes them.
fn token_bin(ids: impl IntoIterator<Item = u16>) -> Vec<u8> {
    ids.into_iter().flat_map(u16::to_le_bytes).collect()
}

/// The checkpoint's tensor `name` as f32 values.
fn saved(ck: &Path, name: &str) -> Vec<f32> {
    let ck = StateFile::open(ck).unwrap();
    ck.tensor(name).unwrap().flatten_all().unwrap().to_vec1().unwrap()
}

fn values(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1().unwrap()
}

#[test]
fn training_starts_from_the_files_weights_unless_asked_for_random() {
    let d = Dir::new();
    let config = tiny_config();
    let weights = write_weights(&d.path("model.safetensors"), &config, 1);
    d.write("data.bin", token_bin((0..400).map(|i| (i % 50) as u16)));
    // With a learning rate of 0 the checkpoint holds the starting weights.
    let run = |extra: &[&str]| {
        d.oomfix(&["train", "model.safetensors", "--data", "data.bin"])
            .args(["--seq-len", "16", "--steps", "1", "--lr", "0"])
            .args(["--save", "ck.safetensors"])
            .args(extra)
            .assert()
            .code(0);
        saved(&d.path("ck.safetensors"), "wte.weight")
    };
    let file = values(&weights["wte.weight"]);
    assert_eq!(run(&[]), file, "the default starts from the file");
    assert_eq!(run(&["--init", "pretrained"]), file);
    assert_eq!(run(&["--pretrained"]), file, "the former flag still works");
    let random = run(&["--init", "random"]);
    assert_eq!(random.len(), file.len());
    assert_ne!(random, file, "--init random does not read the file's weights");
}
