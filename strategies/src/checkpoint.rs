//! Activation checkpointing: keep segment inputs, recompute the segments in backward.
//!
//! Two halves:
//!
//! * [`Checkpoint`], the planner half, tightens [`Checkpointing`] from none to
//!   every block (segments of one block).
//! * [`backward`], the mechanism, computes a model's loss and parameter gradients
//!   under any [`Checkpointing`] policy. It works with any candle model that can be
//!   written as *stem → blocks → head*: the stem (embeddings) is a tensor already
//!   computed from the parameters, each block maps hidden states to hidden states
//!   ([`Block`]), and the head maps the last hidden states to a scalar loss.
//!
//! candle has no checkpointing of its own, and its graph keeps every op's inputs
//! alive until the loss is dropped. The mechanism therefore works in user space:
//!
//! 1. The forward runs each segment on its input and keeps only the segment's
//!    output, detached from the graph and made a fresh [`Var`] (the next segment's
//!    input). The segment's graph is freed as soon as its output is detached.
//! 2. The head computes the loss on a `Var` made from the last segment's output;
//!    `backward` gives the head's parameter gradients and the gradient of the last
//!    hidden states. The head's graph and gradient store are then dropped.
//! 3. From the last segment to the first, the segment is recomputed from its kept
//!    input and differentiated from a scalar whose backward hands `y` the
//!    gradient `grad_y` as it is (a custom op; the same as differentiating
//!    `(y * grad_y).sum_all()` without its product, ones and the stray
//!    gradient of `grad_y`, each as large as `y`): its gradient with respect
//!    to the segment's parameters and input is exactly the chain rule with
//!    upstream gradient `grad_y` (whatever loss scale `grad_y` carries, the
//!    segment's gradients carry too). The input's gradient becomes the next
//!    `grad_y`; parameter gradients are detached and summed across segments; each
//!    gradient store is dropped before the next segment is recomputed.
//! 4. The first segment's input is the stem tensor itself, still attached to the
//!    stem's graph, so its surrogate backward also reaches the embeddings.
//!
//! With [`Checkpointing::None`] the mechanism is the plain backward over one graph.
//!
//! ```
//! use candle_core::{DType, Device, Tensor, Var};
//! use oomfix_strategies::{checkpoint, Checkpointing};
//!
//! let dev = Device::Cpu;
//! let w = Var::randn(0f32, 0.5, (4, 4), &dev)?;
//! let x = Var::randn(0f32, 1.0, (2, 4), &dev)?;
//! let block = |h: &Tensor| h.matmul(w.as_tensor())?.tanh();
//! let blocks = [block, block, block];
//! let vars = [w.clone(), x.clone()];
//! let run = |policy| {
//!     checkpoint::backward(x.as_tensor(), &blocks, |h: &Tensor| h.sqr()?.mean_all(), &vars, policy, 1.0)
//! };
//! let plain = run(Checkpointing::None)?;
//! let recomputed = run(Checkpointing::Every(1))?;
//! let diff = (plain.grads[0].as_ref().unwrap() - recomputed.grads[0].as_ref().unwrap())?;
//! assert!(diff.abs()?.max_all()?.to_scalar::<f32>()? < 1e-6);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::cell::RefCell;
use std::ops::Range;
use std::rc::Rc;

use candle_core::{backprop::GradStore, Tensor, Var};

use crate::offload::HostBuffer;
use crate::seed::seeded;
use crate::{
    Checkpointing, Error, Execution, Plan, Result, SearchContext, SegmentInputs, Strategy,
};

/// Planner half: checkpoint every block (keep only each block's input).
///
/// Every block is recomputed once in backward whatever the segment length, so
/// the only setting the search needs is per-block checkpointing, the most
/// frugal one when blocks dominate; relaxing removes checkpointing again.
/// Longer segments ([`Checkpointing::Every`] with `k > 1`) stay available to
/// library users.
#[derive(Debug, Clone, Copy, Default)]
pub struct Checkpoint;

