//! One forward pass of a family, laid out as stem, blocks, head and output
//! layer, and the LM loss of its logits, whole or in chunks of tokens.

use super::layers::{self, Tagged};
use super::TokenBatch;
use crate::track::tag::{Module, Op, Scope};
use crate::Result;
use candle_core::{DType, Tensor};
#[cfg(doc)]
use oomfix_strategies::checkpoint;
use oomfix_strategies::chunked_loss;
use oomfix_strategies::nn::loss;
use oomfix_strategies::Execution;
use std::rc::Rc;

/// A hidden-state map of a [`Forward`]: a block, or the head.
pub(crate) type Layer<'a> = Box<dyn Fn(&Tensor) -> candle_core::Result<Tensor> + 'a>;

/// One forward pass of a family on a batch, laid out for
/// [`checkpoint::backward`]: the stem's output `[b, s, h]` (attached to the
/// parameters' graph), the blocks, the head from the last block's output
/// to the hidden states `[b·s, h]` the output layer takes, and the output
/// layer, whose logits `[b·s, P]` over the padded vocabulary
/// ([`layers::lm_logits`]) the loss takes whole or in chunks of tokens
/// ([`Output::loss`]). The families build it; [`HubModel`](super::HubModel)'s training step
/// and [`logits`](Self::logits) run it.
pub(crate) struct Forward<'a> {
    pub(crate) stem: Tensor,
    pub(crate) blocks: Vec<Layer<'a>>,
    pub(crate) head: Layer<'a>,
    pub(crate) output: Output<'a>,
}

/// The output layer of a family: the output embedding `[V, h]` (tied or
/// not), bias `[V]` (BERT's decoder) and soft-cap of the logits (Gemma 2:
/// `cap·tanh(logits/cap)`), tagged as their module.
#[derive(Clone, Copy)]
pub(crate) struct Output<'a> {
    pub(crate) weight: &'a Tensor,
    pub(crate) bias: Option<&'a Tensor>,
    pub(crate) softcap: Option<f64>,
    pub(crate) tag: Module,
}

impl Output<'_> {
    /// The padded logits `[n, P]` of the hidden states `x` `[n, h]`,
    /// soft-capped where the family caps them.
    fn logits(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let _m = Scope::module(self.tag);
        let logits = layers::lm_logits(x, self.weight, self.bias)?;
        match self.softcap {
            Some(cap) => (logits / cap)?.tanh()?.affine(cap, 0.0),
            None => Ok(logits),
        }
    }

    /// The mean cross-entropy of the hidden states `x` `[n, h]` against the
    /// batch's targets (over its `loss_mask` positions): of the whole
    /// logits ([`lm_loss`]), or chunk by chunk of tokens whose logits take
    /// at most `exec.loss_chunk_bytes`
    /// ([`oomfix_strategies::chunked_loss::linear_cross_entropy`], its
    /// gradients made for `exec.loss_scale`).
    pub(super) fn loss(
        &self,
        x: &Tensor,
        vocab: usize,
        batch: &TokenBatch,
        exec: &Execution,
    ) -> candle_core::Result<Tensor> {
        let Some(bytes) = exec.loss_chunk_bytes else {
            return lm_loss(&self.logits(x)?, vocab, batch);
        };
        if self.softcap.is_some() {
            // Refused before training: such a model does not declare the capability.
            candle_core::bail!("the loss in chunks does not soft-cap the logits");
        }
        let (weight, bias) = {
            let _m = Scope::new(self.tag, Op::Matmul);
            layers::padded_output(self.weight, self.bias)?
        };
        let _scope = Scope::new(Module::intern("loss"), Op::Loss);
        let head = chunked_loss::LmHead {
            weight: &weight,
            bias: bias.as_ref(),
            classes: vocab,
        };
        let mask = loss_mask(batch)?;
        let targets = batch.targets.flatten_all()?;
        chunked_loss::linear_cross_entropy(
            x,
            &head,
            &targets,
            mask.as_ref(),
            bytes,
            exec.loss_scale,
        )
    }
}

impl<'a> Forward<'a> {
    /// A block or head of the pass.
    pub(crate) fn layer(f: impl Fn(&Tensor) -> candle_core::Result<Tensor> + 'a) -> Layer<'a> {
        Box::new(f)
    }

    /// The head's logits `[b·s, P]` in the compute dtype, detached, from a
    /// pass without backward. Each block's input is detached from the
    /// graph, so a block's activations are dropped once its output exists.
    fn padded_logits(self) -> Result<Tensor> {
        let _scope = Scope::module(Module::ROOT);
        let x = oomfix_strategies::model::through_blocks(&self.stem, &self.blocks)?;
        Ok(self.output.logits(&(self.head)(&x)?)?.detach())
    }

    /// The logits `[b, s, vocab]` in f32: [`padded_logits`](Self::padded_logits)
    /// without the padding columns.
    pub(crate) fn logits(self, vocab: usize) -> Result<Tensor> {
        let (b, s, _) = self.stem.dims3()?;
        Ok(self
            .padded_logits()?
            .narrow(1, 0, vocab)?
            .reshape((b, s, vocab))?
            .to_dtype(DType::F32)?)
    }
}

/// The cross-entropy of `logits` (`[b·s, V]`) against the batch's targets, over
/// the batch's `loss_mask` positions or all positions. What it allocates is
/// tagged `loss` / [`Op::Loss`] in the memory timeline (the op itself, in
/// `oomfix-strategies`, knows nothing of tags).
pub(crate) fn lm_loss(
    logits: &Tensor,
    vocab: usize,
    batch: &TokenBatch,
) -> candle_core::Result<Tensor> {
    let _scope = Scope::new(Module::intern("loss"), Op::Loss);
    let mask = loss_mask(batch)?;
    let targets = batch.targets.flatten_all()?;
    loss::cross_entropy_padded(logits, vocab, &targets, mask.as_ref())
}

/// The batch's `loss_mask` as an f32 vector `[b·s]`, if it has one.
fn loss_mask(batch: &TokenBatch) -> candle_core::Result<Option<Tensor>> {
    batch
        .loss_mask
        .as_ref()
        .map(|m| m.flatten_all()?.to_dtype(DType::F32))
        .transpose()
}

/// The blocks of a pass as its layers, each run by `forward` with the
/// context `ctx` they share.
pub(crate) fn block_layers<'a, B, C: 'a>(
    blocks: &'a [B],
    ctx: C,
    forward: fn(&B, &Tensor, &C) -> candle_core::Result<Tensor>,
) -> Vec<Layer<'a>> {
    let ctx = Rc::new(ctx);
    blocks
        .iter()
        .map(|block| {
            let ctx = Rc::clone(&ctx);
            Forward::layer(move |x| forward(block, x, &ctx))
        })
        .collect()
}

/// The head of a causal pass: the final norm, tagged as its module `tag`,
/// of the last block's output `[b, s, h]`, as the `[b·s, h]` hidden states
/// the output layer takes.
pub(crate) fn final_norm<'a>(norm: &'a impl Tagged, tag: Module) -> Layer<'a> {
    Forward::layer(move |x| norm.forward_in(tag, x)?.reshape(((), x.dim(2)?)))
}
