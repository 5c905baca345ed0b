//! Llama-style decoder: RMSNorm, RoPE, SwiGLU, grouped-query attention
//! (Llama 2/3, Mistral, TinyLlama; Qwen2 with `qkv_bias`; Qwen3 with
//! RMSNorm on each query and key head; Phi-3 with fused `qkv_proj` and
//! `gate_up_proj`), with the checkpoint's RMSNorm
//! epsilon, head size, RoPE base and scaling ([`rope`]), and optional biases
//! on every attention projection (`attention_bias`) and the MLP (`mlp_bias`).

use candle_core::{DType, Device, Tensor, Var};
use oomfix_strategies::nn::ops::{self, RopeTables, WeightLayout};
use oomfix_strategies::nn::{Projection, RmsNorm};
use oomfix_strategies::Execution;

use super::layers::{module_tags, residual, split_heads, tiled_residual, Attend, Packing, Tagged};
use super::{batch_dims, rope, Forward, Layer, Output, Params, TokenBatch};
use super::{block_layers, final_norm};
use crate::track::tag::{Module, Op, Scope};
use crate::{ModelConfig, Result};

#[derive(Clone)]
struct Block {
    input_norm: RmsNorm,
    heads: Heads,
    o_proj: Projection,
    post_norm: RmsNorm,
    gate_up: GateUp,
    down_proj: Projection,
    intermediate: usize,
    /// `input_layernorm`, `self_attn`, `post_attention_layernorm`, `mlp`
    /// under `model.layers.{l}`.
    tags: [Module; 4],
}

/// The query, key and value heads of a Llama-style block's attention (Llama,
/// Gemma): the projections, Qwen3's and Gemma 3's RMSNorm over each query
/// and key head, and RoPE.
#[derive(Clone)]
pub(super) struct Heads {
    qkv: Qkv,
    qk_norm: Option<(RmsNorm, RmsNorm)>,
    head_dim: usize,
    /// The part of each head RoPE rotates (`head_dim` unless
    /// `partial_rotary_factor` says less).
    rotary: usize,
    heads: usize,
    kv_heads: usize,
}

impl Heads {
    /// The heads of a block of `config` with the projections `qkv`, and
    /// the norms `self_attn.q_norm` and `self_attn.k_norm` from `norm` where
    /// the model has them; RoPE rotates the first `rotary` elements of each
    /// head.
    pub(super) fn new(
        config: &ModelConfig,
        qkv: Qkv,
        norm: impl Fn(&str) -> Result<RmsNorm>,
        rotary: usize,
    ) -> Result<Self> {
        let qk_norm = if config.settings.qk_norm {
            Some((norm("self_attn.q_norm")?, norm("self_attn.k_norm")?))
        } else {
            None
        };
        Ok(Heads {
            qkv,
            qk_norm,
            head_dim: config.head_dim(),
            rotary,
            heads: config.heads,
            kv_heads: config.kv_heads,
        })
    }

