//! Training steps of a plan on any [`Model`].

use crate::track;
use crate::track::alloc::{self, Phase};
use crate::train::{clip_factor, Optim};
use crate::train::{StepStats, TrainOptions};
use crate::{Error, Result};
use candle_core::{DType, Device, Tensor, Var};
use oomfix_strategies::accumulate::GradAccumulator;
use oomfix_strategies::model::{self, MicroBatch, Model};
use oomfix_strategies::precision::{LossScaler, LossScalerConfig, MasterWeights};
use oomfix_strategies::shard::{Comm, Traffic};
use oomfix_strategies::{Attention, Execution, Plan, Precision};
use std::time::Instant;

/// Runs optimizer steps of a [`Plan`] on a model oomfix does not know.
///
/// The model is built by the caller's builder in the plan's compute dtype;
/// everything else is the plan's fixes: micro-batches of `micro_batch`
/// samples, `grad_accum` of them per step ([`GradAccumulator`]), fp32
/// master weights under mixed precision ([`MasterWeights`]) with dynamic
/// loss scaling for fp16, blocks recomputed and attention computed as the
/// plan's [`Execution`] says, and the plan's optimizer: `candle_nn::AdamW`
/// one tensor at a time, [`FusedAdamW`](oomfix_strategies::adamw::FusedAdamW),
/// [`OffloadedAdamW`](oomfix_strategies::offload::OffloadedAdamW) (on the CPU the
/// "host" is the same memory: offload then changes where the step runs, not
/// how much memory it takes), or, built with [`sharded`](Self::sharded),
/// [`ShardedOptimizer`](oomfix_strategies::shard::ShardedOptimizer) over a [`Comm`], at the learning rate of
/// `options.schedule` (as the main trainer: [`crate::train::LrSchedule`]).
///
/// Micro-batch `k` of step `t` on rank `r` of `w` asks the model for
/// micro-batch number `((t·w) + r)·grad_accum + k` ([`MicroBatch::index`]).
///
/// ```
/// # use candle_core::{DType, Device, Tensor, Var};
/// # use oomfix_strategies::model::{Forward, MicroBatch, Model};
/// # struct Regression { w: Var }
/// # impl Model for Regression {
/// #     fn vars(&self) -> Vec<Var> { vec![self.w.clone()] }
/// #     fn forward(&self, b: &MicroBatch) -> candle_core::Result<Forward<'_>> {
/// #         let x = Tensor::ones((b.size, 4), self.w.dtype(), self.w.device())?;
/// #         Ok(Forward::Loss(x.matmul(self.w.as_tensor())?.sqr()?.mean_all()?))
/// #     }
/// # }
/// use oomfix::anymodel::AnyTrainer;
/// use oomfix::{Plan, TrainOptions};
///
/// let build = |dtype: DType, dev: &Device| Ok(Regression { w: Var::ones((4, 1), dtype, dev)? });
/// let plan = Plan { micro_batch: 2, grad_accum: 2, ..Plan::baseline(4, 1) };
/// let mut trainer = AnyTrainer::new(build, plan, &Device::Cpu, &TrainOptions::default())?;
/// let first = trainer.step()?.loss;
/// let second = trainer.step()?.loss;
/// assert!(second < first);
/// # Ok::<(), oomfix::Error>(())
/// ```
pub struct AnyTrainer<M: Model> {
    model: M,
    vars: Vec<Var>,
    plan: Plan,
    master: Option<MasterWeights>,
    optim: Optim,
    scaler: Option<LossScaler>,
    accumulator: GradAccumulator,
    execution: Execution,
    device: Device,
    rank: usize,
    world: usize,
    step: u64,
    /// `adamw.lr`: the rate the schedule is a factor of.
    peak_lr: f64,
    /// The learning rate over the run (the main trainer's, [`crate::train::LrSchedule`]).
    schedule: crate::train::LrSchedule,
    /// The global norm the gradients are clipped to (`None`: no clipping).
    max_grad_norm: Option<f64>,
    /// What was live before the model was built ([`track::phase_peak`]).
    live_base: u64,
}

