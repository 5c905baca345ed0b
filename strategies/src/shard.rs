//! ZeRO-style sharding of optimizer state, gradients and parameters.
//!
//! The planner half is [`Shard`]. The mechanism: a [`Comm`] trait for the
//! collectives, with backends on existing engines — [`ThreadComm`] (in one
//! process, for tests), `MpiComm` (processes on the CPU through MPI, feature
//! `mpi`) and `NcclComm` (one process per GPU through NCCL, feature `nccl`) —,
//! [`partition`] to assign whole parameters to ranks, and
//! [`ShardedOptimizer`], which runs [`FusedAdamW`] on each rank's share and
//! moves gradients and parameters in flat buckets.

use std::sync::{Arc, Barrier, Mutex};

use candle_core::backend::BackendDevice;
use candle_core::cpu_backend::CpuDevice;
use candle_core::{CpuStorage, DType, Device, InplaceOp1, Layout, Tensor, Var};

use crate::accumulate::{divisors, GradAccumulator};
use crate::adamw::{FusedAdamW, ParamsAdamW};
use crate::float::one_gradient_each;
use crate::offload::OffloadedAdamW;
use crate::{
    Error, ModelFacts, Plan, Result, SearchContext, Sharding, StateBytes, StepCost, Strategy,
};

#[cfg(feature = "mpi")]
mod mpi_comm;
#[cfg(feature = "mpi")]
pub use mpi_comm::MpiComm;
#[cfg(feature = "nccl")]
mod nccl_comm;
#[cfg(feature = "nccl")]
pub use nccl_comm::NcclComm;

/// Planner half: spread training over `gpus` ranks, sharding optimizer state
/// (stage 1), then gradients (stage 2), then parameters (stage 3).
#[derive(Debug, Clone, Copy, Default)]
pub struct Shard;

fn with_stage(plan: &Plan, world_size: usize, stage: u8) -> Option<Plan> {
    let global = plan.global_batch();
    if !global.is_multiple_of(world_size) {
        return None;
    }
    let per_rank = global / world_size;
    // keep the micro-batch if it still divides the per-rank batch, else the largest that does
    let micro = divisors(per_rank)
        .into_iter()
        .rev()
        .find(|&d| d <= plan.micro_batch)?;
    Some(Plan {
        micro_batch: micro,
        grad_accum: per_rank / micro,
        shard: Sharding {
            world_size,
            stage,
            ..plan.shard
        },
        ..*plan
    })
}

