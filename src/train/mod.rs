//! Trainable GPT-2, Llama-style and BERT models, built from differentiable candle ops.
//!
//! [`build_model`] makes a [`HubModel`] from a [`ModelConfig`], with random
//! weights or weights loaded by their Hub names from `.safetensors` files, in a
//! compute dtype (f32, bf16, f16) on a device. A [`HubModel`] is a
//! [`Model`] like any model given as code, and [`Trainer`] trains either.
//! [`HubModel::forward_backward`]
//! runs one forward and backward pass on a [`TokenBatch`] under an activation
//! checkpointing policy ([`oomfix_strategies::checkpoint::backward`]), with attention
//! composed (the probabilities as one
//! [`attention_probs`](oomfix_strategies::nn::ops::attention_probs) node, then
//! `P·v`) or computed by
//! [`oomfix_strategies::attention::flash_attention`] ([`Attention`]), and returns the
//! loss and detached gradients aligned with [`HubModel::named_vars`];
//! [`HubModel::logits`] runs the same forward pass without backward.
//!
//! The models are written for training, not inference: no KV cache, no dropout
//! (recomputation must be deterministic), and none of candle's fused fast paths
//! (`softmax_last_dim`, `rms_norm`, `layer_norm`, `rope`, fused SDPA), which
//! have no backward: norms, biased projections, GELU, SwiGLU, RoPE, the
//! embedding lookup and the attention probabilities are fused ops with
//! their own backward ([`oomfix_strategies::nn`]), the rest is composed from
//! candle ops. Conventions follow Hugging Face `transformers`: GPT-2 with
//! `Conv1D` weights (`[in, out]`), tanh-approximate GELU, tied LM head; Llama with
//! RMSNorm, RoPE in the `rotate_half` form, SwiGLU and grouped-query
//! attention; BERT post-LN with erf GELU and the masked-LM head
//! (`cls.predictions`), every token of segment A (token type 0). Norm epsilons,
//! the RoPE base and scaling, the head size, Qwen3's q/k norms, the GELU
//! form and Llama's optional biases are the checkpoint's own
//! ([`crate::ModelSettings`]); what the families do not implement (other
//! architectures, other RoPE scalings, other activations, a sliding window
//! shorter than the sequence) is refused ([`check_supported`]).
//!
//! # What stays alive until backward
//!
//! candle's graph holds every op's inputs, so every op output on the path from a
//! parameter to the loss lives until the loss and the gradient store are dropped.
//! The tables list every tensor with its own storage that one forward creates
//! (views: reshapes of contiguous tensors, transposes, narrows, broadcasts, own no
//! storage and are omitted). `b` batch, `s` sequence, `h` hidden, `H` heads, `KV`
//! key/value heads, `d` head size (`h = H·d`), `I` MLP inner size, `V` vocabulary,
//! `n = b·s`. `c` is the compute dtype (the weights' dtype), `f32` is always f32;
//! entries marked *16-bit* exist only when `c` is bf16/f16 (with f32 compute
//! the cast is a no-op), and `[n,1]` row statistics are listed together.
//!
//! Layer norm (LN, GPT-2 and BERT) and RMS norm (RMS, Llama) on `[n, h]`: the
//! output `[n,h]` c only (statistics in f32 inside the op, recomputed in
//! backward). A projection with a bias keeps only its output (the bias is
//! added in place); GELU and SwiGLU keep only their output.
//!
//! Attention probabilities
//! ([`attention_probs`](oomfix_strategies::nn::ops::attention_probs)): the
//! scores `q·kᵀ` are made into `softmax(scores·scale + mask)` in place, so the op keeps one
//! `[b,H,s,s]` tensor; the mask is applied by position (causal) or by the
//! batch's key flags, never built.
//!
//! ## GPT-2 (per block)
//!
//! | tensor | shape | dtype |
//! |---|---|---|
//! | `ln_1` | LN of `[n,h]` | as above |
//! | `c_attn` (matmul + bias in place) | `[n,3h]` | c |
//! | q, k, v contiguous copies | `[b,H,s,d]` ×3 | c |
//! | probabilities (scale `1/√d` and causal mask inside) | `[b,H,s,s]` | c |
//! | context `P v` | `[b,H,s,d]` | c |
//! | heads merged (copy) | `[n,h]` | c |
//! | `attn.c_proj` | `[n,h]` | c |
//! | residual | `[n,h]` | c |
//! | `ln_2` | LN of `[n,h]` | as above |
//! | `c_fc`, GELU | `[n,I]` ×2 | c |
//! | `mlp.c_proj` | `[n,h]` | c |
//! | residual (block output) | `[n,h]` | c |
//!
//! Stem: `wte` rows `[n,h]` c; + `wpe` rows (a narrow, no copy) `[n,h]` c.
//!
//! ## Llama (per block)
//!
//! | tensor | shape | dtype |
//! |---|---|---|
//! | `input_layernorm` | RMS of `[n,h]` | as above |
//! | `q_proj` (+ bias in place with `qkv_bias`) | `[n,h]` | c |
//! | `k_proj`, `v_proj` (+ bias each) | `[n,KV·d]` ×2 | c |
//! | v contiguous copy | `[b,KV,s,d]` | c |
//! | RoPE on q (attention scale folded in the tables; fused, heads moved first) | `[b,H,s,d]` | c |
//! | RoPE on k | `[b,KV,s,d]` | c |
//! | probabilities (grouped: `[b,KV,(H/KV)·s,s]`; causal mask inside) | `[b,H,s,s]` | c |
//! | context | `[b,H,s,d]` | c |
//! | heads merged (copy) | `[n,h]` | c |
//! | `o_proj` matmul | `[n,h]` | c |
//! | residual | `[n,h]` | c |
//! | `post_attention_layernorm` | RMS of `[n,h]` | as above |
//! | `gate_proj`, `up_proj` matmuls, SwiGLU `SiLU(gate)·up` | `[n,I]` ×3 | c |
//! | `down_proj` matmul | `[n,h]` | c |
//! | residual (block output) | `[n,h]` | c |
//!
//! With a `head_dim` that is not `h/H` the query-sized rows (`q_proj`, RoPE
//! on q, context, heads merged) are `[n,H·d]` rather than `[n,h]`. Qwen3's
//! RMSNorm over each head of q and k (`q_norm`, `k_norm`, before RoPE) adds
//! their outputs `[n,H·d]` and `[n,KV·d]` c. RoPE scaling changes only the
//! tables' values (`yarn`'s attention factor is folded into both tables).
//!
//! Partial rotary (Phi-4-mini) copies the rotated part of each head of q
//! and k `[n,H·r]`, `[n,KV·r]`, turns it (the same size again) and joins
//! it to the rest (`[n,H·d]`, `[n,KV·d]` in place of RoPE's output).
//!
//! Gemma 2 / 3 (`gemma.rs`) add to a Llama block two norms
//! (`pre_feedforward_layernorm`, `post_feedforward_layernorm`, `[n,h]`
//! each), a GeLU and its product with up in place of SwiGLU (`[n,I]` ×2),
//! Gemma 3's q/k norms, and compose attention: the scores `[b,H,s,s]` c,
//! with a cap their tanh and its multiple (c ×2), the masked scores c, with
//! 16-bit compute their f32 copy, the shifted scores, exponentials and
//! probabilities f32 ×3, with 16-bit compute the probabilities' copy c, the
//! row maximum and sum `[b,H,s]` f32. Its stem keeps the embedding rows and
//! their √hidden multiple `[n,h]` ×2 and, per kind of block (full, sliding),
//! RoPE tables and an `[s,s]` mask c; Gemma 2's head soft-caps the logits
//! (`[n,P]` ×3 more).
//!
//! Keys and values are never repeated for grouped-query attention: each group's
//! queries are multiplied with the shared key/value head directly.
//! Stem: `embed_tokens` rows `[n,h]` c. Once per forward: RoPE tables `[s,d]` ×4 f32 (cos/sin, and both scaled
//! for the queries: flash attention is then called with scale 1).
//!
//! ## BERT (per block)
//!
//! | tensor | shape | dtype |
//! |---|---|---|
//! | `query`, `key`, `value` (matmul + bias in place) | `[n,h]` ×3 | c |
//! | q, k, v contiguous copies | `[b,H,s,d]` ×3 | c |
//! | probabilities (scale `1/√d` and key padding inside) | `[b,H,s,s]` | c |
//! | context | `[b,H,s,d]` | c |
//! | heads merged (copy) | `[n,h]` | c |
//! | `attention.output.dense` | `[n,h]` | c |
//! | residual | `[n,h]` | c |
//! | `attention.output.LayerNorm` | LN of `[n,h]` | as above |
//! | `intermediate.dense`, GELU (erf) | `[n,I]` ×2 | c |
//! | `output.dense` | `[n,h]` | c |
//! | residual | `[n,h]` | c |
//! | `output.LayerNorm` (block output) | LN of `[n,h]` | as above |
//!
//! Stem: word rows `[n,h]` c; position rows + token-type row (`[s,h]` c, not
//! `[n,h]`); sum `[n,h]` c; embeddings LN of `[n,h]`. Once per forward, with an
//! `attention_mask`: its key flags `[b,s]` as bytes.
//!
//! ## Flash attention
//!
//! With [`Attention::Flash`] the rows from the probabilities to the context
//! (`P v`) become one op: it keeps its inputs (the q, k, v
//! copies above), its output `[b,H,s,d]` c (in place of the context) and a
//! log-sum-exp `[b,H,s]` f32 (plus, with a padding mask, one byte per key). No
//! `[b,H,s,s]` tensor exists: GPT-2 and Llama attend
//! causally, BERT passes the batch's `attention_mask` as key padding. Its
//! backward recomputes the probabilities block by block; its working set is
//! f32 copies of q, k, v, the output and its gradient, the f32 gradient of q,
//! and per query head f32 gradients of k and v.
//!
//! ## Head and loss
//!
//! | family | tensor | shape | dtype |
//! |---|---|---|---|
//! | GPT-2 | `ln_f` | LN of `[n,h]` | as above |
//! | Llama | `model.norm` | RMS of `[n,h]` | as above |
//! | BERT | `transform.dense`, GELU (erf) | `[n,h]` ×2 | c |
//! | BERT | `transform.LayerNorm` | LN of `[n,h]` | as above |
//! | all, `V` not a multiple of 64 | the output embedding padded with zero rows (BERT: and its bias) | `[P,h]` | c |
//! | all | logits (matmul with the tied embedding or `lm_head`; BERT: + `cls.predictions.bias` in place) | `[n,P]` | c |
//! | all | nll ([`loss::cross_entropy`]: one fused op, nothing `[n,V]` of its own) | `[n]` | f32 |
//! | with a `loss_mask` (always for BERT) | nll × mask | `[n]` | f32 |
//! | all | sum, mean | scalar ×2 | f32 |
//!
//! With the loss in chunks of tokens ([`Execution::loss_chunk_bytes`],
//! [`oomfix_strategies::chunked_loss`]) the logits are never kept: the loss
//! op keeps its inputs (the final norm's output, the output embedding,
//! padded or not) and makes, chunk by chunk, each chunk's logits `[r,P]` c
//! and their gradient `[r,P]` c (freed with the chunk), the hidden states'
//! gradient `[n,h]` c and, for a trained head, the weight's gradient
//! `[P,h]` c, which it hands to the backward; the per-row losses `[n]` f32
//! as above.
//!
//! `P` is `V` rounded up to a multiple of [`VOCAB_ALIGN`](crate::spec::VOCAB_ALIGN) (64): the padded
//! columns are masked out of the loss, and the products around the logits run
//! on aligned kernels. The loss's backward writes the logits' gradient `[n,P]`
//! c in one pass (it recomputes each row's log-sum-exp from the kept logits;
//! zero in the padding).
//!
//! Summed, per block (elements; the row max of each softmax included): GPT-2
//! `14·n·h + 2·n·I + 5·b·H·s² + 2·b·H·s`; Llama `13·n·h + 7·n·KV·d + 3·n·I +
//! 5·b·H·s² + 2·b·H·s`; BERT `14·n·h + 2·n·I + 4·b·H·s² + 2·b·H·s` (`+ b·H·s²`
//! with a padding mask); the once-per-forward masks and RoPE tables come on top.
//! With flash attention the `b·H·s²` and `2·b·H·s` terms are replaced by `b·H·s`
//! f32 values (the log-sum-exp).
//!
//! ## Checkpointing
//!
//! With [`Checkpointing::Every`]`(k)` the blocks' tables above exist for one segment
//! of `k` blocks at a time, during that segment's forward and again during its
//! recompute in backward. What stays from the forward is the stem (its tables
//! above) and, for `m` segments, `m` tensors `[n,h]` c: a fresh `Var` holding each
//! segment's output (the next segment's input, or the head's input for the last).
//! The head's tables live only during the head's backward, before any segment is
//! recomputed. While a segment is differentiated, the upstream gradient `[n,h]` c
//! and the surrogate's product `y·grad_y` `[n,h]` c are alive besides its tables.

