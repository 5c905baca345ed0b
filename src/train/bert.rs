//! BERT: post-LN encoder with learned positions and token types, masked-LM head.

use candle_core::{Tensor, Var};
use oomfix_strategies::nn::ops::{self, GeluForm, WeightLayout};
use oomfix_strategies::nn::{LayerNorm, Projection};
use oomfix_strategies::Execution;

use super::block_layers;
use super::layers::{module_tags, residual, split_heads, tiled, Attend, Tagged};
use super::{batch_dims, Forward, Output, Params, TokenBatch};
use crate::track::tag::{Module, Op, Scope};
use crate::{Error, ModelConfig, Result};

#[derive(Clone)]
struct Block {
    query: Projection,
    key: Projection,
    value: Projection,
    attn_out: Projection,
    attn_norm: LayerNorm,
    intermediate: Projection,
    output: Projection,
    out_norm: LayerNorm,
    heads: usize,
    gelu: GeluForm,
    /// `attention`, `intermediate`, `output` under `bert.encoder.layer.{l}`.
    tags: [Module; 3],
}

impl Block {
    fn new(p: &Params, l: usize, config: &ModelConfig) -> Result<Self> {
        let prefix = format!("bert.encoder.layer.{l}");
        let eps = config.norm_eps();
        let dense = |name: &str| p.linear(&format!("{prefix}.{name}"), true, WeightLayout::OutIn);
        Ok(Block {
            query: dense("attention.self.query")?,
            key: dense("attention.self.key")?,
            value: dense("attention.self.value")?,
            attn_out: dense("attention.output.dense")?,
            attn_norm: p.layer_norm(&format!("{prefix}.attention.output.LayerNorm"), eps)?,
            intermediate: dense("intermediate.dense")?,
            output: dense("output.dense")?,
            out_norm: p.layer_norm(&format!("{prefix}.output.LayerNorm"), eps)?,
            heads: config.heads,
            gelu: super::gelu_form(config)?,
            tags: module_tags(&prefix, ["attention", "intermediate", "output"]),
        })
    }

    fn forward(
        &self,
        x: &Tensor,
        attend: &Attend,
        mlp_tile: Option<usize>,
    ) -> candle_core::Result<Tensor> {
        let d = x.dim(2)? / self.heads;
        let x = {
            let _m = Scope::module(self.tags[0]);
            let heads = |proj: &Projection| split_heads(&proj.forward(x)?, self.heads);
            let (k, v) = (
                heads(&self.key)?.contiguous()?,
                heads(&self.value)?.contiguous()?,
            );
            let attn = self.attn_out.forward(&attend.forward(
                &heads(&self.query)?,
                &k,
                &v,
                1.0 / (d as f64).sqrt(),
            )?)?;
            let sum = residual(x, &attn)?;
            self.attn_norm.forward(&sum)?
        };
        tiled(self, &x, mlp_tile, self.tags[2], Block::mlp)
    }

    /// The row-wise part: the MLP, its residual and the LayerNorm after it,
    /// `out_norm(x + output(gelu(intermediate(x))))`.
    fn mlp(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let [_, intermediate, output] = self.tags;
        let inner = {
            let _m = Scope::module(intermediate);
            let inner = self.intermediate.forward(x)?;
            let _op = Scope::op(Op::Gelu);
            ops::gelu(&inner, self.gelu)?
        };
        let _m = Scope::module(output);
        let mlp = self.output.forward(&inner)?;
        let sum = residual(x, &mlp)?;
        self.out_norm.forward(&sum)
    }
}

/// A trainable BERT with its masked-LM head.
pub(crate) struct Bert {
    config: ModelConfig,
    word: Tensor,
    position: Tensor,
    token_type: Tensor,
    emb_norm: LayerNorm,
    blocks: Vec<Block>,
    transform: Projection,
    transform_norm: LayerNorm,
    gelu: GeluForm,
    decoder_bias: Tensor,
    vars: Vec<(String, Var)>,
    /// `bert.embeddings`, `attn_mask`, `cls.predictions.transform`, `cls.predictions.decoder`.
    tags: [Module; 4],
}

impl Bert {
    pub(crate) fn new(config: &ModelConfig, p: Params) -> Result<Self> {
        let e = "bert.embeddings";
        let c = "cls.predictions";
        Ok(Bert {
            config: config.clone(),
            word: p.get(&format!("{e}.word_embeddings.weight"))?,
            position: p.get(&format!("{e}.position_embeddings.weight"))?,
            token_type: p.get(&format!("{e}.token_type_embeddings.weight"))?,
            emb_norm: p.layer_norm(&format!("{e}.LayerNorm"), config.norm_eps())?,
            blocks: (0..config.layers)
                .map(|l| Block::new(&p, l, config))
                .collect::<Result<_>>()?,
            transform: p.linear(&format!("{c}.transform.dense"), true, WeightLayout::OutIn)?,
            transform_norm: p.layer_norm(&format!("{c}.transform.LayerNorm"), config.norm_eps())?,
            decoder_bias: p.get(&format!("{c}.bias"))?,
            gelu: super::gelu_form(config)?,
            vars: p.into_vars(),
            tags: [
                "bert.embeddings",
                "attn_mask",
                "cls.predictions.transform",
                "cls.predictions.decoder",
            ]
            .map(Module::intern),
        })
    }

    /// The forward pass on `batch`: embeddings, blocks and the masked-LM head.
    /// Packed documents ([`TokenBatch::documents`]) are refused: BERT
    /// attends as the batch's `attention_mask` says.
    pub(super) fn forward(&self, batch: &TokenBatch, exec: &Execution) -> Result<Forward<'_>> {
        let (b, s) = batch_dims(batch, &self.config)?;
        if batch.documents.is_some() {
            return Err(Error::Usage(
                "BERT does not take packed documents (a batch's `documents`): give it one \
                 document per row, padded, with an attention_mask"
                    .into(),
            ));
        }
        let h = self.config.hidden;
        let [embeddings, mask, transform, decoder] = self.tags;
        let stem = {
            let _m = Scope::new(embeddings, Op::Embedding);
            let words = ops::embedding_padded(
                &self.word,
                &batch.input_ids.flatten_all()?,
                self.config.settings.pad_token_id,
            )?
            .reshape((b, s, h))?;
            // Every token is in segment A: token type 0 for all positions.
            let position_and_type = self
                .position
                .narrow(0, 0, s)?
                .broadcast_add(&self.token_type.narrow(0, 0, 1)?)?;
            let sum = words.broadcast_add(&position_and_type)?;
            drop(_m);
            self.emb_norm.forward_in(embeddings, &sum)?
        };
        let attend = {
            let _m = Scope::new(mask, Op::Attention);
            Attend::padded(exec, batch.attention_mask.as_ref())?
        };
        let blocks = block_layers(
            &self.blocks,
            (attend, exec.mlp_tile()),
            |blk, x, (attend, tile)| blk.forward(x, attend, *tile),
        );
        let head = Forward::layer(move |x| {
            let _m = Scope::module(transform);
            let x = self.transform.forward(x)?;
            let x = {
                let _op = Scope::op(Op::Gelu);
                ops::gelu(&x, self.gelu)?
            };
            self.transform_norm.forward(&x)?.reshape((b * s, h))
        });
        let output = Output {
            weight: &self.word,
            bias: Some(&self.decoder_bias),
            softcap: None,
            tag: decoder,
        };
        Ok(Forward {
            stem,
            blocks,
            head,
            output,
        })
    }
}

super::trainable_family!(Bert);
