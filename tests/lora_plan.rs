//! LoRA and QLoRA planning with the real binary, on a Llama-3-8B-shaped
//! checkpoint (a real header over a sparse data region, with the Hub's
//! `config.json`): it fits 8 GiB with NF4 base weights (at 1024 tokens with
//! the loss in chunks); without LoRA
//! nothing fits 24 GiB and the advice says what LoRA would need; bad LoRA
//! settings are one line and exit 2.

mod common;

use assert_cmd::Command;
use serde_json::{json, Value};
use std::path::Path;
use std::time::Duration;
use tempfile::TempDir;

const GIB: u64 = 1 << 30;

/// A directory holding Meta-Llama-3-8B's shape: 32 blocks, hidden 4096, 32
/// heads and 8 key/value heads, MLP 14336, vocabulary 128256, untied head,
/// bf16 (8,030,261,248 parameters, 16 GB of data as a hole).
fn llama3_8b() -> TempDir {
    let dir = TempDir::new().unwrap();
    let config = oomfix::ModelConfig::llama(32, 4096, 32, 8, 14336, 128256, false);
    assert_eq!(config.parameter_count(), 8_030_261_248);
    let tensors = common::with_dtype(config.tensors(), "BF16");
    common::write_safetensors(&dir.path().join("model.safetensors"), &tensors);
    common::write_json(
        &dir.path().join("config.json"),
        &json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_attention_heads": 32,
            "num_hidden_layers": 32,
            "num_key_value_heads": 8,
            "max_position_embeddings": 8192,
            "rope_theta": 500000.0,
            "rms_norm_eps": 1e-05,
            "tie_word_embeddings": false,
            "vocab_size": 128256,
            "torch_dtype": "bfloat16"
        }),
    );
    dir
}

fn oomfix(dir: &Path) -> Command {
    let mut cmd = common::oomfix_in(dir);
    cmd.timeout(Duration::from_secs(120));
    cmd
}

/// `oomfix ARGS --json` in `dir`: the exit code and the JSON object.
fn plan_json(dir: &Path, args: &[&str]) -> (i32, Value) {
    let out = oomfix(dir).args(args).arg("--json").output().unwrap();
    (out.status.code().unwrap(), common::json_stdout(&out))
}

#[test]
fn qlora_fits_llama3_8b_in_8_gib() {
    let d = llama3_8b();
    let args = [
        ".",
        "--budget",
        "8GiB",
        "--lora",
        "16",
        "--base-precision",
        "nf4",
        "--seq-len",
        "512",
    ];
    let (code, out) = plan_json(d.path(), &args);
    assert_eq!(code, 0, "{out:#}");
    let plan = &out["plan"];
    assert_eq!(
        plan["lora"],
        json!({
            "rank": 16,
            "alpha": 32,
            "targets": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
            "base": "nf4"
        })
    );
    assert!(out["pinned"].as_array().unwrap().contains(&json!("lora")));
    let peak = out["estimate"]["peak_bytes"].as_u64().unwrap();
    assert!(peak <= 8 * GIB, "{peak}");
    // The frozen weights on the device, about 4.7 GiB (4-bit blocks and
    // their absmax, the 16-bit head), the 16-bit token embedding (only
    // looked up, 1 GiB) on the host, and the adapters' 41.9 M parameters:
    // no more gradients than the adapters' (bf16, 2 bytes each, or fp32).
    let weights = out["estimate"]["weights_bytes"].as_u64().unwrap();
    assert!((4 * GIB + GIB / 2..5 * GIB).contains(&weights), "{weights}");
    let host = out["estimate"]["host_bytes"].as_u64().unwrap();
    assert!(host >= 128_256 * 4096 * 2, "{host}");
    let gradients = out["estimate"]["gradients_bytes"].as_u64().unwrap();
    assert!(gradients <= 4 * 41_943_040, "{gradients}");
    // Every attempt carries the LoRA; none of them moved the pinned base.
    for a in out["attempts"].as_array().unwrap() {
        assert_eq!(a["lora"]["base"], "nf4", "{a:#}");
    }
    // The table names it.
    let table = oomfix(d.path()).args(args).output().unwrap();
    let text = String::from_utf8_lossy(&table.stdout);
    assert!(text.contains("LoRA r16 α32"), "{text}");
    assert!(text.contains("bf16/nf4"), "{text}");

    // At 1024 tokens (the default here) the NF4 base fits too, with the
    // token embedding on the host.
    let (code, out) = plan_json(d.path(), &args[..7]);
    assert_eq!(code, 0, "{out:#}");
    assert_eq!(out["plan"]["seq_len"], 1024);
    assert_eq!(out["plan"]["lora"]["base"], "nf4");
    let peak = out["estimate"]["peak_bytes"].as_u64().unwrap();
    assert!(peak <= 8 * GIB, "{peak}");
    // Unpinned, the search quantizes the base no further than it must: NF4,
    // not NF4 with 8-bit absmax values.
    let (code, out) = plan_json(d.path(), &args[..5]);
    assert_eq!(code, 0, "{out:#}");
    assert_eq!(out["plan"]["lora"]["base"], "nf4");
    assert_eq!(out["plan"]["seq_len"], 1024);
    assert!(out["estimate"]["peak_bytes"].as_u64().unwrap() <= 8 * GIB);
}

