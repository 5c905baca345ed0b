//! Optimizer offload: fp32 master weights and AdamW state in host memory, the
//! AdamW step run by the CPU (the optimizer half of ZeRO-Offload, Ren et al.
//! 2021).
//!
//! The planner half is [`Offload`]; the mechanism is [`OffloadedAdamW`]. The
//! device keeps only what forward and backward need, the compute weights and
//! their gradients: 12 bytes per parameter (4 of master weight, 8 of moments)
//! move to the host. Each step copies the gradients to the host, updates there
//! with [`FusedAdamW`]'s CPU kernel, and copies the new weights back in the
//! compute dtype, through host staging tensors allocated once. The price is
//! time: two transfers of the model across the bus and a CPU pass over the
//! state, every optimizer step.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Device, Layout, Tensor, Var};

use crate::accumulate::zip_in_place;
use crate::adamw::{FusedAdamW, ParamsAdamW};
use crate::float::{
    check_param, contiguous_range, one_gradient_each, with_cpu_mut_src, with_float_vec,
};
use crate::{
    Error, ModelFacts, OptimizerImpl, Plan, Result, SearchContext, StateBytes, StepCost, Strategy,
};

/// Planner half: move master weights and optimizer state to host memory
/// (`cpu-adamw`). Offered only where the device's memory is apart from the
/// host's ([`SearchContext::host_offload`]); it is the slowest fix, so it comes
/// last by default.
///
/// ```
/// use oomfix_strategies::offload::Offload;
/// use oomfix_strategies::{OptimizerImpl, Plan, SearchContext, Strategy};
///
/// let mut ctx = SearchContext::new(8, 12);
/// let offloaded = Offload.tighten(&Plan::baseline(8, 1024), &ctx).unwrap();
/// assert_eq!(offloaded.optimizer, OptimizerImpl::OffloadedAdamW);
/// assert!(Offload.tighten(&offloaded, &ctx).is_none());
/// assert_eq!(Offload.relax(&offloaded, &ctx).unwrap().optimizer, OptimizerImpl::FusedAdamW);
/// ctx.host_offload = false; // the CPU: its memory is the host's
/// assert!(Offload.tighten(&Plan::baseline(8, 1024), &ctx).is_none());
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct Offload;

impl Strategy for Offload {
    fn name(&self) -> &'static str {
        "offload"
    }
    fn tighten(&self, plan: &Plan, ctx: &SearchContext) -> Option<Plan> {
        (ctx.host_offload && !plan.optimizer.is_offloaded()).then_some(Plan {
            optimizer: OptimizerImpl::OffloadedAdamW,
            ..*plan
        })
    }
    fn relax(&self, plan: &Plan, _ctx: &SearchContext) -> Option<Plan> {
        plan.optimizer.is_offloaded().then_some(Plan {
            optimizer: OptimizerImpl::FusedAdamW,
            ..*plan
        })
    }
    /// Offloaded, the fp32 master weights and both moments are host memory,
    /// with staging tensors for the gradients going down (all of it this
    /// rank's share under ZeRO stage 1+); on the device the
    /// step's only temporary is a strided gradient made contiguous before
    /// its copy, one at a time (the largest tensor in the compute dtype).
    fn memory(&self, plan: &Plan, model: &ModelFacts, state: &mut StateBytes) {
        if !plan.optimizer.is_offloaded() {
            return;
        }
        let compute = plan.precision.compute_bytes();
        state.host +=
            plan.per_rank(12 * model.parameters, 1) + plan.per_rank(compute * model.parameters, 1);
        state.master_weights = 0;
        state.optimizer_state = 0;
        state.optimizer_transient = compute * model.largest_tensor;
    }
    /// Offloaded, the host runs the step; each stepped parameter's gradient
    /// goes down the bus and its compute weight comes back up, in the
    /// compute dtype; the device's memory sees none of the step.
    fn time(&self, plan: &Plan, _model: &ModelFacts, cost: &mut StepCost) {
        if plan.optimizer.is_offloaded() {
            cost.on_host = true;
            cost.device_bytes_per_parameter = 0.0;
            cost.bus_bytes_per_parameter = 2.0 * plan.precision.compute_bytes() as f64;
        }
    }
}

// ---------------------------------------------------------------------------
// Mechanism: AdamW on the host for weights on a device.

