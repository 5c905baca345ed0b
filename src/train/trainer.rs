//! The training loop: one optimizer step of a [`Plan`] on a [`TrainableModel`].
//!
//! A step runs `grad_accum` micro-batches of `micro_batch` sequences through
//! forward and backward (with the plan's checkpointing and attention), sums their gradients
//! ([`GradAccumulator`]), unscales and checks them under fp16 loss scaling, and
//! steps the optimizer: `candle_nn::AdamW` one tensor at a time (each gradient
//! dropped as soon as its tensor is updated), or [`FusedAdamW`] in place. Under
//! mixed precision the optimizer updates fp32 master weights, copied back into
//! the 16-bit compute weights after the step.

use super::data::DataSource;
use super::{build_model, Batch, TrainableModel};
use crate::measure::alloc;
use crate::{Error, ModelConfig, Result};
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use oomfix_strategies::accumulate::GradAccumulator;
use oomfix_strategies::adamw::FusedAdamW;
use oomfix_strategies::precision::{LossScaler, LossScalerConfig, MasterWeights};
use oomfix_strategies::{Attention, OptimizerImpl, Plan, Precision};
use std::path::PathBuf;
use std::time::Instant;

/// Settings of a training run besides the plan.
#[derive(Debug, Clone)]
pub struct TrainOptions {
    /// AdamW hyper-parameters.
    pub adamw: ParamsAdamW,
    /// Seed of the random initialisation and of synthetic data.
    pub seed: u64,
    /// Pretrained weights to start from (`None`: random initialisation).
    pub weights: Option<Vec<PathBuf>>,
}

impl Default for TrainOptions {
    fn default() -> Self {
        TrainOptions { adamw: ParamsAdamW { lr: 3e-4, ..Default::default() }, seed: 0, weights: None }
    }
}

/// What one optimizer step did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepStats {
    /// Mean loss over the micro-batches.
    pub loss: f32,
    /// Tokens processed.
    pub tokens: usize,
    /// Wall time of the step in seconds.
    pub seconds: f64,
    /// Heap high-water mark during forward and backward (0 without a counting allocator).
    pub forward_backward_peak: u64,
    /// Heap high-water mark during the optimizer step.
    pub optimizer_peak: u64,
    /// The optimizer step was skipped because fp16 gradients overflowed.
    pub skipped: bool,
}

impl StepStats {
    /// The higher of the two phase peaks.
    pub fn peak(&self) -> u64 {
        self.forward_backward_peak.max(self.optimizer_peak)
    }
}

enum Optim {
    /// One `candle_nn::AdamW` per tensor (with the var it updates), so each is
    /// stepped and its gradient freed in turn.
    Candle(Vec<(AdamW, Var)>),
    Fused(FusedAdamW),
}

/// Runs training steps of a plan.
pub struct Trainer {
    model: Box<dyn TrainableModel>,
    plan: Plan,
    device: Device,
    master: Option<MasterWeights>,
    optim: Optim,
    scaler: Option<LossScaler>,
    step: u64,
}

/// The compute dtype of a precision.
pub fn compute_dtype(p: Precision) -> DType {
    match p {
        Precision::F32 => DType::F32,
        Precision::Bf16 => DType::BF16,
        Precision::F16 => DType::F16,
    }
}