mod bert;
pub mod chat;
pub mod data;
pub mod examples;
mod optim;
pub mod saved;
pub mod tokenizer;
mod trainer;
pub use crate::state_file::StateFile;
mod schedule;
pub use saved::{ModelSource, TrainingState};
pub use schedule::{default_lr, Decay, LrSchedule, PRETRAINED_LR, RANDOM_INIT_LR};
pub use trainer::{compute_dtype, plan_changes, Evaluation, StepStats, TrainOptions, Trainer};
mod gemma;
mod gpt2;
mod layers;
mod llama;
pub mod lora;
mod rope;

use std::cell::RefCell;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::rc::Rc;

use candle_core::{DType, Device, Tensor, Var};
use oomfix_strategies::chunked_loss;
use oomfix_strategies::model::{self, Capabilities, MicroBatch, Model};
use oomfix_strategies::nn::loss;
use oomfix_strategies::Execution;
#[cfg(doc)]
use oomfix_strategies::{Attention, Checkpointing};
use rand::{rngs::StdRng, Rng, SeedableRng};
use rand_distr::{Distribution, Normal};

use crate::track::alloc::{self, Phase};
use crate::track::tag::{self, Module, Op, Scope, Tag};
use crate::{Error, Family, ModelConfig, Result};
use oomfix_strategies::nn::ops::WeightLayout;
use oomfix_strategies::nn::{LayerNorm, Linear, Projection, RmsNorm};

