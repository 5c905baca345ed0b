//! A fused, in-place AdamW step.
//!
//! The planner half ([`FusedAdamWStrategy`]) switches a plan to the fused
//! optimizer; the mechanism is [`FusedAdamW`].

use std::collections::{HashMap, HashSet};

use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, DType, Device, Tensor, Var};
use rayon::prelude::*;

pub use candle_nn::ParamsAdamW;

use crate::float::{
    check_param, contiguous_range, is_kernel_dtype, one_gradient_each, with_cpu_mut,
    with_cpu_mut_src, with_float_vec, Float, CHUNK,
};
use crate::{
    Error, ModelFacts, OptimizerImpl, Plan, Result, SearchContext, StateBytes, StepCost, Strategy,
};

#[cfg(feature = "cuda")]
mod cuda;

/// Planner half: replace `candle_nn::AdamW` with the fused in-place step (an
/// already offloaded optimizer is left as it is).
#[derive(Debug, Clone, Copy, Default)]
pub struct FusedAdamWStrategy;

impl Strategy for FusedAdamWStrategy {
    fn name(&self) -> &'static str {
        "fused-adamw"
    }
    fn tighten(&self, plan: &Plan, _ctx: &SearchContext) -> Option<Plan> {
        (plan.optimizer == OptimizerImpl::CandleAdamW).then_some(Plan {
            optimizer: OptimizerImpl::FusedAdamW,
            ..*plan
        })
    }
    /// The optimizer step's temporaries: none for [`FusedAdamW`] (in place,
    /// reading 16-bit gradients directly); for `candle_nn::AdamW`
    /// [`CANDLE_ADAMW_TEMPORARIES`] fp32 copies of the largest tensor (its
    /// per-tensor update allocates that many full-size outputs, kept by the
    /// graph until the tensor's update ends), plus, under mixed precision,
    /// the fp32 copy of the one 16-bit gradient being stepped (the trainer
    /// steps one tensor at a time and upcasts just its gradient).
    fn memory(&self, plan: &Plan, model: &ModelFacts, state: &mut StateBytes) {
        let largest = model.largest_tensor;
        match plan.optimizer {
            OptimizerImpl::FusedAdamW => state.optimizer_transient = 0,
            OptimizerImpl::CandleAdamW => {
                let upcast = if plan.precision.is_mixed() {
                    4 * largest
                } else {
                    0
                };
                state.optimizer_transient = CANDLE_ADAMW_TEMPORARIES * 4 * largest + upcast;
            }
            OptimizerImpl::OffloadedAdamW => {}
        }
    }
    /// [`FusedAdamW`] reads and writes the fp32 weights and both moments
    /// once, reads the gradients and, under mixed precision, writes the
    /// compute copy of the weights.
    fn time(&self, plan: &Plan, _model: &ModelFacts, cost: &mut StepCost) {
        if plan.optimizer == OptimizerImpl::FusedAdamW {
            let bytes = plan.precision.compute_bytes() as f64;
            let mixed = if plan.precision.is_mixed() {
                bytes
            } else {
                0.0
            };
            cost.device_bytes_per_parameter = 2.0 * 4.0 * 3.0 + bytes + mixed;
        }
    }
}

pub use crate::memory::CANDLE_ADAMW_TEMPORARIES;

// ---------------------------------------------------------------------------
// Mechanism: the fused step.

/// Key of the step count in [`FusedAdamW::state_tensors`].
pub const STEP_KEY: &str = "step";

fn f32_vec_mut(s: &mut CpuStorage) -> candle_core::Result<&mut Vec<f32>> {
    match s {
        CpuStorage::F32(v) => Ok(v),
        _ => candle_core::bail!("optimizer state must be f32"),
    }
}

/// Whether a parameter is exempt from weight decay by the usual convention
/// (Hugging Face's Trainer, nanoGPT): tensors of fewer than two dimensions,
/// i.e. biases and norm scales; matrices (embeddings included) decay.
pub fn is_decay_exempt(_name: &str, var: &Var) -> bool {
    var.rank() < 2
}