#[cfg(feature = "cuda")]
mod cuda;

/// AdamW for a model on a device, with its fp32 master weights and moments in
/// host memory.
///
/// The compute vars (f32, bf16 or f16, on the CPU or a CUDA device) are what
/// the model computes with. [`step`](Self::step) copies each gradient into a
/// host staging tensor of its own (allocated once, in the compute dtype; the
/// device gradient is dropped as soon as it is copied), runs [`FusedAdamW`]'s
/// CPU kernel on the host masters, then converts each master into its staging
/// tensor (in parallel) and copies that into the compute var's storage in place.
///
/// Memory: on the device, nothing but a gradient made contiguous before its
/// copy when the backward left it strided (`Linear` weights' gradients are
/// transposed views), one at a time; on the host, 12 bytes per parameter
/// element (master and two moments) plus the staging tensors (the compute
/// dtype's size). For CUDA vars the staging tensors of 1 MiB and more are
/// page-locked (`cuMemHostRegister`) while the optimizer lives, so the copies
/// run asynchronously at the bus's speed.
///
/// The arithmetic is [`FusedAdamW`]'s CPU kernel on f32 masters: with vars on
/// the CPU the weights come out bit for bit as from [`FusedAdamW`] over
/// [`MasterWeights`](crate::precision::MasterWeights), and with vars on a CUDA
/// device bit for bit as with the same vars on the CPU.
///
/// ```
/// use candle_core::{DType, Device, Tensor, Var};
/// use oomfix_strategies::adamw::ParamsAdamW;
/// use oomfix_strategies::offload::OffloadedAdamW;
///
/// let w = Var::from_tensor(&Tensor::new(&[1f32, -2.0], &Device::Cpu)?.to_dtype(DType::BF16)?)?;
/// let params = ParamsAdamW { lr: 0.5, weight_decay: 0.0, ..Default::default() };
/// let mut opt = OffloadedAdamW::new(vec![("w".into(), w.clone())], params)?;
/// let grad = Tensor::new(&[1f32, -1.0], &Device::Cpu)?.to_dtype(DType::BF16)?;
/// opt.step(vec![grad])?;
/// // the first AdamW step moves each element by lr against its gradient's sign
/// assert_eq!(w.to_dtype(DType::F32)?.to_vec1::<f32>()?, [0.5, -1.5]);
/// assert_eq!(opt.master_vars()[0].dtype(), DType::F32);
/// # Ok::<(), oomfix_strategies::Error>(())
/// ```
#[derive(Debug)]
pub struct OffloadedAdamW {
    compute: Vec<Var>,
    masters: Vec<Var>,
    /// Page-locks the staging tensors of CUDA vars; declared before `staging`
    /// so that it is dropped (unlocked) first.
    #[cfg(feature = "cuda")]
    _pinned: Vec<cuda::Pinned>,
    /// Host tensors in the compute dtype: each step's gradients, then the weights on their way back.
    staging: Vec<Tensor>,
    optim: FusedAdamW,
}

impl OffloadedAdamW {
    /// An optimizer over named compute vars (names key the state, as in
    /// [`FusedAdamW::new_named`]). Copies each var to the host as an f32 master
    /// and allocates the moments and the staging tensors there. Fails on
    /// invalid hyper-parameters, repeated names, a var that is not f32, bf16
    /// or f16, or one that is not contiguous.
    pub fn new(vars: Vec<(String, Var)>, params: ParamsAdamW) -> Result<Self> {
        let mut compute = Vec::with_capacity(vars.len());
        let mut staging = Vec::with_capacity(vars.len());
        let mut named_masters = Vec::with_capacity(vars.len());
        for (name, var) in vars {
            check_param(&name, &var, "the offloaded AdamW")?;
            // A detached view is not a var, so `from_tensor` gives the master
            // storage of its own even for an f32 var already on the host.
            let host = var.as_detached_tensor().to_device(&Device::Cpu)?;
            staging.push(Tensor::zeros(var.shape(), var.dtype(), &Device::Cpu)?);
            named_masters.push((name, Var::from_tensor(&host.to_dtype(DType::F32)?)?));
            compute.push(var);
        }
        let masters = named_masters.iter().map(|(_, v)| v.clone()).collect();
        let optim = FusedAdamW::new_named(named_masters, params)?;
        #[cfg(feature = "cuda")]
        let _pinned = (compute.iter().zip(&staging))
            .filter_map(|(c, s)| match c.device() {
                Device::Cuda(d) => cuda::Pinned::new(s, d),
                _ => None,
            })
            .collect();
        Ok(OffloadedAdamW {
            compute,
            masters,
            #[cfg(feature = "cuda")]
            _pinned,
            staging,
            optim,
        })
    }

