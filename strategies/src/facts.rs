//! What the fixes' hooks may know about a model: its parameters, blocks
//! and the linear projections of a block.

/// The most linear projections per block [`ModelFacts`] describes.
pub const MAX_LINEARS: usize = 16;

/// One linear projection of a block: its module name (the last part of its
/// path: `q_proj`, `c_attn`, `dense`) and its widths.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Linear {
    /// Module name, as PEFT's `target_modules` names it.
    pub name: &'static str,
    /// Input features.
    pub inputs: u64,
    /// Output features.
    pub outputs: u64,
}

/// What the fixes' memory hooks may know about a model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct ModelFacts {
    /// Trainable parameters (a tied weight counted once).
    pub parameters: u64,
    /// Elements of the largest parameter tensor.
    pub largest_tensor: u64,
    /// Transformer blocks.
    pub layers: usize,
    /// Parameters of one block (0 when not known).
    pub block_parameters: u64,
    /// Parameters that are not trained (frozen), besides `parameters`.
    pub frozen: u64,
    /// Elements of the largest frozen tensor.
    pub largest_frozen: u64,
    /// The linear projections of one block (all blocks alike), in order;
    /// empty when not known.
    pub linears: [Option<Linear>; MAX_LINEARS],
    /// Elements of a token embedding the model only looks rows up in (not
    /// tied to its output layer): frozen under LoRA, it is kept in host
    /// memory ([`crate::lora`]). 0 when there is none or it is not known.
    pub looked_up: u64,
}

impl ModelFacts {
    /// Facts of a model with `parameters` parameters, the largest tensor of
    /// `largest_tensor` elements, and `layers` blocks.
    pub fn new(parameters: u64, largest_tensor: u64, layers: usize) -> Self {
        ModelFacts {
            parameters,
            largest_tensor,
            layers,
            block_parameters: 0,
            frozen: 0,
            largest_frozen: 0,
            linears: [None; MAX_LINEARS],
            looked_up: 0,
        }
    }

    /// These facts with one more linear projection per block, `name`, from
    /// `inputs` to `outputs` features (beyond [`MAX_LINEARS`] it is left out).
    pub fn with_linear(mut self, name: &str, inputs: u64, outputs: u64) -> Self {
        if let Some(slot) = self.linears.iter_mut().find(|l| l.is_none()) {
            *slot = Some(Linear {
                name: crate::intern::intern(name.to_string()),
                inputs,
                outputs,
            });
        }
        self
    }

    /// The linear projections of one block, in order.
    pub fn linears(&self) -> impl Iterator<Item = Linear> + '_ {
        self.linears.iter().flatten().copied()
    }

    /// These facts with `n` parameters in each block.
    pub fn with_block_parameters(self, n: u64) -> Self {
        ModelFacts {
            block_parameters: n,
            ..self
        }
    }

    /// These facts with a looked-up-only token embedding of `n` elements
    /// ([`looked_up`](Self::looked_up)).
    pub fn with_looked_up(self, n: u64) -> Self {
        ModelFacts {
            looked_up: n,
            ..self
        }
    }
}
