//! One optimizer step: the micro-batches' forward and backward, their
//! gradients accumulated (sharded: reduced to their owners), unscaled and
//! checked under fp16 loss scaling, clipped, and the optimizer's update.

use super::zero::ShardedSegments;
use super::Trainer;
use crate::track;
use crate::track::alloc::{self, mark_tensors, Phase};
use crate::track::tag::{Component, Module, Op, Scope};
use crate::train::data::DataSource;
use crate::train::optim::Optim;
use crate::{Error, Result};
use candle_core::{DType, Device, Tensor};
use oomfix_strategies::clip;
use oomfix_strategies::model;
use oomfix_strategies::precision::LossScaler;
use oomfix_strategies::shard::Traffic;
use std::time::Instant;

/// What one optimizer step did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepStats {
    /// Mean loss over the micro-batches.
    pub loss: f32,
    /// Tokens processed.
    pub tokens: usize,
    /// Wall time of the step in seconds.
    pub seconds: f64,
    /// Heap high-water mark during forward and backward (0 without a
    /// counting allocator), or on CUDA the memory pool's used high-water
    /// mark, above what was live before the trainer was built.
    pub forward_backward_peak: u64,
    /// Heap high-water mark during the optimizer step (as
    /// `forward_backward_peak`); on CUDA the pool's used high-water mark over
    /// the whole step.
    pub optimizer_peak: u64,
    /// The optimizer step was skipped because fp16 gradients overflowed.
    pub skipped: bool,
    /// The learning rate of the step.
    pub lr: f64,
    /// The global L2 norm of the step's gradients before clipping: after
    /// accumulation, of the unscaled fp32 values under fp16 loss scaling, over
    /// all ranks. Not finite on a step skipped for an fp16 overflow (NaN
    /// where it was not computed: sharded).
    pub grad_norm: f64,
    /// What this rank's collectives of gradients and parameters moved and
    /// took during the step (zero unless sharded).
    pub collectives: Traffic,
}

impl StepStats {
    /// The higher of the two phase peaks.
    pub fn peak(&self) -> u64 {
        self.forward_backward_peak.max(self.optimizer_peak)
    }
}

/// The factor step `step`'s gradients of global norm `norm` are multiplied
/// by to clip them to `max_norm` (1 without a limit); a non-finite norm stops
/// training (such gradients would make every weight NaN).
fn clip_factor(step: u64, norm: f64, max_norm: Option<f64>) -> Result<f64> {
    if !norm.is_finite() {
        return Err(Error::Runtime(format!(
            "step {step}: the gradient norm is {norm}; training stopped"
        )));
    }
    Ok(max_norm.map_or(1.0, |max| clip::clip_coefficient(norm, max)))
}

