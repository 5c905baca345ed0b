//! What the planner knows about a model: its family, dimensions and trainable tensors.

use serde::{Deserialize, Serialize};

/// The vocabulary of the LM head's products is padded to a multiple of this
/// many rows (zero rows, masked out of the loss): with an odd vocabulary
/// (GPT-2's 50,257, BERT's 30,522 is only 2-aligned) each row of the logits
/// starts at a misaligned address and cuBLAS falls back to slow kernels for
/// the three products around them.
pub const VOCAB_ALIGN: usize = 64;

pub use crate::architecture::Family;

/// Shape hyper-parameters of a transformer, enough to rebuild its tensors and
/// its op sequence.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    /// Architecture family.
    pub family: Family,
    /// Transformer blocks.
    pub layers: usize,
    /// Hidden size (`d_model`).
    pub hidden: usize,
    /// Attention (query) heads.
    pub heads: usize,
    /// Key/value heads (grouped-query attention); equals `heads` for multi-head attention.
    pub kv_heads: usize,
    /// MLP inner size.
    pub intermediate: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// Learned position embeddings (GPT-2, BERT); RoPE models keep this as a limit only.
    pub max_positions: usize,
    /// Output head shares the token embedding.
    pub tied_embeddings: bool,
    /// Llama-style models with biases on the q/k/v projections (Qwen2).
    pub qkv_bias: bool,
    /// What the checkpoint's `config.json` says beyond the shape (absent in
    /// JSON written by older versions: the families' defaults).
    #[serde(default)]
    pub settings: ModelSettings,
}

/// What a checkpoint's `config.json` says beyond the shape: numerics, options
/// the trainable families implement or refuse, and the end-of-text id. `None`
/// (or `false`) when the file does not say it: the family's default, as
/// Hugging Face `transformers` takes it ([`ModelConfig::norm_eps`],
/// [`ModelConfig::rope_theta`]).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ModelSettings {
    /// RoPE base frequency (`rope_theta`; Llama-style).
    pub rope_theta: Option<f64>,
    /// Norm epsilon (`rms_norm_eps`, `layer_norm_eps` or `layer_norm_epsilon`).
    pub norm_eps: Option<f64>,
    /// The `rope_scaling` type (`rope_type` or `type`), when scaling is set
    /// and not `default`.
    pub rope_scaling: Option<String>,
    /// The MLP activation (`hidden_act`, GPT-2's `activation_function`).
    pub hidden_act: Option<String>,
    /// Sliding-window attention span (`sliding_window`, unless
    /// `use_sliding_window` is false).
    pub sliding_window: Option<usize>,
    /// Llama-style: biases on all attention projections, `o_proj` included
    /// (`attention_bias`).
    pub attention_bias: bool,
    /// Llama-style: biases on the MLP projections (`mlp_bias`).
    pub mlp_bias: bool,
    /// The end-of-text id (`eos_token_id`; the first of a list).
    pub eos_token_id: Option<u32>,
    /// The padding id (`pad_token_id`; absent: the class's default, 0 for
    /// BERT and Gemma, 32000 for Phi-3, none for the others). Its embedding
    /// row gets no gradient from the lookup, as transformers'
    /// `padding_idx` gives it none; GPT-2's embedding has no padding id.
    pub pad_token_id: Option<u32>,
    /// The architecture `config.json` names (`architectures[0]`, else
    /// `model_type`); `None` without one.
    pub architecture: Option<String>,
    /// The attention head size (`head_dim`), when `config.json` gives one;
    /// else `hidden / heads` ([`ModelConfig::head_dim`]).
    pub head_dim: Option<usize>,
    /// Llama-style: RMSNorm over each head of q and of k after the
    /// projections, before RoPE (`self_attn.q_norm`, `self_attn.k_norm`; Qwen3).
    pub qk_norm: bool,
    /// Llama-style: one `self_attn.qkv_proj` (rows q, k, v) and one
    /// `mlp.gate_up_proj` (rows gate, up) instead of separate projections (Phi-3).
    pub fused_projections: bool,
    /// The share of each head that RoPE rotates (`partial_rotary_factor`),
    /// when `config.json` gives one.
    pub partial_rotary_factor: Option<f64>,
    /// The numbers of `rope_scaling` (absent ones are transformers' defaults).
    pub rope: RopeFactors,
    /// Gemma 2 / Gemma 3 (text): what their blocks compute beyond a Llama's
    /// ([`GemmaSettings`]); `None` for every other model.
    pub gemma: Option<GemmaSettings>,
    /// A mixture-of-experts MLP in every block (Mixtral, Qwen3-MoE, OLMoE):
    /// planned with its own terms, not trained ([`MoeSettings`]).
    pub moe: Option<MoeSettings>,
    /// Llama-style: the q/k norms span the whole projection (`[H·d]` and
    /// `[KV·d]`, OLMoE) rather than each head (`[d]`, Qwen3).
    pub qk_norm_whole: bool,
}

