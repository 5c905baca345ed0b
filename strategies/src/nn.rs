//! Trainable building blocks for candle models: fused ops with their own
//! backward ([`ops`]) and a fused cross-entropy ([`loss`]).
//!
//! They exist because candle's fast paths cannot be trained through: in
//! candle 0.11, `candle_nn`'s fast `softmax_last_dim`, `rms_norm` and
//! `layer_norm` custom ops have no backward (of `candle_nn::ops`' custom ops
//! only `sigmoid` has one), so a model that calls them, as most candle models
//! and all of `candle-transformers` do, silently gets no gradient for the
//! parameters behind them and cannot train as written. The composed
//! alternatives train, but keep every intermediate result alive until
//! backward. The ops here are single graph nodes with a hand-written backward:
//! they give every input its gradient, keep only their output, and compute
//! in f32 whatever the storage dtype (f32, bf16, f16), on the CPU and (feature
//! `cuda`) on CUDA with NVRTC-compiled kernels. They work on any candle model:
//! swap the call, keep the weights.
//!
//! * [`ops`]: layer norm, RMS norm, biased linear maps, GELU, SwiGLU, rotary
//!   position embedding, the token embedding lookup and the attention
//!   probabilities `softmax(q·kᵀ·scale + mask)`. Flash attention, which keeps
//!   no `[s, s]` tensor at all, is [`crate::attention::flash_attention`].
//! * [`loss`]: cross-entropy that keeps no logits-sized tensor of its own.
//!
//! ```
//! use candle_core::{DType, Device, Tensor, Var};
//! use oomfix_strategies::nn::{loss, ops};
//!
//! let dev = Device::Cpu;
//! let x = Tensor::randn(0f32, 1.0, (6, 8), &dev)?;
//! let w = Var::ones(8, DType::F32, &dev)?;
//! let head = Var::randn(0f32, 0.1, (5, 8), &dev)?;
//! let bias = Var::zeros(5, DType::F32, &dev)?;
//! let h = ops::rms_norm(&x, w.as_tensor(), 1e-5)?;
//! let logits = ops::linear(&h, head.as_tensor(), bias.as_tensor(), ops::WeightLayout::OutIn)?;
//! let targets = Tensor::new(&[0u32, 1, 2, 3, 4, 0], &dev)?;
//! let grads = loss::cross_entropy(&logits, &targets, None)?.backward()?;
//! for var in [&w, &head, &bias] {
//!     assert!(grads.get(var).is_some());
//! }
//! # Ok::<(), candle_core::Error>(())
//! ```

pub mod loss;
pub mod ops;
