//! The fields of a Hugging Face `config.json` that inference uses, and
//! ([`rules`]) what their values must be.

pub(crate) mod rules;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use super::{header::kind, read_small_text};
use crate::architecture::{self, Support};
use crate::{Error, Family, GemmaSettings, ModelSettings, MoeSettings, Result, RopeFactors};

/// What `config.json` says, each field absent when the file does not say it.
/// GPT-2's names (`n_head`, `n_positions`, …) are accepted as aliases.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct HfConfig {
    /// Where it was read from, for messages.
    pub path: PathBuf,
    pub heads: Option<usize>,
    pub kv_heads: Option<usize>,
    pub head_dim: Option<usize>,
    pub max_positions: Option<usize>,
    pub vocab: Option<usize>,
    pub intermediate: Option<usize>,
    pub hidden: Option<usize>,
    pub layers: Option<usize>,
    pub tie_word_embeddings: Option<bool>,
    /// The settings beyond the shape.
    pub settings: ModelSettings,
    /// The keys the file gives a value (not `null`), for naming a field as
    /// the file spells it.
    pub keys: Vec<String>,
    /// The key the RoPE scaling was read from: `rope_scaling`,
    /// `rope_parameters` or `rope_parameters.full_attention`.
    pub rope_key: &'static str,
    /// The dropout probabilities the file sets ([`DROPOUT_KEYS`]).
    pub dropout: BTreeMap<&'static str, f64>,
}

/// The dropout probabilities of the families' `config.json` files. The
/// models train without dropout; a nonzero value is said in `inspect`.
pub(crate) const DROPOUT_KEYS: [&str; 7] = [
    "attention_dropout",
    "attn_pdrop",
    "resid_pdrop",
    "embd_pdrop",
    "hidden_dropout",
    "hidden_dropout_prob",
    "attention_probs_dropout_prob",
];

impl HfConfig {
    /// An input error about this config file.
    pub fn error(&self, msg: impl Into<String>) -> Error {
        Error::input(&self.path, msg)
    }

    /// Whether the file gives `key` a value (not `null`).
    pub fn gives(&self, key: &str) -> bool {
        self.keys.iter().any(|present| present == key)
    }

    /// The first of `keys` (a field and its aliases) the file gives, else
    /// the first.
    pub fn spelled<'a>(&self, keys: &[&'a str]) -> &'a str {
        keys.iter().find(|k| self.gives(k)).unwrap_or(&keys[0])
    }
}

/// A key of `config.json` and the object under it, if any.
type Keyed<'a> = (&'static str, Option<&'a Map<String, Value>>);

/// Where the RoPE settings are: `rope_parameters` in newer files (Gemma 3's
/// per layer type: `full_attention`, `sliding_attention`), and its object.
fn rope_source(obj: &Map<String, Value>) -> std::result::Result<Keyed<'_>, String> {
    let top = obj.get("rope_parameters").and_then(Value::as_object);
    match top.and_then(|p| p.get("full_attention")) {
        Some(Value::Object(full)) => Ok(("rope_parameters.full_attention", Some(full))),
        Some(v) => Err(format!(
            "\"rope_parameters.full_attention\" is {v}, not an object"
        )),
        None => Ok(("rope_parameters", top)),
    }
}

/// The dropout probabilities `obj` sets, each a number from 0 to 1 (as
/// PyTorch's dropout layers require).
fn dropout(obj: &Map<String, Value>) -> std::result::Result<BTreeMap<&'static str, f64>, String> {
    DROPOUT_KEYS
        .into_iter()
        .filter_map(|key| Some((key, obj.get(key).filter(|v| !v.is_null())?)))
        .map(
            |(key, v)| match v.as_f64().filter(|p| (0.0..=1.0).contains(p)) {
                Some(p) => Ok((key, p)),
                None => Err(format!("\"{key}\" is {v}, not a probability from 0 to 1")),
            },
        )
        .collect()
}

