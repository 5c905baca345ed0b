//! Models oomfix does not know: planned by measurement, trained by the
//! plan's fixes.
//!
//! A model given as code implements [`oomfix_strategies::model::Model`]
//! (its variables, a loss or stages per micro-batch, what it can do) and is
//! built by a function of the compute dtype and the device. Then:
//!
//! * [`MeasuredPlanner`] plans it under a budget: the search of
//!   [`crate::search`] (the same pipeline, pins and exploration) with a
//!   [`MeasuredModel`] as the memory model, which measures two small
//!   micro-batches' forward and backward passes per setting of precision,
//!   checkpointing and attention that the search reaches, and
//!   adds the training state from the fixes' memory hooks; fixes the model
//!   cannot take are skipped with the reason
//!   ([`crate::SearchResult::skipped`]); the chosen plan is verified with
//!   one real step;
//! * [`crate::Trainer::of_model`] trains it with the plan (one device, or one
//!   rank of a sharded plan over a [`oomfix_strategies::shard::Comm`]), as
//!   it trains the Hugging Face families.
//!
//! ```
//! use candle_core::{DType, Device, Module, Tensor, Var};
//! use oomfix::anymodel::MeasuredPlanner;
//! use oomfix::strategies::model::{Capabilities, Forward, MicroBatch, Model, Stages};
//! use oomfix::strategies::nn::{linear, Linear};
//! use oomfix::train::data::DataSource;
//! use oomfix::{Planner, Target, Trainer, TrainOptions};
//! # #[global_allocator]
//! # static ALLOC: oomfix::track::CountingAlloc = oomfix::track::CountingAlloc;
//!
//! /// A residual stack of four linear layers on random inputs.
//! struct Stack { layers: Vec<Linear>, vars: Vec<Var> }
//!
//! impl Model for Stack {
//!     fn vars(&self) -> Vec<Var> { self.vars.clone() }
//!     fn forward(&self, b: &MicroBatch) -> candle_core::Result<Forward<'_>> {
//!         let dev = &self.vars[0].device();
//!         let x = Tensor::randn(0f32, 1.0, (b.size, 64), dev)?.to_dtype(self.vars[0].dtype())?;
//!         let blocks = self.layers.iter().map(|l| {
//!             Box::new(move |h: &Tensor| h + l.forward(h)?.tanh()?) as _
//!         }).collect();
//!         let head = Box::new(|h: &Tensor| h.to_dtype(DType::F32)?.sqr()?.mean_all());
//!         Ok(Forward::Stages(Stages { stem: x, blocks, head }))
//!     }
//!     fn capabilities(&self) -> Capabilities {
//!         Capabilities::NONE.with_blocks(self.layers.len())
//!     }
//! }
//!
//! fn build(dtype: DType, dev: &Device) -> candle_core::Result<Stack> {
//!     let varmap = candle_nn::VarMap::new();
//!     let vb = candle_nn::VarBuilder::from_varmap(&varmap, dtype, dev);
//!     let layers = (0..4).map(|i| linear(64, 64, vb.pp(i))).collect::<candle_core::Result<_>>()?;
//!     Ok(Stack { layers, vars: oomfix::strategies::model::vars_of(&varmap) })
//! }
//!
//! let planned = MeasuredPlanner::new(Planner::new(64 << 20).global_batch(8).target(Target::Cpu), build)
//!     .run()?;
//! let plan = planned.result.chosen().expect("fits in 64 MiB").plan;
//! assert!(planned.probe_steps() <= 4);
//! assert!(planned.result.skipped.iter().any(|s| s.strategy == "precision"));
//! let mut trainer = Trainer::of_model(build, plan, &Device::Cpu, &TrainOptions::default())?;
//! trainer.step(&mut DataSource::ModelMade)?;
//! # Ok::<(), oomfix::Error>(())
//! ```

mod probe;

pub use probe::{Fit, MeasuredModel, ModelProber, Probe, ProbeOutcome, Prober, Setting};

use crate::memory::Target;
use crate::search::{Measurement, Planner, SearchResult};
use crate::spec::{Family, ModelConfig, ModelSpec, TensorInfo};
use crate::track::alloc;
use crate::train::TrainOptions;
use crate::{Error, Result};
use candle_core::{DType, Device, Var};
use oomfix_strategies::model::Model;
use serde::Serialize;
use serde_json::{json, Value};
use std::sync::Arc;

