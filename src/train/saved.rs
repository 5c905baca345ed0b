//! The directory `--save` writes and `--resume` reads: a Hugging Face model
//! directory with the training state beside it.
//!
//! * `model.safetensors`: the weights under their Hub names, in the dtype of
//!   the weights the run started from ([`ModelSource::dtype`]; f32 from a
//!   random initialisation), metadata `{"format": "pt"}` (and a `sha256` of
//!   the contents, see [`StateFile`]);
//! * `config.json`: the source's `config.json` with `torch_dtype` set to the
//!   dtype written and `architectures`/`model_type` added when missing, or
//!   one made from the model's shape ([`hf_config`]);
//! * the tokenizer files found beside the source weights, and in a model
//!   directory its licence files and `README.md` ([`ModelSource::files`]);
//! * `optimizer.safetensors` (an oomfix checkpoint file, [`StateFile`]):
//!   AdamW's fp32 moments as `<name>.m` and `<name>.v` (fused AdamW only:
//!   `candle_nn::AdamW` keeps them out of reach) and, when `model.safetensors`
//!   is not f32, the fp32 weights as `master.<name>` so that a resumed run
//!   continues from the exact values;
//! * `trainer_state.json` ([`TrainerState`]): the step, the optimizer's step
//!   count, the data position (with the synthetic generator's state), the loss
//!   scaler, the plan and the model shape.
//!
//! With LoRA ([`Plan::lora`]) the adapters take the weights' place, as PEFT
//! saves them: `adapter_model.safetensors` ([`ADAPTER_FILE`], the fp32
//! adapters under `base_model.model.<module>.lora_A.weight` and
//! `.lora_B.weight`) and `adapter_config.json` ([`ADAPTER_CONFIG_FILE`]),
//! beside the optimizer's moments and the state, which names the base
//! model ([`TrainerState::base_model`]); no `model.safetensors` or
//! `config.json`. A merged LoRA model is a model directory whose state says
//! so ([`TrainerState::merged`]): it is not resumed.
//!
//! A resumed run may use another plan (micro-batch, accumulation,
//! checkpointing, attention, optimizer, precision, device; the moments mean
//! the same in each) but must train the same model.

use crate::state_file::StateFile;
use crate::{Error, Family, ModelConfig, Result};
use candle_core::DType;
use oomfix_strategies::Plan;
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};
use std::path::{Path, PathBuf};

/// The weights, in the Hub's layout.
pub const MODEL_FILE: &str = crate::inspect::MODEL_FILE;
/// A LoRA run's adapters, as PEFT names them.
pub const ADAPTER_FILE: &str = oomfix_strategies::lora::ADAPTER_FILE;
/// A LoRA run's adapter configuration, as PEFT writes it.
pub const ADAPTER_CONFIG_FILE: &str = oomfix_strategies::lora::ADAPTER_CONFIG_FILE;
/// The model's configuration, in the Hub's layout.
pub const CONFIG_FILE: &str = "config.json";
/// The optimizer's moments and the fp32 weights when the model file is not f32.
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
/// The rest of the training state ([`TrainerState`]).
pub const STATE_FILE: &str = "trainer_state.json";
/// The files copied from beside the source weights when present.
pub const SIDE_FILES: [&str; 7] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
];
/// The model card, copied from a model directory (one holding
/// `config.json`) with its licence files ([`is_licence_file`]).
pub const MODEL_CARD: &str = "README.md";

/// Whether the file `name` is one of a model's licence terms, copied with the
/// weights: `LICENSE*` or `LICENCE*` (`LICENSE`, `LICENSE.txt`, `LICENSE.md`, in
/// any case), `NOTICE*`, and Llama's `USE_POLICY.md`.
pub fn is_licence_file(name: &str) -> bool {
    let upper = name.to_ascii_uppercase();
    ["LICENSE", "LICENCE", "NOTICE"]
        .iter()
        .any(|p| upper.starts_with(p))
        || upper == "USE_POLICY.MD"
}

/// [`TrainerState::format`].
pub const STATE_FORMAT: &str = "oomfix-trainer-state";
/// The [`TrainerState::format_version`] this build writes and reads.
pub const STATE_VERSION: u32 = 2;

/// Where the saved model directory's side files and dtype come from.
#[derive(Debug, Clone)]
pub struct ModelSource {
    /// The dtype `model.safetensors` is written in: the source weights' (f32
    /// for a random initialisation).
    pub dtype: DType,
    /// The source's `config.json`, if it has one (else one is made from the
    /// model's shape).
    pub config: Option<PathBuf>,
    /// Files copied into the directory: `(name there, path)`.
    pub files: Vec<(String, PathBuf)>,
    /// The base model's name or path, as a LoRA adapter directory names it
    /// (`base_model_name_or_path`); `None`: the model's shape is all there is.
    pub name: Option<String>,
}

