//! Gemma 2 and Gemma 3 (text) decoders, as Hugging Face `transformers`
//! computes them ([`crate::GemmaSettings`]): RMSNorms scaled by `1 + w`
//! (in f32), four norms per block, the embedding multiplied by √hidden
//! rounded to the compute dtype, scores scaled by
//! `query_pre_attn_scalar^-½`, sliding-window blocks beside full ones,
//! a GeLU (tanh) gated MLP and a tied head; Gemma 2 soft-caps the
//! attention scores and the logits, Gemma 3 norms each query and key head
//! and gives its sliding blocks their own RoPE base.
//!
//! Attention is composed from candle ops (flash attention computes neither
//! the soft-cap nor the window: [`ModelConfig::flash_computes_it`]): the
//! scores `q·kᵀ` (the scale, and `1/cap` with soft-capping, folded into
//! the queries' RoPE tables), `cap·tanh(·)`, the additive mask (causal, or
//! causal within the window), the softmax in f32 (its row maximum detached)
//! and its output in the compute dtype, as transformers' eager attention
//! upcasts it.

use candle_core::{DType, Tensor, Var, D};
use oomfix_strategies::nn::ops::{self, GeluForm, RopeTables, WeightLayout};
use oomfix_strategies::nn::{Projection, RmsNorm};
use oomfix_strategies::{Attention, Execution};

use super::block_layers;
use super::layers::{module_tags, residual, tiled_residual, Packing, Tagged};
use super::llama::{Ends, Heads, Qkv};
use super::{batch_dims, rope, Forward, Params, TokenBatch};
use crate::track::tag::{Module, Op, Scope};
use crate::{Error, GemmaSettings, ModelConfig, Result};

#[derive(Clone)]
struct Block {
    input_norm: RmsNorm,
    heads: Heads,
    o_proj: Projection,
    post_attention_norm: RmsNorm,
    pre_feedforward_norm: RmsNorm,
    post_feedforward_norm: RmsNorm,
    gate_proj: Projection,
    up_proj: Projection,
    down_proj: Projection,
    gelu: GeluForm,
    /// Attends within the sliding window only.
    sliding: bool,
    /// `input_layernorm`, `self_attn`, `post_attention_layernorm`,
    /// `pre_feedforward_layernorm`, `mlp`, `post_feedforward_layernorm`.
    tags: [Module; 6],
}

/// The RoPE tables and the additive mask of one kind of block.
struct Kind {
    /// The queries' tables, scaled by the attention scale (and `1/cap`).
    rope_q: RopeTables,
    rope_k: RopeTables,
    /// `[s, s]` (`[b, 1, s, s]` with packed documents) in the compute
    /// dtype: 0 where a query sees a key, −∞ elsewhere.
    mask: Tensor,
}

/// What every block of one forward shares.
struct Context {
    /// Tokens per tile of the MLP ([`Execution::mlp_tile`]).
    mlp_tile: Option<usize>,
    full: Kind,
    /// The sliding blocks'; `None` when they compute what the full ones do
    /// (same RoPE base, a window no shorter than the sequence).
    sliding: Option<Kind>,
    /// The attention scores' cap.
    softcap: Option<f64>,
}

impl Block {
    fn new(p: &Params, l: usize, config: &ModelConfig, gemma: &GemmaSettings) -> Result<Self> {
        let prefix = format!("model.layers.{l}");
        let bias = config.settings.attention_bias;
        let proj = |name: &str, bias: bool| {
            p.linear(&format!("{prefix}.{name}"), bias, WeightLayout::OutIn)
        };
        let eps = config.norm_eps();
        let norm = |name: &str| p.rms_norm(&format!("{prefix}.{name}"), eps, 1.0);
        let qkv = Qkv::new(proj, false, bias)?;
        Ok(Block {
            input_norm: norm("input_layernorm")?,
            // RoPE turns the whole head.
            heads: Heads::new(config, qkv, norm, config.head_dim())?,
            o_proj: proj("self_attn.o_proj", bias)?,
            post_attention_norm: norm("post_attention_layernorm")?,
            pre_feedforward_norm: norm("pre_feedforward_layernorm")?,
            post_feedforward_norm: norm("post_feedforward_layernorm")?,
            gate_proj: proj("mlp.gate_proj", false)?,
            up_proj: proj("mlp.up_proj", false)?,
            down_proj: proj("mlp.down_proj", false)?,
            gelu: super::gelu_form(config)?,
            sliding: gemma.sliding(l),
            tags: module_tags(
                &prefix,
                [
                    "input_layernorm",
                    "self_attn",
                    "post_attention_layernorm",
                    "pre_feedforward_layernorm",
                    "mlp",
                    "post_feedforward_layernorm",
                ],
            ),
        })
    }

