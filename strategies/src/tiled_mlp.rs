//! `tiled-mlp`: each block's MLP runs over tiles of the sequence's tokens,
//! each tile recomputed in the backward, so that one tile's intermediates
//! (`tile × intermediate size`) exist at a time instead of the whole
//! sequence's (ALST's and Unsloth's sequence-tiled MLP).
//!
//! The planner half ([`TiledMlp`]) sets [`Plan::mlp_tile`]; the mechanism is
//! [`tiled_rows`], which a model's block calls on its row-wise part (the
//! norm before the MLP and the MLP: each token's output depends on that
//! token's input only).
//!
//! [`tiled_rows`] runs the part tile by tile without a graph and joins the
//! outputs; an op on the input stands for the part in the graph. Its
//! backward recomputes each tile with a graph of its own, runs that tile's
//! backward and keeps the tile's input gradient; the parameters' gradients
//! of every tile are summed on the side and added to the step's by
//! [`crate::checkpoint`] (a backward outside it is an error, not a silent
//! loss of gradients).
//!
//! ```
//! use candle_core::{Device, Tensor, Var};
//! use oomfix_strategies::tiled_mlp::{tiled_rows, with_tile_gradients};
//!
//! let w = Var::from_tensor(&Tensor::randn(0f32, 1.0, (4, 4), &Device::Cpu)?)?;
//! let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (2, 5, 4), &Device::Cpu)?)?;
//! let part = {
//!     let w = w.as_tensor().clone();
//!     move |h: &Tensor| h.broadcast_matmul(&w)?.gelu()
//! };
//! let vars = [w.clone(), x.clone()];
//! let (tiled, grads) = with_tile_gradients(&vars, || {
//!     let y = tiled_rows(x.as_tensor(), Some(3), part.clone())?;
//!     y.sum_all()?.backward()
//! })?;
//! let whole = part(x.as_tensor())?.sum_all()?.backward()?;
//! let (a, b) = (grads[0].as_ref().unwrap(), whole.get(w.as_tensor()).unwrap());
//! assert!(a.sub(b)?.abs()?.max_all()?.to_scalar::<f32>()? < 1e-5);
//! let (a, b) = (tiled.get(x.as_tensor()).unwrap(), whole.get(x.as_tensor()).unwrap());
//! assert!(a.sub(b)?.abs()?.max_all()?.to_scalar::<f32>()? < 1e-5);
//! # Ok::<(), candle_core::Error>(())
//! ```

use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, Shape, Tensor, Var};
use std::cell::RefCell;
use std::sync::Arc;

use crate::custom_op::{CustomOp, Input, Kernel};
use crate::{Execution, PartRun, Plan, SearchContext, Strategy};

/// Tokens per tile the planner picks: a multiple of the GPU kernels' tiles,
/// long enough that each tile's products stay efficient (ALST tiles by the
/// hidden size, 4,096 for an 8B model).
pub const DEFAULT_TILE: usize = 4096;

/// The tile the planner picks for a micro-batch of `tokens`:
/// [`DEFAULT_TILE`], or half the tokens when they are fewer than two of it
/// (so that the memory a plan needs grows with the sequence: a length that
/// fits means every shorter one does, tiled or not).
pub fn tile_for(tokens: usize) -> usize {
    DEFAULT_TILE.min(tokens.div_ceil(2)).max(1)
}

/// Planner half: run each block's MLP tile by tile over the micro-batch's
/// tokens ([`Plan::mlp_tile`], of [`tile_for`] tokens).
///
/// ```
/// use oomfix_strategies::tiled_mlp::{TiledMlp, DEFAULT_TILE};
/// use oomfix_strategies::{Execution, Plan, SearchContext, Strategy};
///
/// let ctx = SearchContext::new(1, 32);
/// let long = Plan::baseline(1, 32768);
/// let tiled = TiledMlp.tighten(&long, &ctx).unwrap();
/// assert_eq!(tiled.mlp_tile, Some(DEFAULT_TILE));
/// assert!(TiledMlp.tighten(&tiled, &ctx).is_none());
/// assert_eq!(TiledMlp.relax(&tiled, &ctx).unwrap().mlp_tile, None);
/// // A shorter micro-batch runs in two tiles.
/// assert_eq!(TiledMlp.tighten(&Plan::baseline(1, 4096), &ctx).unwrap().mlp_tile, Some(2048));
/// let exec = Execution::for_plan(&tiled, &oomfix_strategies::builtins());
/// assert_eq!(exec.mlp_tile(), Some(DEFAULT_TILE));
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct TiledMlp;