/// The `[MASK]` token id BERT's uncased vocabulary uses.
const BERT_MASK_ID: u32 = 103;
/// Standard deviation of the random initialisation of matrices.
const INIT_STD: f32 = 0.02;

pub use oomfix_strategies::model::TokenBatch;

/// A random batch for `family` with token ids below `vocab`, reproducible from `seed`.
///
/// Causal families get `seq + 1` random tokens per sequence: inputs are the first
/// `seq`, targets the last `seq`. BERT gets `seq` random tokens; about 15% of the
/// positions (at least one per sequence) are replaced by the `[MASK]` id (103, or
/// `vocab − 1` for vocabularies of 103 tokens or fewer), targeted with the original
/// token and selected by `loss_mask`.
pub fn synthetic_batch(
    family: Family,
    vocab: usize,
    batch: usize,
    seq: usize,
    seed: u64,
    device: &Device,
) -> Result<TokenBatch> {
    if vocab < 2 || batch == 0 || seq == 0 || vocab > u32::MAX as usize {
        return Err(Error::Usage(format!(
            "a synthetic batch needs vocab >= 2, batch >= 1 and seq >= 1 (got {vocab}, {batch}, {seq})"
        )));
    }
    let mut rng = StdRng::seed_from_u64(seed);
    let windows: Vec<u32> = (0..batch * (seq + 1))
        .map(|_| rng.random_range(0..vocab as u32))
        .collect();
    batch_from_windows(family, vocab, &windows, batch, seq, seed, device)
}