/// A mixture-of-experts MLP: a router (`gate`, `[experts, hidden]`) picks
/// `top_k` of `experts` SwiGLU experts of `expert_intermediate` for each
/// token and sums their outputs, weighted.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MoeSettings {
    /// Experts per block (`num_local_experts`, `num_experts`).
    pub experts: usize,
    /// Experts per token (`num_experts_per_tok`).
    pub top_k: usize,
    /// MLP size of one expert (`moe_intermediate_size`, else `intermediate_size`).
    pub expert_intermediate: usize,
    /// Mixtral's tensor names (`block_sparse_moe.gate`,
    /// `block_sparse_moe.experts.E.w1` gate, `w2` down, `w3` up); else
    /// `mlp.gate` and `mlp.experts.E.{gate,up,down}_proj` (Qwen3-MoE, OLMoE).
    pub mixtral_names: bool,
    /// The experts stacked as transformers 5 holds them: `mlp.gate` and
    /// `mlp.experts.gate_up_proj` `[E, 2·I_e, h]`, `mlp.experts.down_proj`
    /// `[E, h, I_e]` (whatever the architecture's own names).
    pub fused_experts: bool,
}

/// What a Gemma 2 or Gemma 3 (text) model computes beyond a Llama-style one,
/// as `transformers` reads it from `config.json` (absent keys take the
/// class's defaults there).
///
/// Both: RMSNorms scaled by `1 + w` (computed in f32), four norms per block
/// (`input_layernorm`, `post_attention_layernorm`,
/// `pre_feedforward_layernorm`, `post_feedforward_layernorm`), the
/// embedding multiplied by √hidden rounded to the compute dtype, scores
/// scaled by `query_pre_attn_scalar^-½`, sliding-window layers beside
/// full ones, a GeLU (tanh) gated MLP. Gemma 2 soft-caps the attention
/// scores and the final logits (`cap·tanh(x/cap)`); Gemma 3 norms each
/// query and key head (`q_norm`, `k_norm`, with `1 + w`) and gives its
/// sliding layers their own RoPE base.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GemmaSettings {
    /// 2 or 3.
    pub version: u8,
    /// `query_pre_attn_scalar`: scores are scaled by its inverse square root.
    pub query_pre_attn_scalar: f64,
    /// `attn_logit_softcapping`: the cap of the attention scores.
    pub attn_softcap: Option<f64>,
    /// `final_logit_softcapping`: the cap of the logits.
    pub final_softcap: Option<f64>,
    /// Per block, whether it attends within `sliding_window` only
    /// (`layer_types`, or the pattern of the class: Gemma 2 every other
    /// block from the first, Gemma 3 five of every `sliding_window_pattern`).
    pub sliding_layers: Vec<bool>,
    /// The RoPE base of the sliding layers (Gemma 3's
    /// `rope_local_base_freq`); `None`: the global base.
    pub local_rope_theta: Option<f64>,
}

impl GemmaSettings {
    /// Whether block `l` is a sliding-window block.
    pub fn sliding(&self, l: usize) -> bool {
        self.sliding_layers.get(l).copied().unwrap_or(false)
    }
}

/// The numbers of a `rope_scaling` object, each `None` when absent.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct RopeFactors {
    /// `factor`: how much longer the context is than the trained one.
    pub factor: Option<f64>,
    /// `low_freq_factor` (`llama3`).
    pub low_freq_factor: Option<f64>,
    /// `high_freq_factor` (`llama3`).
    pub high_freq_factor: Option<f64>,
    /// `original_max_position_embeddings` (`llama3`, `yarn`).
    pub original_max_positions: Option<usize>,
    /// `attention_factor` (`yarn`).
    pub attention_factor: Option<f64>,
    /// `beta_fast` (`yarn`, default 32).
    pub beta_fast: Option<f64>,
    /// `beta_slow` (`yarn`, default 1).
    pub beta_slow: Option<f64>,
    /// `mscale` (`yarn`).
    pub mscale: Option<f64>,
    /// `mscale_all_dim` (`yarn`).
    pub mscale_all_dim: Option<f64>,
    /// `truncate` (`yarn`, default true).
    pub truncate: Option<bool>,
    /// `short_factor` (`longrope`): per frequency, within the original context.
    pub short_factor: Option<Vec<f64>>,
    /// `long_factor` (`longrope`): per frequency, past the original context.
    pub long_factor: Option<Vec<f64>>,
}