impl Strategy for Shard {
    fn name(&self) -> &'static str {
        "shard"
    }
    fn tighten(&self, plan: &Plan, ctx: &SearchContext) -> Option<Plan> {
        if ctx.gpus < 2 || plan.shard.stage >= 3 {
            return None;
        }
        with_stage(plan, ctx.gpus, plan.shard.stage + 1)
    }
    fn relax(&self, plan: &Plan, _ctx: &SearchContext) -> Option<Plan> {
        if plan.shard.stage <= 1 {
            return None;
        }
        with_stage(plan, plan.shard.world_size, plan.shard.stage - 1)
    }
    /// Stage 1 divides master weights and optimizer state over the ranks,
    /// stage 2 also the accumulated gradients and those the step holds,
    /// stage 3 also the weights between passes. For forward and backward a
    /// stage-3 rank gathers all weights, or with checkpointed segments the
    /// weights outside the blocks and one segment's blocks at a time (FSDP's
    /// unit). Ranks own whole tensors, so the rank that owns none of the
    /// weights outside the blocks holds the most: its share, those weights
    /// whole, and the others' shares of one segment. With checkpointed
    /// segments, stages 2 and 3 reduce each segment's gradients once its
    /// backward made them, so the backward's gradients are at most those
    /// outside the blocks, one segment's and the rank's reduced share.
    ///
    /// At stage 1 the step holds the owned share of the reduced gradients
    /// beside the local sums, which the accumulator keeps allocated between
    /// steps when there are several micro-batches. Collectives move buckets
    /// of at most the plan's `bucket_bytes` of one owner's parameters (a
    /// larger parameter is a bucket of its own): `collective_bucket`; a
    /// segment's reduction moves only its own gradients, or those outside
    /// the blocks: `reduction_bucket`.
    /// From ZeRO stage 1 on, each rank steps the share of the parameters it owns.
    fn time(&self, plan: &Plan, _model: &ModelFacts, cost: &mut StepCost) {
        if plan.shard.world_size > 1 && plan.shard.stage >= 1 {
            cost.stepped_parameters /= plan.shard.world_size as f64;
        }
    }
    fn memory(&self, plan: &Plan, model: &ModelFacts, state: &mut StateBytes) {
        let sharded = plan.shard.world_size > 1 && plan.shard.stage >= 1;
        if sharded && plan.shard.stage == 1 {
            let owned = plan.per_rank(state.step_gradients, 1);
            let kept = if plan.grad_accum > 1 {
                state.step_gradients
            } else {
                0
            };
            state.step_gradients = kept + owned;
        }
        let share = |bytes: &mut u64, from_stage: u8| *bytes = plan.per_rank(*bytes, from_stage);
        share(&mut state.master_weights, 1);
        share(&mut state.optimizer_state, 1);
        share(&mut state.accumulated_gradients, 2);
        share(&mut state.step_gradients, 2);
        share(&mut state.step_weights, 3);
        let bucket_of = |params: u64| {
            let bucket = plan.shard.bucket_bytes as u64 / plan.precision.compute_bytes().max(1);
            let owners_share = model.parameters.div_ceil(plan.shard.world_size as u64);
            bucket
                .min(owners_share)
                .min(params)
                .max(model.largest_tensor)
        };
        if sharded {
            state.collective_bucket = bucket_of(model.parameters);
            state.reduction_bucket = state.collective_bucket;
        }
        let segment = plan
            .checkpoint
            .segments(model.layers)
            .into_iter()
            .map(|s| s.len())
            .max();
        let sharded_from = |stage: u8| sharded && plan.shard.stage >= stage;
        if let Some(blocks) = segment.filter(|_| sharded_from(2) && model.block_parameters > 0) {
            let n = plan.shard.world_size as u64;
            let in_blocks = (model.layers as u64 * model.block_parameters).min(model.parameters);
            // `params` parameters' part of the state term `total`.
            let part = |total: u64, params: u64| {
                (u128::from(params) * u128::from(total) / u128::from(model.parameters.max(1)))
                    as u64
            };
            let segment = (blocks as u64 * model.block_parameters).min(in_blocks);
            let outside = model.parameters - in_blocks;
            // Each segment's gradients are reduced once its backward made
            // them: the most a rank holds is the gradients outside the blocks
            // (the last made), one segment's, and its reduced share of the
            // blocks' (with several micro-batches, in the accumulated sums).
            let share = if plan.grad_accum > 1 {
                0
            } else {
                part(state.gradients, in_blocks).div_ceil(n)
            };
            let g = state.gradients;
            state.gradients = g.min(part(g, outside) + part(g, segment) + share);
            state.reduction_bucket = bucket_of(segment.max(outside));
            if sharded_from(3) {
                let w = state.weights;
                let most =
                    w.div_ceil(n) + part(w, outside) + part(w, segment) - part(w, segment) / n;
                state.weights = w.min(most);
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Mechanism: collectives and the sharded optimizer.

/// Collective operations between the ranks of a data-parallel group.
///
/// Every rank calls the same operations in the same order (they block until all
/// ranks arrive). Results are new tensors: no rank's result shares storage with
/// another rank's tensors, and inputs are not modified.
pub trait Comm: Send + Sync {
    /// This rank, in `0..world_size()`.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn world_size(&self) -> usize;
    /// The element-wise sum of `t` over all ranks, on every rank.
    fn all_reduce_sum(&self, t: &Tensor) -> Result<Tensor>;
    /// The element-wise sum of `t` over all ranks, on `root` (`None` elsewhere).
    fn reduce_sum(&self, t: &Tensor, root: usize) -> Result<Option<Tensor>>;
    /// `root`'s `t` on every rank. On other ranks `t` only gives the expected
    /// shape and dtype (its elements are not read).
    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor>;
    /// Every rank's `t`, in rank order, on every rank. The process backends
    /// (MPI, NCCL) need `t` of the same shape and dtype on every rank.
    fn all_gather(&self, t: &Tensor) -> Result<Vec<Tensor>>;
    /// Gives up on the collectives in flight because a peer failed (NCCL
    /// aborts its communicator); the communicator is unusable afterwards. The
    /// default does nothing.
    fn abort(&self) {}
}

/// A communicator behind a `Box` or an `Arc` is one (so a trainer can hold
/// any backend, shared or not).
macro_rules! forward_comm {
    ($($pointer:ident),*) => {$(
        impl<C: Comm + ?Sized> Comm for $pointer<C> {
            fn rank(&self) -> usize {
                (**self).rank()
            }
            fn world_size(&self) -> usize {
                (**self).world_size()
            }
            fn all_reduce_sum(&self, t: &Tensor) -> Result<Tensor> {
                (**self).all_reduce_sum(t)
            }
            fn reduce_sum(&self, t: &Tensor, root: usize) -> Result<Option<Tensor>> {
                (**self).reduce_sum(t, root)
            }
            fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
                (**self).broadcast(t, root)
            }
            fn all_gather(&self, t: &Tensor) -> Result<Vec<Tensor>> {
                (**self).all_gather(t)
            }
            fn abort(&self) {
                (**self).abort()
            }
        }
    )*};
}

forward_comm!(Box, Arc);

pub use crate::plan::DEFAULT_BUCKET_BYTES;

/// An in-process [`Comm`]: one value per thread, meeting at barriers and
/// exchanging tensors through shared slots. For tests and CPU runs of the
/// sharding logic.
///
/// A rank that stops calling collectives (an error or panic on one thread)
/// leaves the others waiting at the next barrier.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use oomfix_strategies::shard::{Comm, ThreadComm};
///
/// let sums = std::thread::scope(|s| {
///     let handles: Vec<_> = ThreadComm::group(3)
///         .into_iter()
///         .map(|c| s.spawn(move || {
///             let t = Tensor::new(&[c.rank() as f32], &Device::Cpu)?;
///             c.all_reduce_sum(&t)?.to_vec1::<f32>().map_err(oomfix_strategies::Error::from)
///         }))
///         .collect();
///     handles.into_iter().map(|h| h.join().unwrap()).collect::<Result<Vec<_>, _>>()
/// })?;
/// assert_eq!(sums, [[3.0], [3.0], [3.0]]);
/// # Ok::<(), oomfix_strategies::Error>(())
/// ```
#[derive(Debug)]
pub struct ThreadComm {
    rank: usize,
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    world: usize,
    barrier: Barrier,
    slots: Mutex<Vec<Option<Tensor>>>,
}

impl ThreadComm {
    /// A group of `n` ranks: move element `r` to the thread that plays rank `r`.
    pub fn group(n: usize) -> Vec<ThreadComm> {
        let shared = Arc::new(Shared {
            world: n,
            barrier: Barrier::new(n),
            slots: Mutex::new(vec![None; n]),
        });
        (0..n)
            .map(|rank| ThreadComm {
                rank,
                shared: shared.clone(),
            })
            .collect()
    }

    /// Publishes `t` (detached), waits for every rank, runs `f` on all ranks'
    /// tensors in rank order, and waits again: every rank has finished reading
    /// the others' tensors before any rank goes on.
    fn exchange<R>(&self, t: &Tensor, f: impl FnOnce(Vec<Tensor>) -> Result<R>) -> Result<R> {
        let lock = || {
            self.shared
                .slots
                .lock()
                .map_err(|_| Error::Comm("a rank panicked".into()))
        };
        lock()?[self.rank] = Some(t.detach());
        self.shared.barrier.wait();
        let all = lock().and_then(|slots| {
            slots
                .iter()
                .cloned()
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| Error::Comm("a slot is empty".into()))
        });
        let result = all.and_then(f);
        self.shared.barrier.wait();
        lock()?[self.rank] = None;
        result
    }

    fn check_root(&self, root: usize) -> Result<()> {
        if root < self.world_size() {
            Ok(())
        } else {
            Err(Error::Comm(format!(
                "root {root} is not a rank of a group of {}",
                self.world_size()
            )))
        }
    }
}

/// The sum of `ts` in order, as a new tensor.
fn sum(ts: &[Tensor]) -> Result<Tensor> {
    let mut acc = ts[0].zeros_like()?;
    for t in ts {
        acc = (acc + t)?;
    }
    Ok(acc)
}

impl Comm for ThreadComm {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.shared.world
    }
    fn all_reduce_sum(&self, t: &Tensor) -> Result<Tensor> {
        self.exchange(t, |all| sum(&all))
    }
    fn reduce_sum(&self, t: &Tensor, root: usize) -> Result<Option<Tensor>> {
        self.check_root(root)?;
        self.exchange(t, |all| (self.rank == root).then(|| sum(&all)).transpose())
    }
    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        self.check_root(root)?;
        self.exchange(t, |mut all| {
            let src = all.swap_remove(root);
            if self.rank == root {
                return Ok(src);
            }
            if src.shape() != t.shape() || src.dtype() != t.dtype() {
                return Err(Error::Comm(format!(
                    "broadcast of {:?} {:?} into {:?} {:?}",
                    src.dtype(),
                    src.shape(),
                    t.dtype(),
                    t.shape()
                )));
            }
            Ok(src.force_contiguous()?)
        })
    }
    fn all_gather(&self, t: &Tensor) -> Result<Vec<Tensor>> {
        self.exchange(t, |all| {
            all.into_iter()
                .enumerate()
                .map(|(r, x)| {
                    if r == self.rank {
                        Ok(x)
                    } else {
                        Ok(x.force_contiguous()?)
                    }
                })
                .collect()
        })
    }
}

