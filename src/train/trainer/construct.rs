//! Building a trainer: the model (a Hugging Face family's, or one given
//! as code), and for the plan its master weights, optimizer, ZeRO units and
//! loss scaler, once the plan is known to run on the model and the ranks.

use super::zero::BlockVars;
use super::{compute_dtype, TrainOptions, Trainer};
use crate::track;
use crate::track::tag::{Module, Op, Scope};
use crate::train::build_model_with;
#[cfg(doc)]
use crate::train::data::DataSource;
use crate::train::optim::Optim;
use crate::{usable, Error, ModelConfig, Result};
use candle_core::{DType, Device};
use oomfix_strategies::accumulate::GradAccumulator;
use oomfix_strategies::model::{self, Model};
use oomfix_strategies::precision::{LossScaler, LossScalerConfig, MasterWeights};
use oomfix_strategies::shard::{Comm, ZeroStage};
use oomfix_strategies::{Checkpointing, Execution, Plan, Precision, SearchContext, Strategy};
use std::sync::Arc;

/// Whether `plan`'s fixes can run on a model that can do `caps` on
/// `device`, by the fixes' own rules ([`Strategy::unusable`]); a usage
/// error naming the first that cannot. The plan's fixes run as they would
/// anywhere else: flash attention where it has a kernel (the CPU, CUDA),
/// the checkpointed inputs on the host on any device.
fn check_fixes(
    caps: model::Capabilities,
    plan: &Plan,
    device: &Device,
    fixes: &[Arc<dyn Strategy>],
) -> Result<()> {
    let mut ctx = SearchContext::new(plan.global_batch(), caps.blocks);
    ctx.gpus = plan.shard.world_size;
    ctx.flash_attention = device.is_cpu() || device.is_cuda();
    ctx.model = caps;
    match usable::first_unusable(plan, &ctx, fixes, |_| true) {
        Some((fix, reason)) => Err(Error::Usage(format!(
            "the plan uses {}, which {reason}",
            fix.fix
        ))),
        None => Ok(()),
    }
}

/// Whether `plan` can run on `comm`'s ranks (one process without); a usage
/// error saying why not.
fn check_world(plan: &Plan, comm: Option<&dyn Comm>) -> Result<()> {
    let world = comm.map_or(1, |c| c.world_size());
    if comm.is_none() && plan.shard.world_size > 1 {
        return Err(Error::Usage(
            "sharded plans run one process per rank: build each rank's trainer with a Comm \
             (Trainer::new_sharded, Trainer::of_model_sharded)"
                .into(),
        ));
    }
    if plan.shard.world_size != world {
        return Err(Error::Usage(format!(
            "the plan shards over {} ranks; this job has {world}",
            plan.shard.world_size
        )));
    }
    if world > 1 && !(1..=3).contains(&plan.shard.stage) {
        return Err(Error::Usage(format!(
            "world size {world} needs ZeRO stage 1, 2 or 3, not {}",
            plan.shard.stage
        )));
    }
    Ok(())
}

impl Trainer {
    /// Builds the model of `config` (random, or `options.weights`) and the
    /// optimizer for `plan` on `device`.
    pub fn new(
        config: &ModelConfig,
        plan: Plan,
        device: &Device,
        options: &TrainOptions,
    ) -> Result<Self> {
        check_world(&plan, None)?;
        Self::build_hub(config, plan, device, options, None)
    }

    /// Builds this rank's trainer of a plan sharded over `comm`'s ranks (one
    /// process per rank; every rank calls it with the same arguments but its
    /// own `comm` and `device`). Collective: the owners of the parameters
    /// send them to the other ranks, so all start equal.
    ///
    /// The plan's world size must be `comm`'s and its ZeRO stage 1 to 3; the
    /// optimizer is fused AdamW over this rank's share (a plan for
    /// `candle_nn::AdamW` runs it too: it holds less), on the host with an
    /// offloaded plan.
    pub fn new_sharded(
        config: &ModelConfig,
        plan: Plan,
        device: &Device,
        options: &TrainOptions,
        comm: Box<dyn Comm>,
    ) -> Result<Self> {
        check_world(&plan, Some(comm.as_ref()))?;
        Self::build_hub(config, plan, device, options, Some(comm))
    }

    /// Builds a model given as code with `build(compute dtype, device)` and
    /// the optimizer for `plan` on `device`. The model makes its own
    /// micro-batches: train it on [`DataSource::ModelMade`]. Its builder
    /// initialises or loads its weights (`options.weights` is a usage error
    /// here), and it cannot be saved as a Hugging Face directory.
    pub fn of_model<M, B>(
        build: B,
        plan: Plan,
        device: &Device,
        options: &TrainOptions,
    ) -> Result<Self>
    where
        M: Model + 'static,
        B: FnOnce(DType, &Device) -> candle_core::Result<M>,
    {
        check_world(&plan, None)?;
        Self::build_code(build, plan, device, options, None)
    }