    /// q `[b, H, s, d]` and k `[b, KV, s, d]` turned by `rope_q` and
    /// `rope_k`, and v `[b, KV, s, d]` contiguous, of the normed input `h`
    /// `[b, s, h]`.
    pub(super) fn forward(
        &self,
        h: &Tensor,
        rope_q: &RopeTables,
        rope_k: &RopeTables,
    ) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
        let (heads, kv) = (self.heads * self.head_dim, self.kv_heads * self.head_dim);
        let (mut q, mut k, v) = self.qkv.forward(h, heads, kv)?;
        if let Some((q_norm, k_norm)) = &self.qk_norm {
            // Over each head: [b, s, heads, d] (views of the projections).
            let (b, s, _) = q.dims3()?;
            q = q_norm.forward(&q.reshape((b, s, self.heads, self.head_dim))?)?;
            k = k_norm.forward(&k.reshape((b, s, self.kv_heads, self.head_dim))?)?;
        }
        let (q, k) = {
            let _op = Scope::op(Op::Rope);
            (
                self.rope(&q, self.heads, rope_q)?,
                self.rope(&k, self.kv_heads, rope_k)?,
            )
        };
        let v = split_heads(&v, self.kv_heads)?.contiguous()?;
        Ok((q, k, v))
    }

    /// The scale the attention applies: 1 with the whole head rotated (the
    /// queries' RoPE tables carry it), else `1/√d`.
    fn attention_scale(&self) -> f64 {
        if self.rotary == self.head_dim {
            1.0
        } else {
            (self.head_dim as f64).powf(-0.5)
        }
    }

    /// RoPE on `x` (`[b, s, n·d]` or `[b, s, n, d]`, `n` = `heads`) with the
    /// heads moved first, `[b, n, s, d]`: the whole head ([`ops::rope`]), or
    /// its first `rotary` elements, the rest passed through as transformers'
    /// partial rotary does (Phi-4-mini). Partial: the rotated part's
    /// contiguous copy `[n·rotary]` per token, its RoPE and the two parts
    /// joined `[b, n, s, d]` (a non-contiguous `x`, a fused projection's
    /// slice, is copied first).
    fn rope(&self, x: &Tensor, heads: usize, tables: &RopeTables) -> candle_core::Result<Tensor> {
        if self.rotary == self.head_dim {
            return ops::rope(x, heads, tables);
        }
        let (b, s) = (x.dim(0)?, x.dim(1)?);
        let (d, r) = (self.head_dim, self.rotary);
        let x = x.reshape((b, s, heads, d))?;
        let rotated = ops::rope(&x.narrow(3, 0, r)?, heads, tables)?;
        let passed = x.narrow(3, r, d - r)?.transpose(1, 2)?;
        Tensor::cat(&[&rotated, &passed], 3)
    }
}

/// The q, k, v projections: three, or Phi-3's one `qkv_proj` whose rows are
/// q (`H·d`), then k and v (`KV·d` each).
#[derive(Clone)]
pub(super) enum Qkv {
    Separate(Projection, Projection, Projection),
    Fused(Projection),
}

impl Qkv {
    /// The projections `self_attn.q_proj`, `k_proj` and `v_proj` from
    /// `proj`, with a bias where `bias`; when `fused`, Phi-3's
    /// `self_attn.qkv_proj` (no bias).
    pub(super) fn new(
        proj: impl Fn(&str, bool) -> Result<Projection>,
        fused: bool,
        bias: bool,
    ) -> Result<Self> {
        Ok(if fused {
            Qkv::Fused(proj("self_attn.qkv_proj", false)?)
        } else {
            Qkv::Separate(
                proj("self_attn.q_proj", bias)?,
                proj("self_attn.k_proj", bias)?,
                proj("self_attn.v_proj", bias)?,
            )
        })
    }

    /// q `[b, s, H·d]`, k and v `[b, s, KV·d]` (the fused form's are views of its output).
    fn forward(
        &self,
        h: &Tensor,
        q: usize,
        kv: usize,
    ) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
        match self {
            Qkv::Separate(qp, kp, vp) => Ok((qp.forward(h)?, kp.forward(h)?, vp.forward(h)?)),
            Qkv::Fused(p) => {
                let all = p.forward(h)?;
                Ok((
                    all.narrow(2, 0, q)?,
                    all.narrow(2, q, kv)?,
                    all.narrow(2, q + kv, kv)?,
                ))
            }
        }
    }
}

/// The MLP's gate and up projections: two, or Phi-3's one `gate_up_proj`
/// whose rows are the gate's, then up's.
#[derive(Clone)]
enum GateUp {
    Separate(Projection, Projection),
    Fused(Projection),
}

impl GateUp {
    /// gate and up `[b, s, I]` (the fused form's are views of its output).
    fn forward(&self, h: &Tensor, i: usize) -> candle_core::Result<(Tensor, Tensor)> {
        match self {
            GateUp::Separate(g, u) => Ok((g.forward(h)?, u.forward(h)?)),
            GateUp::Fused(p) => {
                let both = p.forward(h)?;
                Ok((both.narrow(2, 0, i)?, both.narrow(2, i, i)?))
            }
        }
    }
}

/// What every block of one forward shares.
struct Context {
    attend: Attend,
    /// Tables for the queries, scaled by `1/√d`.
    rope_q: RopeTables,
    rope_k: RopeTables,
    /// Tokens per tile of the MLP ([`Execution::mlp_tile`]).
    mlp_tile: Option<usize>,
}