impl Strategy for Checkpoint {
    fn name(&self) -> &'static str {
        "checkpoint"
    }
    fn tighten(&self, plan: &Plan, _ctx: &SearchContext) -> Option<Plan> {
        (plan.checkpoint == Checkpointing::None).then_some(Plan {
            checkpoint: Checkpointing::Every(1),
            ..*plan
        })
    }
    /// No checkpointing, and so no checkpointed inputs kept on the host
    /// ([`crate::offload_activations`]).
    fn relax(&self, plan: &Plan, _ctx: &SearchContext) -> Option<Plan> {
        (plan.checkpoint != Checkpointing::None).then_some(Plan {
            checkpoint: Checkpointing::None,
            offload_activations: false,
            ..*plan
        })
    }
    /// Blocks recomputed as the plan says ([`backward`]). Its memory terms are
    /// activations, which the memory model derives from the plan's
    /// `checkpoint` field.
    fn execution(&self, plan: &Plan, exec: &mut Execution) {
        exec.checkpoint = plan.checkpoint;
    }
    /// Needs the model's blocks ([`crate::model::Forward::Stages`]).
    fn unusable(&self, ctx: &SearchContext) -> Option<String> {
        (ctx.model.blocks == 0).then(|| {
            "needs a model that gives blocks to recompute (its forward returns a loss, not stages)"
                .into()
        })
    }
}

/// One block of a model as checkpointing sees it: hidden states in, hidden states
/// out, built from differentiable candle ops on the block's parameters.
///
/// Recomputation calls `forward` a second time on the same input and must get the
/// same result, so a block must be deterministic (no dropout with a fresh mask).
/// Anything else the block needs (an attention mask, rotary tables) is captured by
/// the implementor; closures `Fn(&Tensor) -> candle_core::Result<Tensor>` are blocks.
pub trait Block {
    /// Applies the block to hidden states `x`.
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor>;
}

impl<F: Fn(&Tensor) -> candle_core::Result<Tensor>> Block for F {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self(x)
    }
}

/// What runs around each segment of [`backward_with`]: e.g. ZeRO stage 3
/// gathering the parameters of a segment's blocks before the segment runs and
/// freeing them after (FSDP's unit), so that one segment's parameters are
/// whole at a time; or ZeRO 2-3 reducing a segment's gradients as soon as its
/// backward made them ([`gradients`](Self::gradients)).
pub trait SegmentHook {
    /// Before the blocks `blocks` run: in the forward, or recomputed for
    /// their backward.
    fn before(&mut self, blocks: Range<usize>) -> Result<()>;
    /// After they ran (forward) or after their backward, once nothing built
    /// from them is alive but their output and gradients.
    fn after(&mut self, blocks: Range<usize>) -> Result<()>;
    /// After the backward of `blocks` (and [`after`](Self::after)): the
    /// gradients of the parameters only these blocks use are final in
    /// `grads` (indexed like the vars given to [`backward_with`]; `None`
    /// where the loss does not depend on a var). The hook may take some, e.g.
    /// to reduce them across ranks at once so that the whole local gradient
    /// set never exists: it leaves `None` and sets `taken` at each var it
    /// takes. The gradients of parameters outside the blocks (the stem's,
    /// the head's) are final only when the backward returns. By default
    /// nothing is taken.
    fn gradients(
        &mut self,
        _blocks: Range<usize>,
        _grads: &mut [Option<Tensor>],
        _taken: &mut [bool],
    ) -> Result<()> {
        Ok(())
    }
}

/// The [`SegmentHook`] that does nothing.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoHook;

impl SegmentHook for NoHook {
    fn before(&mut self, _: Range<usize>) -> Result<()> {
        Ok(())
    }
    fn after(&mut self, _: Range<usize>) -> Result<()> {
        Ok(())
    }
}

