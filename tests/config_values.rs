//! `config.json` values transformers could not use, beside valid weights of
//! each family, through the real binary: `train` refuses each with exit 2
//! and one line naming `config.json` and the field, before any weight is
//! read and with nothing written; the same files with the valid config train
//! a step. Values transformers tolerates and oomfix does not use are planned
//! and said by `inspect`.

mod common;

use std::path::Path;

use common::*;
use oomfix::{GemmaSettings, ModelConfig, ModelSettings};
use serde_json::{json, Value};
use tempfile::TempDir;

/// A family's tensors and its valid `config.json`.
struct Family {
    name: &'static str,
    tensors: Vec<(String, Vec<usize>)>,
    config: Value,
}

fn gpt2() -> Family {
    Family {
        name: "gpt2",
        tensors: tiny_gpt2().tensors(),
        config: json!({
            "architectures": ["GPT2LMHeadModel"], "n_embd": 32, "n_head": 2, "n_layer": 2,
            "n_positions": 64, "vocab_size": 256, "attn_pdrop": 0.0,
        }),
    }
}

fn llama_json(architecture: &str, extra: Value) -> Value {
    let base = json!({
        "architectures": [architecture], "hidden_size": 32, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 2, "max_position_embeddings": 32,
        "vocab_size": 96, "intermediate_size": 48, "tie_word_embeddings": false,
    });
    merged(base, extra)
}

fn llama() -> Family {
    Family {
        name: "llama",
        tensors: tiny_llama().tensors(),
        config: llama_json("LlamaForCausalLM", json!({})),
    }
}

fn qwen3() -> Family {
    let mut c = tiny_llama();
    c.settings = ModelSettings {
        qk_norm: true,
        ..Default::default()
    };
    Family {
        name: "qwen3",
        tensors: c.tensors(),
        config: llama_json("Qwen3ForCausalLM", json!({"head_dim": 8})),
    }
}

fn phi3() -> Family {
    let mut c = tiny_llama();
    c.kv_heads = 4;
    c.settings.fused_projections = true;
    Family {
        name: "phi3",
        tensors: c.tensors(),
        config: llama_json(
            "Phi3ForCausalLM",
            json!({"num_key_value_heads": 4, "pad_token_id": 0}),
        ),
    }
}

fn gemma(version: u8) -> Family {
    let mut c = tiny_llama();
    c.settings = ModelSettings {
        head_dim: Some(8),
        qk_norm: version == 3,
        gemma: Some(GemmaSettings {
            version,
            query_pre_attn_scalar: 8.0,
            attn_softcap: None,
            final_softcap: None,
            sliding_layers: vec![true, false],
            local_rope_theta: None,
        }),
        ..Default::default()
    };
    c.tied_embeddings = true;
    Family {
        name: if version == 2 { "gemma2" } else { "gemma3" },
        tensors: c.tensors(),
        config: llama_json(
            &format!("Gemma{version}ForCausalLM"),
            json!({"head_dim": 8, "query_pre_attn_scalar": 8, "sliding_window": 8,
                   "tie_word_embeddings": true,
                   "layer_types": ["sliding_attention", "full_attention"]}),
        ),
    }
}

fn bert() -> Family {
    let c = ModelConfig {
        max_positions: 64,
        ..ModelConfig::bert(2, 32, 2, 128)
    };
    Family {
        name: "bert",
        tensors: c.tensors(),
        config: json!({
            "architectures": ["BertForMaskedLM"], "hidden_size": 32, "num_attention_heads": 2,
            "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 128,
            "max_position_embeddings": 64, "hidden_dropout_prob": 0.0,
        }),
    }
}

impl Family {
    /// The family's weights (F32, sparse) with its config and `extra` over it.
    fn dir(&self, extra: &Value) -> TempDir {
        let config = merged(self.config.clone(), extra.clone());
        model_dir(self.tensors.clone(), config)
    }
}

/// `train` for one step on the CPU, saving to `save`.
fn train(model: &Path, save: &Path) -> std::process::Output {
    oomfix()
        .arg("train")
        .args(on_cpu("1GiB", "2"))
        .args(["--steps", "1", "--save"])
        .arg(save)
        .arg(model)
        .output()
        .unwrap()
}

