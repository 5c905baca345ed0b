//! Any candle model, as the fixes see it: its variables, a loss for one
//! micro-batch, and optionally its blocks, the attention it computes and the
//! 16-bit dtypes it computes in.
//!
//! A model implements [`Model`] in a few lines: [`vars`](Model::vars) (the
//! trainable `Var`s in a fixed order) and [`forward`](Model::forward) (build
//! a micro-batch of the size asked for, or take the next one from its own
//! data, and return its loss, or its [`Stages`] so that checkpointing can
//! recompute its blocks). [`capabilities`](Model::capabilities) says which
//! fixes it can take; the default is none of those that need the model's
//! help ([`Capabilities::NONE`]), and a fix that needs what a model lacks is
//! skipped by a planner with the reason ([`crate::Strategy::unusable`]):
//!
//! | fix | needs of the model |
//! |---|---|
//! | `checkpoint` | its blocks: [`Forward::Stages`], and [`Capabilities::blocks`] > 0 |
//! | `flash-attention` | attention computed as [`Execution::attention`] says ([`Capabilities::attention`]) |
//! | `precision` | to be built in bf16 (or f16 where the device has no bf16): [`Capabilities::bf16`], [`Capabilities::f16`] |
//! | `accumulate`, `fused-adamw`, `shard`, `offload` | nothing: they act on the variables and their gradients |
//!
//! The model is built by its owner in the compute dtype the plan asks for
//! (mixed precision keeps fp32 master copies of its variables elsewhere), so
//! a planner or trainer takes a builder `Fn(DType, &Device) -> Result<M>`.
//!
//! [`forward_backward`] runs one micro-batch through forward and backward
//! under an [`Execution`] (checkpointing with [`crate::checkpoint::backward`],
//! the loss scale) and returns detached gradients aligned with the variables.
//!
//! ```
//! use candle_core::{DType, Device, Tensor, Var};
//! use oomfix_strategies::model::{self, Forward, MicroBatch, Model};
//! use oomfix_strategies::Execution;
//!
//! /// Least squares on a fixed random problem: w·x ≈ y.
//! struct Regression { w: Var, x: Tensor, y: Tensor }
//!
//! impl Model for Regression {
//!     fn vars(&self) -> Vec<Var> { vec![self.w.clone()] }
//!     fn forward(&self, batch: &MicroBatch) -> candle_core::Result<Forward<'_>> {
//!         let x = self.x.narrow(0, 0, batch.size)?;
//!         let y = self.y.narrow(0, 0, batch.size)?;
//!         let loss = x.matmul(self.w.as_tensor())?.sub(&y)?.sqr()?.mean_all()?;
//!         Ok(Forward::Loss(loss))
//!     }
//! }
//!
//! let dev = Device::Cpu;
//! let m = Regression {
//!     w: Var::zeros((4, 1), DType::F32, &dev)?,
//!     x: Tensor::randn(0f32, 1.0, (8, 4), &dev)?,
//!     y: Tensor::randn(0f32, 1.0, (8, 1), &dev)?,
//! };
//! let out = model::forward_backward(&m, &m.vars(), &MicroBatch::new(8, 0, Execution::default()))?;
//! assert_eq!(out.grads.len(), 1);
//! assert_eq!(out.grads[0].as_ref().unwrap().dims(), [4, 1]);
//! # Ok::<(), oomfix_strategies::Error>(())
//! ```

use candle_core::{DType, Tensor, Var};

use crate::checkpoint::{self, Gradients};
use crate::{Checkpointing, Error, Execution, ModelFacts, Precision, Result};

/// What a model can do for the fixes that need its help.
///
/// ```
/// use oomfix_strategies::model::Capabilities;
/// use oomfix_strategies::Precision;
/// let caps = Capabilities::NONE.with_blocks(6);
/// assert!(caps.computes_in(Precision::F32));
/// assert!(!caps.computes_in(Precision::Bf16));
/// assert!(Capabilities::ALL.computes_in(Precision::F16));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct Capabilities {
    /// Blocks its forward returns as [`Forward::Stages`] (0: it returns a
    /// loss only, and cannot be checkpointed).
    pub blocks: usize,
    /// Whether it computes attention as [`Execution::attention`] says
    /// (composed, or [`crate::attention::flash_attention`]).
    pub attention: bool,
    /// Whether it can be built and trained in bf16.
    pub bf16: bool,
    /// Whether it can be built and trained in f16 (with loss scaling).
    pub f16: bool,
}

impl Capabilities {
    /// A model that needs no fix's help and gives none: fp32 only, a loss
    /// only, its own attention.
    pub const NONE: Capabilities = Capabilities {
        blocks: 0,
        attention: false,
        bf16: false,
        f16: false,
    };

