//! ZeRO's unit of a sharded step with checkpointed segments (FSDP's): the
//! parameters of each block, gathered while its segment runs (stage 3) and
//! whose gradients are reduced once its backward made them (stages 2 and 3).

use crate::track::alloc::mark_tensors;
use crate::track::tag::{Component, Op, Scope};
use candle_core::{Tensor, Var};
use oomfix_strategies::checkpoint::SegmentHook;
#[cfg(doc)]
use oomfix_strategies::model::Model;
use oomfix_strategies::shard::{Comm, ShardedOptimizer};
use std::ops::Range;

/// The model's vars by block (indices into [`Model::vars`]), and those
/// outside every block (embeddings, final norm, head).
#[derive(Debug)]
pub(super) struct BlockVars {
    pub(super) blocks: Vec<Vec<usize>>,
    pub(super) outside: Vec<usize>,
}

impl BlockVars {
    /// From the block of each var ([`Model::var_blocks`]), of `blocks` blocks.
    pub(super) fn new(var_blocks: &[Option<usize>], blocks: usize) -> Self {
        let mut units = BlockVars {
            blocks: vec![Vec::new(); blocks],
            outside: Vec::new(),
        };
        for (i, block) in var_blocks.iter().enumerate() {
            match block.filter(|&b| b < blocks) {
                Some(b) => units.blocks[b].push(i),
                None => units.outside.push(i),
            }
        }
        units
    }
}

/// ZeRO's unit as a [`SegmentHook`] (FSDP's): at stage 3 a segment's blocks'
/// parameters are gathered before it runs and freed after; at stages 2 and
/// 3 their gradients are reduced to their owners as soon as the segment's
/// backward made them, so that a rank never holds more local gradients than
/// one segment's and those outside the blocks.
pub(super) struct ShardedSegments<'a> {
    pub(super) opt: &'a mut ShardedOptimizer<Box<dyn Comm>>,
    pub(super) units: &'a BlockVars,
    /// The model's vars (for zeros where a parameter got no gradient).
    pub(super) vars: &'a [Var],
}

impl ShardedSegments<'_> {
    fn vars(&self, blocks: Range<usize>) -> Vec<usize> {
        self.units.blocks[blocks].concat()
    }
}

impl SegmentHook for ShardedSegments<'_> {
    fn before(&mut self, blocks: Range<usize>) -> oomfix_strategies::Result<()> {
        let _op = Scope::op(Op::WeightSync);
        let vars = self.vars(blocks);
        self.opt.gather(&vars)
    }
    fn after(&mut self, blocks: Range<usize>) -> oomfix_strategies::Result<()> {
        let vars = self.vars(blocks);
        self.opt.release(&vars)
    }
    fn gradients(
        &mut self,
        blocks: Range<usize>,
        grads: &mut [Option<Tensor>],
        taken: &mut [bool],
    ) -> oomfix_strategies::Result<()> {
        let _op = Scope::op(Op::GradAccumulate);
        let vars = self.vars(blocks);
        let mut mine = Vec::with_capacity(vars.len());
        for &i in &vars {
            mine.push(match grads[i].take() {
                Some(g) => g,
                None => self.vars[i].zeros_like()?,
            });
            taken[i] = true;
        }
        mark_tensors(&mine, Component::Gradients);
        self.opt.reduce_some(&vars, mine)
    }
}
