//! The training loop: one optimizer step of a [`Plan`] on a [`Model`]: a
//! [`HubModel`] built from a [`ModelConfig`] ([`Trainer::new`]) or a model
//! given as code, built by its owner's function ([`Trainer::of_model`]).
//!
//! A step runs `grad_accum` micro-batches of `micro_batch` sequences through
//! forward and backward (with the plan's checkpointing and attention), sums their gradients
//! ([`GradAccumulator`]), unscales and checks them under fp16 loss scaling, and
//! steps the optimizer: `candle_nn::AdamW` one tensor at a time (each gradient
//! dropped as soon as its tensor is updated), [`FusedAdamW`] in place, or
//! [`OffloadedAdamW`](oomfix_strategies::offload::OffloadedAdamW) on the host. Under mixed precision the optimizer updates
//! fp32 master weights, copied back into the 16-bit compute weights after the
//! step; offloaded, the masters always live on the host.
//!
//! At world size N ([`Trainer::new_sharded`], one process per rank with a
//! [`Comm`]), every rank runs `grad_accum` micro-batches of its own slice of
//! each global batch (rank `r` takes the `r`-th of the N consecutive runs of
//! `micro_batch × grad_accum` windows the data source yields per step) and a
//! [`ShardedOptimizer`] over fused AdamW steps at the plan's ZeRO stage: 1
//! shards the optimizer state, 2 also reduces each gradient to its owner
//! only, 3 also frees the parameters a rank does not own between steps and
//! gathers them before the forward. With checkpointed segments, stages 2
//! and 3 reduce a segment's gradients as soon as its backward made them, and
//! stage 3 gathers a segment's parameters only while it runs. The loss
//! reported is the mean over all ranks, the same number on every rank.
//!
//! [`Trainer::save`] writes a Hugging Face model directory with the whole
//! training state beside it ([`super::saved`]) and [`Trainer::resume`]
//! restores it, so a resumed run of the same plan takes the same steps as one
//! that was never stopped; another plan of the same model continues from the
//! same weights, moments and data position.

mod construct;
mod evaluate;
mod options;
mod resume;
mod save;
mod step;
mod zero;

pub use evaluate::Evaluation;
pub use options::TrainOptions;
pub use resume::plan_changes;
pub use step::StepStats;

use super::data::DataSource;
use super::optim::Optim;
use super::saved::ModelSource;
use super::{batch_dims, batch_from_windows, TokenBatch};
use crate::track::tag::{Op, Scope};
use crate::{Error, Family, ModelConfig, Result};
use candle_core::{Device, Tensor, Var};
use oomfix_strategies::accumulate::GradAccumulator;
use oomfix_strategies::model::{MicroBatch, Model};
use oomfix_strategies::precision::{LossScaler, MasterWeights};
use oomfix_strategies::shard::Comm;
use oomfix_strategies::{Execution, Plan};
use zero::BlockVars;