/// Reads `dir/config.json` when it exists; a malformed one is an input error naming it.
pub(crate) fn read(dir: &Path) -> Result<Option<HfConfig>> {
    let path = dir.join("config.json");
    if !path.is_file() {
        return Ok(None);
    }
    let text = read_small_text(&path)?;
    let value: Value = serde_json::from_str(&text)
        .map_err(|e| Error::input(&path, format!("not valid JSON: {e}")))?;
    let obj = value.as_object().ok_or_else(|| {
        Error::input(
            &path,
            format!("top level is {}, not an object", kind(&value)),
        )
    })?;
    let count = |keys: &[&str]| count_field(obj, keys).map_err(|msg| Error::input(&path, msg));
    let heads = count(&["num_attention_heads", "n_head"])?;
    if heads == Some(0) {
        return Err(Error::input(&path, "num_attention_heads is 0"));
    }
    let tie_word_embeddings = match obj.get("tie_word_embeddings") {
        None | Some(Value::Null) => None,
        Some(Value::Bool(b)) => Some(*b),
        Some(other) => {
            return Err(Error::input(
                &path,
                format!("\"tie_word_embeddings\" is {}, not a boolean", kind(other)),
            ))
        }
    };
    let settings = settings(obj).map_err(|msg| Error::input(&path, msg))?;
    let (rope_key, _) = rope_source(obj).map_err(|msg| Error::input(&path, msg))?;
    let rope_key = match obj.get("rope_scaling") {
        Some(v) if !v.is_null() => "rope_scaling",
        _ => rope_key,
    };
    Ok(Some(HfConfig {
        settings,
        keys: obj
            .iter()
            .filter(|(_, v)| !v.is_null())
            .map(|(k, _)| k.clone())
            .collect(),
        rope_key,
        dropout: dropout(obj).map_err(|msg| Error::input(&path, msg))?,
        heads,
        kv_heads: count(&["num_key_value_heads"])?,
        head_dim: count(&["head_dim"])?,
        max_positions: count(&["max_position_embeddings", "n_positions"])?,
        vocab: count(&["vocab_size"])?,
        intermediate: count(&["intermediate_size", "n_inner"])?,
        hidden: count(&["hidden_size", "n_embd"])?,
        layers: count(&["num_hidden_layers", "n_layer"])?,
        tie_word_embeddings,
        path,
    }))
}

