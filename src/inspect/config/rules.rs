//! What a `config.json`'s values must be, checked once the weights' shapes
//! are known: the one place for these rules, so that the family code may
//! assume they hold.
//!
//! A value transformers could not use (a size the weights contradict, a
//! RoPE factor that makes the frequencies infinite, a window of no tokens, a
//! padding id outside the vocabulary) is refused with one line naming the
//! file and the field, before any weight is read. The types and the ranges
//! that need no other field are checked as the file is parsed
//! ([`super::read`]); a value oomfix does not implement is refused by name
//! by [`crate::ModelConfig::unimplemented`]. A value transformers tolerates
//! and oomfix does not use (a dropout probability; a RoPE factor below 1,
//! which transformers warns about) is accepted and said in the returned
//! notes, which `inspect` and the plan print.

use super::HfConfig;
use crate::{Family, ModelConfig, Result};

/// Checks `hf`'s values against each other and against `config` (the model
/// the weights and `hf` together describe); returns notes on the values
/// accepted but not used as transformers would use them.
pub(crate) fn check(hf: &HfConfig, config: &ModelConfig) -> Result<Vec<String>> {
    if config.family == Family::Generic {
        // Planned from its numbers alone: nothing computes with them.
        return Ok(Vec::new());
    }
    let sizes_in_the_weights = [
        (
            hf.vocab,
            config.vocab,
            &["vocab_size"][..],
            "the embedding's rows",
        ),
        (
            hf.hidden,
            config.hidden,
            &["hidden_size", "n_embd"][..],
            "the embedding's columns",
        ),
        (
            hf.layers,
            config.layers,
            &["num_hidden_layers", "n_layer"][..],
            "the blocks",
        ),
    ];
    for (said, found, keys, what) in sizes_in_the_weights {
        if let Some(said) = said.filter(|&v| v != found) {
            return refuse(
                hf,
                hf.spelled(keys),
                &said,
                format!("the weights have {found} ({what})"),
            );
        }
    }
    // A mixture of experts' `intermediate_size` may be the dense MLP's.
    if config.settings.moe.is_none() {
        if let Some(said) = hf.intermediate.filter(|&v| v != config.intermediate) {
            let key = hf.spelled(&["intermediate_size", "n_inner"]);
            let why = format!("the weights' MLP has {}", config.intermediate);
            return refuse(hf, key, &said, why);
        }
    }
    let key = hf.spelled(&["max_position_embeddings", "n_positions"]);
    match hf.max_positions {
        Some(0) => return refuse(hf, key, &0, "a context of no tokens".into()),
        // GPT-2 and BERT learn a position table of that many rows.
        Some(said) if config.family.has_learned_positions() && said != config.max_positions => {
            let why = format!(
                "the weights' position table has {} rows",
                config.max_positions
            );
            return refuse(hf, key, &said, why);
        }
        _ => {}
    }
    if config.family == Family::Llama {
        llama(hf, config)?;
    }
    if let Some(w) = config.settings.sliding_window.filter(|&w| w == 0) {
        return refuse(
            hf,
            "sliding_window",
            &w,
            "a window of no tokens attends to nothing".into(),
        );
    }
    // GPT-2 has no padding row; the others' embeddings keep one. (A class's
    // default outside a tiny vocabulary pads nothing: see `notes`.)
    let pad = config.settings.pad_token_id.map(|p| p as usize);
    let given = hf.gives("pad_token_id");
    if let Some(p) = pad.filter(|&p| given && p >= config.vocab && config.family != Family::Gpt2) {
        let why = format!(
            "the embedding's padding row must be one of its {} rows",
            config.vocab
        );
        return refuse(hf, "pad_token_id", &p, why);
    }
    Ok(notes(hf, config))
}

/// The refusal of `field`'s `value`, `why` it cannot be used.
fn refuse<T>(hf: &HfConfig, field: &str, value: &dyn std::fmt::Display, why: String) -> Result<T> {
    Err(hf.error(format!("\"{field}\" is {value}: {why}")))
}