impl Default for ModelSource {
    fn default() -> Self {
        ModelSource {
            dtype: DType::F32,
            config: None,
            files: Vec::new(),
            name: None,
        }
    }
}

impl ModelSource {
    /// The source of weights in `dir` (the directory beside them) stored as
    /// `dtype`: its `config.json` and the [`SIDE_FILES`] present there; in a
    /// model directory (one with a `config.json`), also its licence files
    /// ([`is_licence_file`]) and model card ([`MODEL_CARD`]), so that the
    /// saved model carries the terms it was published under.
    pub fn beside(dir: &Path, dtype: DType) -> Self {
        let config = Some(dir.join(CONFIG_FILE)).filter(|p| p.is_file());
        let mut files: Vec<(String, PathBuf)> = SIDE_FILES
            .iter()
            .map(|n| (n.to_string(), dir.join(n)))
            .filter(|(_, p)| p.is_file())
            .collect();
        if config.is_some() {
            let listed = if dir.as_os_str().is_empty() {
                Path::new(".")
            } else {
                dir
            };
            let mut terms: Vec<String> = std::fs::read_dir(listed)
                .into_iter()
                .flatten()
                .flatten()
                .filter_map(|e| e.file_name().into_string().ok())
                .filter(|n| is_licence_file(n) || n == MODEL_CARD)
                .filter(|n| dir.join(n).is_file())
                .collect();
            terms.sort();
            files.extend(terms.into_iter().map(|n| {
                let path = dir.join(&n);
                (n, path)
            }));
        }
        ModelSource {
            dtype,
            config,
            files,
            name: Some(if dir.as_os_str().is_empty() {
                ".".into()
            } else {
                dir.display().to_string()
            }),
        }
    }
}

/// A loss scaler's state (fp16).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ScalerState {
    /// The current scale.
    pub scale: f64,
    /// Steps since the last overflow.
    pub growth_tracker: u32,
}

/// Where the data stood.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DataState {
    /// The synthetic generator's state (its random number generator).
    Synthetic {
        /// The generator state's bits.
        state: u64,
    },
    /// The next read position in a token stream.
    Tokens {
        /// Next read position.
        position: u64,
        /// Ids in the stream.
        tokens: u64,
    },
    /// The next row of examples.
    Examples {
        /// Next row.
        row: u64,
        /// Rows in a pass.
        rows: u64,
    },
}

/// `trainer_state.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrainerState {
    /// [`STATE_FORMAT`].
    pub format: String,
    /// [`STATE_VERSION`].
    pub format_version: u32,
    /// Optimizer steps taken.
    pub step: u64,
    /// The fused optimizer's step count (its bias correction), when
    /// `optimizer.safetensors` holds moments.
    pub optimizer_step: Option<u64>,
    /// Where the data stood.
    pub data: DataState,
    /// The fp16 loss scaler's state, under fp16.
    pub loss_scaler: Option<ScalerState>,
    /// The plan the run used.
    pub plan: Plan,
    /// The model's shape.
    pub model: ModelConfig,
    /// A LoRA run's base model, as its adapter directory names it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_model: Option<String>,
    /// The directory holds a LoRA run's merged model (`model.safetensors`,
    /// `config.json`), not its adapters: a model to train or load, not a
    /// checkpoint to resume.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub merged: bool,
}

/// A saved directory, opened: its state read and its tensor files verified.
pub struct TrainingState {
    /// The directory.
    pub dir: PathBuf,
    /// `trainer_state.json`.
    pub state: TrainerState,
    /// `model.safetensors` (a LoRA run's: `adapter_model.safetensors`).
    pub model: StateFile,
    /// `optimizer.safetensors`.
    pub optimizer: StateFile,
}

