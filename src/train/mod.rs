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
//! What a forward pass keeps alive until backward, tensor by tensor, is in
//! [`activations`].

pub mod activations;
mod batch;
mod bert;
pub mod chat;
pub mod data;
pub mod examples;
mod forward;
mod gemma;
mod gpt2;
mod hub;
mod layers;
mod llama;
pub mod lora;
mod optim;
mod params;
mod rope;
pub mod saved;
mod schedule;
pub mod tokenizer;
mod trainer;
mod weights;

pub use crate::state_file::StateFile;
pub(crate) use batch::batch_dims;
pub use batch::{batch_from_windows, synthetic_batch};
pub(crate) use forward::{block_layers, final_norm, Forward, Layer, Output};
pub use hub::{build_model, build_model_with, check_supported, HubModel, StepOutput};
pub use oomfix_strategies::model::TokenBatch;
pub(crate) use params::Params;
pub use saved::{ModelSource, TrainingState};
pub use schedule::{default_lr, Decay, LrSchedule, PRETRAINED_LR, RANDOM_INIT_LR};
pub use trainer::{compute_dtype, plan_changes, Evaluation, StepStats, TrainOptions, Trainer};

use crate::{Error, ModelConfig, Result};
#[cfg(doc)]
use oomfix_strategies::{model::Model, Attention};

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
