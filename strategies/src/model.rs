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
//! | `chunked-loss` | an LM head and cross-entropy computed by [`crate::chunked_loss::linear_cross_entropy`] as [`Execution::loss_chunk_bytes`] says ([`Capabilities::chunked_loss`]) |
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
    /// Whether its loss is an LM head and a cross-entropy that it computes
    /// chunk by chunk of tokens when [`Execution::loss_chunk_bytes`] says so
    /// ([`crate::chunked_loss::linear_cross_entropy`]).
    pub chunked_loss: bool,
    /// Whether its blocks run their MLP tile by tile of tokens when
    /// [`Execution::mlp_tile`] says so ([`crate::tiled_mlp::tiled_rows`]).
    pub tiled_mlp: bool,
}

impl Capabilities {
    /// A model that needs no fix's help and gives none: fp32 only, a loss
    /// only, its own attention.
    pub const NONE: Capabilities = Capabilities {
        blocks: 0,
        attention: false,
        bf16: false,
        f16: false,
        chunked_loss: false,
        tiled_mlp: false,
    };

    /// Everything a fix may need, with an unknown number of blocks (what
    /// oomfix's own model families give).
    pub const ALL: Capabilities = Capabilities {
        blocks: usize::MAX,
        attention: true,
        bf16: true,
        f16: true,
        chunked_loss: true,
        tiled_mlp: true,
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

    /// Computing its LM loss in chunks as the execution says.
    pub const fn with_chunked_loss(self) -> Self {
        Capabilities {
            chunked_loss: true,
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

/// Token tensors of one micro-batch, for models that train on token data
/// (a trainer reads them from its data source; a model that makes its own
/// data gets none).
#[derive(Debug, Clone)]
pub struct TokenBatch {
    /// Token ids, u32 `[b, s]`.
    pub input_ids: Tensor,
    /// Target ids, u32 `[b, s]`: for causal LMs the next token of each position
    /// (already shifted by the data source); for masked LMs the original token at
    /// each position (only masked positions count).
    pub targets: Tensor,
    /// Positions that count in the loss, `[b, s]` of 0/1 in any dtype; `None`: all
    /// positions. Masked-LM batches normally carry one: the masked positions.
    pub loss_mask: Option<Tensor>,
    /// Real tokens (nonzero) versus padding (0), `[b, s]` of any dtype. Used by
    /// bidirectional attention; causal models ignore it (right padding cannot be
    /// attended to by earlier positions; keep padded positions out of `loss_mask`).
    pub attention_mask: Option<Tensor>,
    /// Document ids of packed rows, `[b, s]` u32: each document a run of
    /// equal ids. A position attends only to positions of its own document,
    /// and positions (rotary angles, learned position rows) count from 0 at
    /// each document's first token, so a row computes what its documents
    /// would one by one. `None`: each row is one document.
    pub documents: Option<Tensor>,
}

impl TokenBatch {
    /// `(b, s)` of the inputs, checked against the targets and masks.
    pub fn dims(&self) -> Result<(usize, usize)> {
        let dims = self.input_ids.dims2()?;
        let others = [
            Some(&self.targets),
            self.loss_mask.as_ref(),
            self.attention_mask.as_ref(),
            self.documents.as_ref(),
        ];
        if others
            .into_iter()
            .flatten()
            .any(|t| t.dims() != [dims.0, dims.1])
        {
            return Err(Error::Config(format!(
                "batch tensors disagree: input_ids is {:?}; targets and masks must have the same shape",
                self.input_ids.dims()
            )));
        }
        Ok(dims)
    }
}

/// What a model's forward is asked for: one micro-batch.
#[derive(Debug, Clone)]
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
    /// The run's seed (a trainer's `seed` option): a model that makes its own
    /// data draws it from this and [`index`](Self::index).
    pub seed: u64,
    /// The tokens of the micro-batch, where the trainer reads them from a data
    /// source; `None` where the model makes its own data.
    pub tokens: Option<TokenBatch>,
}

impl MicroBatch {
    /// Micro-batch number `index` of `size` samples, with sequences of one
    /// token (set [`seq_len`](Self::seq_len) for sequence models), seed 0 and
    /// no tokens.
    pub fn new(size: usize, index: u64, execution: Execution) -> Self {
        MicroBatch {
            size,
            seq_len: 1,
            index,
            execution,
            seed: 0,
            tokens: None,
        }
    }

    /// With sequences of `seq_len` tokens.
    pub fn with_seq_len(self, seq_len: usize) -> Self {
        MicroBatch { seq_len, ..self }
    }

    /// With the run's seed.
    pub fn with_seed(self, seed: u64) -> Self {
        MicroBatch { seed, ..self }
    }

    /// The micro-batch of `tokens`: its size and sequence length are theirs.
    pub fn with_tokens(self, tokens: TokenBatch) -> Result<Self> {
        let (size, seq_len) = tokens.dims()?;
        Ok(MicroBatch {
            size,
            seq_len,
            tokens: Some(tokens),
            ..self
        })
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

/// A trainable candle model as the fixes see it: a model given as code, or
/// one of the Hugging Face families a trainer builds from a checkpoint.
///
/// See the [module docs](self) for what each fix needs and an example.
pub trait Model {
    /// The trainable variables, in an order that does not change (gradients,
    /// optimizer state and sharding follow it; with a `candle_nn::VarMap`,
    /// [`vars_of`] sorts them by name).
    fn vars(&self) -> Vec<Var>;
    /// The variables' names, in [`vars`](Self::vars) order, for saved files
    /// and logs (default: `var.0`, `var.1`, …).
    fn var_names(&self) -> Vec<String> {
        (0..self.vars().len()).map(|i| format!("var.{i}")).collect()
    }
    /// The block each variable belongs to, in [`vars`](Self::vars) order
    /// (`None`: outside every block, or unknown; the default): ZeRO stage 3
    /// gathers a checkpointed segment's parameters only while it runs, and
    /// stages 2-3 reduce them once its backward made them.
    fn var_blocks(&self) -> Vec<Option<usize>> {
        vec![None; self.vars().len()]
    }
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
    fn var_names(&self) -> Vec<String> {
        (**self).var_names()
    }
    fn var_blocks(&self) -> Vec<Option<usize>> {
        (**self).var_blocks()
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
    forward_backward_with(model, vars, batch, &mut checkpoint::NoHook)
}

/// [`forward_backward`], calling `hook` around each checkpointed segment of
/// blocks ([`checkpoint::backward_with`]): e.g. ZeRO stage 3 gathering a
/// segment's parameters only while it runs. A gradient the hook took is
/// `None` in the result, its [`Gradients::taken`] flag set; every other
/// variable has one (zeros where the loss does not reach it).
pub fn forward_backward_with<M: Model + ?Sized>(
    model: &M,
    vars: &[Var],
    batch: &MicroBatch,
    hook: &mut dyn checkpoint::SegmentHook,
) -> Result<Gradients> {
    let exec = &batch.execution;
    let out = match model.forward(batch)? {
        Forward::Stages(Stages { stem, blocks, head }) => checkpoint::backward_with(
            stem,
            &blocks,
            head,
            vars,
            exec.checkpoint,
            exec.segment_inputs,
            exec.loss_scale,
            hook,
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
        .zip(&out.taken)
        .map(|((g, v), &taken)| match g {
            None if !taken => Ok(Some(v.zeros_like()?)),
            g => Ok(g),
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Gradients {
        loss: out.loss,
        grads,
        taken: out.taken,
    })
}

/// The loss of `batch` from a forward pass without backward (evaluation):
/// with [`Forward::Stages`], each block's input is detached, so a block's
/// activations are dropped once its output exists and the pass never keeps
/// more than one block's.
pub fn loss_only<M: Model + ?Sized>(model: &M, batch: &MicroBatch) -> Result<f32> {
    let loss = match model.forward(batch)? {
        Forward::Loss(loss) => loss,
        Forward::Stages(s) => (s.head)(&through_blocks(&s.stem, &s.blocks)?)?,
    };
    Ok(loss.to_dtype(DType::F32)?.to_scalar::<f32>()?)
}

/// `stem` through `blocks` for a pass without backward: each block's input
/// is detached from the graph, so a block's activations are dropped once
/// its output exists; the output is detached too.
pub fn through_blocks<B: crate::checkpoint::Block>(
    stem: &Tensor,
    blocks: &[B],
) -> candle_core::Result<Tensor> {
    blocks
        .iter()
        .try_fold(stem.detach(), |x, block| Ok(block.forward(&x)?.detach()))
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
