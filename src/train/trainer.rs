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

use super::data::{DataPosition, DataSource};
use super::optim::Optim;
use super::saved::{self, DataState, ModelSource, ScalerState, TrainerState, TrainingState};
use super::{batch_dims, batch_from_windows, build_model_with, TokenBatch};
use crate::output::write_dir_atomic;
use crate::state_file::{self, StateFile};
use crate::track;
use crate::track::alloc::mark_tensors;
use crate::track::alloc::{self, Phase};
use crate::track::tag::{Component, Module, Op, Scope};
use crate::{Error, Family, ModelConfig, Result};
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::ParamsAdamW;
use oomfix_strategies::accumulate::GradAccumulator;
use oomfix_strategies::adamw::FusedAdamW;
use oomfix_strategies::checkpoint::SegmentHook;
use oomfix_strategies::clip;
use oomfix_strategies::model::{self, MicroBatch, Model};
use oomfix_strategies::precision::{LossScaler, LossScalerConfig, MasterWeights};
use oomfix_strategies::shard::{Comm, ShardedOptimizer, Traffic, ZeroStage};
use oomfix_strategies::{Attention, Checkpointing, Execution, Plan, Precision, Strategy};
use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

/// Settings of a training run besides the plan.
#[derive(Clone)]
#[non_exhaustive]
pub struct TrainOptions {
    /// AdamW hyper-parameters. Weight decay applies to matrices only, not to
    /// biases and norm scales ([`is_decay_exempt`](oomfix_strategies::adamw::is_decay_exempt)); default 0.
    /// The default learning rate is [`RANDOM_INIT_LR`](super::RANDOM_INIT_LR); from
    /// pretrained [`weights`](Self::weights), [`PRETRAINED_LR`](super::PRETRAINED_LR)
    /// is the usual choice ([`default_lr`](super::default_lr)).
    pub adamw: ParamsAdamW,
    /// Seed of the random initialisation and of synthetic data (a model
    /// given as code gets it in every [`MicroBatch::seed`]; its builder
    /// initialises it).
    pub seed: u64,
    /// Pretrained weights to start from (`None`: random initialisation). A
    /// model given as code loads its own: there it is a usage error.
    pub weights: Option<Vec<PathBuf>>,
    /// The fixes whose execution hooks make the plan's forward/backward pass
    /// ([`Execution::for_plan`]); default: the built-in ones.
    pub fixes: Vec<Arc<dyn Strategy>>,
    /// The learning rate over the run, as a factor of `adamw.lr` (default:
    /// constant).
    pub schedule: super::LrSchedule,
    /// What [`Trainer::save`] writes beside the weights, and their dtype
    /// (default: f32, a configuration made from the shape, no other files).
    pub source: ModelSource,
    /// Clip the gradients of each optimizer step to this global L2 norm
    /// (`torch.nn.utils.clip_grad_norm_`'s `max_norm`); `None` (the
    /// default here; `oomfix train` clips at 1.0): no clipping.
    pub max_grad_norm: Option<f64>,
    /// On CUDA, trim the memory pool at every phase change of a step
    /// (forward, backward, optimizer step, between steps): it waits for the
    /// device and returns the pool's cached memory to the driver
    /// (`track::cuda::trim`, PyTorch's `empty_cache()`). It frees no live
    /// tensor and costs the waits; default off. Nothing elsewhere.
    pub trim_between_phases: bool,
    /// With a LoRA plan, [`Trainer::save`] writes the merged model (the
    /// adapters added into the base weights) instead of the adapters.
    pub merge_lora: bool,
}