impl Trainer {
    /// Builds the model and the optimizer for `plan` on `device`.
    pub fn new(config: &ModelConfig, plan: Plan, device: &Device, options: &TrainOptions) -> Result<Self> {
        if plan.shard.world_size > 1 {
            return Err(Error::Usage(
                "sharded plans run one process per GPU; the single-device trainer runs world size 1".into(),
            ));
        }
        if plan.attention == Attention::Flash && !device.is_cpu() {
            return Err(Error::Usage(
                "flash attention runs on the CPU only; plan without the flash-attention strategy".into(),
            ));
        }
        let dtype = compute_dtype(plan.precision);
        let model = build_model(config, options.weights.as_deref(), dtype, device, options.seed)?;
        let compute: Vec<Var> = model.vars().iter().map(|(_, v)| v.clone()).collect();
        let master = plan.precision.is_mixed().then(|| MasterWeights::new(compute.clone())).transpose()?;
        let opt_vars = master.as_ref().map_or(compute, |m| m.master_vars().to_vec());
        let optim = match plan.optimizer {
            OptimizerImpl::CandleAdamW => Optim::Candle(
                opt_vars
                    .into_iter()
                    .map(|v| Ok((AdamW::new(vec![v.clone()], options.adamw.clone())?, v)))
                    .collect::<Result<_>>()?,
            ),
            OptimizerImpl::FusedAdamW => {
                let names = model.vars().iter().map(|(n, _)| n.clone());
                Optim::Fused(FusedAdamW::new_named(names.zip(opt_vars).collect(), options.adamw.clone())?)
            }
        };
        let scaler = (plan.precision == Precision::F16).then(|| LossScaler::new(LossScalerConfig::default())).transpose()?;
        Ok(Trainer { model, plan, device: device.clone(), master, optim, scaler, step: 0 })
    }

    /// The model being trained.
    pub fn model(&self) -> &dyn TrainableModel {
        self.model.as_ref()
    }

    /// The plan.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// Optimizer steps taken.
    pub fn steps(&self) -> u64 {
        self.step
    }

    fn batch(&self, data: &mut DataSource) -> Result<Batch> {
        let (b, s) = (self.plan.micro_batch, self.plan.seq_len);
        let config = self.model.config();
        let windows = data.next_windows(b, s, config.vocab);
        Batch::from_windows(config.family, config.vocab, &windows, b, s, self.step, &self.device)
    }

    /// One optimizer step over `grad_accum` micro-batches from `data`.
    pub fn step(&mut self, data: &mut DataSource) -> Result<StepStats> {
        let start = Instant::now();
        alloc::reset_peak();
        let scale = self.scaler.as_ref().map_or(1.0, LossScaler::scale);
        let mut acc = GradAccumulator::new();
        let mut loss_sum = 0.0;
        for _ in 0..self.plan.grad_accum {
            let batch = self.batch(data)?;
            let out = self.model.forward_backward(&batch, self.plan.checkpoint, self.plan.attention, scale)?;
            loss_sum += out.loss;
            acc.add(out.grads)?;
        }
        let mut grads = acc.finish(1.0 / self.plan.grad_accum as f64)?;
        let loss = loss_sum / self.plan.grad_accum as f32;
        if !loss.is_finite() {
            return Err(Error::NonFinite { step: self.step + 1, loss });
        }
        let forward_backward_peak = alloc::peak();
        alloc::reset_peak();
        let mut skipped = false;
        if let Some(scaler) = &mut self.scaler {
            let finite = scaler.unscale_and_check(&mut grads)?;
            scaler.update(!finite);
            skipped = !finite;
        }
        if !skipped {
            self.optimizer_step(grads)?;
        }
        let optimizer_peak = alloc::peak();
        self.step += 1;
        Ok(StepStats {
            loss,
            tokens: self.plan.micro_batch * self.plan.grad_accum * self.plan.seq_len,
            seconds: start.elapsed().as_secs_f64(),
            forward_backward_peak,
            optimizer_peak,
            skipped,
        })
    }

    fn optimizer_step(&mut self, grads: Vec<Tensor>) -> Result<()> {
        match &mut self.optim {
            Optim::Fused(opt) => opt.step(&grads)?,
            Optim::Candle(opts) => {
                for ((opt, var), g) in opts.iter_mut().zip(grads) {
                    // candle_nn::AdamW reads a GradStore: make one holding this gradient only.
                    let mut store = Tensor::new(0f32, &self.device)?.backward()?;
                    store.insert(var.as_tensor(), g.to_dtype(DType::F32)?);
                    opt.step(&store)?;
                }
            }
        }
        if let Some(m) = &self.master {
            m.sync_to_compute()?;
        }
        Ok(())
    }
}