impl Trainer {
    /// One optimizer step over `grad_accum` micro-batches from `data` (at
    /// world size N, this rank's slice of the N × `grad_accum` micro-batches
    /// the step takes from `data`; every rank must be given the same data).
    /// [`StepStats::tokens`] counts the tokens of all ranks.
    ///
    /// Sets the allocation [`Phase`] as it goes (forward, backward per
    /// micro-batch, then the optimizer step; the model switches to backward
    /// once its loss is computed) and marks the gradients' buffers for
    /// recorded timelines.
    pub fn step(&mut self, data: &mut DataSource) -> Result<StepStats> {
        let start = Instant::now();
        let before = self.traffic();
        let trimming = self
            .trim_between_phases
            .then(|| TrimBetweenPhases::on(&self.device));
        let outcome = self.step_phases(data);
        alloc::set_phase(Phase::Setup);
        drop(trimming);
        let (loss, forward_backward_peak, optimizer_peak, skipped, grad_norm) = outcome?;
        let lr = self.lr();
        self.step += 1;
        Ok(StepStats {
            loss,
            tokens: self.plan.micro_batch
                * self.plan.grad_accum
                * self.plan.seq_len
                * self.world_size(),
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

    /// For examples, what each of this rank's micro-batches of the step
    /// weighs: its learned tokens × micro-batches of the step (all ranks) ÷
    /// the learned tokens of the step, so that the step's loss and gradient
    /// are the mean over every learned token of the step, whatever the
    /// accumulation and the ranks (transformers' `num_items_in_batch`);
    /// `None` for token streams, whose micro-batches weigh the same.
    fn example_weights(&self, data: &mut DataSource) -> Option<Vec<f64>> {
        let DataSource::Examples(examples) = data else {
            return None;
        };
        let (rank, world, accum) = (self.rank(), self.world_size(), self.plan.grad_accum);
        let learned =
            examples.learned_ahead(world * accum, self.plan.micro_batch, self.plan.seq_len);
        let total: usize = learned.iter().sum();
        let all = (world * accum) as f64;
        Some(
            learned[rank * accum..(rank + 1) * accum]
                .iter()
                .map(|&n| n as f64 * all / total.max(1) as f64)
                .collect(),
        )
    }

    /// The phases of [`step`](Self::step): `(loss, forward/backward peak,
    /// optimizer peak, skipped, gradient norm)`.
    fn step_phases(&mut self, data: &mut DataSource) -> Result<(f32, u64, u64, bool, f64)> {
        let _scope = Scope::module(Module::ROOT);
        alloc::set_phase(Phase::Forward);
        alloc::reset_peak();
        track::reset_device_peak(&self.device)?;
        let scale = self.scaler.as_ref().map_or(1.0, LossScaler::scale);
        self.optim.start_gradients(&mut self.accumulator);
        let mut loss_sum = 0.0;
        let (rank, world) = (self.rank(), self.world_size());
        let per_rank = self.plan.micro_batch * self.plan.grad_accum;
        let weights = self.example_weights(data);
        data.skip_windows(rank * per_rank, self.plan.seq_len);
        if let Optim::Sharded(opt) = &mut self.optim {
            let _op = Scope::op(Op::WeightSync);
            match &self.units {
                // Each segment gathers its blocks' parameters itself.
                Some(units) => opt.gather(&units.outside)?,
                None => opt.gather_params()?,
            }
        }
        let accum = self.plan.grad_accum as u64;
        for k in 0..accum {
            alloc::set_phase(Phase::Forward);
            let index = (self.step * world as u64 + rank as u64) * accum + k;
            let weight = weights.as_ref().map_or(1.0, |w| w[k as usize]);
            let exec = self.execution.loss_scale(scale * weight);
            let batch = self
                .micro_batch(data, index, self.step, exec, true)?
                .expect("training batches wrap around");
            let vars = &self.vars;
            let out = match (&mut self.optim, &self.units) {
                (Optim::Sharded(opt), Some(units)) => {
                    let mut hook = ShardedSegments { opt, units, vars };
                    model::forward_backward_with(self.model.as_ref(), vars, &batch, &mut hook)?
                }
                _ => model::forward_backward(self.model.as_ref(), vars, &batch)?,
            };
            alloc::set_phase(Phase::Backward);
            self.trace_pool("backward");
            // The gradients the segments' hook did not take.
            let grads: Vec<Tensor> = out.grads.into_iter().flatten().collect();
            mark_tensors(&grads, Component::Gradients);
            loss_sum += out.loss.to_dtype(DType::F32)?.to_scalar::<f32>()? * weight as f32;
            let _op = Scope::op(Op::GradAccumulate);
            match (&mut self.optim, &self.units) {
                // The blocks' gradients were reduced segment by segment.
                (Optim::Sharded(opt), Some(units)) => opt.reduce_some(&units.outside, grads)?,
                _ => self.optim.add_gradients(&mut self.accumulator, grads)?,
            }
            self.trace_pool("accumulate");
        }
        data.skip_windows((world - 1 - rank) * per_rank, self.plan.seq_len);
        // The mean gradient of the step: on a sharded plan, of this rank's share.
        let mut grads = {
            let _op = Scope::op(Op::GradAccumulate);
            self.optim
                .mean_gradients(&mut self.accumulator, self.plan.grad_accum)?
        };
        mark_tensors(&grads, Component::Gradients);
        let mut loss = loss_sum / self.plan.grad_accum as f32;
        if let Some(comm) = self.comm() {
            let sum = comm.all_reduce_sum(&Tensor::new(&[loss], &Device::Cpu)?)?;
            loss = sum.to_vec1::<f32>()?[0] / world as f32;
        }
        if let Optim::Sharded(opt) = &mut self.optim {
            opt.release_params()?;
        }
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
            let _op = Scope::op(Op::GradUnscale);
            let mut finite = scaler.unscale_and_check(&mut grads)?;
            mark_tensors(&grads, Component::Gradients);
            // Every rank skips, or none: an overflow on one is an overflow of the sum.
            if let Optim::Sharded(opt) = &self.optim {
                let t = Tensor::new(&[u8::from(!finite)], &Device::Cpu)?;
                finite = opt.comm().all_reduce_sum(&t)?.to_vec1::<u8>()?[0] == 0;
            }
            scaler.update(!finite);
            skipped = !finite;
        }
        let grad_norm = if skipped {
            match self.optim {
                Optim::Sharded(_) => f64::NAN,
                _ => clip::global_norm(&grads)?,
            }
        } else {
            let start = Instant::now();
            let norm = self.optimizer_step(grads)?;
            let seconds = start.elapsed().as_secs_f64();
            tracing::debug!(
                seconds,
                optimizer = self.plan.optimizer.as_str(),
                "optimizer step"
            );
            norm
        };
        self.trace_pool("optimizer step");
        Ok((
            loss,
            forward_backward_peak,
            track::phase_peak(&self.device, self.live_base)?,
            skipped,
            grad_norm,
        ))
    }

    /// Logs the CUDA pool's counters after `moment` when debug logging is on
    /// (`track::cuda::trace_pool` in `cuda` builds); nothing elsewhere.
    fn trace_pool(&self, moment: &str) {
        #[cfg(feature = "cuda")]
        if let Device::Cuda(cuda) = &self.device {
            crate::track::cuda::trace_pool(cuda, moment);
        }
        let _ = moment;
    }

    /// The learning rate of the step about to be taken.
    fn lr(&self) -> f64 {
        self.schedule.rate(self.peak_lr, self.step)
    }

    /// The optimizer step from the step's gradients, clipped to
    /// `max_grad_norm`; returns their global norm before clipping. A
    /// non-finite norm stops training (such gradients would make every
    /// weight NaN), leaving the weights as they were.
    fn optimizer_step(&mut self, grads: Vec<Tensor>) -> Result<f64> {
        let _scope = Scope::new(Module::intern("optimizer"), Op::AdamW);
        let lr = self.lr();
        // On a sharded plan `grads` are this rank's share: the norm is the
        // ranks' together.
        let norm = self.optim.global_norm(&grads)?;
        let factor = clip_factor(self.step + 1, norm, self.max_grad_norm)?;
        self.optim.step(grads, lr, factor, &self.device)?;
        if let Some(m) = &self.master {
            let _op = Scope::op(Op::WeightSync);
            m.sync_to_compute()?;
        }
        Ok(norm)
    }
}

/// While alive, the CUDA pool of a device is trimmed at every phase change
/// ([`TrainOptions::trim_between_phases`]); nothing on other devices.
struct TrimBetweenPhases;

impl TrimBetweenPhases {
    fn on(device: &Device) -> TrimBetweenPhases {
        #[cfg(feature = "cuda")]
        if let Device::Cuda(cuda) = device {
            crate::track::cuda::trim_between_phases(Some(cuda));
        }
        let _ = device;
        TrimBetweenPhases
    }
}

impl Drop for TrimBetweenPhases {
    fn drop(&mut self) {
        #[cfg(feature = "cuda")]
        crate::track::cuda::trim_between_phases(None);
    }
}
