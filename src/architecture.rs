//! The architectures a `config.json` can name (`architectures[0]` or
//! `model_type`), and what oomfix does with each: the family it trains (or,
//! for a mixture of experts, plans) it as, or what that family lacks to
//! compute it as Hugging Face `transformers` does.

use serde::{Deserialize, Serialize};

/// Architecture family, inferred from tensor names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Family {
    /// GPT-2: learned positions, LayerNorm, GELU MLP, Conv1D weights (`in x out`).
    Gpt2,
    /// Llama-style: RoPE, RMSNorm, SwiGLU, grouped-query attention (Llama 2/3, Mistral, Qwen2, …).
    Llama,
    /// BERT encoder with a masked-LM head.
    Bert,
    /// Unknown architecture: only the tensors are known; estimates are generic.
    Generic,
}

impl Family {
    /// Lower-case name (`gpt2`, `llama`, `bert`, `generic`).
    pub fn as_str(self) -> &'static str {
        match self {
            Family::Gpt2 => "gpt2",
            Family::Llama => "llama",
            Family::Bert => "bert",
            Family::Generic => "generic",
        }
    }
}

impl Family {
    /// Whether the family has a learned position table that bounds the sequence length.
    pub fn has_learned_positions(self) -> bool {
        matches!(self, Family::Gpt2 | Family::Bert)
    }
}

impl std::fmt::Display for Family {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What oomfix does with an architecture.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Support {
    /// Planned and trained as `family` (a mixture of experts: planned
    /// only); `qk_norm`: with RMSNorm on each query and key head (Qwen3,
    /// Gemma 3; OLMoE: on the whole projections); `fused`: with one q/k/v
    /// and one gate/up projection (Phi-3); `gemma`: Gemma's blocks, of
    /// version 2 or 3 ([`crate::GemmaSettings`]); `moe`: a mixture of
    /// experts ([`crate::MoeSettings`]).
    Implemented {
        /// The family whose model computes it.
        family: Family,
        /// Per-head RMSNorm on q and k before RoPE.
        qk_norm: bool,
        /// Fused `qkv_proj` and `gate_up_proj`.
        fused: bool,
        /// Gemma 2 or 3 (text); `None` for the others.
        gemma: Option<u8>,
        /// A mixture-of-experts MLP (planned, not trained); `None` for the others.
        moe: Option<Moe>,
    },
    /// Known, not implemented: `missing` says what its model computes that
    /// oomfix's families do not.
    Missing(&'static str),
    /// Not an architecture oomfix knows.
    Unknown,
}

/// The mixture-of-experts architectures oomfix plans.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Moe {
    /// Mixtral: `block_sparse_moe`, `num_local_experts`, `intermediate_size` per expert.
    Mixtral,
    /// Qwen3-MoE: `mlp.experts`, `num_experts`, `moe_intermediate_size`, per-head q/k norms.
    Qwen3,
    /// OLMoE: `mlp.experts`, `num_experts`, `intermediate_size` per expert,
    /// q/k norms over the whole projections.
    Olmoe,
}

/// One architecture: its class names and `model_type`s, and what oomfix does.
struct Entry {
    names: &'static [&'static str],
    support: Support,
}

const fn implemented(names: &'static [&'static str], family: Family, qk_norm: bool) -> Entry {
    Entry {
        names,
        support: Support::Implemented {
            family,
            qk_norm,
            fused: false,
            gemma: None,
            moe: None,
        },
    }
}

const fn gemma(names: &'static [&'static str], version: u8) -> Entry {
    Entry {
        names,
        support: Support::Implemented {
            family: Family::Llama,
            qk_norm: version == 3,
            fused: false,
            gemma: Some(version),
            moe: None,
        },
    }
}

const fn missing(names: &'static [&'static str], what: &'static str) -> Entry {
    Entry {
        names,
        support: Support::Missing(what),
    }
}

const fn moe(names: &'static [&'static str], kind: Moe) -> Entry {
    Entry {
        names,
        support: Support::Implemented {
            family: Family::Llama,
            qk_norm: !matches!(kind, Moe::Mixtral),
            fused: false,
            gemma: None,
            moe: Some(kind),
        },
    }
}

const TABLE: &[Entry] = &[
    implemented(
        &["GPT2LMHeadModel", "GPT2Model", "gpt2"],
        Family::Gpt2,
        false,
    ),
    implemented(
        &["LlamaForCausalLM", "LlamaModel", "llama"],
        Family::Llama,
        false,
    ),
    implemented(
        &["MistralForCausalLM", "MistralModel", "mistral"],
        Family::Llama,
        false,
    ),
    implemented(
        &["Qwen2ForCausalLM", "Qwen2Model", "qwen2"],
        Family::Llama,
        false,
    ),
    implemented(
        &["Qwen3ForCausalLM", "Qwen3Model", "qwen3"],
        Family::Llama,
        true,
    ),
    implemented(
        &["BertForMaskedLM", "BertModel", "BertForPreTraining", "bert"],
        Family::Bert,
        false,
    ),
    missing(
        &["GemmaForCausalLM", "GemmaModel", "gemma"],
        "Gemma 1's blocks (two norms each, no sliding windows) are not implemented \
         (Gemma 2 and Gemma 3 are)",
    ),
    gemma(&["Gemma2ForCausalLM", "Gemma2Model", "gemma2"], 2),
    gemma(&["Gemma3ForCausalLM", "Gemma3TextModel", "gemma3_text"], 3),
    missing(
        &["Gemma3ForConditionalGeneration", "gemma3"],
        "it is the multimodal Gemma 3 (a vision tower and projector beside the language model, \
         its tensors under language_model.): only the text model is implemented \
         (Gemma3ForCausalLM, model_type gemma3_text)",
    ),
    Entry {
        names: &["Phi3ForCausalLM", "Phi3Model", "phi3"],
        support: Support::Implemented {
            family: Family::Llama,
            qk_norm: false,
            fused: true,
            gemma: None,
            moe: None,
        },
    },
    missing(
        &["PhiForCausalLM", "PhiModel", "phi"],
        "parallel attention and MLP with LayerNorm and partial rotary are not implemented",
    ),
    moe(&["MixtralForCausalLM", "mixtral"], Moe::Mixtral),
    missing(
        &["Qwen2MoeForCausalLM", "qwen2_moe"],
        "a mixture-of-experts MLP with a shared expert is not implemented",
    ),
    moe(&["Qwen3MoeForCausalLM", "qwen3_moe"], Moe::Qwen3),
    moe(&["OlmoeForCausalLM", "olmoe"], Moe::Olmoe),
    missing(
        &[
            "DeepseekV2ForCausalLM",
            "DeepseekV3ForCausalLM",
            "deepseek_v2",
            "deepseek_v3",
        ],
        "multi-head latent attention and the mixture-of-experts MLP are not implemented",
    ),
];