/// A batch from `batch` windows of `seq + 1` token ids each (row after row).
///
/// Causal families take the first `seq` ids of a window as inputs and the last
/// `seq` as targets. BERT takes the first `seq` ids, replaces about 15% of them
/// (at least one per sequence, chosen reproducibly from `seed`) by the `[MASK]` id
/// (103, or `vocab − 1` for vocabularies of 103 tokens or fewer) and targets
/// the originals at those positions.
pub fn batch_from_windows(
    family: Family,
    vocab: usize,
    windows: &[u32],
    batch: usize,
    seq: usize,
    seed: u64,
    device: &Device,
) -> Result<TokenBatch> {
    if windows.len() != batch * (seq + 1) {
        return Err(Error::Usage(format!(
            "{} token ids do not make {batch} windows of {} tokens",
            windows.len(),
            seq + 1
        )));
    }
    let ids = |v: Vec<u32>| Tensor::from_vec(v, (batch, seq), device);
    let rows = || windows.chunks(seq + 1);
    let inputs: Vec<u32> = rows().flat_map(|r| r[..seq].to_vec()).collect();
    if family != Family::Bert {
        let targets = rows().flat_map(|r| r[1..].to_vec()).collect();
        return Ok(TokenBatch {
            input_ids: ids(inputs)?,
            targets: ids(targets)?,
            loss_mask: None,
            attention_mask: None,
            documents: None,
        });
    }
    let mut rng = StdRng::seed_from_u64(seed ^ 0x6d61_736b);
    let mut masked: Vec<bool> = (0..batch * seq).map(|_| rng.random_bool(0.15)).collect();
    for row in masked.chunks_mut(seq) {
        if !row.contains(&true) {
            row[rng.random_range(0..seq)] = true;
        }
    }
    let mask_id = if vocab > BERT_MASK_ID as usize {
        BERT_MASK_ID
    } else {
        vocab as u32 - 1
    };
    let masked_inputs = inputs
        .iter()
        .zip(&masked)
        .map(|(&t, &m)| if m { mask_id } else { t })
        .collect();
    let loss_mask = masked.iter().map(|&m| f32::from(u8::from(m))).collect();
    Ok(TokenBatch {
        input_ids: ids(masked_inputs)?,
        targets: ids(inputs)?,
        loss_mask: Some(Tensor::from_vec(loss_mask, (batch, seq), device)?),
        attention_mask: None,
        documents: None,
    })
}

/// What one forward and backward pass of a [`HubModel`] returns.
#[derive(Debug)]
pub struct StepOutput {
    /// The loss (not multiplied by the loss scale).
    pub loss: f32,
    /// Gradients of `loss × loss_scale`, one per [`HubModel::named_vars`]
    /// entry, in order, in the compute dtype, detached from any graph. A
    /// parameter the batch does not reach gets zeros.
    pub grads: Vec<Tensor>,
}

/// The family's model inside a [`HubModel`].
enum FamilyModel {
    Gpt2(gpt2::Gpt2),
    Llama(llama::Llama),
    Gemma(gemma::Gemma),
    Bert(bert::Bert),
}

/// A model of a Hugging Face family oomfix implements (GPT-2, Llama-style,
/// BERT), built by [`build_model`] from a [`ModelConfig`]: a
/// [`Model`] like any model given as code, whose micro-batches carry
/// tokens ([`MicroBatch::tokens`]), with its Hub names, its blocks
/// ([`ModelConfig::block_of`]) and every capability a fix may need.
pub struct HubModel {
    family: FamilyModel,
    lora: Option<lora::LoraModel>,
}

impl HubModel {
    /// The frozen base and adapters of a LoRA model (`None`: every
    /// parameter is trained).
    pub fn lora(&self) -> Option<&lora::LoraModel> {
        self.lora.as_ref()
    }

    /// The model's shape.
    pub fn config(&self) -> &ModelConfig {
        match &self.family {
            FamilyModel::Gpt2(m) => m.config(),
            FamilyModel::Llama(m) => m.config(),
            FamilyModel::Gemma(m) => m.config(),
            FamilyModel::Bert(m) => m.config(),
        }
    }

    /// The trainable parameters with their Hub names, in
    /// [`ModelConfig::tensors`] order (a tied weight appears once).
    pub fn named_vars(&self) -> &[(String, Var)] {
        match &self.family {
            FamilyModel::Gpt2(m) => m.named_vars(),
            FamilyModel::Llama(m) => m.named_vars(),
            FamilyModel::Gemma(m) => m.named_vars(),
            FamilyModel::Bert(m) => m.named_vars(),
        }
    }