impl ModelConfig {
    /// GPT-2 small (124M): the built-in default model.
    pub fn gpt2_small() -> Self {
        Self::gpt2(12, 768, 12)
    }
    /// GPT-2 medium (355M).
    pub fn gpt2_medium() -> Self {
        Self::gpt2(24, 1024, 16)
    }
    /// A GPT-2-shaped model (vocab 50257, 1024 positions, MLP 4x).
    pub fn gpt2(layers: usize, hidden: usize, heads: usize) -> Self {
        ModelConfig {
            family: Family::Gpt2,
            layers,
            hidden,
            heads,
            kv_heads: heads,
            intermediate: 4 * hidden,
            vocab: 50257,
            max_positions: 1024,
            tied_embeddings: true,
            qkv_bias: false,
            settings: ModelSettings::default(),
        }
    }
    /// Llama-2-7B.
    pub fn llama2_7b() -> Self {
        Self::llama(32, 4096, 32, 32, 11008, 32000, false)
    }
    /// TinyLlama-1.1B (grouped-query attention, 4 KV heads).
    pub fn tinyllama_1_1b() -> Self {
        Self::llama(22, 2048, 32, 4, 5632, 32000, false)
    }
    /// A Llama-style model.
    pub fn llama(
        layers: usize,
        hidden: usize,
        heads: usize,
        kv_heads: usize,
        intermediate: usize,
        vocab: usize,
        tied_embeddings: bool,
    ) -> Self {
        ModelConfig {
            family: Family::Llama,
            layers,
            hidden,
            heads,
            kv_heads,
            intermediate,
            vocab,
            max_positions: 4096,
            tied_embeddings,
            qkv_bias: false,
            settings: ModelSettings::default(),
        }
    }
    /// BERT-base (uncased vocabulary).
    pub fn bert_base() -> Self {
        Self::bert(12, 768, 12, 30522)
    }
    /// A BERT-shaped encoder (MLP 4x, 512 positions, 2 token types).
    pub fn bert(layers: usize, hidden: usize, heads: usize, vocab: usize) -> Self {
        ModelConfig {
            family: Family::Bert,
            layers,
            hidden,
            heads,
            kv_heads: heads,
            intermediate: 4 * hidden,
            vocab,
            max_positions: 512,
            tied_embeddings: true,
            qkv_bias: true,
            settings: ModelSettings::default(),
        }
    }

    /// The norm epsilon: `config.json`'s, else the family's default in
    /// `transformers` (GPT-2 1e-5, Llama-style 1e-6, BERT 1e-12).
    pub fn norm_eps(&self) -> f64 {
        self.settings.norm_eps.unwrap_or(match self.family {
            Family::Gpt2 => 1e-5,
            Family::Bert => 1e-12,
            Family::Llama | Family::Generic => 1e-6,
        })
    }

    /// The RoPE base frequency: `config.json`'s, else 10 000.
    pub fn rope_theta(&self) -> f64 {
        self.settings.rope_theta.unwrap_or(10_000.0)
    }

    /// The MLP activation: `config.json`'s, else the family's (GPT-2
    /// `gelu_new`, Llama-style `silu`, BERT `gelu`).
    pub fn hidden_act(&self) -> &str {
        self.settings
            .hidden_act
            .as_deref()
            .unwrap_or(match self.family {
                Family::Gpt2 => "gelu_new",
                Family::Bert => "gelu",
                Family::Llama | Family::Generic => "silu",
            })
    }

