//! Mixed precision: 16-bit compute, fp32 master weights, dynamic loss scaling.
//!
//! The planner half is [`MixedPrecision`]. The mechanism: [`cast_var_map`] turns
//! a model's weights to bf16/f16, [`MasterWeights`] keeps their fp32 masters for
//! the optimizer, and [`LossScaler`] keeps f16 gradients in range.
//!
//! A mixed-precision step with f16 compute:
//!
//! ```text
//! let loss = model.forward(..)?;                       // f16 compute vars
//! let store = scaler.scale_loss(&loss)?.backward()?;
//! let mut grads = masters.grads(&store, None)?;        // f16, detached
//! drop(store);
//! let finite = scaler.unscale_and_check(&mut grads)?;
//! if finite {
//!     opt.step(&grads)?;                               // FusedAdamW over masters.master_vars()
//!     masters.sync_to_compute()?;
//! }
//! scaler.update(!finite);
//! ```

use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, DType, Layout, Storage, Tensor, Var};
use candle_nn::VarMap;

use crate::accumulate::collect_grads;
use crate::float::{contiguous_range, is_kernel_dtype, with_float_vec, Float};
use crate::{Error, ModelFacts, Plan, Precision, Result, SearchContext, StateBytes, Strategy};

/// Planner half: switch fp32 compute to bf16 (or f16 with loss scaling where
/// the device has no bf16).
#[derive(Debug, Clone, Copy, Default)]
pub struct MixedPrecision;

impl Strategy for MixedPrecision {
    fn name(&self) -> &'static str {
        "precision"
    }
    fn tighten(&self, plan: &Plan, ctx: &SearchContext) -> Option<Plan> {
        if plan.precision != Precision::F32 {
            return None;
        }
        Some(Plan {
            precision: half_of(ctx),
            ..*plan
        })
    }
    /// Needs a model that can be built in the 16-bit dtype of the device.
    fn unusable(&self, ctx: &SearchContext) -> Option<String> {
        let half = half_of(ctx);
        (!ctx.model.computes_in(half)).then(|| format!("needs a model that can be built in {half}"))
    }
    /// Back to fp32 (faster where 16-bit products are not: the CPU widens them).
    fn relax(&self, plan: &Plan, _ctx: &SearchContext) -> Option<Plan> {
        plan.precision.is_mixed().then_some(Plan {
            precision: Precision::F32,
            ..*plan
        })
    }
    /// Weights and gradients in the compute dtype; under mixed precision fp32
    /// master weights beside them ([`MasterWeights`]).
    fn memory(&self, plan: &Plan, model: &ModelFacts, state: &mut StateBytes) {
        let compute = model.parameters * plan.precision.compute_bytes();
        state.weights = compute;
        state.step_weights = compute;
        state.gradients = compute;
        state.step_gradients = compute;
        if plan.precision.is_mixed() {
            state.master_weights = 4 * model.parameters;
        }
    }
}

/// The 16-bit precision of a search: bf16 where the device computes in it,
/// else fp16.
fn half_of(ctx: &SearchContext) -> Precision {
    if ctx.supports_bf16 {
        Precision::Bf16
    } else {
        Precision::F16
    }
}

// ---------------------------------------------------------------------------
// Mechanism: dynamic loss scaling.

/// Settings of a [`LossScaler`]; the defaults are those of PyTorch's
/// `torch.cuda.amp.GradScaler`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LossScalerConfig {
    /// Scale before the first step (default 2^16).
    pub init_scale: f64,
    /// Factor applied after `growth_interval` finite steps in a row (default 2).
    pub growth_factor: f64,
    /// Factor applied after a step with non-finite gradients (default 0.5).
    pub backoff_factor: f64,
    /// Finite steps in a row before the scale grows (default 2000).
    pub growth_interval: u32,
}

impl Default for LossScalerConfig {
    fn default() -> Self {
        LossScalerConfig {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
        }
    }
}

/// Dynamic loss scaling for f16 training, as PyTorch's `GradScaler` does it.
///
/// Per step: backpropagate from [`scale_loss`](Self::scale_loss); call
/// [`unscale_and_check`](Self::unscale_and_check) on the gradients; take the
/// optimizer step only if it returned `true`; then call
/// [`update`](Self::update) with whether non-finite values were found. bf16
/// has f32's exponent range and normally needs no loss scaling.
///
/// ```
/// use oomfix_strategies::precision::{LossScaler, LossScalerConfig};
///
/// let mut s = LossScaler::new(LossScalerConfig { growth_interval: 2, ..Default::default() })?;
/// s.update(true); // overflow: back off
/// assert_eq!(s.scale(), 32768.0);
/// s.update(false);
/// s.update(false); // two finite steps: grow
/// assert_eq!(s.scale(), 65536.0);
/// # Ok::<(), oomfix_strategies::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct LossScaler {
    config: LossScalerConfig,
    scale: f64,
    /// Finite steps since the last change of scale.
    growth_tracker: u32,
}

