//! Optimizer offload: fp32 master weights and AdamW state in host memory, the
//! AdamW step run by the CPU (the optimizer half of ZeRO-Offload, Ren et al.
//! 2021).
//!
//! The planner half is [`Offload`]; the mechanism is [`OffloadedAdamW`]. The
//! device keeps only what forward and backward need, the compute weights and
//! their gradients: 12 bytes per parameter (4 of master weight, 8 of moments)
//! move to the host. Each step copies the gradients to the host, updates there
//! with [`FusedAdamW`]'s CPU kernel, and copies the new weights back in the
//! compute dtype. The price is time: two transfers of the model across the bus
//! and a CPU pass over the state, every optimizer step.

use candle_core::{DType, Device, Layout, Tensor, Var};
use rayon::prelude::*;

use crate::adamw::{FusedAdamW, ParamsAdamW};
use crate::{Error, OptimizerImpl, Plan, Result, SearchContext, Strategy};

/// Planner half: move master weights and optimizer state to host memory
/// (`cpu-adamw`). Offered only where the device's memory is apart from the
/// host's ([`SearchContext::host_offload`]); it is the slowest fix, so it comes
/// last by default.
///
/// ```
/// use oomfix_strategies::offload::Offload;
/// use oomfix_strategies::{OptimizerImpl, Plan, SearchContext, Strategy};
///
/// let mut ctx = SearchContext { global_batch: 8, gpus: 1, supports_bf16: true,
///                               flash_attention: true, layers: 12, host_offload: true };
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
}

// ---------------------------------------------------------------------------
// Mechanism: AdamW on the host for weights on a device.

/// AdamW for a model on a device, with its fp32 master weights and moments in
/// host memory.
///
/// The compute vars (f32, bf16 or f16, on any device) are what the model
/// computes with. [`step`](Self::step) takes their gradients, copies each to
/// the host (the device copy is dropped as soon as it is read), runs
/// [`FusedAdamW`] on the host masters, and writes the masters back into the
/// compute vars, converted to their dtype (on the host, in parallel) and
/// uploaded one tensor at a time.
///
/// Memory: on the device, during the step, the gradients until each is on the
/// host, then one compute-dtype weight at a time on its way up; on the host,
/// 12 bytes per parameter element (master and two moments), plus the
/// gradients, then the converted weights, during a step.
///
/// For the same gradients the weights come out exactly as from [`FusedAdamW`]
/// over [`MasterWeights`](crate::precision::MasterWeights) on the device's own
/// memory: the arithmetic is the same f32 kernel.
///
/// ```
/// use candle_core::{DType, Device, Layout, Tensor, Var};
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
    optim: FusedAdamW,
}

impl OffloadedAdamW {
    /// An optimizer over named compute vars (names key the state, as in
    /// [`FusedAdamW::new_named`]). Copies each var to the host as an f32 master
    /// and allocates the moments there. Fails on invalid hyper-parameters,
    /// repeated names, or a var that is not f32, bf16 or f16.
    pub fn new(vars: Vec<(String, Var)>, params: ParamsAdamW) -> Result<Self> {
        let mut compute = Vec::with_capacity(vars.len());
        let mut named_masters = Vec::with_capacity(vars.len());
        for (name, var) in vars {
            if !matches!(var.dtype(), DType::F32 | DType::BF16 | DType::F16) {
                return Err(Error::Unsupported(format!(
                    "parameter `{name}` has dtype {:?}; the offloaded AdamW takes f32, bf16 or f16",
                    var.dtype()
                )));
            }
            // A detached view is not a var, so `from_tensor` gives the master
            // storage of its own even for an f32 var already on the host.
            let host = var
                .as_detached_tensor()
                .to_device(&Device::Cpu)?
                .to_dtype(DType::F32)?;
            named_masters.push((name, Var::from_tensor(&host)?));
            compute.push(var);
        }
        let masters = named_masters.iter().map(|(_, v)| v.clone()).collect();
        let optim = FusedAdamW::new_named(named_masters, params)?;
        Ok(OffloadedAdamW {
            compute,
            masters,
            optim,
        })
    }

    /// One step with `grads[i]` the gradient of the `i`-th compute var (any
    /// device; f32, bf16 or f16). The gradients are consumed: each one's device
    /// memory is released once it is on the host. On an error from the
    /// gradients' checks (count, shape, dtype) nothing has changed.
    pub fn step(&mut self, grads: Vec<Tensor>) -> Result<()> {
        if grads.len() != self.compute.len() {
            return Err(Error::Config(format!(
                "{} gradients for {} parameters",
                grads.len(),
                self.compute.len()
            )));
        }
        let host = grads.into_iter().map(to_host).collect::<Result<Vec<_>>>()?;
        self.optim.step(&host)?;
        drop(host);
        self.sync_to_compute()
    }

    /// Writes every master into its compute var: converted to the compute
    /// dtype on the host (tensors in parallel), then uploaded one at a time.
    /// [`step`](Self::step) calls it; call it after loading masters by hand.
    pub fn sync_to_compute(&self) -> Result<()> {
        let converted = (self.compute.par_iter().zip(&self.masters))
            .map(|(c, m)| Ok(m.as_tensor().to_dtype(c.dtype())?))
            .collect::<Result<Vec<Tensor>>>()?;
        for (c, h) in self.compute.iter().zip(converted) {
            c.set(&h.to_device(c.device())?)?;
        }
        Ok(())
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

/// `g` on the host, with its layout. candle copies a tensor's whole storage
/// between devices, which is exact for a tensor that covers its storage from
/// the start in some order of its dimensions (what the backward gives: fresh
/// buffers, transposed for `Linear` weights); other views are made contiguous
/// on their device first.
fn to_host(g: Tensor) -> Result<Tensor> {
    if g.device().is_cpu() {
        return Ok(g);
    }
    let g = if covers_from_start(g.layout()) {
        g
    } else {
        g.contiguous()?
    };
    Ok(g.to_device(&Device::Cpu)?)
}

/// Whether `l` addresses exactly the elements `0..n` of its storage (`n` its
/// element count): contiguous or a permutation of the dimensions of a
/// contiguous layout, at offset 0.
fn covers_from_start(l: &Layout) -> bool {
    let mut dims: Vec<(usize, usize)> = (l.stride().iter().copied())
        .zip(l.dims().iter().copied())
        .filter(|&(_, d)| d > 1)
        .collect();
    dims.sort_unstable();
    let mut next = 1;
    for (stride, dim) in dims {
        if stride != next {
            return false;
        }
        next *= dim;
    }
    l.start_offset() == 0
}

#[cfg(test)]
mod tests {
    use super::covers_from_start;
    use candle_core::{Device, Tensor};

    #[test]
    fn layouts_that_cover_their_storage_from_the_start() {
        let t = Tensor::zeros((4, 3, 2), candle_core::DType::F32, &Device::Cpu).unwrap();
        let covers = |t: &Tensor| covers_from_start(t.layout());
        assert!(covers(&t));
        assert!(covers(&t.t().unwrap()));
        assert!(covers(&t.permute((2, 0, 1)).unwrap()));
        assert!(covers(&t.narrow(0, 0, 1).unwrap()));
        assert!(!covers(&t.narrow(0, 1, 2).unwrap()));
        assert!(!covers(&t.narrow(1, 0, 2).unwrap()));
        assert!(!covers(&t.narrow(2, 1, 1).unwrap()));
    }
}
