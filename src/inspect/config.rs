//! The fields of a Hugging Face `config.json` that inference uses.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use super::{header::kind, read_small_text};
use crate::architecture::{self, Support};
use crate::{Error, ModelSettings, Result, RopeFactors};

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
}

impl HfConfig {
    /// An input error about this config file.
    pub fn error(&self, msg: impl Into<String>) -> Error {
        Error::input(&self.path, msg)
    }
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
    Ok(Some(HfConfig {
        settings,
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
    // Newer files group RoPE's settings under `rope_parameters`.
    let rope_params = get("rope_parameters").and_then(Value::as_object);
    let rope_theta = match rope_params.and_then(|p| p.get("rope_theta")) {
        Some(v) => positive("rope_parameters.rope_theta", Some(v))?,
        None => positive("rope_theta", get("rope_theta"))?,
    };
    let scaling = match (get("rope_scaling"), rope_params) {
        (Some(v), _) => Some(("rope_scaling", v)),
        (None, Some(p)) => p
            .get("rope_type")
            .map(|_| ("rope_parameters", &obj["rope_parameters"])),
        (None, None) => None,
    };
    let (rope_scaling, rope) = match scaling {
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
    let architecture = match get("architectures") {
        Some(Value::Array(a)) if !a.is_empty() => match &a[0] {
            Value::String(name) => Some(name.clone()),
            v => return Err(format!("\"architectures\" holds {v}, not a class name")),
        },
        _ => text("model_type")?,
    };
    let support = architecture.as_deref().map(architecture::support);
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
    let hidden_act = match text("hidden_act")? {
        Some(a) => Some(a),
        None => text("activation_function")?,
    };
    let sliding_window = match get("use_sliding_window") {
        Some(Value::Bool(false)) => None,
        _ => count_field(obj, &["sliding_window"])?,
    };
    let eos_token_id = match get("eos_token_id") {
        None => None,
        Some(Value::Array(a)) => match a.first() {
            None => None,
            Some(v) => Some(token_id("eos_token_id", v)?),
        },
        Some(v) => Some(token_id("eos_token_id", v)?),
    };
    Ok(ModelSettings {
        rope_theta,
        norm_eps,
        rope_scaling,
        hidden_act,
        sliding_window,
        attention_bias: flag("attention_bias")?,
        mlp_bias: flag("mlp_bias")?,
        eos_token_id,
        architecture,
        head_dim: count_field(obj, &["head_dim"])?.filter(|&d| d > 0),
        qk_norm,
        fused_projections,
        partial_rotary_factor,
        rope,
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
}