impl LossScaler {
    /// A scaler at `config.init_scale`. Fails unless the scale is positive and
    /// finite, `growth_factor > 1`, `0 < backoff_factor < 1` and `growth_interval >= 1`.
    pub fn new(config: LossScalerConfig) -> Result<Self> {
        let c = &config;
        let ok = c.init_scale.is_finite()
            && c.init_scale > 0.0
            && c.growth_factor.is_finite()
            && c.growth_factor > 1.0
            && c.backoff_factor > 0.0
            && c.backoff_factor < 1.0
            && c.growth_interval >= 1;
        if !ok {
            return Err(Error::Config(format!("invalid loss scaler settings {c:?}")));
        }
        Ok(LossScaler {
            config,
            scale: config.init_scale,
            growth_tracker: 0,
        })
    }

    /// The current scale.
    pub fn scale(&self) -> f64 {
        self.scale
    }

    /// Finite steps since the scale last changed (with [`scale`](Self::scale),
    /// the state a checkpoint needs; see [`restore`](Self::restore)).
    pub fn growth_tracker(&self) -> u32 {
        self.growth_tracker
    }

    /// Restores the state saved from [`scale`](Self::scale) and
    /// [`growth_tracker`](Self::growth_tracker).
    pub fn restore(&mut self, scale: f64, growth_tracker: u32) -> Result<()> {
        if !(scale.is_finite() && scale > 0.0) {
            return Err(Error::Config(format!("invalid loss scale {scale}")));
        }
        self.scale = scale;
        self.growth_tracker = growth_tracker;
        Ok(())
    }

    /// `loss * scale`, to backpropagate from.
    pub fn scale_loss(&self, loss: &Tensor) -> Result<Tensor> {
        Ok(loss.affine(self.scale, 0.0)?)
    }

    /// Divides every gradient by the scale (each is replaced by a new tensor of
    /// its dtype) and returns whether all values are finite afterwards. One
    /// gradient-sized temporary exists at a time.
    pub fn unscale_and_check(&self, grads: &mut [Tensor]) -> Result<bool> {
        let inv = 1.0 / self.scale;
        let mut finite = true;
        for g in grads.iter_mut() {
            let unscaled = g.affine(inv, 0.0)?;
            finite &= all_finite(&unscaled)?;
            *g = unscaled;
        }
        Ok(finite)
    }

    /// Adjusts the scale after a step: back off on non-finite gradients (and
    /// restart the count), grow after `growth_interval` finite steps in a row.
    pub fn update(&mut self, found_inf: bool) {
        if found_inf {
            self.scale *= self.config.backoff_factor;
            self.growth_tracker = 0;
            return;
        }
        self.growth_tracker += 1;
        if self.growth_tracker >= self.config.growth_interval {
            let grown = self.scale * self.config.growth_factor;
            // like PyTorch, never grow to infinity
            if grown.is_finite() {
                self.scale = grown;
            }
            self.growth_tracker = 0;
        }
    }
}

/// Whether every value of `t` is finite. Contiguous f32/bf16/f16 CPU tensors are
/// read in place; elsewhere `sum(t * 0)` is used (0 when all values are finite,
/// NaN otherwise), which needs one temporary of `t`'s size.
fn all_finite(t: &Tensor) -> Result<bool> {
    if t.device().is_cpu() && t.is_contiguous() && is_kernel_dtype(t.dtype()) {
        let (storage, layout) = t.storage_and_layout();
        if let Storage::Cpu(s) = &*storage {
            return Ok(cpu_all_finite(s, layout)?);
        }
    }
    let zero_or_nan = crate::reduce::sum_all(&t.affine(0.0, 0.0)?)?
        .to_dtype(DType::F32)?
        .to_scalar::<f32>()?;
    Ok(zero_or_nan.is_finite())
}