    /// [`of_model`](Self::of_model) for one rank of a plan sharded over
    /// `comm`'s ranks, as [`new_sharded`](Self::new_sharded) (each rank
    /// builds its own trainer with the same builder).
    pub fn of_model_sharded<M, B>(
        build: B,
        plan: Plan,
        device: &Device,
        options: &TrainOptions,
        comm: Box<dyn Comm>,
    ) -> Result<Self>
    where
        M: Model + 'static,
        B: FnOnce(DType, &Device) -> candle_core::Result<M>,
    {
        check_world(&plan, Some(comm.as_ref()))?;
        Self::build_code(build, plan, device, options, Some(comm))
    }

    fn build_hub(
        config: &ModelConfig,
        plan: Plan,
        device: &Device,
        options: &TrainOptions,
        comm: Option<Box<dyn Comm>>,
    ) -> Result<Self> {
        let live_base = track::live_bytes(device)?;
        // Recorded timelines classify what is built here as weights, then optimizer state.
        let scope = Scope::new(Module::intern("model"), Op::InitWeights);
        let model = build_model_with(
            config,
            options.weights.as_deref(),
            compute_dtype(plan.precision),
            device,
            options.seed,
            plan.lora.as_ref(),
        )?;
        drop(scope);
        let config = Some(model.config().clone());
        let lora = model.lora().cloned();
        let mut trainer = Self::build(
            Box::new(model),
            config,
            plan,
            device,
            options,
            comm,
            live_base,
        )?;
        trainer.lora = lora;
        Ok(trainer)
    }

    fn build_code<M, B>(
        build: B,
        plan: Plan,
        device: &Device,
        options: &TrainOptions,
        comm: Option<Box<dyn Comm>>,
    ) -> Result<Self>
    where
        M: Model + 'static,
        B: FnOnce(DType, &Device) -> candle_core::Result<M>,
    {
        if options.weights.is_some() {
            return Err(Error::Usage(
                "a model given as code loads its own weights in its builder; \
                 TrainOptions::weights is for the Hugging Face families"
                    .into(),
            ));
        }
        if plan.lora.is_some() {
            return Err(Error::Usage(
                "LoRA adapts the projections of a Hugging Face family's model; \
                 a model given as code trains its own variables"
                    .into(),
            ));
        }
        let live_base = track::live_bytes(device)?;
        let scope = Scope::new(Module::intern("model"), Op::InitWeights);
        let model = build(compute_dtype(plan.precision), device)?;
        drop(scope);
        Self::build(
            Box::new(model),
            None,
            plan,
            device,
            options,
            comm,
            live_base,
        )
    }

    /// The trainer of `model` (built in the plan's compute dtype, after
    /// `live_base` bytes were live) for `plan`.
    fn build(
        model: Box<dyn Model>,
        config: Option<ModelConfig>,
        plan: Plan,
        device: &Device,
        options: &TrainOptions,
        comm: Option<Box<dyn Comm>>,
        live_base: u64,
    ) -> Result<Self> {
        if plan.micro_batch == 0 || plan.grad_accum == 0 {
            return Err(Error::Usage(
                "a plan needs a micro-batch and accumulation of at least 1".into(),
            ));
        }
        check_fixes(model.capabilities(), &plan, device, &options.fixes)?;
        track::keep_device_reserve(device)?;
        let vars = model.vars();
        if vars.is_empty() {
            return Err(Error::Usage("the model has no variables to train".into()));
        }
        let names = model.var_names();
        // A sharded optimizer keeps the masters of its own share itself.
        let sharded = comm.as_ref().is_some_and(|c| c.world_size() > 1);
        let scope = Scope::new(Module::intern("model"), Op::InitWeights);
        let master = (plan.precision.is_mixed() && !plan.optimizer.is_offloaded() && !sharded)
            .then(|| MasterWeights::new(vars.clone()))
            .transpose()?;
        drop(scope);
        let opt_vars = master
            .as_ref()
            .map_or_else(|| vars.clone(), |m| m.master_vars().to_vec());
        let _scope = Scope::new(Module::intern("optimizer"), Op::InitOptimizer);
        let named = names.iter().cloned().zip(opt_vars).collect();
        let optim = Optim::new(&plan, named, &options.adamw, comm)?;
        let units = match &optim {
            Optim::Sharded(opt)
                if opt.stage() != ZeroStage::OptimizerState
                    && plan.checkpoint != Checkpointing::None =>
            {
                let blocks = model.capabilities().blocks.min(vars.len());
                Some(BlockVars::new(&model.var_blocks(), blocks))
            }
            _ => None,
        };
        let scaler = (plan.precision == Precision::F16)
            .then(|| LossScaler::new(LossScalerConfig::default()))
            .transpose()?;
        Ok(Trainer {
            model,
            vars,
            names,
            config,
            seed: options.seed,
            plan,
            device: device.clone(),
            master,
            optim,
            scaler,
            accumulator: GradAccumulator::new(),
            execution: Execution::for_plan(&plan, &options.fixes),
            peak_lr: options.adamw.lr,
            schedule: options.schedule,
            source: options.source.clone(),
            max_grad_norm: options.max_grad_norm,
            trim_between_phases: options.trim_between_phases,
            step: 0,
            live_base,
            units,
            lora: None,
            merge_lora: options.merge_lora,
        })
    }
}