/// Owner rank of each parameter, given the parameters' element counts: largest
/// first, each to the rank with the fewest elements so far (ties: lowest rank,
/// then earlier parameter), as PyTorch's `ZeroRedundancyOptimizer` assigns them.
pub fn partition(sizes: &[usize], world_size: usize) -> Result<Vec<usize>> {
    if world_size == 0 {
        return Err(Error::Config("world size must be at least 1".into()));
    }
    let mut order: Vec<usize> = (0..sizes.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(sizes[i]));
    let mut load = vec![0usize; world_size];
    let mut owners = vec![0; sizes.len()];
    for i in order {
        let rank = (0..world_size).min_by_key(|&r| load[r]).unwrap_or(0);
        owners[i] = rank;
        load[rank] += sizes[i];
    }
    Ok(owners)
}

/// What a ZeRO stage shards across ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ZeroStage {
    /// Stage 1: optimizer state. Gradients are all-reduced to every rank.
    OptimizerState,
    /// Stage 2: optimizer state and gradients. Each gradient is reduced to its
    /// owner only.
    Gradients,
    /// Stage 3: optimizer state, gradients and parameters. Non-owned parameters
    /// are freed between steps and gathered before the forward.
    Parameters,
}

impl TryFrom<u8> for ZeroStage {
    type Error = Error;
    fn try_from(stage: u8) -> Result<Self> {
        match stage {
            1 => Ok(ZeroStage::OptimizerState),
            2 => Ok(ZeroStage::Gradients),
            3 => Ok(ZeroStage::Parameters),
            _ => Err(Error::Config(format!(
                "ZeRO stage must be 1, 2 or 3, not {stage}"
            ))),
        }
    }
}

