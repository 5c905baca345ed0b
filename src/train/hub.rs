//! A model of a Hugging Face family oomfix implements, built from its
//! shape with random or pretrained weights, as a [`Model`] the trainer
//! trains like any model given as code.

use super::weights::Tensors;
use super::{batch_dims, bert, gemma, gpt2, llama, lora, Forward, Params, TokenBatch};
use crate::track::alloc::{self, Phase};
use crate::track::tag::{self, Module, Op, Tag};
use crate::{Error, Family, ModelConfig, Result};
use candle_core::{DType, Device, Tensor, Var};
use oomfix_strategies::model::{self, Capabilities, MicroBatch, Model};
#[cfg(doc)]
use oomfix_strategies::Attention;
use oomfix_strategies::Execution;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::rc::Rc;

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
        Some(paths) => Tensors::read(config, paths, seed)?,
        None => Tensors::random(config, seed),
    };
    let params = match lora {
        Some(lora) => Params::frozen(lora::Adapting::new(
            config, tensors, *lora, dtype, device, seed,
        )?),
        None => Params::new(
            tensors
                .map(|made| {
                    let (name, t) = made?;
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