    fn forward(&self, x: &Tensor, ctx: &Context) -> candle_core::Result<Tensor> {
        let [input_norm, attn, post_attn, ..] = self.tags;
        let kind = match (&ctx.sliding, self.sliding) {
            (Some(sliding), true) => sliding,
            _ => &ctx.full,
        };
        let h = self.input_norm.forward_in(input_norm, x)?;
        let out = {
            let _m = Scope::module(attn);
            let (q, k, v) = self.heads.forward(&h, &kind.rope_q, &kind.rope_k)?;
            self.o_proj
                .forward(&attend(&q, &k, &v, &kind.mask, ctx.softcap)?)?
        };
        let x = {
            let out = self.post_attention_norm.forward_in(post_attn, &out)?;
            residual(x, &out)?
        };
        tiled_residual(self, &x, ctx.mlp_tile, self.tags[4], Block::mlp)
    }

    /// The row-wise part: the norms around the MLP and the MLP,
    /// `post(down(gelu(gate(h)) · up(h)))` of `h = pre(x)`.
    fn mlp(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let [.., pre_ff, mlp_tag, post_ff] = self.tags;
        let h = self.pre_feedforward_norm.forward_in(pre_ff, x)?;
        let out = {
            let _m = Scope::module(mlp_tag);
            let gate = self.gate_proj.forward(&h)?;
            let up = self.up_proj.forward(&h)?;
            let act = {
                let _op = Scope::op(Op::Gelu);
                ops::gelu(&gate, self.gelu)?.mul(&up)?
            };
            self.down_proj.forward(&act)?
        };
        self.post_feedforward_norm.forward_in(post_ff, &out)
    }
}

/// `softmax(cap·tanh(q·kᵀ) + mask)·v` (without a cap: `q·kᵀ + mask`), the
/// softmax in f32 and its output in `q`'s dtype, heads merged: `q`
/// `[b, H, s, d]` (its scale folded in), `k`, `v` `[b, KV, s, d]`
/// contiguous, `mask` `[s, s]` or `[b, 1, s, s]` → `[b, s, H·d]`.
/// Grouped-query heads share `k` and `v` without a copy.
///
/// Keeps, besides its inputs, score-sized tensors `[b, H, s, s]`: the
/// scores; with a cap, `tanh` and its multiple; the masked scores; with a
/// 16-bit compute dtype, their f32 copy; the shifted scores, their
/// exponentials and the probabilities (f32); with a 16-bit compute dtype,
/// the probabilities' copy; and the row maximum and sum `[b, H, s]` f32.
fn attend(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &Tensor,
    softcap: Option<f64>,
) -> candle_core::Result<Tensor> {
    let _op = Scope::op(Op::Attention);
    let (b, h, s, d) = q.dims4()?;
    let kv = k.dim(1)?;
    let scores = {
        let _op = Scope::op(Op::Matmul);
        q.reshape((b, kv, h / kv * s, d))?
            .matmul(&k.t()?)?
            .reshape((b, h, s, s))?
    };
    let scores = match softcap {
        Some(cap) => scores.tanh()?.affine(cap, 0.0)?,
        None => scores,
    };
    let probs = {
        let _op = Scope::op(Op::Softmax);
        let x = scores.broadcast_add(mask)?.to_dtype(DType::F32)?;
        let max = x.max_keepdim(D::Minus1)?.detach();
        let e = x.broadcast_sub(&max)?.exp()?;
        e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?
            .to_dtype(q.dtype())?
    };
    let _op = Scope::op(Op::Matmul);
    probs
        .reshape((b, kv, h / kv * s, s))?
        .matmul(v)?
        .reshape((b, h, s, d))?
        .transpose(1, 2)?
        .reshape((b, s, h * d))
}

/// The additive mask in `dtype`: 0 where query `i` sees key `j` (`j ≤ i`,
/// with a window `w` `i − j < w`, and with packed documents `j` at or
/// after the first position of `i`'s document), −∞ elsewhere: `[s, s]`,
/// or `[b, 1, s, s]` for the `b` rows of first positions `starts`.
fn mask(
    s: usize,
    window: Option<usize>,
    starts: Option<&[Vec<u32>]>,
    dtype: DType,
    device: &candle_core::Device,
) -> candle_core::Result<Tensor> {
    let row = |first: &dyn Fn(usize) -> usize| -> Vec<f32> {
        (0..s)
            .flat_map(|i| {
                let first = first(i);
                (0..s).map(move |j| {
                    let seen = first <= j && j <= i && window.is_none_or(|w| i - j < w);
                    if seen {
                        0.0
                    } else {
                        f32::NEG_INFINITY
                    }
                })
            })
            .collect()
    };
    let mask = match starts {
        None => Tensor::from_vec(row(&|_| 0), (s, s), device)?,
        Some(starts) => {
            let values: Vec<f32> = starts
                .iter()
                .flat_map(|st| row(&|i| st[i] as usize))
                .collect();
            Tensor::from_vec(values, (starts.len(), 1, s, s), device)?
        }
    };
    mask.to_dtype(dtype)
}