/// Per-step scalars of the AdamW update, in f32 as the kernels use them (the
/// CUDA kernel takes this struct by value: keep its layout in step with
/// `adamw.cu`).
#[derive(Debug, Clone, Copy)]
#[repr(C)]
struct Coeffs {
    beta1: f32,
    one_minus_beta1: f32,
    beta2: f32,
    one_minus_beta2: f32,
    /// `1 / (1 - beta1^t)`
    scale_m: f32,
    /// `1 / (1 - beta2^t)`
    scale_v: f32,
    eps: f32,
    lr: f32,
    /// `1 - lr * weight_decay`
    decay: f32,
    /// The factor each gradient is multiplied by as it is read (gradient
    /// clipping's coefficient; 1 otherwise).
    grad_scale: f32,
}

impl Coeffs {
    fn new(p: &ParamsAdamW, t: u64, grad_scale: f64) -> Self {
        let t = t as f64;
        Coeffs {
            beta1: p.beta1 as f32,
            one_minus_beta1: (1.0 - p.beta1) as f32,
            beta2: p.beta2 as f32,
            one_minus_beta2: (1.0 - p.beta2) as f32,
            scale_m: (1.0 / (1.0 - p.beta1.powf(t))) as f32,
            scale_v: (1.0 / (1.0 - p.beta2.powf(t))) as f32,
            eps: p.eps as f32,
            lr: p.lr as f32,
            decay: (1.0 - p.lr * p.weight_decay) as f32,
            grad_scale: grad_scale as f32,
        }
    }
}