    /// What the trainable families do not implement in this configuration,
    /// as `(field, value, why)` for a message; `None` when they implement
    /// all of it. `seq_len`: the sequence length trained (a sliding window
    /// shorter than it is refused: the models attend to every earlier token).
    pub fn unsupported(&self, seq_len: usize) -> Option<(&'static str, String, String)> {
        if let Some(found) = self.unimplemented() {
            return Some(found);
        }
        if self.settings.moe.is_some() {
            let arch = self
                .settings
                .architecture
                .as_deref()
                .unwrap_or("mixture-of-experts");
            return Some((
                "architectures",
                format!("{arch:?}"),
                "a mixture-of-experts model is planned, not trained: training its router and \
                 experts is not implemented"
                    .into(),
            ));
        }
        let windowed = self.settings.gemma.is_none();
        match self.settings.sliding_window.filter(|&w| windowed && w < seq_len) {
            Some(w) => Some((
                "sliding_window",
                w.to_string(),
                format!(
                    "sliding-window attention is not implemented, and the sequence length {seq_len} exceeds the window"
                ),
            )),
            None => None,
        }
    }

    /// What oomfix implements for no sequence length: the architecture
    /// `config.json` names ([`crate::architecture::refusal`]), a RoPE
    /// scaling type, an activation; as `(field, value, why)`, `field` the key
    /// as `config.json` spells it. Such a model is refused before planning.
    pub fn unimplemented(&self) -> Option<(&'static str, String, String)> {
        let s = &self.settings;
        if let Some(arch) = &s.architecture {
            if let Some(why) = crate::architecture::refusal(arch) {
                let field = if arch.chars().any(char::is_uppercase) {
                    "architectures"
                } else {
                    "model_type"
                };
                return Some((field, format!("{arch:?}"), why));
            }
        }
        if let Some(p) = s.partial_rotary_factor.filter(|&p| p != 1.0) {
            let r = self.rotary_dim();
            if self.family != Family::Llama || s.gemma.is_some() || r == 0 || !r.is_multiple_of(2) {
                return Some((
                    "partial_rotary_factor",
                    p.to_string(),
                    format!(
                        "partial rotary is implemented for Llama-style models with an even \
                         rotated size (here {r} of {})",
                        self.head_dim()
                    ),
                ));
            }
        }
        if let Some(kind) = &s.rope_scaling {
            if self.family == Family::Llama
                && !crate::architecture::ROPE_SCALINGS.contains(&kind.as_str())
            {
                return Some((
                    "rope_scaling",
                    format!("{kind:?}"),
                    format!(
                        "the RoPE scalings implemented are {}",
                        crate::architecture::ROPE_SCALINGS.join(", ")
                    ),
                ));
            }
        }
        let d = self.head_dim();
        if self.family != Family::Generic && self.heads > 0 && !d.is_multiple_of(2) {
            let (field, value) = match self.settings.head_dim {
                Some(given) => ("head_dim", given.to_string()),
                None => ("num_attention_heads", self.heads.to_string()),
            };
            return Some((
                field,
                value,
                format!("heads of an even size are implemented (here {d})"),
            ));
        }
        let act = self.hidden_act();
        let implemented: &[&str] = match self.family {
            Family::Gpt2 | Family::Bert => &["gelu", "gelu_new", "gelu_pytorch_tanh"],
            Family::Llama if s.gemma.is_some() => &["gelu", "gelu_new", "gelu_pytorch_tanh"],
            Family::Llama => &["silu", "swish"],
            Family::Generic => &[],
        };
        if self.family != Family::Generic && !implemented.contains(&act) {
            let field = if self.family == Family::Gpt2 {
                "activation_function"
            } else if s.gemma.is_some() {
                "hidden_activation"
            } else {
                "hidden_act"
            };
            return Some((
                field,
                format!("{act:?}"),
                format!(
                    "the {} family implements {}",
                    self.family,
                    implemented.join(", ")
                ),
            ));
        }
        None
    }

    /// The part of each head RoPE rotates: `head_dim × partial_rotary_factor`
    /// rounded down (as transformers' `int()`), the whole head without one.
    pub fn rotary_dim(&self) -> usize {
        match self.settings.partial_rotary_factor {
            Some(p) if p != 1.0 => (self.head_dim() as f64 * p) as usize,
            _ => self.head_dim(),
        }
    }

    /// Whether [`oomfix_strategies::attention::flash_attention`] computes
    /// this model's attention: not for Gemma 2 and 3, whose scores are
    /// soft-capped (Gemma 2) and whose sliding-window blocks see only the
    /// last `sliding_window` keys; their blocks compose attention from
    /// candle ops, and the planner never chooses flash attention for them.
    pub fn flash_computes_it(&self) -> bool {
        self.settings.gemma.is_none()
    }