impl Strategy for TiledMlp {
    fn name(&self) -> &'static str {
        "tiled-mlp"
    }
    fn tighten(&self, plan: &Plan, ctx: &SearchContext) -> Option<Plan> {
        let tokens = plan.micro_batch * plan.seq_len;
        (ctx.model.tiled_mlp && plan.mlp_tile.is_none() && tokens >= 2).then_some(Plan {
            mlp_tile: Some(tile_for(tokens)),
            ..*plan
        })
    }
    fn relax(&self, plan: &Plan, _ctx: &SearchContext) -> Option<Plan> {
        plan.mlp_tile.is_some().then_some(Plan {
            mlp_tile: None,
            ..*plan
        })
    }
    /// The MLP in tiles of the plan's tokens. Its memory and time terms
    /// (one tile's intermediates; the MLP's forward once more) are the
    /// block's, which the memory and step-time models derive from the
    /// execution.
    fn execution(&self, plan: &Plan, exec: &mut Execution) {
        if let Some(tile) = plan.mlp_tile {
            exec.parts.mlp = PartRun::Tiled(tile);
        }
    }
    /// Needs a model whose blocks run their MLP as the execution says.
    fn unusable(&self, ctx: &SearchContext) -> Option<String> {
        (!ctx.model.tiled_mlp)
            .then(|| "cannot be used for this model: it does not run its MLP in tiles".into())
    }
}

/// A block's row-wise part on one tile: `[t, h]` in, `[t, h]` out, each
/// row's output from that row's input only.
pub type RowWise = Arc<dyn Fn(&Tensor) -> candle_core::Result<Tensor> + Send + Sync>;

/// The parameter gradients tiles' backwards make, by variable, while
/// [`with_tile_gradients`] collects them.
struct TileGradients {
    vars: Vec<Tensor>,
    grads: Vec<Option<Tensor>>,
}

thread_local! {
    static COLLECTING: RefCell<Option<TileGradients>> = const { RefCell::new(None) };
}

/// Runs `f` (which runs backward passes through [`tiled_rows`]) while the
/// tiles' gradients of `vars` are collected: returns `f`'s result and those
/// gradients, one per variable (`None` where no tile made one).
pub fn with_tile_gradients<T>(
    vars: &[Var],
    f: impl FnOnce() -> candle_core::Result<T>,
) -> candle_core::Result<(T, Vec<Option<Tensor>>)> {
    let collector = TileGradients {
        vars: vars.iter().map(|v| v.as_tensor().clone()).collect(),
        grads: vec![None; vars.len()],
    };
    let outer = COLLECTING.with(|c| c.borrow_mut().replace(collector));
    let out = f();
    let collected = COLLECTING.with(|c| std::mem::replace(&mut *c.borrow_mut(), outer));
    Ok((out?, collected.map(|c| c.grads).unwrap_or_default()))
}