/// √hidden rounded to `dtype`, as transformers multiplies the embedding by
/// a tensor of the weights' dtype.
fn embed_scale(hidden: usize, dtype: DType) -> f64 {
    let x = (hidden as f64).sqrt();
    match dtype {
        DType::BF16 => half::bf16::from_f64(x).to_f64(),
        DType::F16 => half::f16::from_f64(x).to_f64(),
        _ => x as f32 as f64,
    }
}

/// A trainable Gemma 2 or Gemma 3 (text) model.
pub(crate) struct Gemma {
    config: ModelConfig,
    gemma: GemmaSettings,
    ends: Ends,
    blocks: Vec<Block>,
    vars: Vec<(String, Var)>,
}

impl Gemma {
    pub(crate) fn new(config: &ModelConfig, p: Params) -> Result<Self> {
        let gemma = config
            .settings
            .gemma
            .clone()
            .ok_or_else(|| Error::Usage("a Gemma model needs Gemma's settings".into()))?;
        Ok(Gemma {
            config: config.clone(),
            ends: Ends::new(config, &p, 1.0)?,
            blocks: (0..config.layers)
                .map(|l| Block::new(&p, l, config, &gemma))
                .collect::<Result<_>>()?,
            gemma,
            vars: p.into_vars(),
        })
    }

    /// The forward pass on `batch`: the scaled embedding, blocks, final norm,
    /// LM head and (Gemma 2) the logits' soft-cap. Attention is composed
    /// whatever `exec` says; flash attention is an error. Packed documents
    /// ([`TokenBatch::documents`]): each token attends to its own document
    /// (within its window on the sliding blocks) and RoPE turns it by its
    /// position in the document (per-token tables, both kinds of block);
    /// the masks are `[b, 1, s, s]`.
    pub(super) fn forward(&self, batch: &TokenBatch, exec: &Execution) -> Result<Forward<'_>> {
        if exec.attention == Attention::Flash {
            return Err(Error::Usage(
                "flash attention does not compute Gemma's soft-capped scores and sliding \
                 windows: Gemma attends with composed attention"
                    .into(),
            ));
        }
        let (_, s) = batch_dims(batch, &self.config)?;
        let (device, dtype) = (self.ends.device(), self.ends.dtype());
        let g = &self.gemma;
        let softcap = g.attn_softcap;
        let q_scale = g.query_pre_attn_scalar.powf(-0.5) / softcap.unwrap_or(1.0);
        let ctx = {
            let _m = Scope::new(self.ends.rotary_tag(), Op::Rope);
            let packing = Packing::of(batch, device)?;
            // Positions run to the longest document's length.
            let positions = packing.as_ref().map_or(s, |p| p.longest);
            let tables = |freqs: &[f64], factor: f64| {
                rope::tables(freqs, factor, positions, packing.as_ref(), device)
            };
            let starts = packing.as_ref().map(|p| p.starts.as_slice());
            let kind = |freqs: &[f64], factor: f64, window: Option<usize>| -> Result<Kind> {
                Ok(Kind {
                    rope_q: tables(freqs, factor * q_scale)?,
                    rope_k: tables(freqs, factor)?,
                    mask: mask(s, window, starts, dtype, device)?,
                })
            };
            let (freqs, factor) = rope::frequencies(&self.config, positions)?;
            let window = self.config.settings.sliding_window.filter(|&w| w < s);
            let any_sliding = (0..self.config.layers).any(|l| g.sliding(l));
            let local = rope::local_frequencies(&self.config);
            let sliding = if any_sliding && (window.is_some() || local.is_some()) {
                Some(match &local {
                    Some(f) => kind(f, 1.0, window)?,
                    None => kind(&freqs, factor, window)?,
                })
            } else {
                None
            };
            Context {
                mlp_tile: exec.mlp_tile(),
                full: kind(&freqs, factor, None)?,
                sliding,
                softcap,
            }
        };
        let scale = embed_scale(self.config.hidden, dtype);
        let stem = self.ends.embedded(batch, &self.config, Some(scale))?;
        let blocks = block_layers(&self.blocks, ctx, Block::forward);
        Ok(self.ends.pass(stem, blocks, g.final_softcap))
    }
}

super::trainable_family!(Gemma);