/// Runs training steps of a plan on one model: a Hugging Face family's
/// ([`Trainer::new`]) or a model given as code ([`Trainer::of_model`]).
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
/// use oomfix::train::data::DataSource;
/// use oomfix::{Plan, Trainer, TrainOptions};
///
/// let build = |dtype: DType, dev: &Device| Ok(Regression { w: Var::ones((4, 1), dtype, dev)? });
/// let plan = Plan { micro_batch: 2, grad_accum: 2, ..Plan::baseline(4, 1) };
/// let mut trainer = Trainer::of_model(build, plan, &Device::Cpu, &TrainOptions::default())?;
/// let mut data = DataSource::ModelMade;
/// let first = trainer.step(&mut data)?.loss;
/// let second = trainer.step(&mut data)?.loss;
/// assert!(second < first);
/// # Ok::<(), oomfix::Error>(())
/// ```
pub struct Trainer {
    model: Box<dyn Model>,
    /// The model's vars and their names, taken once ([`Model::vars`]).
    vars: Vec<Var>,
    names: Vec<String>,
    /// The shape of a Hugging Face family's model (`None`: a model given as
    /// code), which its token batches and saved directories follow.
    config: Option<ModelConfig>,
    seed: u64,
    plan: Plan,
    device: Device,
    master: Option<MasterWeights>,
    optim: Optim,
    scaler: Option<LossScaler>,
    /// Kept between steps so that its sums are allocated once.
    accumulator: GradAccumulator,
    /// What the plan's fixes make a forward/backward pass do.
    execution: Execution,
    /// `adamw.lr`: the rate the schedule is a factor of.
    peak_lr: f64,
    schedule: super::LrSchedule,
    /// What a saved directory holds beside the weights.
    source: ModelSource,
    max_grad_norm: Option<f64>,
    /// [`TrainOptions::trim_between_phases`].
    trim_between_phases: bool,
    step: u64,
    /// What was live before the model was built ([`track::phase_peak`]).
    live_base: u64,
    /// ZeRO stage 2 or 3 with checkpointed segments: the parameters of each
    /// block, whose gradients are reduced once its segment's backward made
    /// them and (stage 3) which are gathered only while it runs (FSDP's
    /// unit); `None` otherwise.
    units: Option<BlockVars>,
    /// A LoRA plan's frozen base and adapted modules.
    lora: Option<super::lora::LoraModel>,
    merge_lora: bool,
}

impl Drop for Trainer {
    /// Frees the host buffers the offloaded activations of this thread's
    /// steps were kept in.
    fn drop(&mut self) {
        oomfix_strategies::checkpoint::release_host_buffers();
    }
}

/// The compute dtype of a precision.
pub use oomfix_strategies::model::dtype_of as compute_dtype;

impl Trainer {
    /// The model being trained.
    pub fn model(&self) -> &dyn Model {
        self.model.as_ref()
    }

    /// The shape of the Hugging Face family's model being trained (`None`:
    /// a model given as code).
    pub fn config(&self) -> Option<&ModelConfig> {
        self.config.as_ref()
    }

    /// The shape of the model, for what only a Hugging Face family's has
    /// (its saved directory); a usage error naming `what` for a model
    /// given as code.
    fn hub_config(&self, what: &str) -> Result<&ModelConfig> {
        self.config.as_ref().ok_or_else(|| {
            Error::Usage(format!(
                "{what} needs a Hugging Face family's model; a model given as code is saved by its owner"
            ))
        })
    }

    /// The plan.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// The fp32 master weights in the order of the model's vars: under mixed
    /// precision, or with the optimizer offloaded (then on the host, always
    /// copies of their own).
    fn masters(&self) -> Option<&[Var]> {
        match (&self.master, &self.optim) {
            (Some(m), _) => Some(m.master_vars()),
            (None, Optim::Offloaded(opt)) => Some(opt.master_vars()),
            _ => None,
        }
    }

    /// The parameters' tensors with their Hub names, and the fp32 master
    /// weights that are buffers of their own as `master.<name>` (for naming
    /// recorded blocks).
    pub fn parameter_buffers(&self) -> Vec<(String, Tensor)> {
        let vars = || self.names.iter().zip(&self.vars);
        let mut out: Vec<(String, Tensor)> = vars()
            .map(|(n, v)| (n.clone(), v.as_tensor().clone()))
            .collect();
        let offloaded = self.plan.optimizer.is_offloaded();
        if let Some(masters) = self.masters() {
            for ((name, c), v) in vars().zip(masters) {
                if offloaded || c.dtype() != v.dtype() {
                    out.push((format!("master.{name}"), v.as_tensor().clone()));
                }
            }
        }
        if let Optim::Sharded(opt) = &self.optim {
            for (i, (name, c)) in vars().enumerate() {
                match opt.weights_of_record(i) {
                    Some(m) if offloaded || m.dtype() != c.dtype() => {
                        out.push((format!("master.{name}"), m.as_tensor().clone()))
                    }
                    _ => {}
                }
            }
        }
        out
    }

    /// What the plan's fixes make each forward/backward pass do.
    pub fn execution(&self) -> &Execution {
        &self.execution
    }

