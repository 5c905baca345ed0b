//! Checkpoints of the families people fine-tune, through the real binary:
//! used whole or refused before anything is planned or written, an
//! architecture oomfix does not implement refused by name (and listed by
//! `inspect`), the head size `config.json` gives planned.

mod common;

use std::path::Path;

use common::*;
use oomfix::{ModelConfig, ModelSettings};
use serde_json::{json, Value};

/// `config.json` of a 2-layer Llama-style model of hidden 32 (4 heads, 2 kv).
fn llama_config(architecture: &str, extra: Value) -> Value {
    let base = json!({
        "architectures": [architecture],
        "hidden_size": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "max_position_embeddings": 64,
        "tie_word_embeddings": true,
    });
    merged(base, extra)
}

/// `oomfix` (plan) on `model` within 1 GiB on the CPU at 16 tokens, with
/// `options`; with `--save`-like side effects checked by the caller.
fn plan(model: &Path, options: &[&str]) -> std::process::Output {
    oomfix()
        .args(["--budget", "1GiB", "--device", "cpu", "--seq-len", "16"])
        .args(options)
        .arg(model)
        .output()
        .unwrap()
}

/// What `inspect --json` says of `model`.
fn inspect_json(model: &Path) -> Value {
    json_of(oomfix().args(["inspect", "--json"]).arg(model), 0)
}

fn qwen3(head_dim: usize) -> ModelConfig {
    let mut c = tiny_llama();
    c.settings = ModelSettings {
        head_dim: Some(head_dim),
        qk_norm: true,
        ..Default::default()
    };
    c
}

#[test]
fn a_tensor_the_model_would_not_use_is_refused_before_planning() {
    // Qwen3's q/k norms in a checkpoint that says it is a Llama.
    let tensors = qwen3(8).tensors();
    let d = model_dir(tensors.clone(), llama_config("LlamaForCausalLM", json!({})));
    refused(
        &plan(&d.path().join("model.safetensors"), &[]),
        &[
            "4 tensors the model would not use",
            "model.layers.0.self_attn.k_norm.weight",
            "llama (LlamaForCausalLM)",
        ],
    );
    // Without config.json: the family from the names, and no architecture.
    std::fs::remove_file(d.path().join("config.json")).unwrap();
    refused(
        &plan(d.path(), &[]),
        &["q_norm.weight", "config.json names no architecture"],
    );
    // Training is refused the same way, before --save is made.
    let save = d.path().join("out");
    let out = oomfix()
        .args([
            "train", "--budget", "1GiB", "--device", "cpu", "--steps", "1",
        ])
        .arg(d.path())
        .arg("--save")
        .arg(&save)
        .output()
        .unwrap();
    common::assert_exit(&out, 2);
    assert!(!save.exists());
}