impl Default for TrainOptions {
    fn default() -> Self {
        TrainOptions {
            adamw: ParamsAdamW {
                lr: super::RANDOM_INIT_LR,
                // Hugging Face's Trainer default (candle's is 0.01).
                weight_decay: 0.0,
                ..Default::default()
            },
            seed: 0,
            weights: None,
            fixes: oomfix_strategies::builtins(),
            schedule: super::LrSchedule::default(),
            source: ModelSource::default(),
            max_grad_norm: None,
            trim_between_phases: false,
            merge_lora: false,
        }
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

/// The model's vars by block (indices into [`Model::vars`]), and those
/// outside every block (embeddings, final norm, head).
#[derive(Debug)]
struct BlockVars {
    blocks: Vec<Vec<usize>>,
    outside: Vec<usize>,
}

impl BlockVars {
    /// From the block of each var ([`Model::var_blocks`]), of `blocks` blocks.
    fn new(var_blocks: &[Option<usize>], blocks: usize) -> Self {
        let mut units = BlockVars {
            blocks: vec![Vec::new(); blocks],
            outside: Vec::new(),
        };
        for (i, block) in var_blocks.iter().enumerate() {
            match block.filter(|&b| b < blocks) {
                Some(b) => units.blocks[b].push(i),
                None => units.outside.push(i),
            }
        }
        units
    }
}

/// ZeRO's unit as a [`SegmentHook`] (FSDP's): at stage 3 a segment's blocks'
/// parameters are gathered before it runs and freed after; at stages 2 and
/// 3 their gradients are reduced to their owners as soon as the segment's
/// backward made them, so that a rank never holds more local gradients than
/// one segment's and those outside the blocks.
struct ShardedSegments<'a> {
    opt: &'a mut ShardedOptimizer<Box<dyn Comm>>,
    units: &'a BlockVars,
    /// The model's vars (for zeros where a parameter got no gradient).
    vars: &'a [Var],
}

impl ShardedSegments<'_> {
    fn vars(&self, blocks: Range<usize>) -> Vec<usize> {
        self.units.blocks[blocks].concat()
    }
}

