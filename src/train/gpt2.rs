//! GPT-2: learned positions, pre-LN blocks, `Conv1D` projections, tied LM head.

use candle_core::{Tensor, Var};
use oomfix_strategies::nn::ops::{self, GeluForm, WeightLayout};
use oomfix_strategies::nn::{LayerNorm, Projection};
use oomfix_strategies::Execution;

use super::layers::{module_tags, residual, tiled_residual, Attend, Packing, Tagged};
use super::{batch_dims, Forward, Output, Params, TokenBatch};
use super::{block_layers, final_norm};
use crate::track::tag::{Module, Op, Scope};
use crate::{ModelConfig, Result};

#[derive(Clone)]
struct Block {
    ln_1: LayerNorm,
    c_attn: Projection,
    attn_proj: Projection,
    ln_2: LayerNorm,
    c_fc: Projection,
    mlp_proj: Projection,
    heads: usize,
    gelu: GeluForm,
    /// `h.{l}.ln_1`, `h.{l}.attn`, `h.{l}.ln_2`, `h.{l}.mlp`.
    tags: [Module; 4],
}

impl Block {
    fn new(p: &Params, l: usize, config: &ModelConfig) -> Result<Self> {
        let conv = |name: &str| p.linear(&format!("h.{l}.{name}"), true, WeightLayout::InOut);
        let eps = config.norm_eps();
        Ok(Block {
            ln_1: p.layer_norm(&format!("h.{l}.ln_1"), eps)?,
            c_attn: conv("attn.c_attn")?,
            attn_proj: conv("attn.c_proj")?,
            ln_2: p.layer_norm(&format!("h.{l}.ln_2"), eps)?,
            c_fc: conv("mlp.c_fc")?,
            mlp_proj: conv("mlp.c_proj")?,
            heads: config.heads,
            gelu: super::gelu_form(config)?,
            tags: module_tags(&format!("h.{l}"), ["ln_1", "attn", "ln_2", "mlp"]),
        })
    }

    fn forward(
        &self,
        x: &Tensor,
        attend: &Attend,
        mlp_tile: Option<usize>,
    ) -> candle_core::Result<Tensor> {
        let (b, s, h) = x.dims3()?;
        let d = h / self.heads;
        let [ln_1, attn_tag, ..] = self.tags;
        let normed = self.ln_1.forward_in(ln_1, x)?;
        let x = {
            let _m = Scope::module(attn_tag);
            // [b, s, 3h] viewed as [b, s, 3, H, d]; part i is [b, H, s, d] (strided).
            let qkv = self
                .c_attn
                .forward(&normed)?
                .reshape((b, s, 3, self.heads, d))?;
            let part = |i: usize| qkv.narrow(2, i, 1)?.squeeze(2)?.transpose(1, 2);
            let (k, v) = (part(1)?.contiguous()?, part(2)?.contiguous()?);
            let attn = attend.forward(&part(0)?, &k, &v, 1.0 / (d as f64).sqrt())?;
            let out = self.attn_proj.forward(&attn)?;
            residual(x, &out)?
        };
        tiled_residual(self, &x, mlp_tile, self.tags[3], Block::mlp)
    }

    /// The row-wise part: `mlp_proj(gelu(c_fc(ln_2(x))))`.
    fn mlp(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let [_, _, ln_2, mlp_tag] = self.tags;
        let normed = self.ln_2.forward_in(ln_2, x)?;
        let _m = Scope::module(mlp_tag);
        let inner = self.c_fc.forward(&normed)?;
        let inner = {
            let _op = Scope::op(Op::Gelu);
            ops::gelu(&inner, self.gelu)?
        };
        self.mlp_proj.forward(&inner)
    }
}

/// A trainable GPT-2.
pub(crate) struct Gpt2 {
    config: ModelConfig,
    wte: Tensor,
    wpe: Tensor,
    blocks: Vec<Block>,
    ln_f: LayerNorm,
    vars: Vec<(String, Var)>,
    /// `wte`, `ln_f`, `lm_head`.
    tags: [Module; 3],
}

impl Gpt2 {
    pub(crate) fn new(config: &ModelConfig, p: Params) -> Result<Self> {
        Ok(Gpt2 {
            config: config.clone(),
            wte: p.get("wte.weight")?,
            wpe: p.get("wpe.weight")?,
            blocks: (0..config.layers)
                .map(|l| Block::new(&p, l, config))
                .collect::<Result<_>>()?,
            ln_f: p.layer_norm("ln_f", config.norm_eps())?,
            vars: p.into_vars(),
            tags: ["wte", "ln_f", "lm_head"].map(Module::intern),
        })
    }

    /// The forward pass on `batch`: embeddings, blocks, `ln_f`, and the tied
    /// embedding as the output layer. Packed documents
    /// ([`TokenBatch::documents`]): each token attends to its own document
    /// and takes the position row of its place in the document (the rows
    /// looked up per token, `[b·s, h]`, instead of the first `s` rows).
    pub(super) fn forward(&self, batch: &TokenBatch, exec: &Execution) -> Result<Forward<'_>> {
        let (b, s) = batch_dims(batch, &self.config)?;
        let h = self.config.hidden;
        let [wte, ln_f, lm_head] = self.tags;
        let packing = Packing::of(batch, self.wte.device())?;
        let stem = {
            let _m = Scope::new(wte, Op::Embedding);
            let tokens =
                ops::embedding(&self.wte, &batch.input_ids.flatten_all()?)?.reshape((b, s, h))?;
            match &packing {
                Some(p) => {
                    let rows = ops::embedding(&self.wpe, &p.positions.flatten_all()?)?;
                    tokens.add(&rows.reshape((b, s, h))?)?
                }
                None => tokens.broadcast_add(&self.wpe.narrow(0, 0, s)?)?,
            }
        };
        let ctx = (Attend::causal(exec, packing.as_ref()), exec.mlp_tile());
        Ok(Forward {
            stem,
            blocks: block_layers(&self.blocks, ctx, |blk, x, (attend, tile)| {
                blk.forward(x, attend, *tile)
            }),
            head: final_norm(&self.ln_f, ln_f),
            output: Output {
                weight: &self.wte,
                bias: None,
                softcap: None,
                tag: lm_head,
            },
        })
    }
}

super::trainable_family!(Gpt2);