/// ZeRO-style sharded AdamW over whole parameters.
///
/// Each parameter is owned by one rank ([`partition`]); each rank keeps
/// [`FusedAdamW`] state for the parameters it owns only. Under mixed
/// precision (bf16 or f16 vars) it also keeps the fp32 master weights of
/// those parameters only: the owner steps its masters, casts them into its
/// vars, and the vars travel in their 16-bit dtype. Built with
/// [`offloaded`](Self::offloaded), a rank keeps its share's masters and
/// moments in host memory instead and steps them there ([`OffloadedAdamW`]
/// over the owned vars: ZeRO-Offload's partitioned optimizer). Gradients and
/// parameters travel in buckets: flat buffers of the parameters one rank owns,
/// consecutive in var order, of one dtype, up to `bucket_bytes` each (a
/// parameter larger than that is a bucket of its own); one collective per
/// bucket, in the gradients' dtype. A step, given this rank's gradients of its
/// slice of the global batch (mean-reduced loss, equal slices):
///
/// * stage 1: every bucket of gradients is all-reduced (every rank receives
///   all reduced gradients); the owner keeps its own, averages them and steps
///   its parameters, then each owner broadcasts its updated parameters,
///   bucket by bucket;
/// * stage 2: each bucket is reduced to its owner only (ranks never hold
///   reduced gradients they do not own), and each rank drops its local
///   gradients of a bucket as soon as the bucket is sent; with several
///   micro-batches a step, each micro-batch's gradients are reduced at once
///   ([`reduce`](Self::reduce)), so between micro-batches a rank holds the
///   sums of its own share only; then as stage 1;
/// * stage 3: as stage 2, but parameters are not broadcast after the step:
///   non-owned parameters are freed ([`release_params`](Self::release_params))
///   and must be gathered ([`gather_params`](Self::gather_params)) before the
///   next forward.
///
/// What it does not do:
/// * whole parameters are the unit of ownership: the balance is as good as
///   the greedy partition of parameter sizes;
/// * [`reduce`](Self::reduce) takes a whole backward's gradients, so the
///   full local gradient set exists once per rank at the end of backward; a
///   caller that runs the backward in segments reduces each segment's
///   gradients once they are made with [`reduce_some`](Self::reduce_some)
///   (the trainer does, with checkpointing). Communication does not overlap
///   computation: candle runs all work on one stream;
/// * [`gather_params`](Self::gather_params) gathers every parameter at once;
///   a caller that runs the model in segments gathers and frees each
///   segment's parameters with [`gather`](Self::gather) and
///   [`release`](Self::release) (the trainer does, with checkpointing). A
///   freed parameter's storage (on the CPU or a GPU)
///   is swapped for an empty one while the var (and every model tensor
///   sharing it) stays in place; reading a freed parameter is a bug (most ops
///   report a dtype mismatch, some may panic on an out-of-range index).
///
/// Every rank must construct it with the same vars (same order and shapes).
/// Construction is collective: each owner broadcasts its initial parameters so
/// all ranks start equal.
///
/// A training step on each rank:
///
/// ```text
/// opt.gather_params()?;                  // stage 3: materialise all parameters
/// for micro_batch in my_slice {
///     let store = loss(&model, micro_batch)?.backward()?;
///     opt.reduce(collect_grads(&store, &vars)?)?;   // stage 1: sum locally, reduce once
/// }
/// opt.release_params()?;                 // stage 3, optional: free early
/// let grads = opt.take_reduced(1.0 / micro_batches as f64)?;  // this rank's share, averaged
/// opt.step_owned(&grads)?;               // (`step(grads)` does all three for one micro-batch)
/// ```
#[derive(Debug)]
pub struct ShardedOptimizer<C: Comm> {
    comm: C,
    stage: ZeroStage,
    vars: Vec<Var>,
    owners: Vec<usize>,
    /// The fp32 masters of the owned 16-bit vars, by var index (none when
    /// the optimizer is offloaded: it keeps its masters on the host).
    masters: Vec<Option<Var>>,
    opt: OwnedAdamW,
    /// Whether each var is whole on every rank (always outside stage 3;
    /// at stage 3 between [`gather`](Self::gather) and [`release`](Self::release)).
    whole: Vec<bool>,
    /// The most bytes of one bucket.
    bucket_bytes: usize,
    /// The running sums of the reduced gradients, by var index (`None` for
    /// the vars another rank owns).
    reduced: Vec<Option<GradAccumulator>>,
    /// What the collectives moved and took.
    traffic: std::cell::Cell<Traffic>,
}

/// The AdamW over a rank's share of the parameters.
#[derive(Debug)]
enum OwnedAdamW {
    /// On the vars' device, over the vars or their fp32 masters.
    Device(FusedAdamW),
    /// Masters and moments on the host; it writes the vars itself.
    Host(Box<OffloadedAdamW>),
}

impl OwnedAdamW {
    fn fused(&self) -> &FusedAdamW {
        match self {
            OwnedAdamW::Device(opt) => opt,
            OwnedAdamW::Host(opt) => opt.optimizer(),
        }
    }
    fn fused_mut(&mut self) -> &mut FusedAdamW {
        match self {
            OwnedAdamW::Device(opt) => opt,
            OwnedAdamW::Host(opt) => opt.optimizer_mut(),
        }
    }
}

/// What a rank's collectives of gradients and parameters moved and took
/// ([`ShardedOptimizer::traffic`]).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Traffic {
    /// Collective calls (one per bucket).
    pub calls: u64,
    /// Bytes this rank handed to them: each call's input (a bucket of
    /// gradients or parameters, in their dtype), whatever the algorithm
    /// puts on the wire.
    pub bytes: u64,
    /// Wall time inside them, in seconds.
    pub seconds: f64,
}

impl std::ops::Sub for Traffic {
    type Output = Traffic;
    fn sub(self, earlier: Traffic) -> Traffic {
        Traffic {
            calls: self.calls - earlier.calls,
            bytes: self.bytes - earlier.bytes,
            seconds: self.seconds - earlier.seconds,
        }
    }
}