    /// Whether the `chunked-loss` fix computes this model's loss: not for a
    /// head whose logits are soft-capped (Gemma 2), which it does not cap.
    pub fn chunked_loss_computes_it(&self) -> bool {
        self.settings
            .gemma
            .as_ref()
            .is_none_or(|g| g.final_softcap.is_none())
    }

    /// The offset added to the RMSNorm scales: 1 for Gemma (`1 + w`), else 0.
    pub fn norm_offset(&self) -> f32 {
        if self.settings.gemma.is_some() {
            1.0
        } else {
            0.0
        }
    }

    /// Size of one attention head: `config.json`'s `head_dim`, else
    /// `hidden / heads`.
    pub fn head_dim(&self) -> usize {
        self.settings
            .head_dim
            .unwrap_or(self.hidden / self.heads.max(1))
    }

    /// The trainable tensors with their Hub names and shapes, in the order the
    /// model uses them (tied weights listed once).
    pub fn tensors(&self) -> Vec<(String, Vec<usize>)> {
        let (h, i, v) = (self.hidden, self.intermediate, self.vocab);
        let kv = self.kv_heads * self.head_dim();
        let q = self.heads * self.head_dim();
        let mut t: Vec<(String, Vec<usize>)> = Vec::new();
        let mut add = |name: String, shape: &[usize]| t.push((name, shape.to_vec()));
        match self.family {
            Family::Gpt2 => {
                add("wte.weight".into(), &[v, h]);
                add("wpe.weight".into(), &[self.max_positions, h]);
                for l in 0..self.layers {
                    let p = format!("h.{l}.");
                    add(format!("{p}ln_1.weight"), &[h]);
                    add(format!("{p}ln_1.bias"), &[h]);
                    add(format!("{p}attn.c_attn.weight"), &[h, 3 * h]);
                    add(format!("{p}attn.c_attn.bias"), &[3 * h]);
                    add(format!("{p}attn.c_proj.weight"), &[h, h]);
                    add(format!("{p}attn.c_proj.bias"), &[h]);
                    add(format!("{p}ln_2.weight"), &[h]);
                    add(format!("{p}ln_2.bias"), &[h]);
                    add(format!("{p}mlp.c_fc.weight"), &[h, i]);
                    add(format!("{p}mlp.c_fc.bias"), &[i]);
                    add(format!("{p}mlp.c_proj.weight"), &[i, h]);
                    add(format!("{p}mlp.c_proj.bias"), &[h]);
                }
                add("ln_f.weight".into(), &[h]);
                add("ln_f.bias".into(), &[h]);
            }
            Family::Llama => {
                add("model.embed_tokens.weight".into(), &[v, h]);
                for l in 0..self.layers {
                    let p = format!("model.layers.{l}.");
                    add(format!("{p}input_layernorm.weight"), &[h]);
                    if self.settings.fused_projections {
                        add(format!("{p}self_attn.qkv_proj.weight"), &[q + 2 * kv, h]);
                    } else {
                        add(format!("{p}self_attn.q_proj.weight"), &[q, h]);
                        add(format!("{p}self_attn.k_proj.weight"), &[kv, h]);
                        add(format!("{p}self_attn.v_proj.weight"), &[kv, h]);
                    }
                    if self.qkv_bias || self.settings.attention_bias {
                        add(format!("{p}self_attn.q_proj.bias"), &[q]);
                        add(format!("{p}self_attn.k_proj.bias"), &[kv]);
                        add(format!("{p}self_attn.v_proj.bias"), &[kv]);
                    }
                    add(format!("{p}self_attn.o_proj.weight"), &[h, q]);
                    if self.settings.attention_bias {
                        add(format!("{p}self_attn.o_proj.bias"), &[h]);
                    }
                    if self.settings.qk_norm {
                        let d = self.head_dim();
                        let (qn, kn) = if self.settings.qk_norm_whole {
                            (q, kv)
                        } else {
                            (d, d)
                        };
                        add(format!("{p}self_attn.q_norm.weight"), &[qn]);
                        add(format!("{p}self_attn.k_norm.weight"), &[kn]);
                    }
                    add(format!("{p}post_attention_layernorm.weight"), &[h]);
                    if self.settings.gemma.is_some() {
                        add(format!("{p}pre_feedforward_layernorm.weight"), &[h]);
                        add(format!("{p}post_feedforward_layernorm.weight"), &[h]);
                    }
                    if let Some(m) = &self.settings.moe {
                        let (e, x) = (m.experts, m.expert_intermediate);
                        if m.fused_experts {
                            add(format!("{p}mlp.gate.weight"), &[e, h]);
                            add(format!("{p}mlp.experts.gate_up_proj"), &[e, 2 * x, h]);
                            add(format!("{p}mlp.experts.down_proj"), &[e, h, x]);
                        } else if m.mixtral_names {
                            let b = format!("{p}block_sparse_moe.");
                            add(format!("{b}gate.weight"), &[e, h]);
                            for k in 0..e {
                                add(format!("{b}experts.{k}.w1.weight"), &[x, h]);
                                add(format!("{b}experts.{k}.w2.weight"), &[h, x]);
                                add(format!("{b}experts.{k}.w3.weight"), &[x, h]);
                            }
                        } else {
                            add(format!("{p}mlp.gate.weight"), &[e, h]);
                            for k in 0..e {
                                let b = format!("{p}mlp.experts.{k}.");
                                add(format!("{b}gate_proj.weight"), &[x, h]);
                                add(format!("{b}up_proj.weight"), &[x, h]);
                                add(format!("{b}down_proj.weight"), &[h, x]);
                            }
                        }
                    } else if self.settings.fused_projections {
                        add(format!("{p}mlp.gate_up_proj.weight"), &[2 * i, h]);
                        add(format!("{p}mlp.down_proj.weight"), &[h, i]);
                    } else {
                        add(format!("{p}mlp.gate_proj.weight"), &[i, h]);
                        add(format!("{p}mlp.up_proj.weight"), &[i, h]);
                        add(format!("{p}mlp.down_proj.weight"), &[h, i]);
                    }
                    if self.settings.mlp_bias {
                        add(format!("{p}mlp.gate_proj.bias"), &[i]);
                        add(format!("{p}mlp.up_proj.bias"), &[i]);
                        add(format!("{p}mlp.down_proj.bias"), &[h]);
                    }
                }
                add("model.norm.weight".into(), &[h]);
                if !self.tied_embeddings {
                    add("lm_head.weight".into(), &[v, h]);
                }
            }
            Family::Bert => {
                let e = "bert.embeddings.";
                add(format!("{e}word_embeddings.weight"), &[v, h]);
                add(
                    format!("{e}position_embeddings.weight"),
                    &[self.max_positions, h],
                );
                add(format!("{e}token_type_embeddings.weight"), &[2, h]);
                add(format!("{e}LayerNorm.weight"), &[h]);
                add(format!("{e}LayerNorm.bias"), &[h]);
                for l in 0..self.layers {
                    let p = format!("bert.encoder.layer.{l}.");
                    for m in ["query", "key", "value"] {
                        add(format!("{p}attention.self.{m}.weight"), &[h, h]);
                        add(format!("{p}attention.self.{m}.bias"), &[h]);
                    }
                    add(format!("{p}attention.output.dense.weight"), &[h, h]);
                    add(format!("{p}attention.output.dense.bias"), &[h]);
                    add(format!("{p}attention.output.LayerNorm.weight"), &[h]);
                    add(format!("{p}attention.output.LayerNorm.bias"), &[h]);
                    add(format!("{p}intermediate.dense.weight"), &[i, h]);
                    add(format!("{p}intermediate.dense.bias"), &[i]);
                    add(format!("{p}output.dense.weight"), &[h, i]);
                    add(format!("{p}output.dense.bias"), &[h]);
                    add(format!("{p}output.LayerNorm.weight"), &[h]);
                    add(format!("{p}output.LayerNorm.bias"), &[h]);
                }
                let c = "cls.predictions.";
                add(format!("{c}transform.dense.weight"), &[h, h]);
                add(format!("{c}transform.dense.bias"), &[h]);
                add(format!("{c}transform.LayerNorm.weight"), &[h]);
                add(format!("{c}transform.LayerNorm.bias"), &[h]);
                add(format!("{c}bias"), &[v]);
            }
            Family::Generic => {}
        }
        t
    }