/// The settings beyond the shape that `obj` gives; a field of the wrong
/// kind is an error naming it.
fn settings(obj: &Map<String, Value>) -> std::result::Result<ModelSettings, String> {
    let get = |key: &str| obj.get(key).filter(|v| !v.is_null());
    let positive = |key: &str, v: Option<&Value>| match v {
        None => Ok(None),
        Some(v) => v
            .as_f64()
            .filter(|x| x.is_finite() && *x > 0.0)
            .map(Some)
            .ok_or_else(|| format!("\"{key}\" is {v}, not a positive number")),
    };
    let flag = |key: &str| match get(key) {
        None => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(v) => Err(format!("\"{key}\" is {v}, not a boolean")),
    };
    let text = |key: &str| match get(key) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(v) => Err(format!("\"{key}\" is {v}, not a string")),
    };
    let rope_top = get("rope_parameters").and_then(Value::as_object);
    let (rope_key, rope_params) = rope_source(obj)?;
    let local_params = rope_top
        .and_then(|p| p.get("sliding_attention"))
        .and_then(Value::as_object);
    let rope_theta = match rope_params.and_then(|p| p.get("rope_theta")) {
        Some(v) => positive(&format!("{rope_key}.rope_theta"), Some(v))?,
        None => positive("rope_theta", get("rope_theta"))?,
    };
    let rope_params_value = rope_params.map(|m| Value::Object(m.clone()));
    let scaling = match (get("rope_scaling"), &rope_params_value) {
        (Some(v), _) => Some(("rope_scaling", v)),
        (None, Some(p)) => p.get("rope_type").map(|_| (rope_key, p)),
        (None, None) => None,
    };
    let (rope_scaling, mut rope) = match scaling {
        None => (None, RopeFactors::default()),
        Some((key, Value::Object(m))) => match m.get("rope_type").or_else(|| m.get("type")) {
            Some(Value::String(t)) if t == "default" => (None, RopeFactors::default()),
            Some(Value::String(t)) => (Some(t.clone()), rope_factors(key, m)?),
            _ => {
                return Err(format!(
                    "\"{key}\" has no \"rope_type\" (or \"type\") string"
                ))
            }
        },
        Some((key, v)) => return Err(format!("\"{key}\" is {v}, not an object")),
    };
    // Phi-3 keeps the original context at the top level.
    if rope.original_max_positions.is_none() {
        rope.original_max_positions = count_field(obj, &["original_max_position_embeddings"])?;
    }
    let architecture = match get("architectures") {
        Some(Value::Array(a)) if !a.is_empty() => match &a[0] {
            Value::String(name) => Some(name.clone()),
            v => return Err(format!("\"architectures\" holds {v}, not a class name")),
        },
        _ => text("model_type")?,
    };
    let support = architecture.as_deref().map(architecture::support);
    let gemma_version = match support {
        Some(Support::Implemented { gemma, .. }) => gemma,
        _ => None,
    };
    let qk_norm = matches!(support, Some(Support::Implemented { qk_norm: true, .. }));
    let fused_projections = matches!(support, Some(Support::Implemented { fused: true, .. }));
    let partial_rotary_factor = match rope_params.and_then(|p| p.get("partial_rotary_factor")) {
        Some(v) => positive("rope_parameters.partial_rotary_factor", Some(v))?,
        None => positive("partial_rotary_factor", get("partial_rotary_factor"))?,
    };
    let norm_key = ["rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon"]
        .into_iter()
        .find(|k| get(k).is_some());
    let norm_eps = match norm_key {
        Some(k) => positive(k, get(k))?,
        None => None,
    };
    let hidden_act = match (gemma_version, text("hidden_act")?) {
        // Gemma's MLP reads `hidden_activation` (GeLU-tanh when absent).
        (Some(_), _) => Some(text("hidden_activation")?.unwrap_or("gelu_pytorch_tanh".into())),
        (None, Some(a)) => Some(a),
        (None, None) => text("activation_function")?,
    };
    let sliding_window = match (get("use_sliding_window"), obj.get("sliding_window")) {
        (Some(Value::Bool(false)), _) => None,
        // Gemma's default window when the file has none.
        (_, None) if gemma_version.is_some() => Some(4096),
        _ => count_field(obj, &["sliding_window"])?,
    };
    let moe_kind = match support {
        Some(Support::Implemented { moe, .. }) => moe,
        _ => None,
    };
    let moe = match moe_kind {
        Some(kind) => Some(moe_settings(obj, kind)?),
        None => None,
    };
    let gemma = match gemma_version {
        Some(version) => Some(gemma_settings(obj, version, local_params)?),
        None => None,
    };
    let eos_token_id = match get("eos_token_id") {
        None => None,
        Some(Value::Array(a)) => match a.first() {
            None => None,
            Some(v) => Some(token_id("eos_token_id", v)?),
        },
        Some(v) => Some(token_id("eos_token_id", v)?),
    };
    let pad_token_id = match get("pad_token_id") {
        Some(v) => Some(token_id("pad_token_id", v)?),
        // A null is no padding id; an absent key, the class's default.
        None if obj.contains_key("pad_token_id") => None,
        None => match support {
            Some(Support::Implemented {
                family: Family::Bert,
                ..
            })
            | Some(Support::Implemented { gemma: Some(_), .. }) => Some(0),
            Some(Support::Implemented { fused: true, .. }) => Some(32000), // Phi-3
            _ => None,
        },
    };
    Ok(ModelSettings {
        // Gemma 3's global base when the file gives none.
        rope_theta: rope_theta.or((gemma_version == Some(3)).then_some(1_000_000.0)),
        norm_eps,
        rope_scaling,
        hidden_act,
        sliding_window,
        attention_bias: flag("attention_bias")?,
        mlp_bias: flag("mlp_bias")?,
        eos_token_id,
        pad_token_id,
        architecture,
        head_dim: match (count_field(obj, &["head_dim"])?, gemma_version) {
            (None, Some(_)) => Some(256), // Gemma's default head size
            (d, _) => d.filter(|&d| d > 0),
        },
        qk_norm,
        fused_projections,
        partial_rotary_factor,
        rope,
        gemma,
        moe,
        qk_norm_whole: moe_kind == Some(architecture::Moe::Olmoe),
    })
}