impl<C: Comm> ShardedOptimizer<C> {
    /// Partitions `vars` over the ranks of `comm`, creates AdamW state (and
    /// fp32 masters of 16-bit vars) for this rank's share (named by global
    /// index, as [`FusedAdamW::new`] would), and synchronises the parameters
    /// from their owners. Stage 3 then frees the non-owned parameters.
    pub fn new(comm: C, vars: Vec<Var>, params: ParamsAdamW, stage: ZeroStage) -> Result<Self> {
        Self::with_buckets(comm, vars, params, stage, DEFAULT_BUCKET_BYTES)
    }

    /// As [`new`](Self::new), with buckets of at most `bucket_bytes` (at
    /// least 1; every rank must give the same).
    pub fn with_buckets(
        comm: C,
        vars: Vec<Var>,
        params: ParamsAdamW,
        stage: ZeroStage,
        bucket_bytes: usize,
    ) -> Result<Self> {
        Self::build(comm, vars, params, stage, bucket_bytes, false)
    }

    /// As [`with_buckets`](Self::with_buckets), with this rank's fp32
    /// masters and moments in host memory, stepped there by
    /// [`OffloadedAdamW`] (its share only: the host holds 12 bytes per owned
    /// parameter element, plus staging in the vars' dtype). Gradients and
    /// parameters travel as with [`new`](Self::new); the owner's reduced
    /// gradients go to the host for its step and its updated vars come back
    /// before they are sent.
    pub fn offloaded(
        comm: C,
        vars: Vec<Var>,
        params: ParamsAdamW,
        stage: ZeroStage,
        bucket_bytes: usize,
    ) -> Result<Self> {
        Self::build(comm, vars, params, stage, bucket_bytes, true)
    }