    /// The transformer block the tensor named `name` belongs to: `h.N.`
    /// (GPT-2), `layers.N.` (Llama), `layer.N.` (BERT) name block N; `None`
    /// for tensors outside the blocks (embeddings, final norm, head).
    pub fn block_of(name: &str) -> Option<usize> {
        let parts: Vec<&str> = name.split('.').collect();
        parts.windows(2).find_map(|w| {
            matches!(w[0], "h" | "layers" | "layer")
                .then(|| w[1].parse().ok())
                .flatten()
        })
    }

    /// Elements of the token embedding when the model only looks rows up in
    /// it: a Llama-style model's `embed_tokens` not tied to its output layer
    /// (Gemma scales the rows it looks up and ties them: 0). Frozen under
    /// LoRA, it is kept in host memory
    /// ([`oomfix_strategies::ModelFacts::looked_up`]).
    pub fn looked_up_embedding(&self) -> u64 {
        let llama = self.family == Family::Llama && self.settings.gemma.is_none();
        if llama && !self.tied_embeddings {
            (self.vocab * self.hidden) as u64
        } else {
            0
        }
    }

    /// Parameters of one transformer block (the first; all are alike).
    pub fn block_parameters(&self) -> u64 {
        self.tensors()
            .iter()
            .filter(|(n, _)| Self::block_of(n) == Some(0))
            .map(|(_, s)| s.iter().product::<usize>() as u64)
            .sum()
    }

