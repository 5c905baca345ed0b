//! The Hub shapes of `scripts/make-hub-shape.py` (the tensor lists
//! transformers builds from each model's Hub config, over a sparse data
//! region; Llama 3.x, Qwen3, Gemma 2/3, Phi-3.5/4-mini, TinyLlama and the
//! mixtures of experts Mixtral, Qwen3-MoE and OLMoE) read by the real
//! binary: each is recognised as its architecture
//! with transformers' parameter count; those under 4B parameters plan a
//! full fine-tune on one 80 GiB GPU, and Meta-Llama-3-8B fits 8 GiB under
//! QLoRA. These are the checkpoints the GPU rows of the family
//! accuracy matrix are measured on.

mod common;

use assert_cmd::Command;
use serde_json::Value;
use std::path::Path;
use tempfile::TempDir;

/// `scripts/make-hub-shape.py` run by `python` with `args`: its output.
fn make(python: &str, args: &[&str]) -> String {
    common::run_python_check(python, "make-hub-shape.py", args)
}

/// `oomfix inspect --json DIR`'s object.
fn inspect(dir: &Path) -> Value {
    let out = Command::cargo_bin("oomfix")
        .unwrap()
        .args(["inspect", "--json"])
        .arg(dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}: {}",
        dir.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
#[ignore = "needs OOMFIX_PYTHON, a Python with torch and transformers"]
fn the_hub_shapes_are_read_as_transformers_builds_them() {
    let python = std::env::var("OOMFIX_PYTHON")
        .expect("OOMFIX_PYTHON names a Python with torch and transformers");
    let names = make(&python, &["--list"]);
    let work = TempDir::new().unwrap();
    for name in names.lines() {
        let dir = work.path().join(name);
        let made: Value =
            serde_json::from_str(&make(&python, &[name, dir.to_str().unwrap()])).unwrap();
        let config: Value =
            serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
        let seen = inspect(&dir);
        assert_eq!(seen["parameters"], made["parameters"], "{name}");
        assert_eq!(seen["architecture"], config["architectures"][0], "{name}");
        assert!(seen["missing"].is_null(), "{name}: {}", seen["missing"]);
        if made["parameters"].as_u64().unwrap() > 4_000_000_000 {
            continue; // a full fine-tune of these needs more than one GPU
        }
        Command::cargo_bin("oomfix")
            .unwrap()
            .args([
                "--budget",
                "80GiB",
                "--seq-len",
                "1024",
                "--precision",
                "bf16",
            ])
            .arg(&dir)
            .assert()
            .code(0);
    }
    // The QLoRA plan of the issue, on transformers' own tensor list.
    Command::cargo_bin("oomfix")
        .unwrap()
        .args([
            "--budget",
            "8GiB",
            "--lora",
            "16",
            "--base-precision",
            "nf4",
        ])
        .arg(work.path().join("llama-3-8b"))
        .assert()
        .code(0);
}

#[test]
#[ignore = "needs OOMFIX_PYTHON, a Python with torch and transformers"]
fn a_smaller_model_of_a_family_is_made_with_set() {
    let python = std::env::var("OOMFIX_PYTHON")
        .expect("OOMFIX_PYTHON names a Python with torch and transformers");
    let work = TempDir::new().unwrap();
    let dir = work.path().join("gemma");
    let made = make(
        &python,
        &[
            "gemma-2-2b",
            dir.to_str().unwrap(),
            "--set",
            "num_hidden_layers=2",
        ],
    );
    let made: Value = serde_json::from_str(&made).unwrap();
    let seen = inspect(&dir);
    assert_eq!(seen["layers"], 2);
    assert_eq!(seen["parameters"], made["parameters"]);
}