    /// The family's forward pass on `batch`, laid out as stem, blocks and
    /// the head to the padded logits.
    fn pass(&self, batch: &TokenBatch, exec: &Execution) -> Result<Forward<'_>> {
        match &self.family {
            FamilyModel::Gpt2(m) => m.forward(batch, exec),
            FamilyModel::Llama(m) => m.forward(batch, exec),
            FamilyModel::Gemma(m) => m.forward(batch, exec),
            FamilyModel::Bert(m) => m.forward(batch, exec),
        }
    }

    /// One forward and backward pass on `batch` ([`model::forward_backward`]):
    /// the mean cross-entropy over the positions `loss_mask` selects (all
    /// positions without one; for BERT, the masked positions), and the
    /// gradients of `loss × exec.loss_scale`, with blocks recomputed and
    /// attention computed as `exec` says ([`Attention::Flash`] runs on the
    /// CPU and on CUDA devices).
    pub fn forward_backward(&self, batch: &TokenBatch, exec: &Execution) -> Result<StepOutput> {
        let vars = self.vars();
        let out = model::forward_backward(self, &vars, &self.micro_batch(batch, exec)?)?;
        Ok(StepOutput {
            loss: out.loss.to_dtype(DType::F32)?.to_scalar::<f32>()?,
            grads: out.grads.into_iter().flatten().collect(),
        })
    }

    /// The logits of `batch.input_ids`: f32 `[b, s, V]`, detached, from a
    /// forward pass without backward (attention computed as `exec` says; its
    /// checkpointing and loss scale play no part). Blocks run one after the
    /// other, each block's activations dropped once it is done, so the pass
    /// never keeps more than one block's. BERT attends as the batch's
    /// `attention_mask` says; `targets` and `loss_mask` are not read, but
    /// must have the inputs' shape as in any [`TokenBatch`].
    pub fn logits(&self, batch: &TokenBatch, exec: &Execution) -> Result<Tensor> {
        self.pass(batch, exec)?.logits(self.config().vocab)
    }

    /// The mean loss [`forward_backward`](Self::forward_backward) computes on
    /// `batch`, forward only ([`model::loss_only`]): no gradients, and no
    /// block's activations kept beyond that block.
    pub fn loss(&self, batch: &TokenBatch, exec: &Execution) -> Result<f32> {
        Ok(model::loss_only(self, &self.micro_batch(batch, exec)?)?)
    }

    /// `batch` as a micro-batch under `exec`, checked against the model's
    /// position limit.
    fn micro_batch(&self, batch: &TokenBatch, exec: &Execution) -> Result<MicroBatch> {
        batch_dims(batch, self.config())?;
        Ok(MicroBatch::new(0, 0, *exec).with_tokens(batch.clone())?)
    }

    /// Writes the parameters to a `.safetensors` file under their Hub names, in the
    /// compute dtype, atomically ([`crate::output::write_atomic`]).
    pub fn save(&self, path: &Path) -> Result<()> {
        let tensors = self
            .named_vars()
            .iter()
            .map(|(name, var)| (name.clone(), var.as_tensor().clone()))
            .collect();
        let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
        crate::state_file::write_safetensors(path, tensors, metadata)
    }
}

impl Model for HubModel {
    fn vars(&self) -> Vec<Var> {
        self.named_vars().iter().map(|(_, v)| v.clone()).collect()
    }

    fn var_names(&self) -> Vec<String> {
        self.named_vars().iter().map(|(n, _)| n.clone()).collect()
    }

    fn var_blocks(&self) -> Vec<Option<usize>> {
        let layers = self.config().layers;
        self.named_vars()
            .iter()
            .map(|(n, _)| ModelConfig::block_of(n).filter(|&b| b < layers))
            .collect()
    }

    /// The stages of the micro-batch's tokens: the head ends in the loss
    /// (of the whole logits, or chunk by chunk as the execution says:
    /// `Output::loss`), after which every allocation is backward's (in
    /// chunks, the output layer's gradients are made with the loss).
    fn forward(&self, batch: &MicroBatch) -> candle_core::Result<model::Forward<'_>> {
        let tokens = batch.tokens.clone().ok_or_else(|| {
            candle_core::Error::Msg(
                "a Hugging Face family trains on tokens: the micro-batch has none".into(),
            )
        })?;
        let pass = self
            .pass(&tokens, &batch.execution)
            .map_err(candle_core::Error::wrap)?;
        let (vocab, head, output) = (self.config().vocab, pass.head, pass.output);
        let exec = batch.execution;
        Ok(model::Forward::Stages(model::Stages {
            stem: pass.stem,
            blocks: pass.blocks,
            head: Box::new(move |x: &Tensor| {
                let loss = output.loss(&head(x)?, vocab, &tokens, &exec)?;
                alloc::set_phase(Phase::Backward);
                tag::set(Tag::new(Module::ROOT, Op::Backward));
                Ok(loss)
            }),
        }))
    }

    /// Every capability, except flash attention for a model whose attention
    /// it does not compute ([`ModelConfig::flash_computes_it`]).
    fn capabilities(&self) -> Capabilities {
        let mut caps = Capabilities::ALL.with_blocks(self.config().layers);
        caps.attention = self.config().flash_computes_it();
        caps.chunked_loss = self.config().chunked_loss_computes_it();
        caps
    }
}

/// Builds a trainable model of `config`'s family.
///
/// With `weights`, every tensor of [`ModelConfig::tensors`] is read by name from the
/// `.safetensors` file(s) (a sharded checkpoint: all shards); names may also carry
/// GPT-2's `transformer.` prefix, lack BERT's `bert.` prefix, or use the old
/// `gamma`/`beta` names of layer norms. A tensor the model has no parameter
/// for is an input error unless the model may leave it
/// ([`crate::architecture::may_leave`]: buffers, tied copies, BERT's pooler
/// and next-sentence head).
/// Without, matrices are drawn from N(0, 0.02²), norm scales are ones and biases
/// zeros, reproducibly from `seed`. Parameters are converted to `dtype` on `device`.
pub fn build_model(
    config: &ModelConfig,
    weights: Option<&[PathBuf]>,
    dtype: DType,
    device: &Device,
    seed: u64,
) -> Result<HubModel> {
    build_model_with(config, weights, dtype, device, seed, None)
}

