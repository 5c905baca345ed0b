//! Llama-style decoder: RMSNorm, RoPE, SwiGLU, grouped-query attention
//! (Llama 2/3, Mistral, TinyLlama; Qwen2 with `qkv_bias`; Qwen3 with
//! RMSNorm on each query and key head), with the checkpoint's RMSNorm
//! epsilon, head size, RoPE base and scaling ([`rope`]), and optional biases
//! on every attention projection (`attention_bias`) and the MLP (`mlp_bias`).

use std::rc::Rc;

use candle_core::{Tensor, Var};
use oomfix_strategies::nn::ops::{self, RopeTables, WeightLayout};
use oomfix_strategies::Execution;

use super::layers::{lm_logits, split_heads, Attend, Linear, RmsNorm};
use super::{batch_dims, rope, Forward, Params, TokenBatch};
use crate::track::tag::{Module, Op, Scope};
use crate::{ModelConfig, Result};

struct Block {
    input_norm: RmsNorm,
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    post_norm: RmsNorm,
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
    /// Qwen3's RMSNorm over each query and key head, before RoPE.
    qk_norm: Option<(RmsNorm, RmsNorm)>,
    head_dim: usize,
    heads: usize,
    kv_heads: usize,
    /// `input_layernorm`, `self_attn`, `post_attention_layernorm`, `mlp` under `model.layers.{l}`.
    tags: [Module; 4],
}

/// What every block of one forward shares.
struct Context {
    attend: Attend,
    /// Tables for the queries, scaled by `1/√d`.
    rope_q: RopeTables,
    rope_k: RopeTables,
}

impl Block {
    fn new(p: &Params, l: usize, config: &ModelConfig) -> Result<Self> {
        let prefix = format!("model.layers.{l}");
        let proj = |name: &str, bias: bool| {
            p.linear(&format!("{prefix}.{name}"), bias, WeightLayout::OutIn)
        };
        let eps = config.norm_eps();
        let norm = |name: &str| p.rms_norm(&format!("{prefix}.{name}"), eps);
        let (qkv_bias, o_bias) = (
            config.qkv_bias || config.settings.attention_bias,
            config.settings.attention_bias,
        );
        let mlp_bias = config.settings.mlp_bias;
        Ok(Block {
            input_norm: norm("input_layernorm")?,
            q_proj: proj("self_attn.q_proj", qkv_bias)?,
            k_proj: proj("self_attn.k_proj", qkv_bias)?,
            v_proj: proj("self_attn.v_proj", qkv_bias)?,
            o_proj: proj("self_attn.o_proj", o_bias)?,
            post_norm: norm("post_attention_layernorm")?,
            gate_proj: proj("mlp.gate_proj", mlp_bias)?,
            up_proj: proj("mlp.up_proj", mlp_bias)?,
            down_proj: proj("mlp.down_proj", mlp_bias)?,
            qk_norm: if config.settings.qk_norm {
                Some((norm("self_attn.q_norm")?, norm("self_attn.k_norm")?))
            } else {
                None
            },
            head_dim: config.head_dim(),
            heads: config.heads,
            kv_heads: config.kv_heads,
            tags: [
                "input_layernorm",
                "self_attn",
                "post_attention_layernorm",
                "mlp",
            ]
            .map(|m| Module::intern(&format!("{prefix}.{m}"))),
        })
    }