    /// One step with `grads[i]` the gradient of the `i`-th compute var (same
    /// shape, dtype and device). The gradients are consumed: each one's device
    /// memory is released once it is on the host. Every gradient is checked
    /// before anything is copied: on error, weights, state and step count are
    /// unchanged.
    pub fn step(&mut self, grads: Vec<Tensor>) -> Result<()> {
        self.step_scaled(grads, 1.0)
    }

    /// [`step`](Self::step) with the gradients multiplied by `factor` as the
    /// host's AdamW reads them ([`FusedAdamW::step_scaled`]: gradient
    /// clipping without a scaled copy).
    pub fn step_scaled(&mut self, grads: Vec<Tensor>, factor: f64) -> Result<()> {
        one_gradient_each(grads.len(), self.compute.len())?;
        for (i, (g, c)) in grads.iter().zip(&self.compute).enumerate() {
            if g.shape() != c.shape()
                || g.dtype() != c.dtype()
                || !g.device().same_device(c.device())
            {
                return Err(Error::Config(format!(
                    "gradient {i} is {:?} {:?} on {:?}; its parameter is {:?} {:?} on {:?}",
                    g.dtype(),
                    g.dims(),
                    g.device().location(),
                    c.dtype(),
                    c.dims(),
                    c.device().location()
                )));
            }
        }
        for (g, staged) in grads.into_iter().zip(&self.staging) {
            download(&g, staged)?;
        }
        self.synchronize()?;
        self.optim.step_scaled(&self.staging, factor)?;
        self.sync_to_compute()
    }

    /// Waits for the copies queued on the compute vars' devices (copies with
    /// page-locked staging tensors return before they are done).
    fn synchronize(&self) -> Result<()> {
        let mut done: Vec<&Device> = Vec::new();
        for c in &self.compute {
            if !done.iter().any(|d| d.same_device(c.device())) {
                c.device().synchronize()?;
                done.push(c.device());
            }
        }
        Ok(())
    }

    /// Writes every master into its compute var: converted to the compute
    /// dtype into its staging tensor, then copied into the var's storage (the
    /// copy of one tensor overlaps the conversion of the next; returns when
    /// all are done). [`step`](Self::step) calls it; call it after changing
    /// masters by hand.
    pub fn sync_to_compute(&self) -> Result<()> {
        for ((c, m), staged) in self.compute.iter().zip(&self.masters).zip(&self.staging) {
            narrow_into(m.as_tensor(), staged)?;
            upload(staged, c.as_tensor())?;
        }
        self.synchronize()
    }

    /// The f32 master weights on the host, in the order of the compute vars.
    pub fn master_vars(&self) -> &[Var] {
        &self.masters
    }

    /// The compute vars, as given.
    pub fn compute_vars(&self) -> &[Var] {
        &self.compute
    }

    /// The host optimizer (its state, step count and learning rate).
    pub fn optimizer(&self) -> &FusedAdamW {
        &self.optim
    }

    /// The host optimizer, mutable (to set the learning rate or load state).
    pub fn optimizer_mut(&mut self) -> &mut FusedAdamW {
        &mut self.optim
    }
}

/// A host tensor that a device tensor of one shape and dtype waits in, page-
/// locked where the device is a CUDA one (so that copies in both directions
/// run at the bus's speed and are queued on the device's stream without
/// waiting), reused for as long as the tensors it holds keep that shape:
/// the checkpointed segments' inputs of [`crate::offload_activations`].
///
/// Every copy is queued on the device's stream, so a later copy into the
/// buffer waits for an earlier copy out of it, and a device tensor freed after
/// [`store`](Self::store) returns is reused only once its copy has run; the
/// host never reads the buffer.
#[derive(Debug)]
pub(crate) struct HostBuffer {
    /// Declared before `host` so that it is dropped (unlocked) first.
    #[cfg(feature = "cuda")]
    _pinned: Option<cuda::Pinned>,
    host: Tensor,
    device: Device,
}