/// Each of `cases` (a value over the family's config, and what the refusal
/// names) is refused by `train`: exit 2, one line on stderr naming
/// `config.json` and the field, nothing on stdout, nothing saved.
fn refuses(family: &Family, cases: &[(Value, &str)]) {
    let valid = family.dir(&json!({}));
    let out = train(valid.path(), &valid.path().join("saved"));
    assert_exit(&out, 0);
    for (extra, field) in cases {
        let d = family.dir(extra);
        let save = d.path().join("saved");
        let out = train(d.path(), &save);
        let what = format!("{} with {extra}", family.name);
        eprintln!("{what}");
        refused(&out, &["config.json", field]);
        assert!(!save.exists(), "{what}: {} was written", save.display());
        // inspect, which reads only the header, refuses it the same way.
        let out = oomfix().arg("inspect").arg(d.path()).output().unwrap();
        let inspected = String::from_utf8_lossy(&out.stderr);
        let unimplemented = out.status.code() == Some(0);
        assert!(
            unimplemented || inspected.contains(field),
            "{what}: inspect said {inspected}"
        );
    }
}

/// The sizes and ranges every family reads.
fn shared_cases(vocab: usize, key: fn(&str) -> &str) -> Vec<(Value, String)> {
    [
        ("vocab_size", vocab + 8),
        ("hidden_size", 64),
        ("num_hidden_layers", 3),
        ("intermediate_size", 40),
        ("max_position_embeddings", 0),
    ]
    .into_iter()
    .map(|(field, value)| {
        let k = key(field);
        let mut extra = serde_json::Map::new();
        extra.insert(k.to_string(), json!(value));
        (Value::Object(extra), format!("\"{k}\" is {value}"))
    })
    .collect()
}

fn hf_name(key: &str) -> &str {
    key
}

fn gpt2_name(key: &str) -> &str {
    match key {
        "hidden_size" => "n_embd",
        "num_hidden_layers" => "n_layer",
        "intermediate_size" => "n_inner",
        "max_position_embeddings" => "n_positions",
        other => other,
    }
}

fn check(family: Family, key: fn(&str) -> &str, own: &[(Value, &str)]) {
    let vocab = family.tensors[0].1[0];
    let shared = shared_cases(vocab, key);
    let mut cases: Vec<(Value, &str)> = shared
        .iter()
        .map(|(v, f)| (v.clone(), f.as_str()))
        .collect();
    cases.extend(own.iter().cloned());
    refuses(&family, &cases);
}

/// RoPE and attention values of the Llama-style families.
fn rope_cases() -> Vec<(Value, &'static str)> {
    let llama3 = |factor: f64| {
        json!({"rope_scaling": {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}})
    };
    vec![
        (llama3(0.0), "\"rope_scaling.factor\" is 0"),
        (llama3(-2.0), "rope_scaling.factor"),
        (
            json!({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0}}),
            "original_max_position_embeddings",
        ),
        (json!({"rope_scaling": {"type": "linear"}}), "\"factor\""),
        (
            json!({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 0.0}}),
            "\"rope_scaling.beta_fast\" is 0",
        ),
        (
            json!({"rope_parameters": {"rope_type": "dynamic", "factor": 0.0, "rope_theta": 10000.0}}),
            "\"rope_parameters.factor\" is 0",
        ),
        (json!({"rope_theta": 0}), "\"rope_theta\""),
        (
            json!({"partial_rotary_factor": 1.5}),
            "\"partial_rotary_factor\" is 1.5",
        ),
        (json!({"head_dim": 0}), "\"head_dim\" is 0"),
        (json!({"rms_norm_eps": -1e-6}), "\"rms_norm_eps\""),
        (json!({"pad_token_id": 96}), "\"pad_token_id\" is 96"),
        (
            json!({"attention_dropout": 2.0}),
            "\"attention_dropout\" is 2.0",
        ),
        (json!({"hidden_act": "relu"}), "\"hidden_act\" is \"relu\""),
    ]
}