/// [`build_model`], with `lora` a frozen base with adapters on the targeted
/// projections ([`lora`]; GPT-2 and Llama-style families): the model's
/// variables are the adapters, drawn from `seed`.
pub fn build_model_with(
    config: &ModelConfig,
    weights: Option<&[PathBuf]>,
    dtype: DType,
    device: &Device,
    seed: u64,
    lora: Option<&oomfix_strategies::lora::Lora>,
) -> Result<HubModel> {
    if !matches!(dtype, DType::F32 | DType::BF16 | DType::F16) {
        return Err(Error::Usage(format!(
            "compute dtype must be f32, bf16 or f16, not {dtype:?}"
        )));
    }
    if config.family == Family::Generic {
        return Err(untrainable());
    }
    check_shape(config)?;
    if let Some((field, value, why)) = config.unsupported(0) {
        return Err(Error::Usage(format!(
            "the model's {field} is {value}: {why}"
        )));
    }
    let tensors = match weights {
        Some(paths) => load_tensors(config, paths, seed)?,
        None => random_tensors(config, seed)?,
    };
    let params = match lora {
        Some(lora) => Params::frozen(lora::Adapting::new(
            config, tensors, *lora, dtype, device, seed,
        )?),
        None => Params::new(
            tensors
                .into_iter()
                .map(|(name, t)| {
                    Ok((
                        name,
                        Var::from_tensor(&t.to_dtype(dtype)?.to_device(device)?)?,
                    ))
                })
                .collect::<Result<Vec<_>>>()?,
        ),
    };
    let built = Rc::clone(&params.built);
    let family = match config.family {
        Family::Gpt2 => FamilyModel::Gpt2(gpt2::Gpt2::new(config, params)?),
        Family::Llama if config.settings.gemma.is_some() => {
            FamilyModel::Gemma(gemma::Gemma::new(config, params)?)
        }
        Family::Llama => FamilyModel::Llama(llama::Llama::new(config, params)?),
        Family::Bert => FamilyModel::Bert(bert::Bert::new(config, params)?),
        Family::Generic => return Err(untrainable()),
    };
    let lora = built.borrow_mut().take();
    Ok(HubModel { family, lora })
}

/// The GELU form of `config`'s activation (GPT-2 and BERT): erf for `gelu`,
/// the tanh approximation for `gelu_new` and `gelu_pytorch_tanh`.
pub(crate) fn gelu_form(config: &ModelConfig) -> Result<oomfix_strategies::nn::ops::GeluForm> {
    match config.hidden_act() {
        "gelu" => Ok(oomfix_strategies::nn::ops::GeluForm::Erf),
        "gelu_new" | "gelu_pytorch_tanh" => Ok(oomfix_strategies::nn::ops::GeluForm::Tanh),
        other => Err(Error::Usage(format!(
            "hidden_act {other:?} is not implemented for {}",
            config.family
        ))),
    }
}

/// Refuses a configuration the families do not implement (see
/// [`ModelConfig::unsupported`]) for training `seq_len` tokens per sequence:
/// an input error naming `config_file` (the model's `config.json`), the field
/// and its value.
pub fn check_supported(config: &ModelConfig, seq_len: usize, config_file: &Path) -> Result<()> {
    match config.unsupported(seq_len) {
        None => Ok(()),
        Some((field, value, why)) => Err(Error::input(
            config_file,
            format!("\"{field}\" is {value}: {why}; training it would train another model"),
        )),
    }
}

fn untrainable() -> Error {
    Error::Usage("only GPT-2, Llama-style and BERT models can be trained".into())
}

fn check_shape(config: &ModelConfig) -> Result<()> {
    let c = config;
    let ok = c.layers > 0
        && c.heads > 0
        && c.kv_heads > 0
        && (c.settings.head_dim.is_some() || c.hidden.is_multiple_of(c.heads))
        && c.heads.is_multiple_of(c.kv_heads)
        && c.head_dim().is_multiple_of(2)
        && c.vocab > 0
        && c.intermediate > 0;
    if !ok {
        return Err(Error::Usage(format!(
            "unusable model shape: {} layers, hidden {}, {} heads, {} kv heads, vocab {} \
             (hidden must split into heads of even size, heads into kv groups)",
            c.layers, c.hidden, c.heads, c.kv_heads, c.vocab
        )));
    }
    Ok(())
}

/// The Hub name of a tensor named `name` in a file of `family`.
fn hub_name(family: Family, name: &str) -> String {
    crate::architecture::hub_name(family, name)
}