    /// Trainable parameter count implied by the shapes (tied weights once).
    pub fn parameter_count(&self) -> u64 {
        self.tensors()
            .iter()
            .map(|(_, s)| s.iter().product::<usize>() as u64)
            .sum()
    }
}

/// One trainable tensor as the file describes it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TensorInfo {
    /// Name in the file.
    pub name: String,
    /// Shape.
    pub shape: Vec<usize>,
    /// Stored dtype as safetensors spells it (`F32`, `BF16`, …).
    pub dtype: String,
}

impl TensorInfo {
    /// Number of elements.
    pub fn elements(&self) -> u64 {
        self.shape.iter().map(|&d| d as u64).product()
    }
}

/// A model as the planner sees it: where it came from, its shape, and its
/// trainable tensors.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelSpec {
    /// Path of the weights, or a name for a built-in model.
    pub source: String,
    /// The `.safetensors` files holding the weights (empty for a built-in model).
    #[serde(skip)]
    pub files: Vec<std::path::PathBuf>,
    /// Inferred shape. For [`Family::Generic`] only `family` is meaningful.
    pub config: ModelConfig,
    /// Trainable tensors (buffers such as GPT-2's `attn.bias` excluded, tied weights once).
    pub tensors: Vec<TensorInfo>,
    /// The most common stored dtype.
    pub dtype: String,
    /// Bytes of tensor data in the file(s).
    pub file_bytes: u64,
    /// What was assumed because neither shapes nor `config.json` said it.
    pub assumptions: Vec<String>,
}

impl ModelSpec {
    /// A model built from a config alone (no file), with fp32 weights.
    pub fn from_config(source: impl Into<String>, config: ModelConfig) -> Self {
        let tensors: Vec<TensorInfo> = config
            .tensors()
            .into_iter()
            .map(|(name, shape)| TensorInfo {
                name,
                shape,
                dtype: "F32".into(),
            })
            .collect();
        let file_bytes = tensors.iter().map(|t| t.elements() * 4).sum();
        ModelSpec {
            source: source.into(),
            files: Vec::new(),
            config,
            tensors,
            dtype: "F32".into(),
            file_bytes,
            assumptions: vec![],
        }
    }

    /// The built-in default model: GPT-2 small shape (124,439,808 parameters).
    pub fn default_model() -> Self {
        Self::from_config(
            "built-in gpt2 (124M, GPT-2 small shape)",
            ModelConfig::gpt2_small(),
        )
    }

    /// Trainable parameters (tied weights counted once).
    pub fn parameters(&self) -> u64 {
        self.tensors.iter().map(TensorInfo::elements).sum()
    }

    /// Elements of the largest trainable tensor.
    pub fn largest_tensor(&self) -> u64 {
        self.tensors
            .iter()
            .map(TensorInfo::elements)
            .max()
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn published_parameter_counts() {
        assert_eq!(ModelConfig::gpt2_small().parameter_count(), 124_439_808);
        assert_eq!(ModelConfig::gpt2_medium().parameter_count(), 354_823_168);
        assert_eq!(ModelConfig::llama2_7b().parameter_count(), 6_738_415_616);
        assert_eq!(
            ModelConfig::tinyllama_1_1b().parameter_count(),
            1_100_048_384
        );
    }
}