/// The [`ModelSpec`] of a model given as code: family
/// [`Family::Generic`], `blocks` layers, its variables as tensors
/// (`var.0`, `var.1`, … in the model's order, in their dtype).
pub fn spec_of(source: &str, vars: &[Var], blocks: usize) -> ModelSpec {
    let tensors: Vec<TensorInfo> = vars
        .iter()
        .enumerate()
        .map(|(i, v)| TensorInfo {
            name: format!("var.{i}"),
            shape: v.dims().to_vec(),
            dtype: format!("{:?}", v.dtype()).to_uppercase(),
        })
        .collect();
    let file_bytes = oomfix_strategies::model::var_bytes(vars);
    ModelSpec {
        source: source.to_string(),
        files: Vec::new(),
        config: ModelConfig {
            family: Family::Generic,
            layers: blocks,
            hidden: 0,
            heads: 0,
            kv_heads: 0,
            intermediate: 0,
            vocab: 0,
            // The sequence length is the model's business: 1 unless planned otherwise.
            max_positions: 1,
            tied_embeddings: false,
            qkv_bias: false,
            settings: Default::default(),
        },
        dtype: tensors.first().map_or("F32".into(), |t| t.dtype.clone()),
        tensors,
        file_bytes,
        assumptions: vec!["a model given as code: activations measured, not modelled".to_string()],
    }
}

/// What verifying the chosen plan with a real step gave.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "snake_case", tag = "status")]
pub enum Verification {
    /// One real step of the chosen plan was measured.
    Measured {
        /// Its peak bytes (above what was live before the trainer was built).
        peak_bytes: u64,
        /// Its wall time.
        step_seconds: f64,
        /// Whether the peak is within the budget.
        fits: bool,
    },
    /// Not run: nothing fits, verification was turned off, or the plan is
    /// sharded (in-process ranks share one heap: each rank's peak is not
    /// measurable apart).
    NotRun,
}

/// The outcome of [`MeasuredPlanner::run`].
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct MeasuredPlan {
    /// The model as the search saw it.
    pub spec: ModelSpec,
    /// The search (its attempts' estimates are the measured model's; the
    /// chosen attempt carries the verification's measurement).
    pub result: SearchResult,
    /// Every probe, in order.
    pub probes: Vec<Probe>,
    /// The fit of each setting probed.
    pub fits: Vec<(Setting, Fit)>,
    /// The chosen plan's real step.
    pub verification: Verification,
}

impl MeasuredPlan {
    /// Forward and backward passes measured to plan (the verification's
    /// step not included).
    pub fn probe_steps(&self) -> usize {
        self.probes.len()
    }

    /// Real steps run to verify (0 or 1).
    pub fn verify_steps(&self) -> usize {
        usize::from(matches!(self.verification, Verification::Measured { .. }))
    }

    /// The JSON report: the search's ([`crate::report::search_json`])
    /// with `probes`, `probe_steps`, `fits` and `verification` added.
    pub fn to_json(&self) -> Value {
        let mut v = crate::report::search_json(&self.spec, &self.result);
        let o = v.as_object_mut().expect("an object");
        o.insert("probe_steps".into(), json!(self.probe_steps()));
        o.insert("probes".into(), json!(self.probes));
        o.insert(
            "fits_by_setting".into(),
            json!(self
                .fits
                .iter()
                .map(|(s, f)| json!({"setting": s, "fit": f}))
                .collect::<Vec<_>>()),
        );
        o.insert("verification".into(), json!(self.verification));
        v
    }
}

/// Plans a model given as code by measurement (see the [module docs](self)).
pub struct MeasuredPlanner<M, B> {
    planner: Planner,
    build: B,
    name: String,
    probe_batches: [usize; 2],
    verify: bool,
    _model: std::marker::PhantomData<fn() -> M>,
}