impl SegmentHook for ShardedSegments<'_> {
    fn before(&mut self, blocks: Range<usize>) -> oomfix_strategies::Result<()> {
        let _op = Scope::op(Op::WeightSync);
        let vars = self.vars(blocks);
        self.opt.gather(&vars)
    }
    fn after(&mut self, blocks: Range<usize>) -> oomfix_strategies::Result<()> {
        let vars = self.vars(blocks);
        self.opt.release(&vars)
    }
    fn gradients(
        &mut self,
        blocks: Range<usize>,
        grads: &mut [Option<Tensor>],
        taken: &mut [bool],
    ) -> oomfix_strategies::Result<()> {
        let _op = Scope::op(Op::GradAccumulate);
        let vars = self.vars(blocks);
        let mut mine = Vec::with_capacity(vars.len());
        for &i in &vars {
            mine.push(match grads[i].take() {
                Some(g) => g,
                None => self.vars[i].zeros_like()?,
            });
            taken[i] = true;
        }
        mark_tensors(&mine, Component::Gradients);
        self.opt.reduce_some(&vars, mine)
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

/// Whether a model that can do `caps` can run `plan`'s fixes; a usage
/// error naming the first it cannot.
fn check_capabilities(caps: model::Capabilities, plan: &Plan) -> Result<()> {
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
    if plan.chunked_loss && !caps.chunked_loss {
        return Err(Error::Usage(
            "the plan computes the loss in chunks, and the model computes its own loss".into(),
        ));
    }
    Ok(())
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

/// A model shape in a few words, for messages.
fn describe(c: &ModelConfig) -> String {
    format!(
        "{:?}, {} layers, hidden {}, {} heads, vocab {}",
        c.family, c.layers, c.hidden, c.heads, c.vocab
    )
}

/// Whether two names of a base model are the same model: equal, or paths
/// of the same directory.
fn same_base(a: &str, b: &str) -> bool {
    if a == b {
        return true;
    }
    match (Path::new(a).canonicalize(), Path::new(b).canonicalize()) {
        (Ok(x), Ok(y)) => x == y,
        _ => false,
    }
}

/// What changes when a run of the plan `saved` resumes with the plan `now`,
/// one line per change for the log: the fields that differ
/// ([`Plan::differences`]) and, when it changes, the global batch. Empty when
/// the plans are the same.
pub fn plan_changes(saved: &Plan, now: &Plan) -> Vec<String> {
    let diff = saved.differences(now);
    if diff.is_empty() {
        return Vec::new();
    }
    let fields: Vec<String> = diff
        .iter()
        .map(|(field, was, now)| format!("{field} {was} -> {now}"))
        .collect();
    let mut out = vec![format!(
        "resuming a run of the plan `{saved}` with another plan: {}",
        fields.join(", ")
    )];
    let (was, is) = (saved.global_batch(), now.global_batch());
    if was != is {
        out.push(format!(
            "the global batch changes from {was} to {is} sequences per optimizer step: \
             each step now averages the gradient of {is} sequences, and the data advances \
             {is} × {} tokens per step",
            now.seq_len
        ));
    }
    if saved.seq_len != now.seq_len {
        out.push(format!(
            "the sequence length changes from {} to {} tokens",
            saved.seq_len, now.seq_len
        ));
    }
    out
}

/// The compute dtype of a precision.
pub use oomfix_strategies::model::dtype_of as compute_dtype;

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
        if plan.attention == Attention::Flash && !(device.is_cpu() || device.is_cuda()) {
            return Err(Error::Usage(
                "flash attention runs on the CPU and CUDA only; plan without the flash-attention strategy".into(),
            ));
        }
        check_capabilities(model.capabilities(), &plan)?;
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

    /// The fp32 weights of record: the masters where there are any, else the
    /// compute weights (then f32).
    fn record_vars(&self) -> Vec<Var> {
        match self.masters() {
            Some(m) => m.to_vec(),
            None => self.vars.clone(),
        }
    }

    /// Writes the directory `dir` ([`saved`](super::saved)) atomically: built beside it
    /// and put in place whole ([`write_dir_atomic`]), replacing an existing
    /// one only once the new one is complete.
    ///
    /// The weights are written from the fp32 weights of record (the master
    /// weights under mixed precision or offloaded), converted to the source's
    /// dtype one tensor at a time; the moments are written from the
    /// optimizer's own storage, without copies.
    ///
    /// Sharded (world size > 1), every rank calls it at the same point
    /// (collective): the weights and moments are gathered to rank 0, which
    /// writes one directory, the same as an unsharded run's; every rank
    /// returns an error when rank 0's write fails.
    pub fn save(&self, dir: &Path, data: &DataSource) -> Result<()> {
        let source = &self.source;
        let model = self.hub_config("saving")?;
        let config = saved::hf_config(model, source.config.as_deref(), source.dtype)?;
        let (weights, moments) = self.consolidated()?;
        let mut optimizer: Vec<(String, Tensor)> = Vec::new();
        // The adapters are written in f32: no masters beside them.
        if source.dtype != DType::F32 && self.lora.is_none() {
            optimizer.extend(
                weights
                    .iter()
                    .map(|(n, t)| (format!("master.{n}"), t.clone())),
            );
        }
        for (name, m, v) in moments {
            optimizer.push((format!("{name}.m"), m));
            optimizer.push((format!("{name}.v"), v));
        }
        let optimizer_step = match &self.optim {
            Optim::Sharded(opt) => Some(opt.optimizer().step_count()),
            optim => optim.fused().map(FusedAdamW::step_count),
        };
        let state = TrainerState {
            format: saved::STATE_FORMAT.into(),
            format_version: saved::STATE_VERSION,
            step: self.step,
            optimizer_step,
            data: match data.position() {
                DataPosition::Synthetic(state) => DataState::Synthetic { state },
                DataPosition::Tokens { pos, len } => DataState::Tokens {
                    position: pos,
                    tokens: len,
                },
                DataPosition::Examples { pos, len } => DataState::Examples {
                    row: pos,
                    rows: len,
                },
                DataPosition::ModelMade => return Err(Error::Usage(
                    "a run of a Hugging Face family trains on tokens, not DataSource::ModelMade"
                        .into(),
                )),
            },
            loss_scaler: self.scaler.as_ref().map(|s| ScalerState {
                scale: s.scale(),
                growth_tracker: s.growth_tracker(),
            }),
            plan: self.plan,
            model: model.clone(),
            base_model: self.lora.as_ref().map(|_| self.base_model_name()),
            merged: self.lora.is_some() && self.merge_lora,
        };
        if self.rank() != 0 {
            return self.saved_on_rank_0(true);
        }
        let io = |what: &Path, e: std::io::Error| Error::Io {
            context: format!("writing {}", what.display()),
            source: e,
        };
        let write_json = |path: &Path, value: &serde_json::Value| -> Result<()> {
            let text = serde_json::to_string_pretty(value).expect("JSON serialises") + "\n";
            std::fs::write(path, text).map_err(|e| io(path, e))
        };
        let written = write_dir_atomic(dir, |tmp| {
            let pt = HashMap::from([("format".to_string(), "pt".to_string())]);
            match &self.lora {
                None => state_file::write_safetensors_as(
                    &tmp.join(saved::MODEL_FILE),
                    weights,
                    pt,
                    Some(source.dtype),
                )?,
                Some(lora) if self.merge_lora => {
                    let record: HashMap<String, Tensor> = weights.into_iter().collect();
                    let merged = model
                        .tensors()
                        .into_iter()
                        .map(|(name, _)| {
                            let t = lora.merged_tensor(&name, &record, source.dtype)?;
                            Ok((name, t))
                        })
                        .collect::<Result<Vec<_>>>()?;
                    state_file::write_safetensors_as(
                        &tmp.join(saved::MODEL_FILE),
                        merged,
                        pt,
                        Some(source.dtype),
                    )?;
                }
                Some(lora) => {
                    let family = lora.family();
                    let renamed = weights
                        .into_iter()
                        .map(|(name, t)| (lora.peft_name(&name), t))
                        .collect();
                    state_file::write_safetensors_as(
                        &tmp.join(saved::ADAPTER_FILE),
                        renamed,
                        pt,
                        Some(DType::F32),
                    )?;
                    let config = oomfix_strategies::lora::peft_config(
                        &lora.lora,
                        &self.base_model_name(),
                        family == crate::Family::Gpt2,
                    );
                    write_json(&tmp.join(saved::ADAPTER_CONFIG_FILE), &config)?;
                }
            }
            // A merged model is a model to load, not a checkpoint: its
            // state only marks the directory as this run's output.
            if !state.merged {
                state_file::write(&tmp.join(saved::OPTIMIZER_FILE), optimizer, HashMap::new())?;
            }
            write_json(
                &tmp.join(saved::STATE_FILE),
                &serde_json::to_value(&state).expect("the state serialises"),
            )?;
            for (name, from) in &source.files {
                std::fs::copy(from, tmp.join(name)).map_err(|e| io(from, e))?;
            }
            if self.lora.is_none() || self.merge_lora {
                write_json(&tmp.join(saved::CONFIG_FILE), &config)?;
            }
            Ok(())
        });
        self.saved_on_rank_0(written.is_ok())?;
        written
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

    /// Whether rank 0 wrote the checkpoint, told to every rank (collective
    /// when sharded): an error on the others when it did not.
    fn saved_on_rank_0(&self, ok: bool) -> Result<()> {
        if self.any_rank(!ok)? && ok {
            return Err(Error::Runtime(
                "rank 0 could not write the checkpoint".into(),
            ));
        }
        Ok(())
    }

    /// The weights of record with their Hub names, and the optimizer's
    /// moments `(name, m, v)` (none with `candle_nn::AdamW`), as one
    /// unsharded run holds them. Without sharding they share the trainer's
    /// storage. Sharded (collective), each tensor is sent from the rank that
    /// holds it, one at a time; rank 0 keeps them all (the whole state, for
    /// the time of a save), the others none.
    #[allow(clippy::type_complexity)]
    fn consolidated(&self) -> Result<(Vec<(String, Tensor)>, Vec<(String, Tensor, Tensor)>)> {
        let names = self.names.iter().cloned();
        let record = self.record_vars();
        let Optim::Sharded(opt) = &self.optim else {
            let weights = names
                .zip(record)
                .map(|(n, w)| (n, w.as_tensor().clone()))
                .collect();
            let moments = self.optim.fused().map_or_else(Vec::new, |opt| {
                opt.moments()
                    .into_iter()
                    .map(|(n, m, v)| (n.to_string(), m, v))
                    .collect()
            });
            return Ok((weights, moments));
        };
        let comm = opt.comm();
        let rank = comm.rank();
        let owned: HashMap<&str, (Tensor, Tensor)> = opt
            .optimizer()
            .moments()
            .into_iter()
            .map(|(i, m, v)| (i, (m, v)))
            .collect();
        let (mut weights, mut moments) = (Vec::new(), Vec::new());
        for (i, (name, w)) in names.zip(&record).enumerate() {
            let owner = opt.owners()[i];
            let zeros = |dtype| Tensor::zeros(w.shape(), dtype, w.device());
            // The owner holds the fp32 weights of record (its master under
            // mixed precision; stage 3 freed the others' copies): it sends them.
            let w = match opt.weights_of_record(i) {
                Some(m) => comm.broadcast(&m.as_tensor().to_dtype(DType::F32)?, owner)?,
                None => comm.broadcast(&zeros(DType::F32)?, owner)?,
            };
            let (m, v) = match owned.get(i.to_string().as_str()) {
                Some((m, v)) => (m.clone(), v.clone()),
                None => (zeros(DType::F32)?, zeros(DType::F32)?),
            };
            let (m, v) = (comm.broadcast(&m, owner)?, comm.broadcast(&v, owner)?);
            if rank == 0 {
                weights.push((name.clone(), w));
                moments.push((name, m, v));
            }
        }
        Ok((weights, moments))
    }

    /// Restores the state [`save`](Self::save) wrote to the directory `dir`,
    /// and moves `data` to where that run stood; returns the plan that run
    /// used (this trainer's may differ: the weights, moments, step, data
    /// position and loss scale carry over to any plan of the same model).
    ///
    /// The checkpoint must verify (see [`TrainingState::open`]) and be of the
    /// same model shape (else an input error naming the first difference) and
    /// kind of data; every failure is an input error naming the file. The
    /// checks run before anything changes; a failure while loading tensors
    /// after them leaves the trainer and `data` partly restored (drop them).
    /// Tensors are read and set one at a time: resuming holds at most one
    /// tensor besides the trainer's own state.
    ///
    /// Sharded, every rank calls it (collective at stage 3) and takes its own
    /// share of the moments: a checkpoint of any world size resumes at any other.
    pub fn resume(&mut self, dir: &Path, data: &mut DataSource) -> Result<Plan> {
        let model = self.hub_config("resuming")?;
        let ck = TrainingState::open(dir)?;
        let state_path = dir.join(saved::STATE_FILE);
        if let Some(diff) = saved::first_difference(&ck.state.model, model) {
            return Err(Error::input(
                &state_path,
                format!(
                    "checkpoint is of another model ({}): {diff}; this run trains {}",
                    describe(&ck.state.model),
                    describe(model)
                ),
            ));
        }
        self.check_lora_checkpoint(&ck.state, &state_path)?;
        let position = match ck.state.data {
            DataState::Synthetic { state } => DataPosition::Synthetic(state),
            DataState::Examples { row, rows } => DataPosition::Examples {
                pos: row,
                len: rows,
            },
            DataState::Tokens { position, tokens } => DataPosition::Tokens {
                pos: position,
                len: tokens,
            },
        };
        if let DataSource::Examples(examples) = data {
            // Rows exist at a sequence length: the checkpoint's plan's.
            examples.packed(ck.state.plan.seq_len);
        }
        data.seek(position)
            .map_err(|msg| Error::input(&state_path, format!("cannot continue the data: {msg}")))?;
        self.load_tensors(&ck)?;
        if let (Some(s), Some(saved)) = (&mut self.scaler, ck.state.loss_scaler) {
            s.restore(saved.scale, saved.growth_tracker)
                .map_err(|e| Error::input(&state_path, e.to_string()))?;
        }
        self.step = ck.state.step;
        Ok(ck.state.plan)
    }

    /// Whether a checkpoint of `saved` continues this run's LoRA (or full
    /// fine-tuning): the same kind of run; for LoRA, the same rank, alpha
    /// and targets on the same base model (the base's storage may differ).
    /// An input error naming `path` otherwise.
    fn check_lora_checkpoint(&self, saved: &TrainerState, path: &Path) -> Result<()> {
        let refuse = |msg: String| Err(Error::input(path, msg));
        match (saved.plan.lora, self.plan.lora) {
            (None, None) => Ok(()),
            (Some(_), None) => refuse(
                "the checkpoint holds LoRA adapters: resume it with --lora and the same settings"
                    .into(),
            ),
            (None, Some(_)) => refuse(
                "the checkpoint is of a full fine-tuning run, not LoRA adapters: resume it without --lora"
                    .into(),
            ),
            (Some(was), Some(now)) => {
                if (was.rank, was.alpha, was.targets) != (now.rank, now.alpha, now.targets) {
                    return refuse(format!(
                        "the checkpoint's adapters are `{was}`; this run trains `{now}` (rank, alpha and targets must match)"
                    ));
                }
                let now_base = self.base_model_name();
                match &saved.base_model {
                    Some(was_base) if !same_base(was_base, &now_base) => refuse(format!(
                        "the checkpoint's adapters are for the base model {was_base}; this run's base model is {now_base}"
                    )),
                    _ => Ok(()),
                }
            }
        }
    }

    /// Loads the weights and the optimizer's moments from `ck`, one tensor at a time.
    fn load_tensors(&mut self, ck: &TrainingState) -> Result<()> {
        let read = |file: &StateFile, name: &str, var: &Var| -> Result<Tensor> {
            let t = file.tensor(name)?;
            if t.dims() != var.dims() {
                return Err(Error::input(
                    file.path(),
                    format!(
                        "tensor `{name}` has shape {:?}, the model needs {:?}",
                        t.dims(),
                        var.dims()
                    ),
                ));
            }
            Ok(t)
        };
        let set = |var: &Var, t: &Tensor| -> Result<()> {
            var.set(&t.to_dtype(var.dtype())?.to_device(var.device())?)?;
            Ok(())
        };
        if let Optim::Sharded(opt) = &mut self.optim {
            // Stage 3: every parameter is set, then the non-owned freed again.
            opt.gather_params()?;
        }
        let names = &self.names;
        let masters = self.masters();
        for (i, (name, compute)) in names.iter().zip(&self.vars).enumerate() {
            let master = format!("master.{name}");
            let t = if ck.optimizer.contains(&master) {
                read(&ck.optimizer, &master, compute)?
            } else {
                match &self.lora {
                    Some(lora) => read(&ck.model, &lora.peft_name(name), compute)?,
                    None => read(&ck.model, name, compute)?,
                }
            };
            if let Some(m) = masters {
                set(&m[i], &t)?;
            }
            match &self.optim {
                Optim::Sharded(opt) => opt.set_weights(i, &t)?,
                _ => set(compute, &t)?,
            }
        }
        let saved_moments = ck.state.optimizer_step.filter(|_| {
            names
                .first()
                .is_some_and(|n| ck.optimizer.contains(&format!("{n}.m")))
        });
        if let Optim::Sharded(opt) = &mut self.optim {
            let rank = opt.comm().rank();
            let owned: Vec<usize> = (0..names.len())
                .filter(|&i| opt.owners()[i] == rank)
                .collect();
            if let Some(step) = saved_moments {
                for i in owned {
                    let (name, var) = (&names[i], &self.vars[i]);
                    let m = read(&ck.optimizer, &format!("{name}.m"), var)?;
                    let v = read(&ck.optimizer, &format!("{name}.v"), var)?;
                    opt.optimizer_mut()
                        .set_moments(&i.to_string(), &m, &v)
                        .map_err(|e| Error::input(ck.optimizer.path(), e.to_string()))?;
                }
                opt.optimizer_mut().set_step_count(step);
            } else {
                tracing::warn!(
                    "the checkpoint holds no optimizer moments (its run used candle_nn::AdamW): they restart from zero"
                );
            }
            opt.release_params()?;
            return Ok(());
        }
        match (self.optim.fused_mut(), saved_moments) {
            (Some(opt), Some(step)) => {
                for (name, var) in names.iter().zip(&self.vars) {
                    let m = read(&ck.optimizer, &format!("{name}.m"), var)?;
                    let v = read(&ck.optimizer, &format!("{name}.v"), var)?;
                    opt.set_moments(name, &m, &v)
                        .map_err(|e| Error::input(ck.optimizer.path(), e.to_string()))?;
                }
                opt.set_step_count(step);
            }
            (Some(_), None) => tracing::warn!(
                "the checkpoint holds no optimizer moments (its run used candle_nn::AdamW): they restart from zero"
            ),
            (None, Some(_)) => tracing::warn!(
                "the plan uses candle_nn::AdamW, which cannot take the checkpoint's optimizer moments: they restart from zero"
            ),
            (None, None) => {}
        }
        Ok(())
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

#[cfg(test)]
mod tests {
    use super::plan_changes;
    use oomfix_strategies::{Attention, Plan};

    #[test]
    fn a_plan_change_is_listed_field_by_field() {
        let plan = Plan::baseline(8, 64);
        assert!(plan_changes(&plan, &plan).is_empty());
        let other = Plan {
            micro_batch: 4,
            grad_accum: 2,
            attention: Attention::Flash,
            ..plan
        };
        let lines = plan_changes(&plan, &other);
        assert_eq!(lines.len(), 1, "{lines:?}");
        for part in [
            "micro_batch 8 -> 4",
            "grad_accum 1 -> 2",
            r#"attention "composed" -> "flash""#,
        ] {
            assert!(lines[0].contains(part), "{lines:?}");
        }
        let smaller = Plan {
            micro_batch: 2,
            ..plan
        };
        let lines = plan_changes(&plan, &smaller);
        assert!(
            lines[1].contains("global batch changes from 8 to 2"),
            "{lines:?}"
        );
    }
}