/// The tensors of `config` read from `paths` (on the CPU, in the file's dtype).
/// A checkpoint without the objective's head ([`is_objective_head`]) gets
/// the head initialised from `seed`, with a warning naming its tensors, as
/// transformers does; any other missing tensor is an input error.
fn load_tensors(
    config: &ModelConfig,
    paths: &[PathBuf],
    seed: u64,
) -> Result<Vec<(String, Tensor)>> {
    let first = paths
        .first()
        .ok_or_else(|| Error::Usage("no weights file given".into()))?;
    let wanted = config.tensors();
    let mut found: HashMap<String, (Tensor, &PathBuf)> = HashMap::new();
    let mut unused = Vec::new();
    for path in paths {
        let tensors = candle_core::safetensors::load(path, &Device::Cpu)
            .map_err(|e| Error::input(path, format!("cannot read safetensors: {e}")))?;
        for (file_name, tensor) in tensors {
            let name = hub_name(config.family, &file_name);
            if wanted.iter().any(|(w, _)| *w == name) {
                found.insert(name, (tensor, path));
            } else if !crate::architecture::may_leave(config.family, &name, config.tied_embeddings)
            {
                unused.push(file_name);
            }
        }
    }

    let missing_head: Vec<&str> = wanted
        .iter()
        .map(|(name, _)| name.as_str())
        .filter(|name| !found.contains_key(*name) && is_objective_head(config.family, name))
        .collect();
    let init = Init::new(seed);
    if !missing_head.is_empty() {
        tracing::warn!(
            "{} has no {}: the training objective's head is newly initialised \
             (N(0, 0.02) matrices, zero biases, unit norm scales), as transformers does",
            first.display(),
            missing_head.join(", ")
        );
    }
    let tensors = wanted
        .into_iter()
        .map(|(name, shape)| {
            let Some((tensor, path)) = found.remove(&name) else {
                if is_objective_head(config.family, &name) {
                    return Ok((name.clone(), init.tensor(&name, &shape)?));
                }
                let files = if paths.len() == 1 {
                    String::new()
                } else {
                    format!(" (in {} files)", paths.len())
                };
                return Err(Error::input(
                    first,
                    format!("missing tensor `{name}`{files}"),
                ));
            };
            if tensor.dims() != shape.as_slice() {
                return Err(Error::input(
                    path,
                    format!(
                        "tensor `{name}` has shape {:?}, the model needs {shape:?}",
                        tensor.dims()
                    ),
                ));
            }
            Ok((name, tensor))
        })
        .collect::<Result<Vec<_>>>()?;
    if !unused.is_empty() {
        unused.sort_unstable();
        return Err(Error::input(
            first,
            format!(
                "tensors the {} model would not use: {}; a checkpoint is trained whole or not at all",
                config.family,
                unused.join(", ")
            ),
        ));
    }
    Ok(tensors)
}

/// Random f32 tensors on the CPU for every tensor of `config`.
fn random_tensors(config: &ModelConfig, seed: u64) -> Result<Vec<(String, Tensor)>> {
    let init = Init::new(seed);
    config
        .tensors()
        .into_iter()
        .map(|(name, shape)| Ok((name.clone(), init.tensor(&name, &shape)?)))
        .collect()
}

/// The initialisation of new parameters, as transformers' `_init_weights`
/// does it: matrices from N(0, 0.02²), norm scales ones, biases zeros.
///
/// A matrix is drawn in chunks of [`Init::CHUNK`] values, each from its own
/// generator seeded by the seed, the tensor's name and the chunk's index, so
/// the chunks are drawn in parallel and a tensor's values do not depend on
/// the order tensors are made in or on the number of threads (an 8B model's
/// eight billion values take seconds on a many-core host, not minutes).
struct Init {
    seed: u64,
}

impl Init {
    /// Values per independently seeded chunk of a matrix.
    const CHUNK: usize = 1 << 20;

    fn new(seed: u64) -> Self {
        Init { seed }
    }

    /// A new f32 tensor `name` of `shape` on the CPU.
    fn tensor(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        use rayon::prelude::*;
        let n = shape.iter().product();
        let values: Vec<f32> = if shape.len() >= 2 {
            let normal = Normal::new(0f32, INIT_STD).expect("a positive standard deviation");
            let base = name_seed(self.seed, name);
            let mut values = vec![0f32; n];
            values
                .par_chunks_mut(Self::CHUNK)
                .enumerate()
                .for_each(|(i, chunk)| {
                    let mut rng = StdRng::seed_from_u64(base ^ (i as u64).wrapping_mul(PHI));
                    chunk.iter_mut().for_each(|v| *v = normal.sample(&mut rng));
                });
            values
        } else if name.ends_with(".weight") {
            vec![1.0; n] // a norm's scale
        } else {
            vec![0.0; n] // a bias
        };
        Ok(Tensor::from_vec(values, shape, &Device::Cpu)?)
    }
}

/// 2⁶⁴ / φ, an odd constant that spreads consecutive indices over the seed space.
const PHI: u64 = 0x9e37_79b9_7f4a_7c15;

/// A seed for tensor `name` from the run's `seed`: FNV-1a of the name, mixed
/// with the seed (stable across platforms and releases, unlike std's hasher).
fn name_seed(seed: u64, name: &str) -> u64 {
    let fnv = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    fnv ^ seed.wrapping_mul(PHI)
}

/// Whether `name` belongs to the head of the training objective rather than
/// to the model body: BERT's masked-LM head (`cls.*`, absent from
/// sentence-transformers checkpoints) or a causal LM's untied `lm_head`
/// (absent from a base model's checkpoint).
fn is_objective_head(family: Family, name: &str) -> bool {
    match family {
        Family::Bert => name.starts_with("cls."),
        _ => name == "lm_head.weight",
    }
}

/// The parameters by Hub name, as the families look them up: the trained
/// variables, or (LoRA) a frozen base whose targeted projections get
/// adapters.
pub(crate) struct Params {
    vars: Vec<(String, Var)>,
    index: HashMap<String, usize>,
    lora: Option<lora::Adapting>,
    /// Where [`into_vars`](Self::into_vars) leaves the LoRA model built.
    built: Rc<RefCell<Option<lora::LoraModel>>>,
}

impl Params {
    fn new(vars: Vec<(String, Var)>) -> Self {
        let index = vars
            .iter()
            .enumerate()
            .map(|(i, (name, _))| (name.clone(), i))
            .collect();
        Params {
            vars,
            index,
            lora: None,
            built: Rc::default(),
        }
    }