impl HostBuffer {
    /// A buffer for tensors shaped like `like` (on a CUDA device).
    pub(crate) fn new(like: &Tensor) -> candle_core::Result<Self> {
        let host = Tensor::zeros(like.shape(), like.dtype(), &Device::Cpu)?;
        Ok(HostBuffer {
            #[cfg(feature = "cuda")]
            _pinned: match like.device() {
                Device::Cuda(d) => cuda::Pinned::new(&host, d),
                _ => None,
            },
            host,
            device: like.device().clone(),
        })
    }

    /// Whether `t` fits this buffer: same shape, dtype and device.
    pub(crate) fn fits(&self, t: &Tensor) -> bool {
        t.shape() == self.host.shape()
            && t.dtype() == self.host.dtype()
            && t.device().same_device(&self.device)
    }

    /// Queues the copy of `t` (shaped like the buffer) into it.
    pub(crate) fn store(&self, t: &Tensor) -> candle_core::Result<()> {
        download(t, &self.host)
    }

    /// A new variable on the device with the buffer's contents (a queued
    /// copy: work queued on the device after it sees them).
    pub(crate) fn load(&self) -> candle_core::Result<Var> {
        let v = Var::zeros(self.host.shape(), self.host.dtype(), &self.device)?;
        upload(&self.host, v.as_tensor())?;
        Ok(v)
    }
}

impl Drop for HostBuffer {
    /// Waits for the copies queued on the device before the host memory is
    /// unlocked and freed (a buffer is dropped when its segment's input
    /// changes shape, or with the thread).
    fn drop(&mut self) {
        let _ = self.device.synchronize();
    }
}

/// Copies gradient `g` (any device) into the host tensor `staged` (same dtype
/// and element count, contiguous). A strided `g` is made contiguous on its
/// device first.
fn download(g: &Tensor, staged: &Tensor) -> candle_core::Result<()> {
    let g = g.contiguous()?;
    match g.device() {
        Device::Cpu => with_cpu_mut_src(staged, &g, copy_host),
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => cuda::download(&g, staged),
        other => candle_core::bail!(
            "the offloaded AdamW has no copy from {:?}",
            other.location()
        ),
    }
}

/// Copies the host tensor `staged` into the storage of `var` (any device, same
/// dtype and element count, contiguous).
fn upload(staged: &Tensor, var: &Tensor) -> candle_core::Result<()> {
    match var.device() {
        Device::Cpu => with_cpu_mut_src(var, staged, copy_host),
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => cuda::upload(staged, var),
        other => candle_core::bail!("the offloaded AdamW has no copy to {:?}", other.location()),
    }
}

/// `dst = src` between contiguous host storages of one dtype.
fn copy_host(
    dst: &mut CpuStorage,
    dl: &Layout,
    src: &CpuStorage,
    sl: &Layout,
) -> candle_core::Result<()> {
    let (dr, sr) = (contiguous_range(dl)?, contiguous_range(sl)?);
    match (dst, src) {
        (CpuStorage::F32(d), CpuStorage::F32(s)) => d[dr].copy_from_slice(&s[sr]),
        (CpuStorage::BF16(d), CpuStorage::BF16(s)) => d[dr].copy_from_slice(&s[sr]),
        (CpuStorage::F16(d), CpuStorage::F16(s)) => d[dr].copy_from_slice(&s[sr]),
        (d, s) => candle_core::bail!(
            "host copy from {:?} to {:?}",
            BackendStorage::dtype(s),
            BackendStorage::dtype(d)
        ),
    }
    Ok(())
}

/// Rounds the f32 host tensor `master` into the host tensor `staged` (f32,
/// bf16 or f16; contiguous, same element count), in chunks across the rayon pool.
fn narrow_into(master: &Tensor, staged: &Tensor) -> candle_core::Result<()> {
    with_cpu_mut_src(staged, master, |s, sl, m, ml| {
        let CpuStorage::F32(m) = m else {
            candle_core::bail!("master weights must be f32")
        };
        let m = &m[contiguous_range(ml)?];
        let r = contiguous_range(sl)?;
        with_float_vec!(s, s => {
            zip_in_place(&mut s[r], m, |_, m| m);
            Ok(())
        })
    })
}