#[test]
fn a_qwen3_checkpoint_is_planned_with_its_head_size() {
    // Qwen3-0.6B's layout: head size 128 × 16 heads = 2048 > hidden 1024.
    let mut c = ModelConfig::llama(2, 1024, 16, 8, 3072, 1000, true);
    c.settings = ModelSettings {
        head_dim: Some(128),
        qk_norm: true,
        ..Default::default()
    };
    let config = json!({
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 1024,
        "head_dim": 128,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "num_hidden_layers": 2,
        "intermediate_size": 3072,
        "max_position_embeddings": 40960,
        "rope_theta": 1000000,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": true,
    });
    let d = model_dir(c.tensors(), config);
    let v = inspect_json(d.path());
    assert_eq!(v["head_dim"], 128);
    assert_eq!(v["qk_norm"], true);
    assert_eq!(v["architecture"], "Qwen3ForCausalLM");
    assert_eq!(v["missing"], Value::Null);
    assert_eq!(v["parameters"].as_u64().unwrap(), c.parameter_count());
    // Planned at 64 tokens within 8 GiB on the CPU (exit 0), with `extra` pins.
    let plan_json = |dir: &Path, extra: &[&str]| -> Value {
        let options = ["--budget", "8GiB", "--device", "cpu", "--seq-len", "64"];
        json_of(oomfix().args(options).arg("--json").args(extra).arg(dir), 0)
    };
    plan_json(d.path(), &[]);
    // The activations follow the head size: the same model with head size
    // 64 (hidden / heads) is estimated lower.
    let activations = |dir: &Path| -> u64 {
        plan_json(dir, &["--micro-batch", "1", "--precision", "fp32"])["estimate"]
            ["activations_bytes"]
            .as_u64()
            .unwrap()
    };
    let full = activations(d.path());
    let half = {
        let mut c = c.clone();
        c.settings.head_dim = Some(64);
        let d = model_dir(
            c.tensors(),
            json!({
                "architectures": ["Qwen3ForCausalLM"], "hidden_size": 1024, "head_dim": 64,
                "num_attention_heads": 16, "num_key_value_heads": 8, "num_hidden_layers": 2,
                "max_position_embeddings": 40960, "tie_word_embeddings": true,
            }),
        );
        activations(d.path())
    };
    assert!(full > half, "head size 128: {full} bytes, 64: {half}");
}

/// Tensors of a model oomfix has no family for the names of (Phi-3's fused
/// projections).
fn phi3_tensors() -> Vec<(String, Vec<usize>)> {
    let mut t = vec![("model.embed_tokens.weight".to_string(), vec![64, 32])];
    for l in 0..2 {
        let p = format!("model.layers.{l}.");
        t.push((format!("{p}self_attn.qkv_proj.weight"), vec![64, 32]));
        t.push((format!("{p}self_attn.o_proj.weight"), vec![32, 32]));
        t.push((format!("{p}mlp.gate_up_proj.weight"), vec![96, 32]));
        t.push((format!("{p}mlp.down_proj.weight"), vec![32, 48]));
        t.push((format!("{p}input_layernorm.weight"), vec![32]));
        t.push((format!("{p}post_attention_layernorm.weight"), vec![32]));
    }
    t.push(("model.norm.weight".into(), vec![32]));
    t
}

#[test]
fn an_architecture_oomfix_does_not_implement_is_refused_by_name() {
    let llama = tiny_llama().tensors();
    let none = json!({});
    // A Phi-3 whose RoPE would turn 3 of each head's 8 (an odd part).
    let partial = json!({"partial_rotary_factor": 0.375});
    let cases = [
        (
            llama.clone(),
            "Gemma3ForConditionalGeneration",
            &none,
            "multimodal",
        ),
        (llama.clone(), "Qwen2MoeForCausalLM", &none, "shared expert"),
        (
            phi3_tensors(),
            "Phi3ForCausalLM",
            &partial,
            "partial rotary",
        ),
        (
            llama,
            "MambaForCausalLM",
            &none,
            "not an architecture oomfix implements",
        ),
    ];
    for (tensors, arch, extra, says) in cases {
        let d = model_dir(tensors, llama_config(arch, extra.clone()));
        let named = if extra == &none {
            format!("\"{arch}\"")
        } else {
            "\"partial_rotary_factor\" is 0.375".to_string()
        };
        refused(
            &plan(d.path(), &[]),
            &["config.json", &named, says, "nothing was planned"],
        );
        // inspect reads it and says what is missing.
        let text = stdout_of(oomfix().arg("inspect").arg(d.path()), 0);
        assert!(text.contains(&format!("architecture   {arch}")), "{text}");
        let missing = text
            .lines()
            .find(|l| l.starts_with("missing"))
            .unwrap_or_else(|| panic!("{arch}: no missing line in {text}"));
        assert!(missing.contains(says), "{missing}");
    }
}