/// The rules of a Llama-style model's attention and RoPE.
fn llama(hf: &HfConfig, config: &ModelConfig) -> Result<()> {
    if hf.head_dim == Some(0) {
        return refuse(hf, "head_dim", &0, "a head of no elements".into());
    }
    let (heads, kv) = (config.heads, config.kv_heads);
    if kv == 0 || !heads.is_multiple_of(kv) {
        let why = format!("each key/value head serves a whole group of the {heads} query heads");
        return refuse(hf, "num_key_value_heads", &kv, why);
    }
    if let Some(p) = config.settings.partial_rotary_factor.filter(|&p| p > 1.0) {
        let why = "the part of each head RoPE rotates is at most the whole head (at most 1)";
        return refuse(hf, "partial_rotary_factor", &p, why.into());
    }
    if let Some(g) = &config.settings.gemma {
        if g.sliding_layers.len() != config.layers {
            let key = hf.spelled(&["layer_types", "num_hidden_layers"]);
            let why = format!(
                "{} layer types for the weights' {} blocks",
                g.sliding_layers.len(),
                config.layers
            );
            return refuse(hf, key, &"a list", why);
        }
    }
    let Some(kind) = config.settings.rope_scaling.as_deref() else {
        return Ok(());
    };
    let r = &config.settings.rope;
    let field = |name: &str| format!("{}.{name}", hf.rope_key);
    let missing = |name: &str, what: &str| -> Result<()> {
        let (key, kind) = (hf.rope_key, kind);
        Err(hf.error(format!(
            "\"{key}\" has no \"{name}\": the {kind:?} RoPE scaling needs {what}"
        )))
    };
    let positive = |name: &str, v: Option<f64>, needed: bool| match v {
        Some(x) if x > 0.0 => Ok(()),
        Some(x) => refuse(hf, &field(name), &x, "not a positive number".into()),
        None if needed => missing(name, "it"),
        None => Ok(()),
    };
    let original = |needed: bool| match r.original_max_positions {
        Some(0) => {
            let why = "a context of no tokens".into();
            refuse(hf, &field("original_max_position_embeddings"), &0, why)
        }
        None if needed => missing("original_max_position_embeddings", "it"),
        _ => Ok(()),
    };
    match kind {
        "linear" | "dynamic" => positive("factor", r.factor, true),
        "llama3" => {
            positive("factor", r.factor, true)?;
            positive("low_freq_factor", r.low_freq_factor, true)?;
            positive("high_freq_factor", r.high_freq_factor, true)?;
            original(true)
        }
        "yarn" => {
            positive("factor", r.factor, true)?;
            positive("beta_fast", r.beta_fast, false)?;
            positive("beta_slow", r.beta_slow, false)?;
            original(false)
        }
        "longrope" => {
            original(true)?;
            let pairs = config.rotary_dim() / 2;
            for (name, factors) in [
                ("short_factor", &r.short_factor),
                ("long_factor", &r.long_factor),
            ] {
                match factors {
                    Some(f) if f.len() == pairs => {}
                    Some(f) => {
                        let why = format!(
                            "{} numbers, and the heads rotate {pairs} pairs (one factor each)",
                            f.len()
                        );
                        return refuse(hf, &field(name), &"a list", why);
                    }
                    None => return missing(name, &format!("{pairs} numbers")),
                }
            }
            positive("factor", r.factor, false)
        }
        // Refused by name before planning (`ModelConfig::unimplemented`).
        _ => Ok(()),
    }
}

/// Values accepted that the model does not use as transformers would.
fn notes(hf: &HfConfig, config: &ModelConfig) -> Vec<String> {
    let mut notes = Vec::new();
    let dropout: Vec<String> = hf
        .dropout
        .iter()
        .filter(|(_, &p)| p > 0.0)
        .map(|(k, p)| format!("{k} {p}"))
        .collect();
    if !dropout.is_empty() {
        notes.push(format!(
            "{} sets dropout ({}): oomfix trains without dropout",
            hf.path.display(),
            dropout.join(", ")
        ));
    }
    if let Some(p) = config
        .settings
        .pad_token_id
        .filter(|&p| p as usize >= config.vocab)
    {
        if !hf.gives("pad_token_id") && config.family != Family::Gpt2 {
            notes.push(format!(
                "padding id {p} (the class's default) is outside the vocabulary of {}: no row is kept for padding",
                config.vocab
            ));
        }
    }
    let scaled = matches!(
        config.settings.rope_scaling.as_deref(),
        Some("linear" | "dynamic" | "llama3" | "yarn")
    );
    if let Some(f) = config.settings.rope.factor.filter(|&f| scaled && f < 1.0) {
        notes.push(format!(
            "{}: {}.factor {f} is below 1 (transformers warns and uses it; so does oomfix)",
            hf.path.display(),
            hf.rope_key
        ));
    }
    notes
}