    fn build(
        comm: C,
        vars: Vec<Var>,
        params: ParamsAdamW,
        stage: ZeroStage,
        bucket_bytes: usize,
        offload: bool,
    ) -> Result<Self> {
        if bucket_bytes == 0 {
            return Err(Error::Config("a bucket must hold at least 1 byte".into()));
        }
        let (rank, world) = (comm.rank(), comm.world_size());
        if rank >= world {
            return Err(Error::Comm(format!("rank {rank} in a group of {world}")));
        }
        check_same_vars(&comm, &vars)?;
        let owners = partition(
            &vars.iter().map(|v| v.elem_count()).collect::<Vec<_>>(),
            world,
        )?;
        let n_vars = vars.len();
        let masters = vars
            .iter()
            .enumerate()
            .map(|(i, v)| {
                let narrow = matches!(v.dtype(), DType::BF16 | DType::F16);
                (narrow && owners[i] == rank && !offload)
                    .then(|| Var::from_tensor(&v.to_dtype(DType::F32)?))
                    .transpose()
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        let owned = vars
            .iter()
            .zip(&masters)
            .enumerate()
            .filter(|&(i, _)| owners[i] == rank)
            .map(|(i, (v, m))| (i.to_string(), m.as_ref().unwrap_or(v).clone()))
            .collect();
        let opt = if offload {
            OwnedAdamW::Host(Box::new(OffloadedAdamW::new(owned, params)?))
        } else {
            OwnedAdamW::Device(FusedAdamW::new_named(owned, params)?)
        };
        let mut s = ShardedOptimizer {
            comm,
            stage,
            vars,
            owners,
            masters,
            opt,
            whole: vec![true; n_vars],
            bucket_bytes,
            reduced: Vec::new(),
            traffic: Default::default(),
        };
        s.reduced = s.fresh_sums();
        s.broadcast_params()?;
        s.release_params()?;
        Ok(s)
    }

    /// One optimizer step from this rank's gradients (one per var, in order;
    /// collective): [`reduce`](Self::reduce), then
    /// [`step_owned`](Self::step_owned) with the mean over the ranks. Stage 3
    /// leaves non-owned parameters freed.
    pub fn step(&mut self, grads: Vec<Tensor>) -> Result<()> {
        self.reduce(grads)?;
        let mine = self.take_reduced(1.0)?;
        self.step_owned(&mine, 1.0)
    }

    /// Sends this rank's gradients (one per var, in order; collective) bucket
    /// by bucket and adds what comes back for the parameters this rank owns
    /// to its running sums: stage 1 all-reduces each bucket (non-owners drop
    /// the result at once), stages 2 and 3 reduce it to its owner only. Each
    /// local gradient is dropped as soon as its bucket is sent.
    ///
    /// Called once per micro-batch (stages 2 and 3: a rank then never holds
    /// more than the sums of its own share between micro-batches), or once per
    /// step with locally accumulated gradients (stage 1: one collective per
    /// step instead of one per micro-batch).
    pub fn reduce(&mut self, grads: Vec<Tensor>) -> Result<()> {
        self.reduce_some(&self.every_var(), grads)
    }

    /// [`reduce`](Self::reduce) for the vars `which` only (var indices, every
    /// rank the same, each var once per micro-batch), `grads` one per entry of
    /// `which`: e.g. a segment's parameters as soon as its backward made their
    /// gradients, so that a rank never holds the whole local gradient set
    /// (FSDP's reduce-scatter per unit). Each var's gradient must be reduced
    /// once per micro-batch, in one call or another, before
    /// [`take_reduced`](Self::take_reduced).
    pub fn reduce_some(&mut self, which: &[usize], grads: Vec<Tensor>) -> Result<()> {
        one_gradient_each(grads.len(), which.len())?;
        let n = self.vars.len();
        if let Some(&i) = which.iter().find(|&&i| i >= n) {
            return Err(Error::Config(format!("var {i} of {n} reduced")));
        }
        let rank = self.comm.rank();
        let mut dtypes: Vec<DType> = self.vars.iter().map(|v| v.dtype()).collect();
        let mut slots: Vec<Option<Tensor>> = vec![None; n];
        for (&i, g) in which.iter().zip(grads) {
            dtypes[i] = g.dtype();
            slots[i] = Some(g);
        }
        for (owner, bucket) in self.buckets(&dtypes, which) {
            let flat = flatten(
                bucket
                    .iter()
                    .map(|&i| slots[i].take().expect("each gradient is in one bucket")),
            )?;
            let reduced = match self.stage {
                ZeroStage::OptimizerState => {
                    Some(self.timed(&flat, || self.comm.all_reduce_sum(&flat))?)
                        .filter(|_| owner == rank)
                }
                ZeroStage::Gradients | ZeroStage::Parameters => {
                    self.timed(&flat, || self.comm.reduce_sum(&flat, owner))?
                }
            };
            drop(flat);
            if let Some(sum) = reduced {
                let mut offset = 0;
                for &i in &bucket {
                    let var = &self.vars[i];
                    let n = var.elem_count();
                    let g = sum.narrow(0, offset, n)?.reshape(var.shape())?;
                    self.reduced[i]
                        .as_mut()
                        .expect("the owner keeps a sum")
                        .add(vec![g])?;
                    offset += n;
                }
            }
        }
        Ok(())
    }

    /// The sums of this rank's owned gradients since the last call, times
    /// `scale` / world size (`scale` = 1 / micro-batches gives the mean of the
    /// global batch when each rank's loss is its own mean), in the order of the
    /// owned vars; starts a new round. Local: no collective. An error if
    /// nothing was [`reduce`](Self::reduce)d.
    ///
    /// The sums leave with the returned tensors: nothing stays allocated
    /// for the next step (whose first [`reduce`](Self::reduce) keeps what
    /// the collective returns, without a copy), so the next forward and
    /// backward do not carry this step's share.
    pub fn take_reduced(&mut self, scale: f64) -> Result<Vec<Tensor>> {
        let inv_world = 1.0 / self.comm.world_size() as f64;
        let fresh = self.fresh_sums();
        let sums = std::mem::replace(&mut self.reduced, fresh);
        let counts: Vec<(usize, usize)> = sums
            .iter()
            .enumerate()
            .filter_map(|(i, s)| Some((i, s.as_ref()?.micro_batches())))
            .collect();
        if let Some(&(i, c)) = counts.iter().find(|&&(_, c)| c != counts[0].1) {
            return Err(Error::Config(format!(
                "var {i}'s gradient was reduced {c} times, var {}'s {} times",
                counts[0].0, counts[0].1
            )));
        }
        let mut out = Vec::with_capacity(counts.len());
        for mut sum in sums.into_iter().flatten() {
            out.extend(sum.finish(scale * inv_world)?);
        }
        Ok(out)
    }

    /// Empty running sums for the owned vars.
    fn fresh_sums(&self) -> Vec<Option<GradAccumulator>> {
        let rank = self.comm.rank();
        self.owners
            .iter()
            .map(|&o| (o == rank).then(GradAccumulator::new))
            .collect()
    }

    /// The global L2 norm of the step's gradients, from this rank's owned
    /// share of them (as [`take_reduced`](Self::take_reduced) gives it;
    /// collective): each rank's sum of squares, all-reduced. Every parameter
    /// has one owner, so none is counted twice.
    pub fn global_norm(&self, owned: &[Tensor]) -> Result<f64> {
        let local = crate::clip::squared_norm(owned)?;
        let total = self
            .comm
            .all_reduce_sum(&Tensor::new(&[local], &Device::Cpu)?)?
            .to_vec1::<f64>()?[0];
        Ok(total.sqrt())
    }

    /// AdamW on the owned parameters with their reduced gradients (as
    /// [`take_reduced`](Self::take_reduced) gives them) times `factor` (a
    /// clip coefficient, [`crate::clip::clip_coefficient`]; 1: none), then
    /// the parameters' synchronisation (collective): stages 1 and 2
    /// broadcast each owner's updated parameters, stage 3 frees the
    /// non-owned ones.
    pub fn step_owned(&mut self, grads: &[Tensor], factor: f64) -> Result<()> {
        match &mut self.opt {
            OwnedAdamW::Device(opt) => {
                opt.step_scaled(grads, factor)?;
                for (var, master) in self.vars.iter().zip(&self.masters) {
                    if let Some(m) = master {
                        var.set(&m.as_tensor().to_dtype(var.dtype())?)?;
                    }
                }
            }
            OwnedAdamW::Host(opt) => opt.step_scaled(grads.to_vec(), factor)?,
        }
        match self.stage {
            ZeroStage::Parameters => self.release_params(),
            _ => self.broadcast_params(),
        }
    }

    /// What this rank's collectives of gradients and parameters moved and
    /// took since it was built (the steps' differences give a step's).
    pub fn traffic(&self) -> Traffic {
        self.traffic.get()
    }

    /// Runs the collective `f` of the bucket `flat`, counted in
    /// [`traffic`](Self::traffic): the device is synchronised before and
    /// after, so the time is the collective's own (candle runs all work on
    /// one stream, so nothing overlapped it anyway).
    fn timed<T>(&self, flat: &Tensor, f: impl FnOnce() -> Result<T>) -> Result<T> {
        flat.device().synchronize()?;
        let start = std::time::Instant::now();
        let out = f()?;
        flat.device().synchronize()?;
        let mut t = self.traffic.get();
        t.calls += 1;
        t.bytes += (flat.elem_count() * flat.dtype().size_in_bytes()) as u64;
        t.seconds += start.elapsed().as_secs_f64();
        self.traffic.set(t);
        Ok(out)
    }

    /// Forgets the gradients reduced so far (after a failed step).
    pub fn restart(&mut self) {
        self.reduced
            .iter_mut()
            .flatten()
            .for_each(GradAccumulator::restart);
    }

    /// The buckets, in the order every rank sends them: per owner rank, runs
    /// of its vars in var order with one `dtypes` entry, up to `bucket_bytes`.
    fn buckets(&self, dtypes: &[DType], which: &[usize]) -> Vec<(usize, Vec<usize>)> {
        let mut out = Vec::new();
        for owner in 0..self.comm.world_size() {
            let mut bucket: Vec<usize> = Vec::new();
            let mut bytes = 0;
            for i in which.iter().copied().filter(|&i| self.owners[i] == owner) {
                let size = self.vars[i].elem_count() * dtypes[i].size_in_bytes();
                let same_dtype = bucket.last().is_none_or(|&j| dtypes[j] == dtypes[i]);
                if !bucket.is_empty() && (!same_dtype || bytes + size > self.bucket_bytes) {
                    out.push((owner, std::mem::take(&mut bucket)));
                    bytes = 0;
                }
                bucket.push(i);
                bytes += size;
            }
            if !bucket.is_empty() {
                out.push((owner, bucket));
            }
        }
        out
    }

    /// Stage 3: materialises every parameter on every rank (collective; call
    /// before the forward). A no-op when nothing is freed, and always in stages 1 and 2.
    pub fn gather_params(&mut self) -> Result<()> {
        self.gather(&self.every_var())
    }

    /// Stage 3: frees this rank's non-owned parameters (local; e.g. right after
    /// backward, before [`step`](Self::step)). A no-op when already freed, and
    /// always in stages 1 and 2.
    pub fn release_params(&mut self) -> Result<()> {
        self.release(&self.every_var())
    }

    /// Stage 3: materialises the vars `which` (indices; every rank passes
    /// the same) on every rank, their owners sending those that are freed
    /// (collective). A no-op for vars already whole, and always in stages 1
    /// and 2. With [`release`](Self::release), one block's parameters can
    /// be whole at a time (FSDP's unit).
    pub fn gather(&mut self, which: &[usize]) -> Result<()> {
        let freed: Vec<usize> = which.iter().copied().filter(|&i| !self.whole[i]).collect();
        if freed.is_empty() {
            return Ok(());
        }
        self.broadcast_vars(&freed)?;
        for i in freed {
            self.whole[i] = true;
        }
        Ok(())
    }

    /// Stage 3: frees this rank's copies of the vars `which` that another
    /// rank owns (local, but every rank passes the same `which`). A no-op in
    /// stages 1 and 2.
    pub fn release(&mut self, which: &[usize]) -> Result<()> {
        if self.stage != ZeroStage::Parameters {
            return Ok(());
        }
        let rank = self.comm.rank();
        for &i in which {
            if self.whole[i] && self.owners[i] != rank {
                self.vars[i].as_tensor().inplace_op1(&Reallocate::Free)?;
            }
            self.whole[i] = false;
        }
        Ok(())
    }

    /// Every owner sends its parameters to the other ranks, bucket by bucket,
    /// and they copy them into their vars.
    fn broadcast_params(&self) -> Result<()> {
        self.broadcast_vars(&self.every_var())
    }

    /// The owners of the vars `which` (ascending) send them to the other
    /// ranks, bucket by bucket, and they copy them into their vars
    /// (re-allocating a freed var's storage first).
    fn broadcast_vars(&self, which: &[usize]) -> Result<()> {
        let rank = self.comm.rank();
        let dtypes: Vec<DType> = self.vars.iter().map(|v| v.dtype()).collect();
        for (owner, bucket) in self.buckets(&dtypes, which) {
            let flat = if owner == rank {
                flatten(bucket.iter().map(|&i| self.vars[i].as_tensor().clone()))?
            } else {
                let n = bucket
                    .iter()
                    .map(|&i| self.vars[i].elem_count())
                    .sum::<usize>();
                let dev = self.vars[bucket[0]].device();
                Tensor::zeros(n, dtypes[bucket[0]], dev)?
            };
            let t = self.timed(&flat, || self.comm.broadcast(&flat, owner))?;
            drop(flat);
            if owner == rank {
                continue;
            }
            let mut offset = 0;
            for &i in &bucket {
                let var = &self.vars[i];
                let n = var.elem_count();
                if !self.whole[i] {
                    var.as_tensor()
                        .inplace_op1(&Reallocate::Restore(var.dtype()))?;
                }
                var.set(&t.narrow(0, offset, n)?.reshape(var.shape())?)?;
                offset += n;
            }
        }
        Ok(())
    }

    /// The indices of all vars.
    fn every_var(&self) -> Vec<usize> {
        (0..self.vars.len()).collect()
    }

    /// The fp32 weights this rank steps for var `i`: its master (16-bit
    /// vars, or any var with the optimizer offloaded: then on the host) or
    /// the var itself; `None` for a var another rank owns.
    pub fn weights_of_record(&self, i: usize) -> Option<&Var> {
        let rank = self.comm.rank();
        if self.owners.get(i)? != &rank {
            return None;
        }
        Some(match &self.opt {
            OwnedAdamW::Device(_) => self.masters[i].as_ref().unwrap_or(&self.vars[i]),
            OwnedAdamW::Host(opt) => {
                // The host masters are in the order of the owned vars.
                let position = self.owners[..i].iter().filter(|&&o| o == rank).count();
                &opt.master_vars()[position]
            }
        })
    }

    /// Sets var `i` to `t` (cast to its dtype) and, where this rank keeps
    /// an fp32 master of it, the master too (local; e.g. when resuming).
    pub fn set_weights(&self, i: usize, t: &Tensor) -> Result<()> {
        let var = &self.vars[i];
        var.set(&t.to_dtype(var.dtype())?.to_device(var.device())?)?;
        match self.weights_of_record(i) {
            Some(m) if m.as_tensor().id() != var.as_tensor().id() => {
                m.set(&t.to_dtype(DType::F32)?.to_device(m.device())?)?
            }
            _ => {}
        }
        Ok(())
    }

    /// Whether this rank's masters and moments are in host memory ([`offloaded`](Self::offloaded)).
    pub fn is_offloaded(&self) -> bool {
        matches!(self.opt, OwnedAdamW::Host(_))
    }

    /// Owner rank of each var, in order.
    pub fn owners(&self) -> &[usize] {
        &self.owners
    }

    /// The ZeRO stage.
    pub fn stage(&self) -> ZeroStage {
        self.stage
    }

    /// Whether the non-owned parameters are currently freed (stage 3; also
    /// `true` on a rank that owns every parameter, where there is nothing to free).
    pub fn is_released(&self) -> bool {
        self.stage == ZeroStage::Parameters && self.whole.iter().all(|w| !w)
    }

    /// The AdamW over this rank's parameters: its state is this rank's shard
    /// (for checkpoints, keyed by global var index).
    pub fn optimizer(&self) -> &FusedAdamW {
        self.opt.fused()
    }

    /// The AdamW over this rank's parameters, to restore its shard from a
    /// checkpoint ([`FusedAdamW::set_moments`] by global var index).
    pub fn optimizer_mut(&mut self) -> &mut FusedAdamW {
        self.opt.fused_mut()
    }

    /// Exempts from weight decay the owned vars `exempt` accepts (called with
    /// the var's global index as its name): see
    /// [`FusedAdamW::exempt_from_weight_decay`].
    pub fn exempt_from_weight_decay(&mut self, exempt: impl Fn(&str, &Var) -> bool) {
        self.opt.fused_mut().exempt_from_weight_decay(exempt);
    }

    /// Sets the learning rate.
    pub fn set_learning_rate(&mut self, lr: f64) {
        self.opt.fused_mut().set_learning_rate(lr);
    }

    /// The communicator.
    pub fn comm(&self) -> &C {
        &self.comm
    }

    /// The most bytes of one bucket.
    pub fn bucket_bytes(&self) -> usize {
        self.bucket_bytes
    }
}

/// `ts` flattened and concatenated into one 1-D tensor.
/// Frees or restores a tensor's memory in place, on the CPU or a GPU
/// (candle cannot free the storage of a var that lives on): [`Free`] leaves
/// a storage of one byte (none on the CPU) of another dtype, so that an op
/// reading the freed tensor fails on the dtype mismatch instead of reading
/// out of range; [`Restore`] zeros of the tensor's shape and dtype (before
/// its values are set again).
///
/// [`Free`]: Reallocate::Free
/// [`Restore`]: Reallocate::Restore
enum Reallocate {
    Free,
    Restore(DType),
}

impl InplaceOp1 for Reallocate {
    fn name(&self) -> &'static str {
        "oomfix-reallocate"
    }
    fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> candle_core::Result<()> {
        *s = match *self {
            Reallocate::Free => CpuStorage::U8(Vec::new()),
            Reallocate::Restore(dtype) => CpuDevice.zeros_impl(l.shape(), dtype)?,
        };
        Ok(())
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &mut candle_core::CudaStorage, l: &Layout) -> candle_core::Result<()> {
        use candle_core::backend::BackendStorage;
        *s = match *self {
            Reallocate::Free => s
                .device()
                .zeros_impl(&candle_core::Shape::from(1), DType::U8)?,
            Reallocate::Restore(dtype) => s.device().zeros_impl(l.shape(), dtype)?,
        };
        Ok(())
    }
}

fn flatten(ts: impl Iterator<Item = Tensor>) -> Result<Tensor> {
    let flat: Vec<Tensor> = ts
        .map(|t| t.flatten_all())
        .collect::<candle_core::Result<_>>()?;
    if flat.len() == 1 {
        return Ok(flat.into_iter().next().expect("one").contiguous()?);
    }
    Ok(Tensor::cat(&flat, 0)?)
}

/// Fails on every rank unless all ranks hold the same number of vars with the
/// same total element count (a mismatch would otherwise hang a collective).
fn check_same_vars<C: Comm>(comm: &C, vars: &[Var]) -> Result<()> {
    let total: usize = vars.iter().map(|v| v.elem_count()).sum();
    let mine = [vars.len() as i64, total as i64];
    let all = comm.all_gather(&Tensor::new(&mine, &Device::Cpu)?)?;
    for (r, t) in all.iter().enumerate() {
        let theirs = t.to_vec1::<i64>()?;
        if theirs != mine {
            return Err(Error::Config(format!(
                "rank {r} has other parameters than rank {} (count, elements): {theirs:?} vs {mine:?}",
                comm.rank()
            )));
        }
    }
    Ok(())
}