    fn forward(&self, x: &Tensor, ctx: &Context) -> candle_core::Result<Tensor> {
        let [input_norm, attn, post_norm, mlp_tag] = self.tags;
        let h = {
            let _m = Scope::module(input_norm);
            self.input_norm.forward(x)?
        };
        let x = {
            let _m = Scope::module(attn);
            let (mut q, mut k) = (self.q_proj.forward(&h)?, self.k_proj.forward(&h)?);
            if let Some((q_norm, k_norm)) = &self.qk_norm {
                // Over each head: [b, s, heads, d] (views of the projections).
                let (b, s, _) = q.dims3()?;
                q = q_norm.forward(&q.reshape((b, s, self.heads, self.head_dim))?)?;
                k = k_norm.forward(&k.reshape((b, s, self.kv_heads, self.head_dim))?)?;
            }
            let (q, k) = {
                let _op = Scope::op(Op::Rope);
                (
                    ops::rope(&q, self.heads, &ctx.rope_q)?,
                    ops::rope(&k, self.kv_heads, &ctx.rope_k)?,
                )
            };
            let v = split_heads(&self.v_proj.forward(&h)?, self.kv_heads)?.contiguous()?;
            // The queries' RoPE tables already carry the attention scale.
            let out = self.o_proj.forward(&ctx.attend.forward(&q, &k, &v, 1.0)?)?;
            let _op = Scope::op(Op::Residual);
            x.add(&out)?
        };
        let h = {
            let _m = Scope::module(post_norm);
            self.post_norm.forward(&x)?
        };
        let _m = Scope::module(mlp_tag);
        let gate = self.gate_proj.forward(&h)?;
        let up = self.up_proj.forward(&h)?;
        let mlp = {
            let _op = Scope::op(Op::Silu);
            ops::swiglu(&gate, &up)?
        };
        let out = self.down_proj.forward(&mlp)?;
        let _op = Scope::op(Op::Residual);
        x.add(&out)
    }
}

/// A trainable Llama-style model.
pub(crate) struct Llama {
    config: ModelConfig,
    embed: Tensor,
    blocks: Vec<Block>,
    norm: RmsNorm,
    /// `[V, h]`: the embedding when tied, else `lm_head.weight`.
    lm_head: Tensor,
    vars: Vec<(String, Var)>,
    /// `model.embed_tokens`, `model.rotary_emb`, `model.norm`, `lm_head`.
    tags: [Module; 4],
}

impl Llama {
    pub(crate) fn new(config: &ModelConfig, p: Params) -> Result<Self> {
        let embed = p.get("model.embed_tokens.weight")?;
        Ok(Llama {
            config: config.clone(),
            lm_head: if config.tied_embeddings {
                embed.clone()
            } else {
                p.get("lm_head.weight")?
            },
            embed,
            blocks: (0..config.layers)
                .map(|l| Block::new(&p, l, config))
                .collect::<Result<_>>()?,
            norm: p.rms_norm("model.norm", config.norm_eps())?,
            vars: p.into_vars(),
            tags: [
                "model.embed_tokens",
                "model.rotary_emb",
                "model.norm",
                "lm_head",
            ]
            .map(Module::intern),
        })
    }

    /// The forward pass on `batch`: embedding, blocks, final norm and LM head.
    pub(super) fn forward(&self, batch: &TokenBatch, exec: &Execution) -> Result<Forward<'_>> {
        let (b, s) = batch_dims(batch, &self.config)?;
        let (h, d) = (self.config.hidden, self.config.head_dim());
        let device = self.embed.device();
        let [embed, rotary, norm, lm_head] = self.tags;
        let (freqs, factor) = rope::frequencies(&self.config, s)?;
        let ctx = {
            let _m = Scope::new(rotary, Op::Rope);
            Rc::new(Context {
                attend: Attend::causal(exec),
                rope_q: RopeTables::from_inv_freq(s, &freqs, factor / (d as f64).sqrt(), device)?,
                rope_k: RopeTables::from_inv_freq(s, &freqs, factor, device)?,
            })
        };
        let stem = {
            let _m = Scope::new(embed, Op::Embedding);
            ops::embedding(&self.embed, &batch.input_ids.flatten_all()?)?.reshape((b, s, h))?
        };
        let blocks = self
            .blocks
            .iter()
            .map(|blk| {
                let ctx = Rc::clone(&ctx);
                Forward::layer(move |x| blk.forward(x, &ctx))
            })
            .collect();
        let head = Forward::layer(move |x| {
            let x = {
                let _m = Scope::module(norm);
                self.norm.forward(x)?.reshape((b * s, h))?
            };
            let _m = Scope::module(lm_head);
            lm_logits(&x, &self.lm_head, None)
        });
        Ok(Forward { stem, blocks, head })
    }
}

super::trainable_family!(Llama);