    /// Optimizer steps taken.
    pub fn steps(&self) -> u64 {
        self.step
    }

    /// The communicator of a sharded run (world size > 1).
    pub fn comm(&self) -> Option<&dyn Comm> {
        match &self.optim {
            Optim::Sharded(opt) => Some(opt.comm().as_ref()),
            _ => None,
        }
    }

    /// This process's rank (0 unless sharded).
    pub fn rank(&self) -> usize {
        self.comm().map_or(0, |c| c.rank())
    }

    /// The number of ranks (1 unless sharded).
    pub fn world_size(&self) -> usize {
        self.comm().map_or(1, |c| c.world_size())
    }

    /// Whether `flag` holds on any rank (collective when sharded: every rank
    /// calls it at the same point, e.g. to stop together on a signal).
    pub fn any_rank(&self, flag: bool) -> Result<bool> {
        match self.comm() {
            None => Ok(flag),
            Some(c) => {
                let t = Tensor::new(&[u8::from(flag)], &Device::Cpu)?;
                Ok(c.all_reduce_sum(&t)?.to_vec1::<u8>()?[0] > 0)
            }
        }
    }

    /// Whether [`save`](Self::save) includes the optimizer's moments: with
    /// fused AdamW (offloaded or not) it does; `candle_nn::AdamW` keeps them
    /// out of reach, so a run resumed from its checkpoint restarts them from zero.
    pub fn saves_optimizer_state(&self) -> bool {
        matches!(self.optim, Optim::Sharded(_)) || self.optim.fused().is_some()
    }

    /// The base model's name or path a LoRA adapter directory names (the
    /// model's directory, else its architecture).
    fn base_model_name(&self) -> String {
        self.source.name.clone().unwrap_or_else(|| {
            self.config
                .as_ref()
                .map_or_else(String::new, |c| c.family.to_string())
        })
    }

    /// Micro-batch number `index` of the run under `exec`: a Hugging Face
    /// family's takes the next windows of tokens from `data` (`seed` chooses
    /// BERT's masked positions); a model given as code makes its own from
    /// `index` and the run's seed ([`DataSource::ModelMade`]).
    ///
    /// Examples come `micro_batch` rows at a time, wrapping around past the
    /// last row; without `wrap` (evaluation) the last batch of a pass holds
    /// the rows left, and `None` says none is.
    fn micro_batch(
        &self,
        data: &mut DataSource,
        index: u64,
        seed: u64,
        exec: Execution,
        wrap: bool,
    ) -> Result<Option<MicroBatch>> {
        let _op = Scope::op(Op::Batch);
        let (b, s) = (self.plan.micro_batch, self.plan.seq_len);
        let batch = MicroBatch::new(b, index, exec)
            .with_seq_len(s)
            .with_seed(self.seed);
        match (&self.config, data) {
            (None, DataSource::ModelMade) => Ok(Some(batch)),
            (None, _) => Err(Error::Usage(
                "a model given as code makes its own micro-batches: train it on DataSource::ModelMade"
                    .into(),
            )),
            (Some(_), DataSource::ModelMade) => Err(Error::Usage(
                "a Hugging Face family trains on tokens: give it token data or synthetic tokens"
                    .into(),
            )),
            (Some(config), DataSource::Examples(examples)) => {
                if config.family == Family::Bert {
                    return Err(Error::Usage(
                        "chat and instruction examples train causal language models; BERT is a masked one"
                            .into(),
                    ));
                }
                let Some(tokens) = examples.next_batch(b, s, wrap, &self.device)? else {
                    return Ok(None);
                };
                batch_dims(&tokens, config)?;
                Ok(Some(batch.with_tokens(tokens)?))
            }
            (Some(config), data) => {
                let windows = data.next_windows(b, s, config.vocab);
                let tokens: TokenBatch = batch_from_windows(
                    config.family,
                    config.vocab,
                    &windows,
                    b,
                    s,
                    seed,
                    &self.device,
                )?;
                batch_dims(&tokens, config)?;
                Ok(Some(batch.with_tokens(tokens)?))
            }
        }
    }
}
