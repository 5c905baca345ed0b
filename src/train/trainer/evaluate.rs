//! Evaluation: the model's loss on held-out batches, forward only.

use super::Trainer;
use crate::track;
use crate::track::alloc::{self, Phase};
use crate::track::tag::{Module, Op, Scope};
use crate::train::data::DataSource;
use crate::train::optim::Optim;
use crate::train::TokenBatch;
use crate::{Error, Result};
use candle_core::{DType, Device, Tensor};
use oomfix_strategies::model;
use std::time::Instant;

/// What an evaluation ([`Trainer::evaluate`]) measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Evaluation {
    /// The optimizer steps taken before it.
    pub step: u64,
    /// Mean token cross-entropy over the batches (the mean of their mean
    /// losses).
    pub loss: f64,
    /// `exp(loss)`.
    pub perplexity: f64,
    /// Micro-batches evaluated (of all ranks).
    pub batches: usize,
    /// Tokens whose loss was taken.
    pub tokens: usize,
    /// Wall time in seconds.
    pub seconds: f64,
    /// Heap high-water mark during the evaluation (0 without a counting
    /// allocator), or on CUDA the memory pool's used high-water mark, above
    /// what was live before the trainer was built.
    pub peak: u64,
}

impl Trainer {
    /// The model's loss on the first `batches` micro-batches of `data` (the
    /// plan's micro-batch and sequence length), read from where `data`
    /// stands, forward only ([`model::loss_only`]): no gradients, so no
    /// more memory than a training step of the plan. BERT's masked positions
    /// are the same at every evaluation. Sharded, rank `r` evaluates every
    /// N-th batch from the `r`-th and the mean is of all ranks (collective;
    /// every rank must be given the same data).
    pub fn evaluate(&mut self, data: &mut DataSource, batches: usize) -> Result<Evaluation> {
        let start = Instant::now();
        let _scope = Scope::module(Module::ROOT);
        alloc::set_phase(Phase::Forward);
        alloc::reset_peak();
        track::reset_device_peak(&self.device)?;
        let outcome = self.eval_batches(data, batches);
        alloc::set_phase(Phase::Setup);
        let (sum, weight, count) = outcome?;
        let peak = track::phase_peak(&self.device, self.live_base)?;
        let (sum, weight, count) = match self.comm() {
            None => (sum, weight, count),
            Some(comm) => {
                let t = Tensor::new(&[sum, weight, count as f64], &Device::Cpu)?;
                let v = comm.all_reduce_sum(&t)?.to_vec1::<f64>()?;
                (v[0], v[1], v[2] as usize)
            }
        };
        if count == 0 {
            return Err(Error::Usage(
                "an evaluation needs at least one batch".into(),
            ));
        }
        let loss = sum / weight;
        Ok(Evaluation {
            step: self.step,
            loss,
            perplexity: loss.exp(),
            batches: count,
            tokens: count * self.plan.micro_batch * self.plan.seq_len,
            seconds: start.elapsed().as_secs_f64(),
            peak,
        })
    }

    /// This rank's share of [`evaluate`](Self::evaluate): the weighted sum
    /// of its batches' losses, the sum of the weights and the batches'
    /// count. A batch weighs 1, a batch of examples its learned tokens (so
    /// the loss is the mean over every learned token).
    fn eval_batches(&mut self, data: &mut DataSource, batches: usize) -> Result<(f64, f64, usize)> {
        let (rank, world) = (self.rank(), self.world_size());
        if let Optim::Sharded(opt) = &mut self.optim {
            let _op = Scope::op(Op::WeightSync);
            opt.gather_params()?;
        }
        let exec = self.execution;
        let examples = matches!(data, DataSource::Examples(_));
        let (mut sum, mut weight, mut count) = (0.0, 0.0, 0);
        for i in 0..batches {
            if i % world != rank {
                data.skip_windows(self.plan.micro_batch, self.plan.seq_len);
                continue;
            }
            let Some(batch) = self.micro_batch(data, i as u64, 0, exec, false)? else {
                break;
            };
            let w = match (&batch.tokens, examples) {
                (
                    Some(TokenBatch {
                        loss_mask: Some(m), ..
                    }),
                    true,
                ) => f64::from(m.to_dtype(DType::F32)?.sum_all()?.to_scalar::<f32>()?),
                _ => 1.0,
            };
            sum += w * f64::from(model::loss_only(self.model.as_ref(), &batch)?);
            weight += w;
            count += 1;
        }
        if let Optim::Sharded(opt) = &mut self.optim {
            opt.release_params()?;
        }
        Ok((sum, weight, count))
    }
}