/// The result of [`backward`]: nothing in it refers to a computation graph.
#[derive(Debug)]
pub struct Gradients {
    /// The loss as the head returned it (not multiplied by the loss scale), detached.
    pub loss: Tensor,
    /// Gradient of `loss × loss_scale` for each of the `vars` passed in, in the same
    /// order and dtype; `None` for a variable the loss does not depend on or
    /// whose gradient the hook took. Detached.
    pub grads: Vec<Option<Tensor>>,
    /// Whether the hook took each var's gradient ([`SegmentHook::gradients`];
    /// never with [`backward`]).
    pub taken: Vec<bool>,
}

impl Gradients {
    /// A result of which the hook took no gradient.
    pub fn untaken(loss: Tensor, grads: Vec<Option<Tensor>>) -> Self {
        let taken = vec![false; grads.len()];
        Gradients { loss, grads, taken }
    }
}

/// Computes the loss and the gradients of `vars` for the model `head(blocks(stem))`,
/// recomputing blocks in backward as `policy` says.
///
/// * `stem`: the input of the first block, still attached to the graph that made it
///   (e.g. token plus position embeddings); gradients flow into that graph.
/// * `blocks`: applied in order; `policy` groups them into segments
///   ([`Checkpointing::segments`]).
/// * `head`: maps the last block's output to a scalar loss.
/// * `vars`: the parameters whose gradients are returned (stem, block and head
///   parameters alike; a parameter used in several places gets the sum).
/// * `loss_scale`: the backward differentiates `loss × loss_scale` (mixed-precision
///   loss scaling); `1.0` differentiates the loss itself.
///
/// Gradients are the same as the plain backward's up to floating-point summation
/// order. Before returning, every gradient store and graph built here is dropped
/// and the gradients are detached, so the caller holds no graph beyond `stem`'s.
pub fn backward<B: Block>(
    stem: &Tensor,
    blocks: &[B],
    head: impl FnOnce(&Tensor) -> candle_core::Result<Tensor>,
    vars: &[Var],
    policy: Checkpointing,
    loss_scale: f64,
) -> Result<Gradients> {
    let inputs = SegmentInputs::OnDevice;
    backward_with(
        stem.clone(),
        blocks,
        head,
        vars,
        policy,
        inputs,
        loss_scale,
        &mut NoHook,
    )
}

/// A checkpointed segment's input between the forward and its recompute.
enum Kept {
    /// On the device, as the forward left it.
    Here(Tensor),
    /// On its way to a host buffer, or there.
    Host(Rc<HostBuffer>),
}

thread_local! {
    /// The host buffers of the segments' inputs by segment, kept from one
    /// step to the next (page-locking a buffer once, not every step).
    static HOST_INPUTS: RefCell<Vec<Option<Rc<HostBuffer>>>> = const { RefCell::new(Vec::new()) };
}

/// Frees the page-locked host buffers in which this thread's offloaded
/// segment inputs ([`SegmentInputs::OnHost`]) waited, kept for its later
/// steps; the next offloaded step makes them again. oomfix's trainer calls
/// it when dropped.
pub fn release_host_buffers() {
    HOST_INPUTS.with_borrow_mut(Vec::clear);
}

impl Kept {
    /// Segment `segment`'s input `x`, offloaded where `offload` says and `x`
    /// is on a device: copied into the segment's host buffer (made, or
    /// remade where `x`'s shape changed). On the CPU nothing moves.
    fn new(x: Tensor, segment: usize, offload: bool) -> candle_core::Result<Kept> {
        if !offload || x.device().is_cpu() {
            // A fresh variable at the recompute, as a host copy would be.
            let x = if offload { x.detach() } else { x };
            return Ok(Kept::Here(x));
        }
        let x = x.detach().contiguous()?;
        let buffer = HOST_INPUTS.with_borrow_mut(|all| {
            if all.len() <= segment {
                all.resize(segment + 1, None);
            }
            match &all[segment] {
                Some(b) if b.fits(&x) => Ok(b.clone()),
                _ => {
                    let b = Rc::new(HostBuffer::new(&x)?);
                    all[segment] = Some(b.clone());
                    Ok::<_, candle_core::Error>(b)
                }
            }
        })?;
        buffer.store(&x)?;
        Ok(Kept::Host(buffer))
    }