#[test]
fn the_search_quantizes_the_base_when_16_bits_do_not_fit() {
    let d = llama3_8b();
    let (code, out) = plan_json(d.path(), &[".", "--budget", "10GiB", "--lora", "8"]);
    assert_eq!(code, 0, "{out:#}");
    // 16 GB of bf16 base weights cannot fit 10 GiB: the `lora` fix moved it to NF4.
    let base = out["plan"]["lora"]["base"].as_str().unwrap();
    assert!(base.starts_with("nf4"), "{out:#}");
    let attempts = out["attempts"].as_array().unwrap();
    assert_eq!(attempts[0]["lora"]["base"], "bf16");
    assert!(attempts.iter().any(|a| a["strategy"] == "lora"));
    // With 40 GiB the bf16 base fits, and it is the faster plan (no
    // dequantizing).
    let (code, roomy) = plan_json(d.path(), &[".", "--budget", "40GiB", "--lora", "8"]);
    assert_eq!(code, 0);
    assert_eq!(roomy["plan"]["lora"]["base"], "bf16", "{roomy:#}");
}

/// The options that pin every field of a JSON attempt's plan.
fn pins_of(attempt: &Value) -> Vec<String> {
    let field = |key: &str| match &attempt[key] {
        Value::String(s) => s.clone(),
        v => v.to_string(),
    };
    let either = |key: &str, yes: &str, no: &str| {
        let value = if attempt[key] == true { yes } else { no };
        value.to_string()
    };
    let tile = attempt["mlp_tile"].as_u64();
    let pins = [
        ("--micro-batch", field("micro_batch")),
        ("--grad-accum", field("grad_accum")),
        ("--precision", field("precision")),
        ("--checkpoint", field("checkpoint")),
        ("--attention", field("attention")),
        ("--loss", either("chunked_loss", "chunked", "whole")),
        ("--optimizer", field("optimizer")),
        (
            "--activations",
            either("offload_activations", "host", "device"),
        ),
        ("--mlp-tile", tile.map_or("none".into(), |t| t.to_string())),
    ];
    pins.into_iter()
        .flat_map(|(option, value)| [option.to_string(), value])
        .collect()
}