#[test]
fn gpt2_values_transformers_could_not_use_are_refused_up_front() {
    check(
        gpt2(),
        gpt2_name,
        &[
            (json!({"n_positions": 128}), "\"n_positions\" is 128"),
            (
                json!({"n_head": 3}),
                "num_attention_heads 3 does not divide",
            ),
            (json!({"layer_norm_epsilon": 0}), "\"layer_norm_epsilon\""),
            (json!({"resid_pdrop": -0.1}), "\"resid_pdrop\""),
            (
                json!({"activation_function": "relu"}),
                "\"activation_function\"",
            ),
        ],
    );
}

#[test]
fn llama_values_transformers_could_not_use_are_refused_up_front() {
    let mut cases = rope_cases();
    cases.extend([
        (
            json!({"sliding_window": 0, "use_sliding_window": true}),
            "\"sliding_window\" is 0",
        ),
        (
            json!({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0, 1.0, 1.0],
                   "long_factor": [1.0, 1.0, 1.0, 1.0], "original_max_position_embeddings": 16}}),
            "\"rope_scaling.short_factor\"",
        ),
        (
            json!({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0, 1.0, 1.0, 1.0],
                   "original_max_position_embeddings": 16}}),
            "\"long_factor\"",
        ),
    ]);
    check(llama(), hf_name, &cases);
}

#[test]
fn qwen3_and_phi3_values_transformers_could_not_use_are_refused_up_front() {
    check(qwen3(), hf_name, &rope_cases());
    check(
        phi3(),
        hf_name,
        &[
            (json!({"pad_token_id": 1000}), "\"pad_token_id\" is 1000"),
            (
                json!({"partial_rotary_factor": 2.0}),
                "\"partial_rotary_factor\" is 2",
            ),
            (
                json!({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0],
                       "long_factor": [1.0], "original_max_position_embeddings": 16}}),
                "\"rope_scaling.short_factor\"",
            ),
        ],
    );
}

#[test]
fn gemma_values_transformers_could_not_use_are_refused_up_front() {
    let cases = [
        (json!({"sliding_window": 0}), "\"sliding_window\" is 0"),
        (
            json!({"attn_logit_softcapping": 0}),
            "\"attn_logit_softcapping\"",
        ),
        (
            json!({"final_logit_softcapping": -30.0}),
            "\"final_logit_softcapping\"",
        ),
        (
            json!({"query_pre_attn_scalar": 0}),
            "\"query_pre_attn_scalar\"",
        ),
        (
            json!({"layer_types": ["sliding_attention"]}),
            "\"layer_types\" is a list: 1 layer types for the weights' 2 blocks",
        ),
        (json!({"layer_types": ["local"]}), "\"layer_types\" holds"),
        (
            json!({"hidden_activation": "relu"}),
            "\"hidden_activation\"",
        ),
        (json!({"pad_token_id": 500}), "\"pad_token_id\" is 500"),
        (json!({"head_dim": 0}), "\"head_dim\" is 0"),
    ];
    check(gemma(2), hf_name, &cases);
    check(gemma(3), hf_name, &cases);
}

#[test]
fn bert_values_transformers_could_not_use_are_refused_up_front() {
    check(
        bert(),
        hf_name,
        &[
            (
                json!({"max_position_embeddings": 512}),
                "\"max_position_embeddings\" is 512",
            ),
            (json!({"pad_token_id": 128}), "\"pad_token_id\" is 128"),
            (
                json!({"hidden_dropout_prob": 1.5}),
                "\"hidden_dropout_prob\"",
            ),
            (json!({"layer_norm_eps": 0}), "\"layer_norm_eps\""),
            (
                json!({"num_attention_heads": 5}),
                "num_attention_heads 5 does not divide",
            ),
        ],
    );
}

/// Values transformers accepts and oomfix does not use as it would are
/// planned, and `inspect` says so.
#[test]
fn tolerated_values_are_planned_and_said() {
    let llama = llama();
    let d = llama.dir(&json!({
        "attention_dropout": 0.1,
        "rope_scaling": {"type": "linear", "factor": 0.5},
    }));
    exits(
        oomfix()
            .args(["--budget", "1GiB", "--device", "cpu", "--seq-len", "16"])
            .arg(d.path()),
        0,
    );
    let out = oomfix().arg("inspect").arg(d.path()).output().unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.contains("attention_dropout 0.1") && text.contains("oomfix trains without dropout"),
        "{text}"
    );
    assert!(text.contains("factor 0.5 is below 1"), "{text}");
}