/// A mixture-of-experts model's settings from `obj`, with the classes'
/// defaults for absent keys; Qwen3-MoE's dense blocks (`mlp_only_layers`,
/// a `decoder_sparse_step` other than 1) are refused by name.
fn moe_settings(
    obj: &Map<String, Value>,
    kind: architecture::Moe,
) -> std::result::Result<MoeSettings, String> {
    use architecture::Moe;
    let count =
        |keys: &[&str], default: usize| count_field(obj, keys).map(|v| v.unwrap_or(default));
    if kind == Moe::Qwen3 {
        let dense = match obj.get("mlp_only_layers") {
            Some(Value::Array(a)) => !a.is_empty(),
            _ => false,
        };
        if dense || count(&["decoder_sparse_step"], 1)? != 1 {
            return Err(
                "\"mlp_only_layers\" / \"decoder_sparse_step\": dense blocks among \
                        the mixture-of-experts ones are not implemented"
                    .into(),
            );
        }
    }
    let (experts, top_k, size) = match kind {
        Moe::Mixtral => (
            count(&["num_local_experts"], 8)?,
            count(&["num_experts_per_tok"], 2)?,
            count(&["intermediate_size"], 14336)?,
        ),
        Moe::Qwen3 => (
            count(&["num_experts"], 128)?,
            count(&["num_experts_per_tok"], 8)?,
            count(&["moe_intermediate_size"], 768)?,
        ),
        Moe::Olmoe => (
            count(&["num_experts"], 64)?,
            count(&["num_experts_per_tok"], 8)?,
            count(&["intermediate_size"], 2048)?,
        ),
    };
    if experts == 0 || top_k == 0 || top_k > experts || size == 0 {
        return Err(format!(
            "{experts} experts, {top_k} per token, of MLP size {size}: not a mixture of experts"
        ));
    }
    Ok(MoeSettings {
        experts,
        top_k,
        expert_intermediate: size,
        mixtral_names: kind == Moe::Mixtral,
        fused_experts: false,
    })
}

/// Gemma 2 or 3's settings from `obj` (`version` 2 or 3), with the class's
/// defaults for absent keys (a key set to `null` turns soft-capping off);
/// `local`: Gemma 3's `rope_parameters.sliding_attention`. Bidirectional
/// attention and a scaled local RoPE are refused by name.
fn gemma_settings(
    obj: &Map<String, Value>,
    version: u8,
    local: Option<&Map<String, Value>>,
) -> std::result::Result<GemmaSettings, String> {
    let number = |key: &str, default: Option<f64>| match obj.get(key) {
        None => Ok(default),
        Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .filter(|x| x.is_finite() && *x > 0.0)
            .map(Some)
            .ok_or_else(|| format!("\"{key}\" is {v}, not a positive number")),
    };
    if obj.get("use_bidirectional_attention") == Some(&Value::Bool(true)) {
        return Err(
            "\"use_bidirectional_attention\" is true: Gemma's bidirectional attention \
                    is not implemented (its causal language model is)"
                .into(),
        );
    }
    let layers = count_field(obj, &["num_hidden_layers"])?.unwrap_or(0);
    let sliding_layers = match obj.get("layer_types").filter(|v| !v.is_null()) {
        Some(Value::Array(types)) => types
            .iter()
            .map(|t| match t.as_str() {
                Some("sliding_attention") => Ok(true),
                Some("full_attention") => Ok(false),
                _ => Err(format!(
                    "\"layer_types\" holds {t}: the layer types implemented are \
                     \"sliding_attention\" and \"full_attention\""
                )),
            })
            .collect::<std::result::Result<Vec<_>, _>>()?,
        Some(v) => return Err(format!("\"layer_types\" is {v}, not a list")),
        None => {
            let pattern = match version {
                2 => 2,
                _ => count_field(obj, &["sliding_window_pattern"])?.unwrap_or(6),
            };
            (0..layers)
                .map(|i| pattern != 0 && (i + 1) % pattern != 0)
                .collect()
        }
    };
    let local_rope_theta = match (version, local) {
        (3, Some(m)) => {
            if let Some(t) = m.get("rope_type").and_then(Value::as_str) {
                if t != "default" {
                    return Err(format!(
                        "\"rope_parameters.sliding_attention.rope_type\" is {t:?}: a scaled RoPE \
                         on the sliding layers is not implemented"
                    ));
                }
            }
            match m.get("rope_theta") {
                Some(v) => Some(v.as_f64().filter(|x| *x > 0.0).ok_or_else(|| {
                    format!("\"rope_parameters.sliding_attention.rope_theta\" is {v}, not a positive number")
                })?),
                None => Some(10_000.0),
            }
        }
        (3, None) => number("rope_local_base_freq", Some(10_000.0))?,
        _ => None,
    };
    let (attn, last) = if version == 2 {
        (Some(50.0), Some(30.0))
    } else {
        (None, None)
    };
    Ok(GemmaSettings {
        version,
        query_pre_attn_scalar: number("query_pre_attn_scalar", Some(256.0))?.unwrap_or(256.0),
        attn_softcap: number("attn_logit_softcapping", attn)?,
        final_softcap: number("final_logit_softcapping", last)?,
        sliding_layers,
        local_rope_theta,
    })
}