    /// The parameters of a frozen base with adapters.
    fn frozen(adapting: lora::Adapting) -> Self {
        Params {
            lora: Some(adapting),
            ..Params::new(Vec::new())
        }
    }

    /// The parameter `name` (a clone sharing the `Var`'s storage, or the
    /// frozen tensor).
    pub(crate) fn get(&self, name: &str) -> Result<Tensor> {
        let missing = || Error::Usage(format!("the model has no tensor `{name}`"));
        if let Some(adapting) = &self.lora {
            return adapting.get(name).ok_or_else(missing);
        }
        let i = self.index.get(name).ok_or_else(missing)?;
        Ok(self.vars[*i].1.as_tensor().clone())
    }

    /// The projection `{prefix}.weight` (+ `{prefix}.bias` if `bias`): the
    /// one place every family builds a linear projection of its blocks.
    /// Trained; or, with LoRA, frozen, with an adapter if its name (the
    /// last part of `prefix`) is a target.
    pub(crate) fn linear(
        &self,
        prefix: &str,
        bias: bool,
        layout: WeightLayout,
    ) -> Result<Projection> {
        let b = if bias {
            Some(self.get(&format!("{prefix}.bias"))?)
        } else {
            None
        };
        if let Some(adapting) = &self.lora {
            return adapting.linear(prefix, b);
        }
        let weight = self.get(&format!("{prefix}.weight"))?;
        Ok(Linear::with_layout(weight, b, layout).into())
    }

    /// The layer norm `{prefix}.weight`, `{prefix}.bias`.
    pub(crate) fn layer_norm(&self, prefix: &str, eps: f64) -> Result<LayerNorm> {
        Ok(LayerNorm::new(
            self.get(&format!("{prefix}.weight"))?,
            self.get(&format!("{prefix}.bias"))?,
            eps,
        ))
    }

    /// The RMS norm `{prefix}.weight`, its scale `weight + offset`.
    pub(crate) fn rms_norm(&self, prefix: &str, eps: f64, offset: f32) -> Result<RmsNorm> {
        Ok(RmsNorm::with_offset(
            self.get(&format!("{prefix}.weight"))?,
            eps,
            offset,
        ))
    }

    /// The trained variables with their names (LoRA: the adapters).
    pub(crate) fn into_vars(self) -> Vec<(String, Var)> {
        match self.lora {
            None => self.vars,
            Some(adapting) => {
                let (vars, model) = adapting.finish();
                *self.built.borrow_mut() = Some(model);
                vars
            }
        }
    }
}

/// The accessors of a family's model: a struct with `config: ModelConfig`
/// and `vars: Vec<(String, Var)>` fields, which [`HubModel`] reads; its
/// inherent `forward(&self, &TokenBatch, &Execution) -> Result<Forward>`
/// makes the pass that the training step and the logits run.
macro_rules! trainable_family {
    ($model:ty) => {
        impl $model {
            pub(super) fn config(&self) -> &$crate::ModelConfig {
                &self.config
            }

            pub(super) fn named_vars(&self) -> &[(String, candle_core::Var)] {
                &self.vars
            }
        }
    };
}
pub(crate) use trainable_family;

/// A hidden-state map of a [`Forward`]: a block, or the head.
type Layer<'a> = Box<dyn Fn(&Tensor) -> candle_core::Result<Tensor> + 'a>;

/// One forward pass of a family on a batch, laid out for
/// [`checkpoint::backward`]: the stem's output `[b, s, h]` (attached to the
/// parameters' graph), the blocks, the head from the last block's output
/// to the hidden states `[b·s, h]` the output layer takes, and the output
/// layer, whose logits `[b·s, P]` over the padded vocabulary
/// ([`layers::lm_logits`]) the loss takes whole or in chunks of tokens
/// ([`Output::loss`]). The families build it; [`HubModel`]'s training step
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
    fn loss(
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

/// `(b, s)` of `batch`, checked against the model's position limit (the
/// families with learned positions, GPT-2 and BERT, have no more).
pub(crate) fn batch_dims(batch: &TokenBatch, config: &ModelConfig) -> Result<(usize, usize)> {
    let (b, s) = batch.dims().map_err(|e| match e {
        oomfix_strategies::Error::Config(msg) => Error::Usage(msg),
        e => e.into(),
    })?;
    let learned_positions = matches!(config.family, Family::Gpt2 | Family::Bert);
    if learned_positions && s > config.max_positions {
        return Err(Error::Usage(format!(
            "sequence length {s} exceeds the model's {} learned positions",
            config.max_positions
        )));
    }
    Ok((b, s))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A matrix of several chunks has the same values whatever the number of
    /// threads drawing them, and its chunks are not copies of one another.
    #[test]
    fn random_matrices_do_not_depend_on_the_thread_count() {
        let draw = |threads| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            pool.install(|| {
                Init::new(7)
                    .tensor("model.layers.0.mlp.up_proj.weight", &[3, Init::CHUNK])
                    .unwrap()
                    .to_vec2::<f32>()
                    .unwrap()
            })
        };
        let one = draw(1);
        assert_eq!(one, draw(4));
        assert_ne!(one[0], one[1]);
        let std = (one[0].iter().map(|v| v * v).sum::<f32>() / Init::CHUNK as f32).sqrt();
        assert!((std / INIT_STD - 1.0).abs() < 0.01, "std {std}");
    }
}