impl Block {
    fn new(p: &Params, l: usize, config: &ModelConfig) -> Result<Self> {
        let prefix = format!("model.layers.{l}");
        let proj = |name: &str, bias: bool| {
            p.linear(&format!("{prefix}.{name}"), bias, WeightLayout::OutIn)
        };
        let eps = config.norm_eps();
        let norm = |name: &str| p.rms_norm(&format!("{prefix}.{name}"), eps, 0.0);
        let (qkv_bias, o_bias) = (
            config.qkv_bias || config.settings.attention_bias,
            config.settings.attention_bias,
        );
        let mlp_bias = config.settings.mlp_bias;
        let qkv = Qkv::new(proj, config.settings.fused_projections, qkv_bias)?;
        Ok(Block {
            input_norm: norm("input_layernorm")?,
            heads: Heads::new(config, qkv, norm, config.rotary_dim())?,
            o_proj: proj("self_attn.o_proj", o_bias)?,
            post_norm: norm("post_attention_layernorm")?,
            gate_up: if config.settings.fused_projections {
                GateUp::Fused(proj("mlp.gate_up_proj", false)?)
            } else {
                GateUp::Separate(
                    proj("mlp.gate_proj", mlp_bias)?,
                    proj("mlp.up_proj", mlp_bias)?,
                )
            },
            down_proj: proj("mlp.down_proj", mlp_bias)?,
            intermediate: config.intermediate,
            tags: module_tags(
                &prefix,
                [
                    "input_layernorm",
                    "self_attn",
                    "post_attention_layernorm",
                    "mlp",
                ],
            ),
        })
    }

    fn forward(&self, x: &Tensor, ctx: &Context) -> candle_core::Result<Tensor> {
        let [input_norm, attn, ..] = self.tags;
        let h = self.input_norm.forward_in(input_norm, x)?;
        let x = {
            let _m = Scope::module(attn);
            let (q, k, v) = self.heads.forward(&h, &ctx.rope_q, &ctx.rope_k)?;
            let scale = self.heads.attention_scale();
            let out = self
                .o_proj
                .forward(&ctx.attend.forward(&q, &k, &v, scale)?)?;
            residual(x, &out)?
        };
        tiled_residual(self, &x, ctx.mlp_tile, self.tags[3], Block::mlp)
    }

    /// The row-wise part: the RMSNorm after attention and the MLP,
    /// `down(silu(gate(h)) · up(h))` of `h = RMSNorm(x)`.
    fn mlp(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let [.., post_norm, mlp_tag] = self.tags;
        let h = self.post_norm.forward_in(post_norm, x)?;
        let _m = Scope::module(mlp_tag);
        let (gate, up) = self.gate_up.forward(&h, self.intermediate)?;
        let mlp = {
            let _op = Scope::op(Op::Silu);
            ops::swiglu(&gate, &up)?
        };
        self.down_proj.forward(&mlp)
    }
}

/// What a Llama-style decoder (Llama, Gemma) holds besides its blocks: the
/// token embedding, the final RMSNorm and the LM head.
pub(super) struct Ends {
    embed: Tensor,
    norm: RmsNorm,
    /// `[V, h]`: the embedding when tied, else `lm_head.weight`.
    lm_head: Tensor,
    /// `model.embed_tokens`, `model.rotary_emb`, `model.norm`, `lm_head`.
    tags: [Module; 4],
}

impl Ends {
    /// The ends of `config`'s model from `p`, the final norm scaled by
    /// `w + norm_offset`.
    pub(super) fn new(config: &ModelConfig, p: &Params, norm_offset: f32) -> Result<Self> {
        let embed = p.get("model.embed_tokens.weight")?;
        Ok(Ends {
            lm_head: if config.tied_embeddings {
                embed.clone()
            } else {
                p.get("lm_head.weight")?
            },
            embed,
            norm: p.rms_norm("model.norm", config.norm_eps(), norm_offset)?,
            tags: [
                "model.embed_tokens",
                "model.rotary_emb",
                "model.norm",
                "lm_head",
            ]
            .map(Module::intern),
        })
    }

    /// The blocks' device (the embedding may be kept on the host).
    pub(super) fn device(&self) -> &Device {
        self.lm_head.device()
    }

    /// The compute dtype.
    pub(super) fn dtype(&self) -> DType {
        self.embed.dtype()
    }