fn cpu_all_finite(s: &CpuStorage, l: &Layout) -> candle_core::Result<bool> {
    let r = contiguous_range(l)?;
    Ok(with_float_vec!(s, v => v[r].iter().all(|x| x.to_f32().is_finite())))
}

// ---------------------------------------------------------------------------
// Mechanism: fp32 master weights.

/// fp32 master copies of a model's 16-bit compute vars.
///
/// The model computes with the compute vars (bf16 or f16); the optimizer
/// updates the masters (f32, see [`master_vars`](Self::master_vars)), and
/// [`sync_to_compute`](Self::sync_to_compute) rounds the masters back into the
/// compute vars after each step. An f32 compute var is its own master (no
/// copy, nothing to sync). Memory: 4 bytes per element of every 16-bit var,
/// beside its 2-byte compute copy.
///
/// ```
/// use candle_core::{DType, Device, Tensor, Var};
/// use oomfix_strategies::precision::MasterWeights;
///
/// let w = Var::from_tensor(&Tensor::new(&[1.5f32, -2.0], &Device::Cpu)?.to_dtype(DType::BF16)?)?;
/// let mw = MasterWeights::new(vec![w.clone()])?;
/// assert_eq!(mw.master_vars()[0].dtype(), DType::F32);
/// mw.master_vars()[0].set(&Tensor::new(&[0.25f32, 3.0], &Device::Cpu)?)?;
/// mw.sync_to_compute()?;
/// assert_eq!(w.to_dtype(DType::F32)?.to_vec1::<f32>()?, [0.25, 3.0]);
/// # Ok::<(), oomfix_strategies::Error>(())
/// ```
#[derive(Debug)]
pub struct MasterWeights {
    compute: Vec<Var>,
    masters: Vec<Var>,
}

impl MasterWeights {
    /// Masters for `compute_vars` (f32, bf16 or f16; other dtypes are an error).
    pub fn new(compute_vars: Vec<Var>) -> Result<Self> {
        let masters = compute_vars
            .iter()
            .enumerate()
            .map(|(i, v)| match v.dtype() {
                DType::F32 => Ok(v.clone()),
                DType::BF16 | DType::F16 => Ok(Var::from_tensor(&v.to_dtype(DType::F32)?)?),
                other => Err(Error::Unsupported(format!(
                    "compute var {i} has dtype {other:?}; master weights need f32, bf16 or f16"
                ))),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(MasterWeights {
            compute: compute_vars,
            masters,
        })
    }

    /// The f32 master vars, in the order of the compute vars: hand these to the optimizer.
    pub fn master_vars(&self) -> &[Var] {
        &self.masters
    }

    /// The compute vars, as given.
    pub fn compute_vars(&self) -> &[Var] {
        &self.compute
    }

    /// Copies every master into its compute var (cast to the compute dtype, one
    /// compute-sized temporary at a time). f32 compute vars are skipped: they
    /// are their own masters.
    pub fn sync_to_compute(&self) -> Result<()> {
        for (c, m) in self.compute.iter().zip(&self.masters) {
            if c.dtype() != DType::F32 {
                c.set(&m.as_tensor().to_dtype(c.dtype())?)?;
            }
        }
        Ok(())
    }

    /// The gradients of the compute vars, detached, in master order. With
    /// `dtype` `None` they keep the compute dtype, which [`FusedAdamW`](crate::adamw::FusedAdamW)
    /// reads directly (no widened copy); `Some(DType::F32)` widens them for
    /// optimizers that need the master's dtype (4 bytes per element more).
    pub fn grads(&self, store: &GradStore, dtype: Option<DType>) -> Result<Vec<Tensor>> {
        let grads = collect_grads(store, &self.compute)?;
        match dtype {
            None => Ok(grads),
            Some(d) => grads.into_iter().map(|g| Ok(g.to_dtype(d)?)).collect(),
        }
    }
}

/// Converts every floating-point var of `varmap` to `dtype`, replacing it in the
/// map by a new var (vars already of `dtype` are kept). Models built from the map
/// afterwards (`VarBuilder::from_varmap`) use the converted vars; models built
/// before keep the old ones.
pub fn cast_var_map(varmap: &VarMap, dtype: DType) -> Result<()> {
    let mut vars = varmap
        .data()
        .lock()
        .map_err(|_| Error::Config("the var map's lock is poisoned".into()))?;
    for var in vars.values_mut() {
        if var.dtype().is_float() && var.dtype() != dtype {
            *var = Var::from_tensor(&var.to_dtype(dtype)?)?;
        }
    }
    Ok(())
}