impl TrainingState {
    /// Opens the directory `dir` written by [`crate::train::Trainer::save`].
    /// Every failure is an input error naming the file: a file instead of a
    /// directory (the single-file checkpoints of earlier versions are not
    /// read), a missing or unreadable state, a damaged tensor file.
    pub fn open(dir: &Path) -> Result<Self> {
        Self::check(dir)?;
        let path = dir.join(STATE_FILE);
        let text = std::fs::read_to_string(&path)
            .map_err(|e| Error::input(&path, format!("cannot read the training state: {e}")))?;
        let value: Value = serde_json::from_str(&text)
            .map_err(|e| Error::input(&path, format!("not valid JSON: {e}")))?;
        if value.get("format").and_then(Value::as_str) != Some(STATE_FORMAT) {
            return Err(Error::input(
                &path,
                format!("not an oomfix training state (no \"format\": \"{STATE_FORMAT}\")"),
            ));
        }
        let version = value.get("format_version").and_then(Value::as_u64);
        if version != Some(u64::from(STATE_VERSION)) {
            return Err(Error::input(
                &path,
                format!(
                    "training state format version {}; this oomfix reads {STATE_VERSION}",
                    version.map_or("?".into(), |v| v.to_string())
                ),
            ));
        }
        let state: TrainerState = serde_json::from_value(value)
            .map_err(|e| Error::input(&path, format!("unreadable training state: {e}")))?;
        if state.merged {
            return Err(Error::input(
                &path,
                "the directory holds a merged LoRA model, not adapters: it cannot be resumed \
                 (train it as a model: `oomfix train DIR`)",
            ));
        }
        let weights = match state.plan.lora {
            Some(_) => ADAPTER_FILE,
            None => MODEL_FILE,
        };
        Ok(TrainingState {
            dir: dir.to_path_buf(),
            state,
            model: StateFile::open(&dir.join(weights))?,
            optimizer: StateFile::open(&dir.join(OPTIMIZER_FILE))?,
        })
    }
}

impl TrainingState {
    /// Whether `dir` looks like a saved directory (it is a directory holding
    /// [`STATE_FILE`]), without reading it: for checking a command line
    /// before any work. [`open`](Self::open) checks the rest.
    pub fn check(dir: &Path) -> Result<()> {
        if dir.is_file() {
            return Err(Error::input(
                dir,
                format!(
                    "is a file; a checkpoint is a directory that `--save` writes (with {MODEL_FILE}, \
                     {OPTIMIZER_FILE} and {STATE_FILE}); single-file checkpoints of earlier \
                     versions of oomfix cannot be resumed"
                ),
            ));
        }
        if !dir.is_dir() {
            return Err(Error::input(
                dir,
                "cannot read checkpoint: no such directory",
            ));
        }
        if !dir.join(STATE_FILE).is_file() {
            return Err(Error::input(
                dir,
                format!("not a checkpoint directory: it holds no {STATE_FILE}"),
            ));
        }
        Ok(())
    }
}

/// The first field in which two model shapes differ, as `field saved (this
/// run: now)`; `None` when they are the same. Settings are compared by their
/// effective values (a default left unsaid equals the same value written
/// out, as in the `config.json` a saved directory holds).
pub fn first_difference(saved: &ModelConfig, now: &ModelConfig) -> Option<String> {
    fn walk(prefix: &str, a: &Value, b: &Value) -> Option<String> {
        match (a, b) {
            (Value::Object(x), Value::Object(y)) => {
                let keys: std::collections::BTreeSet<&String> = x.keys().chain(y.keys()).collect();
                keys.into_iter().find_map(|k| {
                    let null = Value::Null;
                    walk(
                        &format!("{prefix}{k}."),
                        x.get(k).unwrap_or(&null),
                        y.get(k).unwrap_or(&null),
                    )
                })
            }
            _ if a == b => None,
            _ => Some(format!(
                "{} {a} (this run: {b})",
                prefix.trim_end_matches('.')
            )),
        }
    }
    let value = |c: &ModelConfig| {
        let mut c = c.clone();
        c.settings.norm_eps = Some(c.norm_eps());
        c.settings.rope_theta = Some(c.rope_theta());
        c.settings.hidden_act = Some(c.hidden_act().to_string());
        // The name only: what it implies (the family, q/k norms, fused
        // projections) is compared field by field, and a directory saved
        // from weights without a config.json names the family's architecture.
        c.settings.architecture = None;
        serde_json::to_value(c).unwrap_or(Value::Null)
    };
    walk("", &value(saved), &value(now))
}

/// The `torch_dtype` name of a dtype.
fn torch_dtype(dtype: DType) -> &'static str {
    match dtype {
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
        _ => "float32",
    }
}

/// The `config.json` that `transformers` reads for `config` with weights of
/// `dtype`: `source`'s (the model's own `config.json`), every field kept,
/// with `torch_dtype` set and `architectures`/`model_type` added when
/// missing; without one, made from the shape (GPT-2 as `GPT2LMHeadModel`,
/// Llama-style as `LlamaForCausalLM` or, with q/k/v biases only,
/// `Qwen2ForCausalLM`, BERT as `BertForMaskedLM`).
pub fn hf_config(config: &ModelConfig, source: Option<&Path>, dtype: DType) -> Result<Value> {
    let made = made_config(config)?;
    let mut out = match source {
        None => made.clone(),
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| Error::input(path, format!("cannot read: {e}")))?;
            match serde_json::from_str(&text) {
                Ok(Value::Object(m)) => m,
                _ => return Err(Error::input(path, "not a JSON object")),
            }
        }
    };
    for key in ["architectures", "model_type"] {
        if !out.contains_key(key) {
            out.insert(key.into(), made[key].clone());
        }
    }
    out.insert("torch_dtype".into(), json!(torch_dtype(dtype)));
    if out.contains_key("dtype") {
        out.insert("dtype".into(), json!(torch_dtype(dtype)));
    }
    Ok(Value::Object(out))
}