/// Whether `model` can run `plan`'s fixes; a usage error naming the first
/// it cannot.
fn check_capabilities<M: Model>(model: &M, plan: &Plan) -> Result<()> {
    let caps = model.capabilities();
    if !caps.computes_in(plan.precision) {
        return Err(Error::Usage(format!(
            "the plan computes in {}, which the model does not support",
            plan.precision
        )));
    }
    if !plan.checkpoint.segments(1).is_empty() && caps.blocks == 0 {
        return Err(Error::Usage(
            "the plan checkpoints blocks, and the model gives none".into(),
        ));
    }
    if plan.attention == Attention::Flash && !caps.attention {
        return Err(Error::Usage(
            "the plan uses flash attention, and the model computes its own attention".into(),
        ));
    }
    Ok(())
}

impl<M: Model> AnyTrainer<M> {
    /// Builds the model with `build(compute dtype, device)` and the
    /// optimizer for `plan` (world size 1) on `device`. `options` gives the
    /// AdamW hyper-parameters and the fixes whose execution hooks make the
    /// pass; its seed and weights are the builder's business.
    pub fn new<B>(build: B, plan: Plan, device: &Device, options: &TrainOptions) -> Result<Self>
    where
        B: FnOnce(DType, &Device) -> candle_core::Result<M>,
    {
        if plan.shard.world_size > 1 {
            return Err(Error::Usage(
                "a sharded plan needs a communicator: AnyTrainer::sharded".into(),
            ));
        }
        Self::build(build, plan, device, options, None)
    }

    /// Like [`new`](Self::new), for one rank of a sharded plan on the CPU:
    /// `comm` connects the plan's `world_size` ranks (each rank builds its
    /// own trainer with the same builder, in the same order of calls).
    /// fp16 (loss scaling across ranks) is not supported here.
    pub fn sharded<B>(
        build: B,
        plan: Plan,
        comm: Box<dyn Comm>,
        options: &TrainOptions,
    ) -> Result<Self>
    where
        B: FnOnce(DType, &Device) -> candle_core::Result<M>,
    {
        if plan.shard.stage == 0 || plan.shard.world_size != comm.world_size() {
            return Err(Error::Usage(format!(
                "the plan shards over {} ranks at ZeRO stage {}; the communicator has {} ranks",
                plan.shard.world_size,
                plan.shard.stage,
                comm.world_size()
            )));
        }
        if plan.precision == Precision::F16 {
            return Err(Error::Usage(
                "fp16 loss scaling is not supported with sharding here; use bf16 or fp32".into(),
            ));
        }
        Self::build(build, plan, &Device::Cpu, options, Some(comm))
    }

    fn build<B>(
        build: B,
        plan: Plan,
        device: &Device,
        options: &TrainOptions,
        comm: Option<Box<dyn Comm>>,
    ) -> Result<Self>
    where
        B: FnOnce(DType, &Device) -> candle_core::Result<M>,
    {
        if plan.micro_batch == 0 || plan.grad_accum == 0 {
            return Err(Error::Usage(
                "a plan needs a micro-batch and accumulation of at least 1".into(),
            ));
        }
        let live_base = track::live_bytes(device)?;
        let model = build(model::dtype_of(plan.precision), device)?;
        check_capabilities(&model, &plan)?;
        let vars = model.vars();
        if vars.is_empty() {
            return Err(Error::Usage("the model has no variables to train".into()));
        }
        // A sharded optimizer keeps the masters of its own share itself.
        let sharded = comm.as_ref().is_some_and(|c| c.world_size() > 1);
        let master = (plan.precision.is_mixed() && !plan.optimizer.is_offloaded() && !sharded)
            .then(|| MasterWeights::new(vars.clone()))
            .transpose()?;
        let opt_vars = master
            .as_ref()
            .map_or_else(|| vars.clone(), |m| m.master_vars().to_vec());
        let (rank, world) = comm.as_ref().map_or((0, 1), |c| (c.rank(), c.world_size()));
        let named = opt_vars.iter().enumerate();
        let named = named.map(|(i, v)| (i.to_string(), v.clone())).collect();
        let optim = Optim::new(&plan, named, &options.adamw, comm)?;
        let scaler = (plan.precision == Precision::F16)
            .then(|| LossScaler::new(LossScalerConfig::default()))
            .transpose()?;
        Ok(AnyTrainer {
            model,
            vars,
            plan,
            master,
            optim,
            scaler,
            accumulator: GradAccumulator::new(),
            execution: Execution::for_plan(&plan, &options.fixes),
            device: device.clone(),
            rank,
            world,
            step: 0,
            peak_lr: options.adamw.lr,
            schedule: options.schedule,
            max_grad_norm: options.max_grad_norm,
            live_base,
        })
    }