/// The numbers of the RoPE scaling object `m` (under `key`); one of the
/// wrong kind is an error naming it.
fn rope_factors(key: &str, m: &Map<String, Value>) -> std::result::Result<RopeFactors, String> {
    let number = |name: &str| match m.get(name).filter(|v| !v.is_null()) {
        None => Ok(None),
        Some(v) => v
            .as_f64()
            .filter(|x| x.is_finite() && *x >= 0.0)
            .map(Some)
            .ok_or_else(|| format!("\"{key}.{name}\" is {v}, not a non-negative number")),
    };
    let factors = |name: &str| match m.get(name).filter(|v| !v.is_null()) {
        None => Ok(None),
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| v.as_f64().filter(|x| x.is_finite() && *x > 0.0))
            .collect::<Option<Vec<f64>>>()
            .map(Some)
            .ok_or_else(|| format!("\"{key}.{name}\" holds a value that is not a positive number")),
        Some(v) => Err(format!("\"{key}.{name}\" is {v}, not a list of numbers")),
    };
    let truncate = match m.get("truncate").filter(|v| !v.is_null()) {
        None => None,
        Some(Value::Bool(b)) => Some(*b),
        Some(v) => return Err(format!("\"{key}.truncate\" is {v}, not a boolean")),
    };
    Ok(RopeFactors {
        factor: number("factor")?,
        low_freq_factor: number("low_freq_factor")?,
        high_freq_factor: number("high_freq_factor")?,
        original_max_positions: count_field(m, &["original_max_position_embeddings"])?,
        attention_factor: number("attention_factor")?,
        beta_fast: number("beta_fast")?,
        beta_slow: number("beta_slow")?,
        mscale: number("mscale")?,
        mscale_all_dim: number("mscale_all_dim")?,
        truncate,
        short_factor: factors("short_factor")?,
        long_factor: factors("long_factor")?,
    })
}

/// A token id in `key`.
fn token_id(key: &str, v: &Value) -> std::result::Result<u32, String> {
    v.as_u64()
        .and_then(|n| u32::try_from(n).ok())
        .ok_or_else(|| format!("\"{key}\" is {v}, not a token id"))
}

/// The first of `keys` present and not null, as a non-negative integer.
fn count_field(
    obj: &Map<String, Value>,
    keys: &[&str],
) -> std::result::Result<Option<usize>, String> {
    let Some((key, value)) = keys
        .iter()
        .find_map(|k| obj.get(*k).filter(|v| !v.is_null()).map(|v| (k, v)))
    else {
        return Ok(None);
    };
    value
        .as_u64()
        .and_then(|n| usize::try_from(n).ok())
        .map(Some)
        .ok_or_else(|| format!("\"{key}\" is {value}, not a non-negative integer"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aliases_and_nulls() {
        let obj: Map<String, Value> =
            serde_json::from_str(r#"{"n_head":12,"num_attention_heads":null,"n_inner":null}"#)
                .unwrap();
        assert_eq!(
            count_field(&obj, &["num_attention_heads", "n_head"]),
            Ok(Some(12))
        );
        assert_eq!(
            count_field(&obj, &["intermediate_size", "n_inner"]),
            Ok(None)
        );
        let bad: Map<String, Value> = serde_json::from_str(r#"{"vocab_size":-3}"#).unwrap();
        assert!(count_field(&bad, &["vocab_size"])
            .unwrap_err()
            .contains("\"vocab_size\" is -3"));
    }

    /// The padding id: the file's, none for a null, else the class's default.
    #[test]
    fn padding_ids_are_the_files_or_the_classs() {
        let pad =
            |json: &str| settings(&serde_json::from_str(json).unwrap()).map(|s| s.pad_token_id);
        for (architecture, default) in [
            ("BertForMaskedLM", Some(0)),
            ("Gemma2ForCausalLM", Some(0)),
            ("Gemma3ForCausalLM", Some(0)),
            ("Phi3ForCausalLM", Some(32000)),
            ("LlamaForCausalLM", None),
            ("Qwen3ForCausalLM", None),
            ("GPT2LMHeadModel", None),
        ] {
            let named = format!(r#"{{"architectures":["{architecture}"]"#);
            assert_eq!(pad(&format!("{named}}}")), Ok(default), "{architecture}");
            assert_eq!(pad(&format!(r#"{named},"pad_token_id":null}}"#)), Ok(None));
            assert_eq!(pad(&format!(r#"{named},"pad_token_id":5}}"#)), Ok(Some(5)));
        }
        assert!(pad(r#"{"pad_token_id":-1}"#)
            .unwrap_err()
            .contains("pad_token_id"));
    }
}