    /// The tag of `model.rotary_emb`, under which the RoPE tables are made.
    pub(super) fn rotary_tag(&self) -> Module {
        self.tags[1]
    }

    /// The embedding of the batch's tokens `[b, s, h]` on the blocks'
    /// device (a table on the host looks the rows up there and sends them
    /// over), multiplied by `scale` where given.
    pub(super) fn embedded(
        &self,
        batch: &TokenBatch,
        config: &ModelConfig,
        scale: Option<f64>,
    ) -> candle_core::Result<Tensor> {
        let _m = Scope::new(self.tags[0], Op::Embedding);
        let (b, s) = batch.input_ids.dims2()?;
        let ids = batch
            .input_ids
            .flatten_all()?
            .to_device(self.embed.device())?;
        let rows = ops::embedding_padded(&self.embed, &ids, config.settings.pad_token_id)?
            .to_device(self.device())?
            .reshape((b, s, config.hidden))?;
        match scale {
            Some(scale) => rows.affine(scale, 0.0),
            None => Ok(rows),
        }
    }

    /// The pass of `stem` through `blocks`, the final norm and the LM head,
    /// its logits soft-capped at `softcap`.
    pub(super) fn pass<'a>(
        &'a self,
        stem: Tensor,
        blocks: Vec<Layer<'a>>,
        softcap: Option<f64>,
    ) -> Forward<'a> {
        let [_, _, norm, lm_head] = self.tags;
        Forward {
            stem,
            blocks,
            head: final_norm(&self.norm, norm),
            output: Output {
                weight: &self.lm_head,
                bias: None,
                softcap,
                tag: lm_head,
            },
        }
    }
}

/// A trainable Llama-style model.
pub(crate) struct Llama {
    config: ModelConfig,
    ends: Ends,
    blocks: Vec<Block>,
    vars: Vec<(String, Var)>,
}

impl Llama {
    pub(crate) fn new(config: &ModelConfig, p: Params) -> Result<Self> {
        Ok(Llama {
            config: config.clone(),
            ends: Ends::new(config, &p, 0.0)?,
            blocks: (0..config.layers)
                .map(|l| Block::new(&p, l, config))
                .collect::<Result<_>>()?,
            vars: p.into_vars(),
        })
    }

    /// The forward pass on `batch`: embedding, blocks, final norm, and the LM
    /// head as the output layer.
    ///
    /// Packed documents ([`TokenBatch::documents`]): each token attends to
    /// its own document and RoPE turns it by its position in the document
    /// (per-token tables `[b·s, d]`, [`RopeTables::at_positions`]). The RoPE
    /// scalings that depend on the length (`dynamic`, `longrope`) take the
    /// longest document's, as transformers takes the largest position id
    /// plus one: a document shorter than the longest gets the frequencies
    /// of the longest, which equal its own unless the two lie on different
    /// sides of the scaling's threshold (`dynamic` past the model's context
    /// also changes with the length).
    pub(super) fn forward(&self, batch: &TokenBatch, exec: &Execution) -> Result<Forward<'_>> {
        let (_, s) = batch_dims(batch, &self.config)?;
        let d = self.config.head_dim();
        let device = self.ends.device();
        let packing = Packing::of(batch, device)?;
        // Positions run to the longest document's length.
        let positions = packing.as_ref().map_or(s, |p| p.longest);
        let (freqs, factor) = rope::frequencies(&self.config, positions)?;
        // The attention scale rides on the queries' tables when RoPE rotates
        // whole heads (partial rotary: the attention applies it).
        let q_factor = if self.config.rotary_dim() == d {
            factor / (d as f64).sqrt()
        } else {
            factor
        };
        let ctx = {
            let _m = Scope::new(self.ends.rotary_tag(), Op::Rope);
            let tables = |factor| rope::tables(&freqs, factor, positions, packing.as_ref(), device);
            Context {
                attend: Attend::causal(exec, packing.as_ref()),
                rope_q: tables(q_factor)?,
                rope_k: tables(factor)?,
                mlp_tile: exec.mlp_tile(),
            }
        };
        let stem = self.ends.embedded(batch, &self.config, None)?;
        let blocks = block_layers(&self.blocks, ctx, Block::forward);
        Ok(self.ends.pass(stem, blocks, None))
    }
}

super::trainable_family!(Llama);