    /// The model being trained.
    pub fn model(&self) -> &M {
        &self.model
    }

    /// The plan.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// Optimizer steps taken.
    pub fn steps(&self) -> u64 {
        self.step
    }

    /// One optimizer step over `grad_accum` micro-batches the model makes.
    /// The peaks of [`StepStats`] are the heap's high-water marks of the
    /// passes and of the optimizer step (0 without
    /// [`crate::track::CountingAlloc`]), or on CUDA the pool's, above what
    /// was live before the trainer was built.
    pub fn step(&mut self) -> Result<StepStats> {
        let start = Instant::now();
        let before = self.traffic();
        let outcome = self.phases();
        alloc::set_phase(Phase::Setup);
        let (loss, forward_backward_peak, optimizer_peak, skipped, grad_norm) = outcome?;
        let lr = self.schedule.rate(self.peak_lr, self.step);
        self.step += 1;
        Ok(StepStats {
            loss,
            tokens: self.plan.micro_batch * self.plan.grad_accum * self.plan.seq_len,
            seconds: start.elapsed().as_secs_f64(),
            forward_backward_peak,
            optimizer_peak,
            skipped,
            lr,
            grad_norm,
            collectives: self.traffic() - before,
        })
    }

    /// What the sharded optimizer's collectives moved and took so far.
    fn traffic(&self) -> Traffic {
        self.optim.traffic()
    }

    fn phases(&mut self) -> Result<(f32, u64, u64, bool, f64)> {
        alloc::set_phase(Phase::Forward);
        alloc::reset_peak();
        track::reset_device_peak(&self.device)?;
        if let Optim::Sharded(opt) = &mut self.optim {
            opt.gather_params()?; // stage 3
        }
        let scale = self.scaler.as_ref().map_or(1.0, LossScaler::scale);
        let exec = self.execution.loss_scale(scale);
        self.optim.start_gradients(&mut self.accumulator);
        let accum = self.plan.grad_accum as u64;
        let mut loss_sum = 0.0;
        for k in 0..accum {
            alloc::set_phase(Phase::Forward);
            let index = ((self.step * self.world as u64) + self.rank as u64) * accum + k;
            let batch =
                MicroBatch::new(self.plan.micro_batch, index, exec).with_seq_len(self.plan.seq_len);
            let out = model::forward_backward(&self.model, &self.vars, &batch)?;
            alloc::set_phase(Phase::Backward);
            loss_sum += out.loss.to_dtype(DType::F32)?.to_scalar::<f32>()?;
            let grads = out.grads.into_iter().flatten().collect();
            self.optim.add_gradients(&mut self.accumulator, grads)?;
        }
        // The mean gradient of the step: on a sharded plan, of this rank's share.
        let mut grads = self
            .optim
            .mean_gradients(&mut self.accumulator, self.plan.grad_accum)?;
        let loss = loss_sum / accum as f32;
        if !loss.is_finite() {
            return Err(Error::NonFinite {
                step: self.step + 1,
                loss,
            });
        }
        let forward_backward_peak = track::phase_peak(&self.device, self.live_base)?;
        alloc::set_phase(Phase::OptimizerStep);
        alloc::reset_peak();
        let mut skipped = false;
        if let Some(scaler) = &mut self.scaler {
            let finite = scaler.unscale_and_check(&mut grads)?;
            scaler.update(!finite);
            skipped = !finite;
        }
        let grad_norm = if skipped {
            f64::NAN
        } else {
            self.optimizer_step(grads)?
        };
        Ok((
            loss,
            forward_backward_peak,
            track::phase_peak(&self.device, self.live_base)?,
            skipped,
            grad_norm,
        ))
    }

    /// The step, its gradients (on a sharded plan this rank's reduced
    /// share) clipped to `max_grad_norm` (the coefficient a factor of the
    /// update, as in [`crate::Trainer`]); returns their global norm before
    /// clipping (over all ranks when sharded).
    fn optimizer_step(&mut self, grads: Vec<Tensor>) -> Result<f64> {
        let lr = self.schedule.rate(self.peak_lr, self.step);
        let (step, max_norm) = (self.step + 1, self.max_grad_norm);
        let norm = self.optim.global_norm(&grads)?;
        let factor = clip_factor(step, norm, max_norm)?;
        self.optim.step(grads, lr, factor, &self.device)?;
        if let Some(m) = &self.master {
            m.sync_to_compute()?;
        }
        Ok(norm)
    }
}
