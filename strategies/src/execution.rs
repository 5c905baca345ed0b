//! What a training step does differently for a plan.

use crate::{Attention, Checkpointing, Plan, Strategy};
use std::sync::Arc;

/// The part of a plan that a model's forward and backward pass carries out:
/// made from the plan by every fix's [`Strategy::execution`] hook, and taken
/// by a model's forward/backward instead of one argument per fix, so that a
/// fix that changes the pass changes this type and the layers that read it,
/// not the models.
///
/// ```
/// use oomfix_strategies::{Attention, Checkpointing, Execution, Plan};
/// let plan = Plan { attention: Attention::Flash, checkpoint: Checkpointing::Every(2), ..Plan::baseline(8, 64) };
/// let exec = Execution::for_plan(&plan, &oomfix_strategies::builtins());
/// assert_eq!(exec.attention, Attention::Flash);
/// assert_eq!(exec.checkpoint, Checkpointing::Every(2));
/// assert_eq!(Execution::default().loss_scale, 1.0);
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct Execution {
    /// Which blocks are recomputed in backward.
    pub checkpoint: Checkpointing,
    /// How attention is computed.
    pub attention: Attention,
    /// The factor the loss is multiplied by before backward (fp16 loss scaling).
    pub loss_scale: f64,
    /// The most bytes one chunk's logits take in the compute dtype when the
    /// LM head and the cross-entropy run chunk by chunk of tokens
    /// ([`crate::chunked_loss`]); `None`: the whole micro-batch's logits at once.
    pub loss_chunk_bytes: Option<u64>,
    /// Where the checkpointed segments' inputs wait for their recompute
    /// ([`crate::offload_activations`]).
    pub segment_inputs: SegmentInputs,
    /// How each block's two parts run between its forward and its
    /// backward: kept, recomputed, or recomputed tile by tile
    /// ([`crate::tiled_mlp`] tiles the MLP).
    pub parts: Parts,
}

/// Executions are compared and hashed field by field, the loss scale by its
/// bits (a scale is a finite positive number, never NaN): an execution can
/// key a map of what was measured under it.
impl Eq for Execution {}

impl std::hash::Hash for Execution {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.checkpoint.hash(state);
        self.attention.hash(state);
        self.loss_scale.to_bits().hash(state);
        self.loss_chunk_bytes.hash(state);
        self.segment_inputs.hash(state);
        self.parts.hash(state);
    }
}

impl Default for Execution {
    /// Plain autograd, composed attention, no loss scaling, the loss unchunked.
    fn default() -> Self {
        Execution {
            checkpoint: Checkpointing::None,
            attention: Attention::Composed,
            loss_scale: 1.0,
            loss_chunk_bytes: None,
            segment_inputs: SegmentInputs::OnDevice,
            parts: Parts::default(),
        }
    }
}

impl Execution {
    /// Tokens per tile of each block's MLP when it runs tile by tile
    /// ([`crate::tiled_mlp`]); `None`: the whole micro-batch at once.
    pub fn mlp_tile(&self) -> Option<usize> {
        match self.parts.mlp {
            PartRun::Tiled(tile) => Some(tile),
            _ => None,
        }
    }

    /// The execution of `plan`: the default, changed by each of `fixes`' hooks in order.
    pub fn for_plan(plan: &Plan, fixes: &[Arc<dyn Strategy>]) -> Self {
        let mut exec = Execution::default();
        for fix in fixes {
            fix.execution(plan, &mut exec);
        }
        exec
    }

    /// With checkpointing `policy`.
    pub fn checkpoint(self, policy: Checkpointing) -> Self {
        Execution {
            checkpoint: policy,
            ..self
        }
    }

    /// With attention computed as `attention` says.
    pub fn attention(self, attention: Attention) -> Self {
        Execution { attention, ..self }
    }

    /// With the LM loss computed in chunks whose logits take at most
    /// `bytes` (`None`: unchunked).
    pub fn loss_chunks(self, bytes: Option<u64>) -> Self {
        Execution {
            loss_chunk_bytes: bytes,
            ..self
        }
    }

    /// With each block's MLP run in tiles of `tile` tokens (`None`: whole).
    pub fn mlp_tiles(self, tile: Option<usize>) -> Self {
        let mlp = tile.map_or(PartRun::Kept, PartRun::Tiled);
        Execution {
            parts: Parts { mlp, ..self.parts },
            ..self
        }
    }

    /// With the loss multiplied by `scale` before backward.
    pub fn loss_scale(self, scale: f64) -> Self {
        Execution {
            loss_scale: scale,
            ..self
        }
    }
}

/// Where [`crate::checkpoint::backward_with`] keeps the checkpointed
/// segments' inputs between the forward and their recompute.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum SegmentInputs {
    /// On the device that computes.
    #[default]
    OnDevice,
    /// In host memory, each copied back to the device just before its
    /// segment is recomputed ([`crate::offload_activations`]). The first
    /// segment's input, attached to the stem's graph, stays on the device.
    OnHost,
}

/// A block's two parts as the families mark them: the attention part
/// (everything up to and including the attention's residual add) and the
/// row-wise part (the norm before the MLP and the MLP, whose rows are
/// independent tokens).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Part {
    /// The norm before attention, the projections, attention and the
    /// residual add.
    Attention,
    /// The norm before the MLP and the MLP.
    Mlp,
}

/// How one part of every block runs between the block's forward and its
/// backward. A fix that changes what a block keeps sets it in its
/// [`Strategy::execution`] hook; the memory and step-time models read it
/// from the block's description, and the families' code from here.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum PartRun {
    /// Its tensors are kept from the forward for the backward.
    #[default]
    Kept,
    /// Its tensors are dropped after the forward and the part recomputed
    /// whole from its input just before its backward.
    Recomputed,
    /// Run over tiles of this many tokens, each tile recomputed just before
    /// its backward, so that one tile's tensors exist at a time.
    Tiled(usize),
}

/// How each part of the blocks runs ([`PartRun`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Parts {
    /// The attention part.
    pub attention: PartRun,
    /// The row-wise part (the MLP with its norm).
    pub mlp: PartRun,
}

impl Parts {
    /// How `part` runs.
    pub fn of(&self, part: Part) -> PartRun {
        match part {
            Part::Attention => self.attention,
            Part::Mlp => self.mlp,
        }
    }
}