/// `part(x)` for `x` `[b, s, h]`, computed in tiles of `tile` of its `b·s`
/// tokens (each given to `part` as `[1, tile, h]`, the last one shorter),
/// keeping no tile's intermediates: see the module's documentation. With
/// no tile ([`Execution::mlp_tile`] `None`), a tile of 0 or one of at least
/// the tokens, `part(x)` as it is.
pub fn tiled_rows(
    x: &Tensor,
    tile: Option<usize>,
    part: impl Fn(&Tensor) -> candle_core::Result<Tensor> + Send + Sync + 'static,
) -> candle_core::Result<Tensor> {
    let (b, s, h) = x.dims3()?;
    let rows = b * s;
    let tile = match tile {
        Some(t) if t > 0 && t < rows => t,
        _ => return part(x),
    };
    let part: RowWise = Arc::new(move |t: &Tensor| {
        let len = t.dim(0)?;
        part(&t.reshape((1, len, t.dim(1)?))?)?.reshape((len, ()))
    });
    let flat = x.reshape((rows, h))?;
    let mut outs = Vec::with_capacity(rows.div_ceil(tile));
    for start in (0..rows).step_by(tile) {
        let len = tile.min(rows - start);
        outs.push(part(&flat.narrow(0, start, len)?.detach())?.detach());
    }
    let out = Tensor::cat(&outs, 0)?;
    drop(outs);
    let op = Tiled { part, tile };
    flat.apply_op2_arc(&out, Arc::new(Box::new(CustomOp(op))))?
        .reshape(x.shape())
}

/// The op standing for the tiled part in the graph: its forward is the
/// output computed already (its second input), its backward recomputes.
struct Tiled {
    part: RowWise,
    tile: usize,
}

impl Kernel<2> for Tiled {
    fn name(&self) -> &'static str {
        "oomfix-tiled-rows"
    }

    fn cpu_fwd(
        &self,
        [_, (out, l)]: [Input<'_, CpuStorage>; 2],
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (a, b) = l.contiguous_offsets().ok_or_else(|| {
            candle_core::Error::Msg("tiled rows: the output is not contiguous".into())
        })?;
        let copy = match out {
            CpuStorage::F32(v) => CpuStorage::F32(v[a..b].to_vec()),
            CpuStorage::BF16(v) => CpuStorage::BF16(v[a..b].to_vec()),
            CpuStorage::F16(v) => CpuStorage::F16(v[a..b].to_vec()),
            CpuStorage::F64(v) => CpuStorage::F64(v[a..b].to_vec()),
            _ => candle_core::bail!("tiled rows: unsupported dtype"),
        };
        Ok((copy, l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        [_, (out, l)]: [Input<'_, candle_core::CudaStorage>; 2],
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::{BackendDevice, BackendStorage};
        let mut copy = out.device().zeros_impl(l.shape(), out.dtype())?;
        out.copy_strided_src(&mut copy, 0, l)?;
        Ok((copy, l.shape().clone()))
    }

    fn bwd(
        &self,
        [x, _]: [&Tensor; 2],
        _: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<[Option<Tensor>; 2]> {
        let rows = x.dim(0)?;
        let mut grads_x = Vec::with_capacity(rows.div_ceil(self.tile));
        for start in (0..rows).step_by(self.tile) {
            let len = self.tile.min(rows - start);
            let input = Var::from_tensor(&x.narrow(0, start, len)?.detach())?;
            let y = (self.part)(input.as_tensor())?;
            let g = grad.narrow(0, start, len)?;
            let mut store = crate::seed::seeded(&y, g)?.backward()?;
            drop(y);
            keep_tile_gradients(&mut store)?;
            let gx = store
                .remove(input.as_tensor())
                .map(|g| g.detach())
                .ok_or_else(|| {
                    candle_core::Error::Msg("tiled rows: the part does not use its input".into())
                })?;
            grads_x.push(gx);
        }
        Ok([Some(Tensor::cat(&grads_x, 0)?), None])
    }
}

/// Adds a tile's parameter gradients in `store` to those being collected.
fn keep_tile_gradients(store: &mut GradStore) -> candle_core::Result<()> {
    COLLECTING.with(|c| {
        let mut c = c.borrow_mut();
        let Some(collector) = c.as_mut() else {
            candle_core::bail!(
                "a tiled MLP's backward ran outside oomfix_strategies::tiled_mlp::with_tile_gradients: \
                 its parameters' gradients would be lost"
            );
        };
        for (var, slot) in collector.vars.iter().zip(&mut collector.grads) {
            let Some(g) = store.remove(var) else {
                continue;
            };
            let g = g.detach();
            *slot = Some(match slot.take() {
                Some(sum) => sum.add(&g)?,
                None => g,
            });
        }
        Ok(())
    })
}
