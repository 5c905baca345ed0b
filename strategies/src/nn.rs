//! Trainable building blocks for candle models: layers with `candle_nn`'s
//! names and shapes ([`Linear`], [`LayerNorm`], [`RmsNorm`], [`Embedding`],
//! [`Activation`], plus [`RotaryEmbedding`] and [`flash_attention`]), the fused
//! ops they are built on ([`ops`]) and a fused cross-entropy ([`loss`]).
//!
//! They exist because candle's fast paths cannot be trained through: in
//! candle 0.11, `candle_nn`'s fast `softmax_last_dim`, `rms_norm` and
//! `layer_norm` custom ops have no backward (of `candle_nn::ops`' custom ops
//! only `sigmoid` has one), so a model that calls them, as most candle models
//! and all of `candle-transformers` do (`candle_nn::LayerNorm` and `RmsNorm`
//! take the fast path on contiguous inputs), silently gets no gradient for
//! the parameters behind them and cannot train as written. The composed
//! alternatives train, but keep every intermediate result alive until
//! backward. The ops here are single graph nodes with a hand-written backward:
//! they give every input its gradient, keep only their output, and compute
//! in f32 whatever the storage dtype (f32, bf16, f16), on the CPU and (feature
//! `cuda`) on CUDA with NVRTC-compiled kernels. They work on any candle model.
//!
//! * The layers take the same `candle_nn::VarBuilder`, make the same tensors
//!   under the same names with the same shapes and initialisation as their
//!   `candle_nn` namesakes (`linear(in, out, vb)`: `weight` `[out, in]` and
//!   `bias` `[out]`; `layer_norm(size, eps, vb)`, `rms_norm`,
//!   `embedding(vocab, hidden, vb)`), implement [`Module`], and convert from
//!   the `candle_nn` types with `From`: switching a model is an import.
//! * [`Projection`]: a linear layer whose weight may be frozen, as LoRA
//!   and QLoRA train a model ([`crate::lora`]): trained, frozen, or frozen
//!   with an adapter.
//! * [`ops`]: layer norm, RMS norm, biased linear maps, GELU, SwiGLU, rotary
//!   position embedding, the token embedding lookup and the attention
//!   probabilities `softmax(q·kᵀ·scale + mask)`, as functions.
//! * [`flash_attention`] (from [`crate::attention`]) keeps no `[s, s]`
//!   tensor at all.
//! * [`loss`]: cross-entropy that keeps no logits-sized tensor of its own.
//!
//! A tiny language model built from these layers, one training step:
//!
//! ```
//! use candle_core::{DType, Device, Module, Tensor};
//! use candle_nn::{Optimizer, VarBuilder, VarMap, SGD};
//! use oomfix_strategies::nn::{
//!     embedding, flash_attention, layer_norm, linear, linear_no_bias, loss, rms_norm,
//!     Activation, AttentionOptions, RotaryEmbedding,
//! };
//!
//! let dev = Device::Cpu;
//! let (vocab, hidden, heads, seq) = (11, 16, 2, 4);
//! let varmap = VarMap::new();
//! let vb = VarBuilder::from_varmap(&varmap, DType::F32, &dev);
//! let embed = embedding(vocab, hidden, vb.pp("embed"))?;
//! let attn_norm = layer_norm(hidden, 1e-5, vb.pp("attn_norm"))?;
//! let qkv = linear(hidden, 3 * hidden, vb.pp("qkv"))?;
//! let rope = RotaryEmbedding::new(heads, hidden / heads, seq, 10_000.0, &dev)?;
//! let out = linear_no_bias(hidden, hidden, vb.pp("out"))?;
//! let mlp_norm = rms_norm(hidden, 1e-5, vb.pp("mlp_norm"))?;
//! let up = linear(hidden, 4 * hidden, vb.pp("up"))?; // gate and up halves
//! let down = linear(2 * hidden, hidden, vb.pp("down"))?;
//! let head = linear_no_bias(hidden, vocab, vb.pp("head"))?;
//! // candle's CPU random numbers take no seed: fixed matrices make the example
//! // the same on every run (biases start at zero, norm weights at one).
//! for var in varmap.all_vars().iter().filter(|v| v.rank() == 2) {
//!     let n = var.elem_count();
//!     let values = (Tensor::arange(0u32, n as u32, &dev)?.to_dtype(DType::F32)? * 0.7)?;
//!     var.set(&(values.sin()? * 0.3)?.reshape(var.shape())?)?;
//! }
//!
//! let forward = |ids: &Tensor| -> candle_core::Result<Tensor> {
//!     let (b, s) = ids.dims2()?;
//!     let x = embed.forward(ids)?; // [b, s, hidden]
//!     let proj = qkv.forward(&attn_norm.forward(&x)?)?;
//!     let q = rope.forward(&proj.narrow(2, 0, hidden)?)?; // [b, heads, s, d]
//!     let k = rope.forward(&proj.narrow(2, hidden, hidden)?)?;
//!     let v = proj
//!         .narrow(2, 2 * hidden, hidden)?
//!         .reshape((b, s, heads, ()))?
//!         .transpose(1, 2)?
//!         .contiguous()?;
//!     let opts = AttentionOptions { causal: true, ..Default::default() };
//!     let ctx = flash_attention(&q, &k, &v, &opts)?.transpose(1, 2)?.reshape((b, s, hidden))?;
//!     let x = (x + out.forward(&ctx)?)?;
//!     let mlp = down.forward(&Activation::Swiglu.forward(&up.forward(&mlp_norm.forward(&x)?)?)?)?;
//!     head.forward(&(x + mlp)?)?.flatten_to(1) // [b·s, vocab]
//! };
//!
//! let ids = Tensor::new(&[[1u32, 4, 2, 7], [3, 3, 9, 0]], &dev)?;
//! let targets = Tensor::new(&[4u32, 2, 7, 1, 3, 9, 0, 5], &dev)?;
//! let before = loss::cross_entropy(&forward(&ids)?, &targets, None)?;
//! let grads = before.backward()?;
//! for var in varmap.all_vars() {
//!     let g = grads.get(&var).expect("every parameter has a gradient");
//!     assert!(g.abs()?.sum_all()?.to_scalar::<f32>()? > 0.0);
//! }
//! SGD::new(varmap.all_vars(), 0.05)?.step(&grads)?;
//! let after = loss::cross_entropy(&forward(&ids)?, &targets, None)?;
//! assert!(after.to_scalar::<f32>()? < before.to_scalar::<f32>()?);
//! # Ok::<(), candle_core::Error>(())
//! ```

mod layers;
pub mod loss;
pub mod ops;

pub use crate::attention::{flash_attention, AttentionOptions};
pub use candle_core::Module;
pub use candle_nn::LayerNormConfig;
pub use layers::{
    embedding, layer_norm, layer_norm_no_bias, linear, linear_b, linear_no_bias, rms_norm,
    Activation, Embedding, LayerNorm, Linear, Projection, RmsNorm, RotaryEmbedding,
};