#[test]
fn nothing_fits_without_lora_and_the_advice_says_what_lora_needs() {
    let d = llama3_8b();
    let (code, out) = plan_json(d.path(), &[".", "--budget", "24GiB"]);
    assert_eq!(code, 1, "{out:#}");
    let advice: Vec<&str> = out["advice"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    let hint = advice
        .iter()
        .find(|a| a.starts_with("--lora 16"))
        .unwrap_or_else(|| panic!("{advice:?}"));
    // 24 GiB holds the bf16 base (16 GB): no quantization needed.
    assert!(hint.starts_with("--lora 16 would fit ("), "{hint}");
    // The figure is the model's own estimate of that plan: planning it with
    // --lora 16 and the closest plan's fields pinned gives the same peak.
    let closest = pins_of(&out["closest"]);
    let mut pinned = vec![".", "--budget", "24GiB"];
    pinned.extend(["--lora", "16", "--base-precision", "bf16"]);
    pinned.extend(closest.iter().map(String::as_str));
    let (code, lora) = plan_json(d.path(), &pinned);
    assert_eq!(code, 0, "{lora:#}");
    let peak = lora["estimate"]["peak_bytes"].as_u64().unwrap();
    assert_eq!(
        *hint,
        format!(
            "--lora 16 would fit ({})",
            oomfix::units::format_bytes(peak)
        )
    );

    // At 8 GiB and 512 tokens NF4 base weights fit; at 1024 tokens too,
    // with the blocks' inputs on the host (the closest plan the hint starts
    // from is checkpointed); the table says so too.
    let (code, out) = plan_json(d.path(), &[".", "--budget", "8GiB", "--seq-len", "512"]);
    assert_eq!(code, 1);
    let advice = out["advice"].to_string();
    assert!(
        advice.contains("--lora 16 --base-precision nf4 would fit ("),
        "{advice}"
    );
    let table = oomfix(d.path())
        .args([".", "--budget", "8GiB"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&table.stdout);
    assert!(
        text.lines()
            .any(|l| l.starts_with("hint: --lora 16 --base-precision nf4 would fit (")),
        "{text}"
    );
    // Nothing fits even with LoRA: no LoRA hint.
    let (_, tiny) = plan_json(d.path(), &[".", "--budget", "2GiB"]);
    assert!(!tiny["advice"].to_string().contains("--lora"), "{tiny:#}");
}

#[test]
fn bad_lora_settings_are_one_line_and_exit_2() {
    let d = llama3_8b();
    let dir = d.path();
    let plan = |extra: &[&'static str]| {
        let mut args = vec![".", "--budget", "8GiB"];
        args.extend_from_slice(extra);
        args
    };
    let train = |extra: &[&'static str]| {
        let mut args = vec!["train", ".", "--budget", "8GiB"];
        args.extend_from_slice(extra);
        args
    };
    for (args, says) in [
        (plan(&["--lora", "0"]), "rank of 0"),
        (plan(&["--lora", "-4"]), "--lora"),
        // k_proj and v_proj are 1024 wide.
        (plan(&["--lora", "1025"]), "k_proj"),
        (
            plan(&["--lora", "16", "--lora-targets", "q_proj,qkv_proj"]),
            "unknown LoRA target `qkv_proj`",
        ),
        (
            plan(&["--base-precision", "nf4"]),
            "--base-precision sets up LoRA",
        ),
        (plan(&["--lora-alpha", "32"]), "needs --lora RANK"),
        (
            plan(&["--lora", "16", "--base-precision", "int3"]),
            "unknown base precision",
        ),
        (plan(&["--lora", "16", "--lora-alpha", "0"]), "--lora-alpha"),
        (
            train(&["--lora", "16", "--merge"]),
            "--merge says what --save writes: it needs --save DIR",
        ),
        (
            train(&["--merge", "--save", "out"]),
            "--merge adds LoRA adapters into the base weights: it needs --lora RANK",
        ),
        (
            train(&["--base-precision", "nf4"]),
            "--base-precision sets up LoRA",
        ),
    ] {
        eprintln!("{args:?}");
        common::refused(&oomfix(dir).args(args).output().unwrap(), &[says]);
    }
    assert!(!dir.join("out").exists());
    // Within bounds: a rank as wide as the narrowest target, and targets given.
    let (code, out) = plan_json(
        dir,
        &plan(&[
            "--lora",
            "1024",
            "--lora-targets",
            "v_proj,q_proj",
            "--lora-alpha",
            "8",
        ]),
    );
    assert!(code <= 1, "{out:#}");
    let lora = &out["attempts"][0]["lora"];
    assert_eq!(lora["targets"], json!(["v_proj", "q_proj"]));
    assert_eq!(lora["alpha"], 8);
}

#[test]
fn the_attempt_spans_log_the_lora() {
    let d = llama3_8b();
    let stderr = common::stderr_of(
        oomfix(d.path())
            .args([".", "--budget", "8GiB", "--lora", "16"])
            .args(["--log-format", "json", "-v"]),
        0,
    );
    let lora: Vec<Value> = stderr
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter_map(|v| {
            let span = v.get("span")?;
            (span.get("name")? == "attempt").then(|| span.get("lora").cloned())?
        })
        .collect();
    assert!(!lora.is_empty(), "{stderr}");
    let first: Value = serde_json::from_str(lora[0].as_str().unwrap()).unwrap();
    assert_eq!(first["rank"], 16);
    assert_eq!(first["base"], "bf16");
}