    /// The input on its device: where `fresh` (a later segment's input), a
    /// fresh variable for a detached or host copy, so that the recompute's
    /// backward gives its gradient; else (the stem) as it was.
    fn restore(self, fresh: bool) -> candle_core::Result<Tensor> {
        match self {
            Kept::Here(x) if fresh && !x.is_variable() => Ok(Var::from_tensor(&x)?.into_inner()),
            Kept::Here(x) => Ok(x),
            Kept::Host(buffer) if fresh => Ok(buffer.load()?.into_inner()),
            Kept::Host(buffer) => Ok(buffer.load()?.as_detached_tensor()),
        }
    }
}

/// [`backward`], keeping the checkpointed segments' inputs where `inputs`
/// says and calling `hook` around each segment: before and after its
/// forward, and before and after its recomputation and backward, then with
/// its gradients. Without checkpointing the whole stack is one segment, from
/// before the forward to after the backward (one graph holds every block).
///
/// With [`SegmentInputs::OnHost`] every segment's input but the first (the
/// stem, attached to its graph; where it has none, as with frozen
/// embeddings, it goes too) is copied to host memory once its segment's
/// forward has run, and back to the device just before the segment is
/// recomputed (on the CPU nothing moves, but the recompute starts from a
/// fresh variable as on a device). The host buffers are page-locked once
/// and kept, one per segment, for the thread's later steps while the
/// inputs keep their shape ([`release_host_buffers`] frees them); the
/// copies are queued on the device's stream,
/// so the host does not wait for them. The gradients are the same bit for
/// bit.
#[allow(clippy::too_many_arguments)]
pub fn backward_with<B: Block>(
    stem: Tensor,
    blocks: &[B],
    head: impl FnOnce(&Tensor) -> candle_core::Result<Tensor>,
    vars: &[Var],
    policy: Checkpointing,
    inputs: SegmentInputs,
    loss_scale: f64,
    hook: &mut dyn SegmentHook,
) -> Result<Gradients> {
    let offload = inputs == SegmentInputs::OnHost;
    // The stem goes to the host with the other inputs where it has no graph
    // (and so no backward) to keep.
    let offload_stem = offload && !stem.track_op();
    let segments = policy.segments(blocks.len());
    if segments.is_empty() {
        hook.before(0..blocks.len())?;
        let mut out = plain(&stem, blocks, head, vars, loss_scale)?;
        hook.after(0..blocks.len())?;
        hook.gradients(0..blocks.len(), &mut out.grads, &mut out.taken)?;
        return Ok(out);
    }
    // Forward: keep only each segment's input (segment 0: the attached stem).
    let mut kept = Vec::with_capacity(segments.len());
    let mut x = stem;
    for (i, segment) in segments.iter().enumerate() {
        hook.before(segment.clone())?;
        let y = run(&blocks[segment.clone()], &x)?.detach();
        hook.after(segment.clone())?;
        kept.push(Kept::new(x, i, offload && (i > 0 || offload_stem))?);
        x = Var::from_tensor(&y)?.into_inner();
    }
    // Head: its parameter gradients and the gradient of the last hidden states.
    let (loss, mut grads, mut grad_y) = {
        let loss = head(&x)?;
        let mut store = backward_of(&scaled(&loss, loss_scale)?, vars)?;
        let mut grads = vec![None; vars.len()];
        accumulate(&mut grads, &mut store, vars)?;
        (loss.detach(), grads, input_grad(&mut store, &x)?)
    };
    let mut taken = vec![false; vars.len()];
    drop(x);
    // Segments, last to first, each recomputed from its input.
    for (i, (segment, input)) in segments.iter().zip(kept).enumerate().rev() {
        let input = input.restore(i > 0)?;
        hook.before(segment.clone())?;
        let y = run(&blocks[segment.clone()], &input)?;
        let mut store = backward_of(&seeded(&y, grad_y.clone())?, vars)?;
        drop(y);
        accumulate(&mut grads, &mut store, vars)?;
        if i > 0 {
            grad_y = input_grad(&mut store, &input)?;
        }
        drop(store);
        hook.after(segment.clone())?;
        hook.gradients(segment.clone(), &mut grads, &mut taken)?;
    }
    Ok(Gradients { loss, grads, taken })
}