#[test]
fn a_config_naming_another_family_than_the_tensors_is_refused() {
    let d = model_dir(
        tiny_gpt2().tensors(),
        llama_config("Qwen3ForCausalLM", json!({})),
    );
    refused(
        &plan(d.path(), &[]),
        &["names Qwen3ForCausalLM, a llama model", "gpt2"],
    );
}

#[test]
fn rope_scalings_are_planned_or_refused_by_name() {
    let rope = |scaling: Value| {
        model_dir(
            tiny_llama().tensors(),
            llama_config("LlamaForCausalLM", json!({ "rope_scaling": scaling })),
        )
    };
    let d = rope(json!({"rope_type": "mrope", "mrope_section": [1, 1, 2]}));
    refused(
        &plan(d.path(), &[]),
        &[
            "\"rope_scaling\" is \"mrope\"",
            "llama3, linear, dynamic, yarn, longrope",
        ],
    );
    for scaling in [
        json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
        json!({"type": "linear", "factor": 2.0}),
        json!({"rope_type": "dynamic", "factor": 2.0}),
        json!({"rope_type": "yarn", "factor": 4.0}),
        json!({"rope_type": "longrope", "short_factor": [1.0, 1.0, 2.0, 4.0],
               "long_factor": [1.0, 2.0, 4.0, 8.0], "original_max_position_embeddings": 16}),
    ] {
        let d = rope(scaling.clone());
        let out = plan(d.path(), &[]);
        assert_eq!(
            out.status.code(),
            Some(0),
            "{scaling}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn a_phi3_checkpoint_is_planned_with_its_fused_projections() {
    let d = model_dir(
        phi3_tensors(),
        llama_config("Phi3ForCausalLM", json!({"intermediate_size": 48})),
    );
    let v = inspect_json(d.path());
    assert_eq!(v["architecture"], "Phi3ForCausalLM");
    assert_eq!(v["missing"], Value::Null);
    let elements: usize = phi3_tensors()
        .iter()
        .map(|(_, s)| s.iter().product::<usize>())
        .sum();
    assert_eq!(v["parameters"].as_u64().unwrap(), elements as u64);
    let out = plan(d.path(), &[]);
    common::assert_exit(&out, 0);
}

/// A mixture-of-experts model's settings for [`ModelConfig::tensors`].
fn moe_config(
    base: ModelConfig,
    experts: usize,
    top_k: usize,
    size: usize,
    mixtral: bool,
) -> ModelConfig {
    let mut c = base;
    c.intermediate = size;
    c.settings.moe = Some(oomfix::MoeSettings {
        experts,
        top_k,
        expert_intermediate: size,
        mixtral_names: mixtral,
        fused_experts: false,
    });
    c
}

/// Every expert is a parameter: the published sizes of Mixtral-8x7B,
/// Qwen3-30B-A3B and OLMoE-1B-7B (as transformers 5.25 builds them).
#[test]
fn mixture_of_experts_parameter_counts_are_the_published_ones() {
    let llama = ModelConfig::llama(32, 4096, 32, 8, 14336, 32000, false);
    let mixtral = moe_config(llama, 8, 2, 14336, true);
    assert_eq!(mixtral.parameter_count(), 46_702_792_704);
    let llama = ModelConfig::llama(48, 2048, 32, 4, 768, 151936, false);
    let mut qwen3 = moe_config(llama, 128, 8, 768, false);
    qwen3.settings.head_dim = Some(128);
    qwen3.settings.qk_norm = true;
    assert_eq!(qwen3.parameter_count(), 30_532_122_624);
    let llama = ModelConfig::llama(16, 2048, 16, 16, 1024, 50304, false);
    let mut olmoe = moe_config(llama, 64, 8, 1024, false);
    olmoe.settings.qk_norm = true;
    olmoe.settings.qk_norm_whole = true;
    assert_eq!(olmoe.parameter_count(), 6_919_161_856);
}

/// A tiny Mixtral-shaped checkpoint (per-expert tensors, as on the Hub) and
/// the same with the experts stacked (as transformers 5 saves them): planned
/// with every expert's weights, labelled a mixture of experts by `inspect`
/// and the plan; training refused by name (exit 2, nothing written); more
/// experts per token estimate more activation memory.
#[test]
fn a_mixture_of_experts_is_planned_labelled_and_not_trained() {
    let base = ModelConfig::llama(2, 32, 4, 2, 24, 64, true);
    let config = |extra: Value| {
        let moe =
            json!({"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 24});
        llama_config("MixtralForCausalLM", merged(moe, extra))
    };
    let per_expert = moe_config(base.clone(), 4, 2, 24, true);
    let want = per_expert.parameter_count();
    let per_expert = per_expert.tensors();
    let mut stacked = moe_config(base.clone(), 4, 2, 24, false);
    stacked.settings.moe.as_mut().unwrap().fused_experts = true;
    for tensors in [per_expert.clone(), stacked.tensors()] {
        let d = model_dir(tensors, config(json!({})));
        let text = stdout_of(oomfix().arg("inspect").arg(d.path()), 0);
        assert!(
            text.contains("experts        4 per block, 2 per token"),
            "{text}"
        );
        assert!(
            text.contains(&format!("parameters     {}", group(want))),
            "{text}"
        );
        let out = plan(d.path(), &[]);
        let text = String::from_utf8(out.stdout).unwrap();
        assert_eq!(out.status.code(), Some(0), "{text}");
        assert!(
            text.contains("(MixtralForCausalLM: mixture of experts, 4 experts, 2 per token)"),
            "{text}"
        );
    }
    let d = model_dir(per_expert, config(json!({})));
    std::fs::write(d.path().join("data.bin"), vec![1u8; 400]).unwrap();
    let out = oomfix()
        .args([
            "train",
            "--budget",
            "1GiB",
            "--device",
            "cpu",
            "--seq-len",
            "8",
        ])
        .args(["--steps", "1", "--data"])
        .arg(d.path().join("data.bin"))
        .arg(d.path())
        .output()
        .unwrap();
    refused(&out, &["MixtralForCausalLM", "planned, not trained"]);
    let out = oomfix()
        .args(["--budget", "1GiB", "--device", "cpu", "--verify"])
        .arg(d.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--verify measures training steps"));
    // Activations grow with the experts each token goes to.
    let estimate = |top_k: usize| {
        let d = model_dir(
            moe_config(base.clone(), 4, top_k, 24, true).tensors(),
            config(json!({ "num_experts_per_tok": top_k })),
        );
        let pins = [
            "--precision",
            "fp32",
            "--micro-batch",
            "2",
            "--grad-accum",
            "4",
        ];
        let v = json_stdout(&plan(d.path(), &[&["--json"][..], &pins].concat()));
        v["estimate"]["activations_bytes"].as_u64().unwrap()
    };
    assert!(estimate(1) < estimate(2) && estimate(2) < estimate(4));
}

/// `1234567` as `1,234,567`.
fn group(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, ch) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(ch);
    }
    out
}

/// A pin the model cannot honour is refused before planning: Gemma's
/// attention is composed (flash attention computes neither its soft-cap
/// nor its windows), and Gemma 2's soft-capped head has no loss in chunks;
/// Gemma 3's uncapped head has.
#[test]
fn pins_a_gemma_model_cannot_honour_are_refused() {
    let with = |model: &str, pin: &[&str]| plan(&fixture_dir().join(model), pin);
    refused(
        &with("gemma2", &["--attention", "flash"]),
        &["--attention flash", "soft-capped scores"],
    );
    refused(
        &with("gemma2", &["--loss", "chunked"]),
        &["--loss chunked", "soft-capped head"],
    );
    let out = with("gemma3", &["--loss", "chunked"]);
    common::assert_exit(&out, 0);
    assert!(String::from_utf8_lossy(&out.stdout).contains("chunked loss"));
}