/// One thread's share of the update: a single pass over the four slices.
fn adamw_serial<P: Float, G: Float>(p: &mut [P], g: &[G], m: &mut [f32], v: &mut [f32], c: Coeffs) {
    for (((p, g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
        let g = g.to_f32() * c.grad_scale;
        *m = c.beta1 * *m + c.one_minus_beta1 * g;
        *v = c.beta2 * *v + c.one_minus_beta2 * (g * g);
        let update = (*m * c.scale_m) / ((*v * c.scale_v).sqrt() + c.eps);
        *p = P::from_f32(p.to_f32() * c.decay - update * c.lr);
    }
}

/// The update of one tensor, split into chunks of [`CHUNK`] elements across the
/// rayon thread pool when it is larger than one chunk.
fn adamw_kernel<P: Float, G: Float>(p: &mut [P], g: &[G], m: &mut [f32], v: &mut [f32], c: Coeffs) {
    if p.len() <= CHUNK {
        return adamw_serial(p, g, m, v, c);
    }
    p.par_chunks_mut(CHUNK)
        .zip(g.par_chunks(CHUNK))
        .zip(m.par_chunks_mut(CHUNK))
        .zip(v.par_chunks_mut(CHUNK))
        .for_each(|(((p, g), m), v)| adamw_serial(p, g, m, v, c));
}

/// Updates `p`, `m` and `v` in place from `g` on the CPU. All four are contiguous
/// and of equal element count; `m` and `v` are f32 and own their storage.
fn update_cpu(
    p: &Tensor,
    g: &Tensor,
    m: &Tensor,
    v: &Tensor,
    c: Coeffs,
) -> candle_core::Result<()> {
    with_cpu_mut(m, |m, ml| {
        let m = &mut f32_vec_mut(m)?[contiguous_range(ml)?];
        with_cpu_mut(v, |v, vl| {
            let v = &mut f32_vec_mut(v)?[contiguous_range(vl)?];
            with_cpu_mut_src(p, g, |p, pl, g, gl| {
                let (pr, gr) = (contiguous_range(pl)?, contiguous_range(gl)?);
                with_float_vec!(p, p => with_float_vec!(g, g => {
                    adamw_kernel(&mut p[pr.clone()], &g[gr.clone()], m, v, c);
                    Ok(())
                }))
            })
        })
    })
}

/// One parameter and its AdamW state.
#[derive(Debug)]
struct Slot {
    name: String,
    var: Var,
    /// First moment, f32, same shape as the parameter.
    m: Var,
    /// Second moment, f32, same shape as the parameter.
    v: Var,
    /// Whether weight decay applies to it.
    decays: bool,
}

/// AdamW with decoupled weight decay and bias correction, updating parameters
/// and state in place in one pass per parameter.
///
/// Semantics are those of `torch.optim.AdamW` and [`candle_nn::AdamW`] (see
/// [`ParamsAdamW`]); per element, at step `t`:
///
/// ```text
/// m = beta1 m + (1 - beta1) g          v = beta2 v + (1 - beta2) g²
/// p = p (1 - lr wd) - lr (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps)
/// ```
///
/// Differences from `candle_nn::AdamW`, which are the point of this type:
/// * the moments `m` and `v` are f32 whatever the parameter dtype (f32, bf16 or f16);
/// * the step allocates nothing per step: it reads the gradient (f32, bf16 or
///   f16, converted while reading) and writes parameter, `m` and `v` in place,
///   chunked across the rayon thread pool. The one exception is a gradient that is
///   not contiguous (candle's backward yields transposed views, e.g. for
///   `Linear` weights): it is copied to a contiguous temporary first, one
///   gradient at a time;
/// * parameters must be contiguous (checked at construction).
///
/// In place means every tensor sharing a parameter's storage sees the update,
/// including a `var.as_detached_tensor()` taken earlier (copy it to keep the
/// old values).
///
/// The state is allocated at construction (8 bytes per parameter element).
/// The kernel runs on the CPU and, with the `cuda` feature, on CUDA devices
/// (one launch per parameter tensor, compiled at first use with NVRTC; the same
/// f32 arithmetic as on the CPU). On other devices [`step`](Self::step) returns
/// [`Error::Unsupported`].
///
/// ```
/// use candle_core::{Device, Tensor, Var};
/// use oomfix_strategies::adamw::{FusedAdamW, ParamsAdamW};
///
/// let w = Var::new(&[1f32, -2.0], &Device::Cpu)?;
/// let params = ParamsAdamW { lr: 0.1, weight_decay: 0.0, ..Default::default() };
/// let mut opt = FusedAdamW::new(vec![w.clone()], params)?;
/// let loss = w.as_tensor().sqr()?.sum_all()?;
/// opt.step_grad_store(&loss.backward()?)?;
/// // the first AdamW step moves each element by lr against its gradient's sign
/// let w = w.as_tensor().to_vec1::<f32>()?;
/// assert!((w[0] - 0.9).abs() < 1e-3 && (w[1] + 1.9).abs() < 1e-3);
/// # Ok::<(), oomfix_strategies::Error>(())
/// ```
#[derive(Debug)]
pub struct FusedAdamW {
    slots: Vec<Slot>,
    params: ParamsAdamW,
    /// Steps taken so far.
    t: u64,
}

fn validate(p: &ParamsAdamW) -> Result<()> {
    let ok = p.lr.is_finite()
        && p.lr >= 0.0
        && (0.0..1.0).contains(&p.beta1)
        && (0.0..1.0).contains(&p.beta2)
        && p.eps.is_finite()
        && p.eps >= 0.0
        && p.weight_decay.is_finite()
        && p.weight_decay >= 0.0;
    if ok {
        Ok(())
    } else {
        Err(Error::Config(format!(
            "invalid AdamW hyper-parameters {p:?} (need lr, eps, weight_decay >= 0 and betas in [0, 1))"
        )))
    }
}

impl FusedAdamW {
    /// An optimizer over `vars`; their state is named `"0"`, `"1"`, … in
    /// [`state_tensors`](Self::state_tensors).
    pub fn new(vars: Vec<Var>, params: ParamsAdamW) -> Result<Self> {
        Self::new_named(
            vars.into_iter()
                .enumerate()
                .map(|(i, v)| (i.to_string(), v))
                .collect(),
            params,
        )
    }

    /// An optimizer over named vars (names must be unique; they key the state in
    /// checkpoints). Fails on invalid hyper-parameters, a var that is not f32,
    /// bf16 or f16, or a var that is not contiguous.
    pub fn new_named(vars: Vec<(String, Var)>, params: ParamsAdamW) -> Result<Self> {
        validate(&params)?;
        let mut names = HashSet::new();
        let slots = vars
            .into_iter()
            .map(|(name, var)| {
                if !names.insert(name.clone()) {
                    return Err(Error::Config(format!(
                        "parameter name `{name}` is used twice"
                    )));
                }
                check_param(&name, &var, "fused AdamW")?;
                let m = Var::zeros(var.shape(), DType::F32, var.device())?;
                let v = Var::zeros(var.shape(), DType::F32, var.device())?;
                Ok(Slot {
                    name,
                    var,
                    m,
                    v,
                    decays: true,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(FusedAdamW {
            slots,
            params,
            t: 0,
        })
    }

    /// One step with `grads[i]` the gradient of the `i`-th var (same order as at
    /// construction; one gradient per var). All gradients are checked (shape,
    /// dtype, device) before anything is updated: on error, parameters, state
    /// and step count are unchanged.
    pub fn step(&mut self, grads: &[Tensor]) -> Result<()> {
        self.step_scaled(grads, 1.0)
    }

    /// [`step`](Self::step) with every gradient multiplied by `factor` as the
    /// kernel reads it (gradient clipping's coefficient,
    /// [`crate::clip::clip_coefficient`]): the step of the gradients times
    /// `factor`, without a scaled copy of them.
    pub fn step_scaled(&mut self, grads: &[Tensor], factor: f64) -> Result<()> {
        one_gradient_each(grads.len(), self.slots.len())?;
        let pairs: Vec<_> = grads.iter().enumerate().collect();
        self.apply(&pairs, factor)
    }

    /// One step with the gradients in a [`GradStore`]; vars without a gradient
    /// are left unchanged (as `candle_nn::AdamW` and PyTorch do), their state too.
    pub fn step_grad_store(&mut self, grads: &GradStore) -> Result<()> {
        let pairs: Vec<_> = (self.slots.iter().enumerate())
            .filter_map(|(i, slot)| Some((i, grads.get(slot.var.as_tensor())?)))
            .collect();
        self.apply(&pairs, 1.0)
    }

    /// Checks every gradient, then takes the step with the gradients times
    /// `grad_scale`: a bad gradient leaves parameters, state and step count
    /// unchanged.
    fn apply(&mut self, pairs: &[(usize, &Tensor)], grad_scale: f64) -> Result<()> {
        pairs
            .iter()
            .try_for_each(|&(i, g)| self.slots[i].check(g))?;
        if !grad_scale.is_finite() {
            return Err(Error::Config(format!(
                "gradient factor {grad_scale} is not finite"
            )));
        }
        self.t += 1;
        let c = Coeffs::new(&self.params, self.t, grad_scale);
        let exempt = Coeffs { decay: 1.0, ..c };
        pairs.iter().try_for_each(|&(i, g)| {
            let slot = &self.slots[i];
            slot.update(g, if slot.decays { c } else { exempt })
        })
    }

    /// Exempts from weight decay the vars whose name `exempt` accepts
    /// (by convention biases and norm scales: [`is_decay_exempt`]); the
    /// others decay. Every var decays until this is called.
    pub fn exempt_from_weight_decay(&mut self, exempt: impl Fn(&str, &Var) -> bool) {
        for slot in &mut self.slots {
            slot.decays = !exempt(&slot.name, &slot.var);
        }
    }

    /// The learning rate.
    pub fn learning_rate(&self) -> f64 {
        self.params.lr
    }

    /// Sets the learning rate (for schedules).
    pub fn set_learning_rate(&mut self, lr: f64) {
        self.params.lr = lr;
    }

    /// The hyper-parameters.
    pub fn params(&self) -> &ParamsAdamW {
        &self.params
    }

    /// Steps taken so far (the `t` of the bias correction).
    pub fn step_count(&self) -> u64 {
        self.t
    }

    /// The moments of each var, without copying: `(name, m, v)` in the
    /// order of construction, f32 tensors sharing the optimizer's storage
    /// (read them before the next [`step`](Self::step) changes them).
    pub fn moments(&self) -> Vec<(&str, Tensor, Tensor)> {
        self.slots
            .iter()
            .map(|s| {
                (
                    s.name.as_str(),
                    s.m.as_detached_tensor(),
                    s.v.as_detached_tensor(),
                )
            })
            .collect()
    }

    /// Sets the moments of the var `name` (copied into the optimizer's own
    /// storage, converted to f32 and to its device), one var at a time so
    /// that restoring a checkpoint holds at most one var's state besides the
    /// optimizer's. Fails, changing nothing, on an unknown name or a shape
    /// that is not the var's.
    pub fn set_moments(&mut self, name: &str, m: &Tensor, v: &Tensor) -> Result<()> {
        let slot = self
            .slots
            .iter()
            .find(|s| s.name == name)
            .ok_or_else(|| Error::Config(format!("no parameter named `{name}`")))?;
        for (key, t) in [("m", m), ("v", v)] {
            if t.shape() != slot.var.shape() {
                return Err(Error::Config(format!(
                    "optimizer state `{name}.{key}` has shape {:?}, expected {:?}",
                    t.shape(),
                    slot.var.shape()
                )));
            }
        }
        slot.m
            .set(&m.to_device(slot.var.device())?.to_dtype(DType::F32)?)?;
        slot.v
            .set(&v.to_device(slot.var.device())?.to_dtype(DType::F32)?)?;
        Ok(())
    }

    /// Sets the steps taken (the `t` of the bias correction), as restored
    /// from a checkpoint along with [`set_moments`](Self::set_moments).
    pub fn set_step_count(&mut self, t: u64) {
        self.t = t;
    }

    /// A copy of the optimizer state for a checkpoint: `"{name}.m"` and
    /// `"{name}.v"` (f32, the parameter's shape) for each var and [`STEP_KEY`]
    /// (an i64 scalar). Ready for `candle_core::safetensors::save`. The copies
    /// take as much memory as the state itself.
    pub fn state_tensors(&self) -> Result<HashMap<String, Tensor>> {
        let mut out = HashMap::with_capacity(2 * self.slots.len() + 1);
        for s in &self.slots {
            out.insert(format!("{}.m", s.name), s.m.as_detached_tensor().copy()?);
            out.insert(format!("{}.v", s.name), s.v.as_detached_tensor().copy()?);
        }
        out.insert(
            STEP_KEY.to_string(),
            Tensor::new(self.t as i64, &Device::Cpu)?,
        );
        Ok(out)
    }

    /// Restores state written by [`state_tensors`](Self::state_tensors) (copied
    /// into the optimizer's own storage, converted to f32 and to its device).
    /// Every key must be present with the right shape; on error nothing changes.
    pub fn load_state(&mut self, state: &HashMap<String, Tensor>) -> Result<()> {
        let get = |key: String, shape: &candle_core::Shape| -> Result<&Tensor> {
            let t = state
                .get(&key)
                .ok_or_else(|| Error::Config(format!("optimizer state has no `{key}`")))?;
            if t.shape() != shape {
                return Err(Error::Config(format!(
                    "optimizer state `{key}` has shape {:?}, expected {shape:?}",
                    t.shape()
                )));
            }
            Ok(t)
        };
        let step = get(STEP_KEY.to_string(), &().into())?
            .to_dtype(DType::I64)?
            .to_scalar::<i64>()?;
        let step = u64::try_from(step)
            .map_err(|_| Error::Config(format!("optimizer step count {step} is negative")))?;
        let moments = self
            .slots
            .iter()
            .map(|s| {
                let m = get(format!("{}.m", s.name), s.var.shape())?;
                let v = get(format!("{}.v", s.name), s.var.shape())?;
                Ok((s.name.clone(), m, v))
            })
            .collect::<Result<Vec<_>>>()?;
        for (name, m, v) in moments {
            self.set_moments(&name, m, v)?;
        }
        self.t = step;
        Ok(())
    }
}

impl Slot {
    /// Whether `g` can be this parameter's gradient.
    fn check(&self, g: &Tensor) -> Result<()> {
        let p = self.var.as_tensor();
        if g.shape() != p.shape() {
            return Err(Error::Config(format!(
                "gradient of `{}` has shape {:?}, the parameter {:?}",
                self.name,
                g.shape(),
                p.shape()
            )));
        }
        if !is_kernel_dtype(g.dtype()) {
            return Err(Error::Unsupported(format!(
                "gradient of `{}` has dtype {:?}; fused AdamW takes f32, bf16 or f16",
                self.name,
                g.dtype()
            )));
        }
        if !g.device().same_device(p.device()) {
            return Err(Error::Config(format!(
                "gradient of `{}` is on another device",
                self.name
            )));
        }
        Ok(())
    }

    /// Updates parameter and state in place from the checked gradient `g`.
    fn update(&self, g: &Tensor, c: Coeffs) -> Result<()> {
        let p = self.var.as_tensor();
        match p.device() {
            Device::Cpu => {
                let g = g.contiguous()?;
                update_cpu(p, &g, self.m.as_tensor(), self.v.as_tensor(), c)?;
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Device::Cuda(_) => {
                let g = g.contiguous()?;
                cuda::update(p, &g, self.m.as_tensor(), self.v.as_tensor(), c)?;
                Ok(())
            }
            other => Err(Error::Unsupported(format!(
                "fused AdamW has no kernel for {:?} yet (parameter `{}`)",
                other.location(),
                self.name
            ))),
        }
    }
}