/// A `config.json` made from the shape alone.
fn made_config(c: &ModelConfig) -> Result<Map<String, Value>> {
    let s = &c.settings;
    let value = match c.family {
        Family::Gpt2 => json!({
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "vocab_size": c.vocab,
            "n_positions": c.max_positions,
            "n_embd": c.hidden,
            "n_layer": c.layers,
            "n_head": c.heads,
            "n_inner": c.intermediate,
            "activation_function": c.hidden_act(),
            "layer_norm_epsilon": c.norm_eps(),
            "tie_word_embeddings": true,
        }),
        Family::Llama => {
            let qwen2 = c.qkv_bias && !s.attention_bias;
            json!({
                "architectures": [if qwen2 { "Qwen2ForCausalLM" } else { "LlamaForCausalLM" }],
                "model_type": if qwen2 { "qwen2" } else { "llama" },
                "num_key_value_heads": c.kv_heads,
                "rms_norm_eps": c.norm_eps(),
                "rope_theta": c.rope_theta(),
                "tie_word_embeddings": c.tied_embeddings,
                "attention_bias": s.attention_bias,
                "mlp_bias": s.mlp_bias,
            })
        }
        Family::Bert => json!({
            "architectures": ["BertForMaskedLM"],
            "model_type": "bert",
            "type_vocab_size": 2,
            "layer_norm_eps": c.norm_eps(),
        }),
        Family::Generic => {
            return Err(Error::Usage(
                "a model of unknown architecture has no Hugging Face configuration".into(),
            ))
        }
    };
    let Value::Object(mut m) = value else {
        unreachable!("json! of an object")
    };
    if let Some(d) = s.head_dim {
        m.insert("head_dim".into(), json!(d));
    }
    if s.qk_norm {
        m.insert("architectures".into(), json!(["Qwen3ForCausalLM"]));
        m.insert("model_type".into(), json!("qwen3"));
    }
    if c.family != Family::Gpt2 {
        // The keys Llama-style and BERT configurations name alike.
        let shared = json!({
            "vocab_size": c.vocab,
            "max_position_embeddings": c.max_positions,
            "hidden_size": c.hidden,
            "intermediate_size": c.intermediate,
            "num_hidden_layers": c.layers,
            "num_attention_heads": c.heads,
            "hidden_act": c.hidden_act(),
            // null where there is none: the class's default may name one.
            "pad_token_id": s.pad_token_id,
        });
        if let Value::Object(shared) = shared {
            m.extend(shared);
        }
    }
    if let Some(eos) = s.eos_token_id {
        m.insert("eos_token_id".into(), json!(eos));
        if c.family != Family::Bert {
            m.insert("bos_token_id".into(), json!(eos));
        }
    }
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_difference_of_two_shapes_is_named() {
        let a = ModelConfig::gpt2(2, 64, 1);
        assert_eq!(first_difference(&a, &a), None);
        let mut b = a.clone();
        b.layers = 3;
        b.vocab = 10;
        assert_eq!(
            first_difference(&a, &b).unwrap(),
            "layers 2 (this run: 3)",
            "fields in name order"
        );
        let mut c = a.clone();
        c.settings.rope_theta = Some(1e6);
        assert_eq!(
            first_difference(&a, &c).unwrap(),
            "settings.rope_theta 10000.0 (this run: 1000000.0)"
        );
        // A default written out is the same model.
        let mut d = a.clone();
        d.settings.hidden_act = Some(a.hidden_act().to_string());
        assert_eq!(first_difference(&a, &d), None);
    }

    #[test]
    fn a_source_config_is_kept_with_the_dtype_written() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("config.json");
        std::fs::write(
            &p,
            r#"{"model_type":"llama","rope_theta":500000.0,"torch_dtype":"bfloat16","custom":1}"#,
        )
        .unwrap();
        let c = ModelConfig::tinyllama_1_1b();
        let v = hf_config(&c, Some(&p), DType::F32).unwrap();
        assert_eq!(v["torch_dtype"], "float32");
        assert_eq!(v["rope_theta"], 500000.0);
        assert_eq!(v["custom"], 1);
        assert_eq!(v["architectures"][0], "LlamaForCausalLM");
        let made = hf_config(&ModelConfig::gpt2_small(), None, DType::BF16).unwrap();
        assert_eq!(made["n_embd"], 768);
        assert_eq!(made["torch_dtype"], "bfloat16");
        assert_eq!(made["model_type"], "gpt2");
    }
}