    /// Everything a fix may need, with an unknown number of blocks (what
    /// oomfix's own model families give).
    pub const ALL: Capabilities = Capabilities {
        blocks: usize::MAX,
        attention: true,
        bf16: true,
        f16: true,
    };

    /// With `blocks` blocks to checkpoint.
    pub const fn with_blocks(self, blocks: usize) -> Self {
        Capabilities { blocks, ..self }
    }

    /// Computing attention as the execution says.
    pub const fn with_attention(self) -> Self {
        Capabilities {
            attention: true,
            ..self
        }
    }

    /// Buildable in bf16 and f16.
    pub const fn with_half(self) -> Self {
        Capabilities {
            bf16: true,
            f16: true,
            ..self
        }
    }

    /// Whether the model can compute in `precision`'s dtype (fp32 always).
    pub fn computes_in(&self, precision: Precision) -> bool {
        match precision {
            Precision::F32 => true,
            Precision::Bf16 => self.bf16,
            Precision::F16 => self.f16,
        }
    }
}

impl Default for Capabilities {
    /// [`Capabilities::NONE`].
    fn default() -> Self {
        Capabilities::NONE
    }
}

/// What a model's forward is asked for: one micro-batch.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct MicroBatch {
    /// Samples in the micro-batch.
    pub size: usize,
    /// Tokens per sample, for models that take sequences (the plan's
    /// `seq_len`); models that do not may ignore it.
    pub seq_len: usize,
    /// Which micro-batch of the run this is, counting from 0 over every
    /// micro-batch of every step and rank: a model that makes its own data
    /// can draw it reproducibly from this number (different ranks and
    /// accumulation steps get different numbers).
    pub index: u64,
    /// What the pass does: the attention it must compute (when the model
    /// declares [`Capabilities::attention`]) and, for [`forward_backward`],
    /// the checkpointing and loss scale.
    pub execution: Execution,
}

impl MicroBatch {
    /// Micro-batch number `index` of `size` samples, with sequences of one
    /// token (set [`seq_len`](Self::seq_len) for sequence models).
    pub fn new(size: usize, index: u64, execution: Execution) -> Self {
        MicroBatch {
            size,
            seq_len: 1,
            index,
            execution,
        }
    }

    /// With sequences of `seq_len` tokens.
    pub fn with_seq_len(self, seq_len: usize) -> Self {
        MicroBatch { seq_len, ..self }
    }
}

/// One block: hidden states in, hidden states out (see
/// [`checkpoint::Block`]: deterministic, differentiable candle ops).
pub type BlockFn<'a> = Box<dyn Fn(&Tensor) -> candle_core::Result<Tensor> + 'a>;

/// The head: the last block's output to the scalar loss, called once.
pub type HeadFn<'a> = Box<dyn FnOnce(&Tensor) -> candle_core::Result<Tensor> + 'a>;

/// A model's forward split as *stem → blocks → head*, so that blocks can be
/// recomputed in backward ([`crate::checkpoint`]).
pub struct Stages<'a> {
    /// The first block's input, computed from the micro-batch (and the stem's
    /// parameters, if any), still attached to its graph.
    pub stem: Tensor,
    /// The blocks, in order.
    pub blocks: Vec<BlockFn<'a>>,
    /// The last block's output to the scalar loss.
    pub head: HeadFn<'a>,
}

impl std::fmt::Debug for Stages<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stages")
            .field("stem", &self.stem.dims())
            .field("blocks", &self.blocks.len())
            .finish_non_exhaustive()
    }
}

/// What a model's forward returns.
#[derive(Debug)]
pub enum Forward<'a> {
    /// The scalar loss of the micro-batch (no checkpointing possible).
    Loss(Tensor),
    /// The stem, blocks and head, which [`forward_backward`] runs (and
    /// recomputes under checkpointing).
    Stages(Stages<'a>),
}

/// A trainable candle model as the fixes see it.
///
/// See the [module docs](self) for what each fix needs and an example.
pub trait Model {
    /// The trainable variables, in an order that does not change (gradients,
    /// optimizer state and sharding follow it; with a `candle_nn::VarMap`,
    /// [`vars_of`] sorts them by name).
    fn vars(&self) -> Vec<Var>;
    /// One micro-batch of `batch.size` samples: its loss, or the stages that
    /// compute it. The model makes its micro-batch (or takes it from data it
    /// holds), in its own compute dtype.
    fn forward(&self, batch: &MicroBatch) -> candle_core::Result<Forward<'_>>;
    /// Which fixes that need the model's help it can take (default: none).
    fn capabilities(&self) -> Capabilities {
        Capabilities::NONE
    }
}

impl<M: Model + ?Sized> Model for Box<M> {
    fn vars(&self) -> Vec<Var> {
        (**self).vars()
    }
    fn forward(&self, batch: &MicroBatch) -> candle_core::Result<Forward<'_>> {
        (**self).forward(batch)
    }
    fn capabilities(&self) -> Capabilities {
        (**self).capabilities()
    }
}