impl<M, B> MeasuredPlanner<M, B>
where
    M: Model + Send + 'static,
    B: Fn(DType, &Device) -> candle_core::Result<M> + Send + Sync + 'static,
{
    /// Plans the model `build` makes with `planner`'s budget, batch,
    /// target, pipeline and pins (its estimator is replaced by the
    /// measured one). Probes at micro-batches 1 and 2; verifies the chosen
    /// plan.
    pub fn new(planner: Planner, build: B) -> Self {
        MeasuredPlanner {
            planner,
            build,
            name: "model given as code".into(),
            probe_batches: [1, 2],
            verify: true,
            _model: std::marker::PhantomData,
        }
    }

    /// The model's name in reports.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// The two micro-batch sizes each setting is probed at (default `[1, 2]`).
    pub fn probe_batches(mut self, sizes: [usize; 2]) -> Self {
        self.probe_batches = sizes;
        self
    }

    /// Whether the chosen plan is verified with one real step (default yes).
    pub fn verify(mut self, verify: bool) -> Self {
        self.verify = verify;
        self
    }

    /// Probes, searches and verifies.
    pub fn run(self) -> Result<MeasuredPlan> {
        let target = self.planner.target_of();
        let device = match target {
            Target::Cpu => Device::Cpu,
            Target::Cuda(i) => Device::new_cuda(i)?,
        };
        let build = Arc::new(self.build);
        let shared = Arc::clone(&build);
        let seq_len = self.planner.seq_len_for(&spec_of("", &[], 0));
        let prober = ModelProber::new(
            move |d: DType, dev: &Device| shared(d, dev),
            &device,
            seq_len,
        )?;
        let caps = prober.model().capabilities();
        let vars = prober.vars().to_vec();
        let blocks = if caps.blocks == usize::MAX {
            0
        } else {
            caps.blocks
        };
        let spec = spec_of(&self.name, &vars, blocks);
        let facts = oomfix_strategies::model::facts(&vars, blocks);
        drop(vars);
        let fixes = oomfix_strategies::registered(self.planner.pipeline_of());
        let measured = Arc::new(MeasuredModel::new(
            facts,
            Box::new(prober),
            self.probe_batches,
            fixes.clone(),
        )?);
        let budget = self.planner.budget_of();
        let planner = self
            .planner
            .model_capabilities(caps)
            .estimator(Arc::clone(&measured));
        let mut result = planner.run(&spec)?;
        drop(planner);
        if let Some(e) = measured.error() {
            return Err(Error::Runtime(e));
        }
        let mut verification = Verification::NotRun;
        if let (true, Some(i)) = (self.verify, result.chosen) {
            let plan = result.attempts[i].plan;
            if plan.shard.world_size <= 1 {
                let options = TrainOptions {
                    fixes,
                    ..TrainOptions::default()
                };
                let m = verify_step(|d, dev| build(d, dev), plan, &device, &options)?;
                let fits = !m.out_of_memory && m.peak_bytes <= budget;
                verification = Verification::Measured {
                    peak_bytes: m.peak_bytes,
                    step_seconds: m.step_seconds.unwrap_or(f64::NAN),
                    fits,
                };
                let attempt = &mut result.attempts[i];
                attempt.measured = Some(m);
                attempt.fits &= fits;
                if !fits {
                    result.chosen = None;
                    result.advice.push(format!(
                        "the chosen plan measured {} in a real step, over the budget of {}",
                        crate::units::format_bytes(m.peak_bytes),
                        crate::units::format_bytes(budget)
                    ));
                }
            }
        }
        let mut fits: Vec<(Setting, Fit)> = measured.fits().into_iter().collect();
        fits.sort_by_key(|(s, _)| s.to_string());
        Ok(MeasuredPlan {
            spec,
            result,
            probes: measured.probes(),
            fits,
            verification,
        })
    }
}

/// Builds a trainer of `plan` with `build` and measures its first step:
/// the peak above the bytes live before the trainer was built (on the CPU
/// the heap's, which needs [`crate::track::CountingAlloc`]; on CUDA the
/// memory pool's).
pub fn verify_step<M, B>(
    build: B,
    plan: oomfix_strategies::Plan,
    device: &Device,
    options: &TrainOptions,
) -> Result<Measurement>
where
    M: Model + 'static,
    B: FnOnce(DType, &Device) -> candle_core::Result<M>,
{
    if device.is_cpu() && !alloc::installed() {
        return Err(Error::Usage(
            "measuring on the CPU needs oomfix::track::CountingAlloc as the global allocator"
                .into(),
        ));
    }
    let mut trainer = crate::Trainer::of_model(build, plan, device, options)?;
    let stats = trainer.step(&mut crate::train::data::DataSource::ModelMade)?;
    Ok(Measurement {
        peak_bytes: stats.peak(),
        reserved_bytes: stats.peak(),
        out_of_memory: false,
        step_seconds: Some(stats.seconds),
    })
}
