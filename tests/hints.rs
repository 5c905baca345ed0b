//! The hints of the real `oomfix` binary when nothing fits, and the
//! sequence-length check: each says what is true of the plan and of this
//! build.

mod common;

use assert_cmd::Command;
use oomfix::units::format_bytes;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::time::Duration;

fn oomfix() -> Command {
    let mut cmd = common::oomfix();
    cmd.timeout(Duration::from_secs(120));
    cmd
}

/// Runs `args`; the exit code, stdout and stderr.
fn run(args: &[&str]) -> (i32, String, String) {
    let out = oomfix().args(args).output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `args` with `--json`: the exit code and the one JSON object.
fn json_of(args: &[&str]) -> (i32, Value) {
    common::code_and_json(oomfix().args(args).arg("--json"))
}

fn advice(v: &Value) -> Vec<String> {
    v["advice"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap().to_string())
        .collect()
}

/// When the device would hold the closest plan but the host cannot hold its
/// offloaded optimizer state, the hints say so, with both figures and
/// `--host-budget`, and do not offer a budget the device already has.
#[test]
fn host_memory_that_fails_is_named_with_both_figures() {
    let args = ["--budget", "3GiB", "--host-budget", "1GiB"];
    let (code, v) = json_of(&args);
    assert_eq!(code, 1, "nothing fits: {v:#}");
    let closest = &v["closest"];
    let host = v["estimate"]["host_bytes"].as_u64().unwrap();
    assert!(host > 1 << 30, "the closest plan offloads: {closest:#}");
    let device = closest["estimated_bytes"].as_u64().unwrap();
    assert!(device < 3 << 30, "the device holds it: {closest:#}");
    let hints = advice(&v);
    let host_hint = hints
        .iter()
        .find(|a| a.contains("host memory is what fails"))
        .unwrap_or_else(|| panic!("no host-memory hint: {hints:?}"));
    assert!(host_hint.contains(&format_bytes(host)), "{host_hint}");
    assert!(host_hint.contains(&format_bytes(1 << 30)), "{host_hint}");
    assert!(host_hint.contains("--host-budget"), "{host_hint}");
    assert!(
        !hints.iter().any(|a| a.starts_with("a budget of")),
        "the device budget is not what fails: {hints:?}"
    );
    assert!(
        hints
            .iter()
            .any(|a| a.starts_with("without offloading, a budget of")),
        "{hints:?}"
    );

    let (code, text, _) = run(&args);
    assert_eq!(code, 1);
    assert!(!text.contains("0 B over the budget"), "{text}");
    assert!(text.contains("within the budget on the device"), "{text}");
    assert!(
        text.contains(&format!(
            "over the host memory it may use ({} on the host, {} allowed: --host-budget)",
            format_bytes(host),
            format_bytes(1 << 30)
        )),
        "{text}"
    );
    assert!(text.contains("hint: host memory is what fails"), "{text}");

    // Given the host memory, the same plan fits.
    let enough = format!("{host}");
    let (code, v) = json_of(&["--budget", "3GiB", "--host-budget", &enough]);
    assert_eq!(code, 0, "{v:#}");
    assert_eq!(v["plan"]["optimizer"], "cpu-adamw");
}

/// Ranks add device memory on GPUs, so planning for CUDA may hint at
/// `--gpus` (saying what a build without NCCL lacks to train over them);
/// on the CPU ranks share the host's memory, so it never does.
#[test]
fn gpus_are_suggested_only_where_ranks_add_memory() {
    // A GPT-2 XL shape (1.56B parameters): its training state outgrows
    // 12 GiB, a quarter of it does not.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("xl.safetensors");
    let config = oomfix::ModelConfig::gpt2(48, 1600, 25);
    common::write_safetensors(&path, &common::with_dtype(config.tensors(), "F32"));
    let model = path.to_str().unwrap();
    let plan = ["--budget", "12GiB", "--seq-len", "128", model];
    // On one GPU, without the offload fix: ZeRO 3 over 4 GPUs would fit.
    let no_offload = "accumulate,precision,flash-attention,checkpoint,fused-adamw,shard";
    let (code, v) = json_of(&[&plan[..], &["--strategies", no_offload]].concat());
    assert_eq!(code, 1, "{v:#}");
    let hints = advice(&v);
    let gpus = hints
        .iter()
        .find(|a| a.contains("--gpus"))
        .unwrap_or_else(|| panic!("no --gpus hint for CUDA: {hints:?}"));
    assert!(gpus.contains("ZeRO stage 3 would fit"), "{gpus}");
    assert_eq!(
        gpus.contains("needs a build with --features nccl"),
        !cfg!(feature = "nccl"),
        "{gpus}"
    );

    // The same on the CPU: the state's shards would fit each rank's budget,
    // but ranks on one host share its memory.
    let cpu = [&plan[..], &["--device", "cpu"]].concat();
    let (code, v) = json_of(&cpu);
    assert_eq!(code, 1, "{v:#}");
    let hints = advice(&v);
    assert!(!hints.is_empty());
    assert!(
        !hints
            .iter()
            .any(|a| a.contains("--gpus") || a.contains("GPUs")),
        "{hints:?}"
    );
    let (code, text, _) = run(&cpu);
    assert_eq!(code, 1);
    assert!(text.contains("hint: "), "{text}");
    assert!(!text.contains("--gpus"), "{text}");
}

/// A Llama-style model with an 8192-token context, as sparse weights with
/// its `config.json`.
fn long_context_llama(dir: &Path) -> PathBuf {
    let config = oomfix::ModelConfig {
        max_positions: 8192,
        ..common::tiny_llama()
    };
    let path = dir.join("model.safetensors");
    common::write_safetensors(&path, &common::with_dtype(config.tensors(), "F32"));
    common::write_json(
        &dir.join("config.json"),
        &json!({
            "model_type": "llama",
            "hidden_size": config.hidden,
            "num_attention_heads": config.heads,
            "num_key_value_heads": config.kv_heads,
            "intermediate_size": config.intermediate,
            "num_hidden_layers": config.layers,
            "vocab_size": config.vocab,
            "max_position_embeddings": 8192,
        }),
    );
    path
}

/// `--seq-len` beyond the model's context is a usage error naming the
/// context and the flag that allows it; with the flag it is planned.
#[test]
fn a_sequence_beyond_the_context_needs_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let model = long_context_llama(dir.path());
    let model = model.to_str().unwrap();
    for args in [
        &["--budget", "80GiB", "--seq-len", "1000000", model][..],
        &["--budget", "80GiB", "--seq-len", "8193", "--json", model],
        &[
            "train",
            model,
            "--device",
            "cpu",
            "--budget",
            "80GiB",
            "--seq-len",
            "8193",
        ],
    ] {
        let (code, stdout, stderr) = run(args);
        assert_eq!(code, 2, "{args:?}: {stderr}");
        assert!(stdout.is_empty(), "{args:?}: {stdout}");
        assert_eq!(stderr.lines().count(), 1, "{args:?}: {stderr}");
        assert!(stderr.contains("context of 8192 tokens"), "{stderr}");
        assert!(stderr.contains("--allow-beyond-context"), "{stderr}");
    }
    // At the context, and beyond it when asked for, it is planned.
    let (code, v) = json_of(&["--budget", "80GiB", "--seq-len", "8192", model]);
    assert_eq!(code, 0, "{v:#}");
    let (code, v) = json_of(&[
        "--budget",
        "80GiB",
        "--seq-len",
        "16384",
        "--allow-beyond-context",
        model,
    ]);
    assert_eq!(code, 0, "{v:#}");
    assert_eq!(v["plan"]["seq_len"], 16384);
    // Learned positions end at the context, flag or not (a GPT-2 in a
    // directory of its own: the Llama's config.json names another family).
    let gpt2_dir = tempfile::TempDir::new().unwrap();
    let gpt2 = common::tiny_gpt2_file(gpt2_dir.path());
    let (code, _, stderr) = run(&[
        "--budget",
        "8GiB",
        "--seq-len",
        "65",
        "--allow-beyond-context",
        gpt2.to_str().unwrap(),
    ]);
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("learned positions"), "{stderr}");
}