/// The variables of a `candle_nn::VarMap`, sorted by name (a `VarMap` keeps
/// them in a hash map, whose order changes from run to run).
pub fn vars_of(varmap: &candle_nn::VarMap) -> Vec<Var> {
    let data = varmap
        .data()
        .lock()
        .expect("a VarMap's lock is not poisoned");
    let mut named: Vec<(&String, &Var)> = data.iter().collect();
    named.sort_by(|a, b| a.0.cmp(b.0));
    named.into_iter().map(|(_, v)| v.clone()).collect()
}

/// What the memory hooks know of a model with `vars` and `blocks` blocks.
pub fn facts(vars: &[Var], blocks: usize) -> ModelFacts {
    let sizes = vars.iter().map(|v| v.elem_count() as u64);
    ModelFacts::new(sizes.clone().sum(), sizes.max().unwrap_or(0), blocks)
}

/// Bytes of `vars` as they are stored.
pub fn var_bytes(vars: &[Var]) -> u64 {
    vars.iter()
        .map(|v| (v.elem_count() * v.dtype().size_in_bytes()) as u64)
        .sum()
}

/// The compute dtype of `precision`.
pub fn dtype_of(precision: Precision) -> DType {
    match precision {
        Precision::F32 => DType::F32,
        Precision::Bf16 => DType::BF16,
        Precision::F16 => DType::F16,
    }
}

/// Runs `batch` through `model`'s forward and backward under
/// `batch.execution`: its loss and the gradients of `loss × loss_scale` for
/// `vars` (the model's [`Model::vars`], taken once by the caller), detached;
/// a variable the loss does not reach gets zeros.
///
/// A model that returns [`Forward::Stages`] is run by
/// [`checkpoint::backward`] with the execution's checkpointing; one that
/// returns a loss under a checkpointing execution is an error (a planner
/// skips checkpointing for it).
pub fn forward_backward<M: Model + ?Sized>(
    model: &M,
    vars: &[Var],
    batch: &MicroBatch,
) -> Result<Gradients> {
    let exec = &batch.execution;
    let out = match model.forward(batch)? {
        Forward::Stages(s) => checkpoint::backward(
            &s.stem,
            &s.blocks,
            s.head,
            vars,
            exec.checkpoint,
            exec.loss_scale,
        )?,
        Forward::Loss(loss) => {
            if !exec.checkpoint.segments(1).is_empty() {
                return Err(Error::Unsupported(format!(
                    "checkpointing ({}) needs the model's blocks: its forward returned a loss, not stages",
                    exec.checkpoint
                )));
            }
            let none: [BlockFn<'_>; 0] = [];
            checkpoint::backward(
                &loss,
                &none,
                |l: &Tensor| Ok(l.clone()),
                vars,
                Checkpointing::None,
                exec.loss_scale,
            )?
        }
    };
    let grads = out
        .grads
        .into_iter()
        .zip(vars)
        .map(|(g, v)| match g {
            Some(g) => Ok(Some(g)),
            None => Ok(Some(v.zeros_like()?)),
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Gradients::untaken(out.loss, grads))
}

/// Whether the linked candle-core stores a tensor's first gradient as it is
/// (the workspace's patched copy, `vendor/README.md`) rather than adding it
/// to a tensor of zeros (candle-core 0.11 as released). The patched
/// backward holds two fewer gradient-sized tensors at each edge it crosses;
/// an analytic memory model calibrated on one does not fit the other, a
/// measured one ([`crate::model`]'s planners) fits both.
///
/// Probed once per process, cheaply: `a + b` summed, then whether the
/// gradients of `a` and `b` share one storage (stored as is: both are the
/// sum's gradient) or not (each is `zeros + gradient`).
///
/// ```
/// // The workspace links the patched candle-core.
/// assert!(oomfix_strategies::model::first_gradient_stored_as_is());
/// ```
pub fn first_gradient_stored_as_is() -> bool {
    static PROBED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *PROBED.get_or_init(|| probe_backward().unwrap_or(false))
}

fn probe_backward() -> candle_core::Result<bool> {
    let dev = candle_core::Device::Cpu;
    let a = Var::zeros(4, DType::F32, &dev)?;
    let b = Var::zeros(4, DType::F32, &dev)?;
    let grads = (a.as_tensor() + b.as_tensor())?.sum_all()?.backward()?;
    let (Some(ga), Some(gb)) = (grads.get(a.as_tensor()), grads.get(b.as_tensor())) else {
        return Ok(false);
    };
    let (sa, _) = ga.storage_and_layout();
    let (sb, _) = gb.storage_and_layout();
    Ok(std::ptr::eq(&*sa, &*sb))
}