/// The plain backward: one graph from the stem to the loss.
fn plain<B: Block>(
    stem: &Tensor,
    blocks: &[B],
    head: impl FnOnce(&Tensor) -> candle_core::Result<Tensor>,
    vars: &[Var],
    loss_scale: f64,
) -> Result<Gradients> {
    let loss = head(&run(blocks, stem)?)?;
    let mut store = backward_of(&scaled(&loss, loss_scale)?, vars)?;
    let mut grads = vec![None; vars.len()];
    accumulate(&mut grads, &mut store, vars)?;
    Ok(Gradients::untaken(loss.detach(), grads))
}

fn run<B: Block>(blocks: &[B], x: &Tensor) -> candle_core::Result<Tensor> {
    blocks
        .iter()
        .try_fold(x.clone(), |x, block| block.forward(&x))
}

fn scaled(loss: &Tensor, loss_scale: f64) -> candle_core::Result<Tensor> {
    if loss_scale == 1.0 {
        Ok(loss.clone())
    } else {
        loss.affine(loss_scale, 0.0)
    }
}

/// The gradients of `t`, those a tiled MLP's tiles made on the side
/// ([`crate::tiled_mlp`]) added to them.
fn backward_of(t: &Tensor, vars: &[Var]) -> candle_core::Result<Backward> {
    let (store, tiles) = crate::tiled_mlp::with_tile_gradients(vars, || t.backward())?;
    Ok(Backward { store, tiles })
}

/// A backward pass's gradients: candle's store and the tiles' gradients
/// of the variables.
struct Backward {
    store: GradStore,
    tiles: Vec<Option<Tensor>>,
}

impl Backward {
    /// The (detached) gradient of `t`, taken out of the store.
    fn remove(&mut self, t: &Tensor) -> Option<Tensor> {
        self.store.remove(t)
    }
}

/// Moves the gradients of `vars` out of `store` (detached) and adds them to `grads`.
fn accumulate(grads: &mut [Option<Tensor>], store: &mut Backward, vars: &[Var]) -> Result<()> {
    for ((acc, var), tile) in grads.iter_mut().zip(vars).zip(&mut store.tiles) {
        for g in [store.store.remove(var.as_tensor()), tile.take()]
            .into_iter()
            .flatten()
        {
            let g = g.detach();
            *acc = Some(match acc.take() {
                Some(sum) => sum.add(&g)?,
                None => g,
            });
        }
    }
    Ok(())
}

/// The detached gradient of a segment input (or of the head's input).
fn input_grad(store: &mut Backward, input: &Tensor) -> Result<Tensor> {
    match store.remove(input) {
        Some(g) => Ok(g.detach()),
        None => Err(Error::Config(
            "checkpointing: the loss does not depend on the blocks' output".into(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// An offloaded segment's input is kept out of the graph (a tracked copy
    /// would hold the device tensor, and its storage, as its backward's
    /// input, and nothing would leave the device) and comes back as a fresh
    /// variable; on the CPU nothing moves.
    #[test]
    fn an_offloaded_input_holds_no_graph_and_comes_back_a_variable() {
        let x = Var::randn(0f32, 1.0, (2, 3), &Device::Cpu).unwrap();
        assert!(x.as_tensor().track_op());
        match Kept::new(x.as_tensor().clone(), 1, true).unwrap() {
            Kept::Here(kept) => assert!(!kept.track_op()),
            Kept::Host(_) => panic!("moved on the CPU"),
        }
        let restored = Kept::new(x.as_tensor().clone(), 1, true)
            .unwrap()
            .restore(true)
            .unwrap();
        assert!(restored.is_variable());
        assert_ne!(restored.id(), x.as_tensor().id());
    }
}