/// What oomfix does with the architecture `name` (a class name such as
/// `Qwen3ForCausalLM`, or a `model_type` such as `qwen3`).
pub fn support(name: &str) -> Support {
    TABLE
        .iter()
        .find(|e| e.names.contains(&name))
        .map_or(Support::Unknown, |e| e.support)
}

/// Why oomfix cannot plan or train the architecture `name`, naming it, in one line;
/// `None` when it implements it.
pub fn refusal(name: &str) -> Option<String> {
    match support(name) {
        Support::Implemented { .. } => None,
        Support::Missing(what) => Some(format!("{name} is known, but {what}")),
        Support::Unknown => Some(format!(
            "{name} is not an architecture oomfix implements (GPT-2, Llama, Mistral, Qwen2, Qwen3, \
             Phi-3, Gemma 2, Gemma 3 text, BERT; Mixtral, Qwen3-MoE and OLMoE planned only)"
        )),
    }
}

/// The Hub name of a tensor named `name` in a checkpoint of `family`: GPT-2's
/// `transformer.` prefix dropped, BERT's `bert.` prefix added where a
/// checkpoint lacks it, the old `gamma`/`beta` names of layer norms as
/// `weight`/`bias`.
pub fn hub_name(family: Family, name: &str) -> String {
    let name = match (name.strip_suffix(".gamma"), name.strip_suffix(".beta")) {
        (Some(stem), _) => format!("{stem}.weight"),
        (_, Some(stem)) => format!("{stem}.bias"),
        _ => name.to_string(),
    };
    match family {
        Family::Gpt2 => name
            .strip_prefix("transformer.")
            .map(str::to_string)
            .unwrap_or(name),
        Family::Bert if !name.starts_with("bert.") && !name.starts_with("cls.") => {
            format!("bert.{name}")
        }
        _ => name,
    }
}

/// Whether the tensor `hub` (a Hub name, [`hub_name`]) is saved state rather
/// than a parameter: GPT-2's attention masks, RoPE's `inv_freq`, BERT's
/// `position_ids`.
pub fn is_buffer(family: Family, hub: &str) -> bool {
    let gpt2_mask = family == Family::Gpt2
        && (hub.ends_with(".attn.bias") || hub.ends_with(".attn.masked_bias"));
    gpt2_mask || hub.ends_with("rotary_emb.inv_freq") || hub.ends_with("embeddings.position_ids")
}

/// Whether a checkpoint of `family` may hold the tensor `hub` (a Hub name)
/// that the model has no parameter for: a buffer ([`is_buffer`]), a stored
/// copy of the tied embedding (`tied`: the output head shares it), or the
/// heads of BERT's other pre-training objective (the pooler and the
/// next-sentence head, which `BertForMaskedLM` leaves too).
pub fn may_leave(family: Family, hub: &str, tied: bool) -> bool {
    let tied_copy = match family {
        Family::Gpt2 | Family::Llama => tied && hub == "lm_head.weight",
        Family::Bert => {
            (tied && hub == "cls.predictions.decoder.weight")
                || hub == "cls.predictions.decoder.bias"
        }
        Family::Generic => false,
    };
    let other_objective = family == Family::Bert
        && (hub.starts_with("bert.pooler.") || hub.starts_with("cls.seq_relationship."));
    is_buffer(family, hub) || tied_copy || other_objective
}

/// The RoPE scaling types the Llama-style model implements.
pub const ROPE_SCALINGS: &[&str] = &["llama3", "linear", "dynamic", "yarn", "longrope"];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn class_names_and_model_types_agree() {
        assert_eq!(support("Qwen3ForCausalLM"), support("qwen3"));
        assert_eq!(
            support("qwen3"),
            Support::Implemented {
                family: Family::Llama,
                qk_norm: true,
                fused: false,
                gemma: None,
                moe: None
            }
        );
        assert!(matches!(
            support("gemma2"),
            Support::Implemented { gemma: Some(2), .. }
        ));
        assert!(matches!(support("gemma"), Support::Missing(_)));
        assert_eq!(support("MambaForCausalLM"), Support::Unknown);
        assert!(refusal("LlamaForCausalLM").is_none());
        assert!(refusal("Gemma3ForCausalLM").is_none());
        let why = refusal("Gemma3ForConditionalGeneration").unwrap();
        assert!(
            why.contains("Gemma3ForConditionalGeneration") && why.contains("gemma3_text"),
            "{why}"
        );
        assert!(refusal("Qwen3MoeForCausalLM").is_none());
        assert!(refusal("Qwen2MoeForCausalLM")
            .unwrap()
            .contains("shared expert"));
    }
}
