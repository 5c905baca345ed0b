//! The memory of a model given as code, from a few measured passes.

use crate::memory::{
    assemble_peak, step_bytes, AfterBackward, Breakdown, Estimator, PeakMoment, Target,
};
use crate::spec::ModelSpec;
use crate::speed::{step_time, StepTime};
use crate::track::alloc;
use crate::{Error, Result};
use candle_core::{DType, Device, Var};
use oomfix_strategies::model::{self, MicroBatch, Model};
use oomfix_strategies::{Execution, ModelFacts, Plan, Precision, StateBytes, Strategy};
use serde::Serialize;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// The part of a plan that changes what a forward and backward pass holds:
/// one affine fit of memory against the micro-batch per setting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Setting {
    /// Compute precision.
    pub precision: Precision,
    /// How the pass runs (the fixes' [`Execution`] of the plan).
    pub exec: Execution,
}

impl Setting {
    /// The setting of `plan`, its passes run as `exec` says.
    pub fn of(plan: &Plan, exec: &Execution) -> Self {
        Setting {
            precision: plan.precision,
            exec: *exec,
        }
    }
}

/// The precision and the execution's checkpointing, attention and loss
/// chunks (what the JSON reports of a setting).
impl Serialize for Setting {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let mut out = s.serialize_struct("Setting", 4)?;
        out.serialize_field("precision", &self.precision)?;
        out.serialize_field("checkpoint", &self.exec.checkpoint)?;
        out.serialize_field("attention", &self.exec.attention)?;
        out.serialize_field("loss_chunk_bytes", &self.exec.loss_chunk_bytes)?;
        out.end()
    }
}

impl std::fmt::Display for Setting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}, checkpoint {}, {} attention",
            self.precision, self.exec.checkpoint, self.exec.attention
        )?;
        if self.exec.loss_chunk_bytes.is_some() {
            f.write_str(", chunked loss")?;
        }
        Ok(())
    }
}

/// What one probe found.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "snake_case", tag = "outcome")]
pub enum ProbeOutcome {
    /// The pass ran: its peak bytes above what was live before it (the
    /// model's weights and whatever else), and its seconds.
    Measured {
        /// Peak bytes of the pass above those live before it.
        bytes: u64,
        /// Wall time of the pass.
        seconds: f64,
    },
    /// The pass ran out of device memory (a CUDA out-of-memory error,
    /// recovered from).
    OutOfMemory,
}

/// One measured forward and backward pass of the model.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Probe {
    /// The setting it ran under.
    pub setting: Setting,
    /// Samples in its micro-batch.
    pub micro_batch: usize,
    /// What it found.
    #[serde(flatten)]
    pub outcome: ProbeOutcome,
}

/// Runs probes: one forward and backward pass of a micro-batch under a
/// setting, measured. [`ModelProber`] is the real one; tests may give
/// another (one that runs out of memory, say).
pub trait Prober: Send {
    /// Measures one pass of `micro_batch` samples under `setting`. A device
    /// out-of-memory is an outcome; any other failure an error.
    fn probe(&mut self, setting: Setting, micro_batch: usize) -> Result<ProbeOutcome>;
    /// Bytes the model holds besides its variables (buffers, tables), as
    /// measured when it was built in fp32; 0 when unknown.
    fn buffer_bytes(&self) -> u64 {
        0
    }
}

/// The affine fit of one setting: bytes and seconds of a pass against the
/// micro-batch, from two probes.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Fit {
    /// Bytes at a micro-batch of 0 (the gradients, the model's fixed working set).
    pub bytes_intercept: f64,
    /// Bytes per sample.
    pub bytes_per_sample: f64,
    /// Seconds at a micro-batch of 0.
    pub seconds_intercept: f64,
    /// Seconds per sample.
    pub seconds_per_sample: f64,
    /// The smallest micro-batch that ran out of memory, if one did: no
    /// larger micro-batch is taken to fit.
    pub out_of_memory_at: Option<usize>,
}

impl Fit {
    /// The fit through the probes of one setting: two measured points give
    /// the line; one (the other out of memory) a flat line through it.
    fn from_probes(probes: &[Probe]) -> Fit {
        let measured: Vec<(f64, f64, f64)> = probes
            .iter()
            .filter_map(|p| match p.outcome {
                ProbeOutcome::Measured { bytes, seconds } => {
                    Some((p.micro_batch as f64, bytes as f64, seconds))
                }
                ProbeOutcome::OutOfMemory => None,
            })
            .collect();
        let out_of_memory_at = probes
            .iter()
            .filter(|p| p.outcome == ProbeOutcome::OutOfMemory)
            .map(|p| p.micro_batch)
            .min();
        let (bytes_intercept, bytes_per_sample, seconds_intercept, seconds_per_sample) =
            match measured.as_slice() {
                [] => (f64::INFINITY, 0.0, 0.0, 0.0),
                [(_, bytes, secs)] => (*bytes, 0.0, *secs, 0.0),
                [(b0, m0, t0), (b1, m1, t1), ..] => {
                    let slope = ((m1 - m0) / (b1 - b0)).max(0.0);
                    let time_slope = ((t1 - t0) / (b1 - b0)).max(0.0);
                    (
                        (m0 - slope * b0).max(0.0),
                        slope,
                        (t0 - time_slope * b0).max(0.0),
                        time_slope,
                    )
                }
            };
        Fit {
            bytes_intercept,
            bytes_per_sample,
            seconds_intercept,
            seconds_per_sample,
            out_of_memory_at,
        }
    }

    /// Bytes of a pass of `micro_batch` samples; `None` when a probe of that
    /// many samples or fewer ran out of memory (or none ran).
    pub fn bytes(&self, micro_batch: usize) -> Option<u64> {
        if self.out_of_memory_at.is_some_and(|b| micro_batch >= b)
            || !self.bytes_intercept.is_finite()
        {
            return None;
        }
        Some((self.bytes_intercept + self.bytes_per_sample * micro_batch as f64).round() as u64)
    }

    /// Seconds of a pass of `micro_batch` samples.
    pub fn seconds(&self, micro_batch: usize) -> f64 {
        self.seconds_intercept + self.seconds_per_sample * micro_batch as f64
    }
}

/// What the measured memory model has learnt so far.
#[derive(Default)]
struct Learnt {
    fits: HashMap<Setting, Fit>,
    probes: Vec<Probe>,
    error: Option<String>,
}

/// A memory model for a model given as code: per setting of
/// precision, checkpointing and attention, the peak of a forward and
/// backward pass is measured at two small micro-batches and fitted as an
/// affine function of the micro-batch, probed the first time a plan of that
/// setting is estimated; the training state (weights, master weights,
/// gradients carried between micro-batches, optimizer state and the step's
/// temporaries, sharding, offload) comes from the fixes' memory hooks, as
/// in [`crate::memory`], with the model's variables as the facts.
///
/// A plan's peak is the larger of
/// * the passes: weights (+ the model's other buffers), master weights,
///   optimizer state and accumulated gradients, plus the fitted pass (which
///   holds the activations, the backward's working set and the fresh
///   gradients);
/// * the optimizer step: weights and gradients as the step holds them,
///   master weights, optimizer state and the step's temporaries;
///
/// plus the target's runtime. On the CPU an offloaded optimizer's "host"
/// memory is the same memory: it is added to the peak there.
///
/// The modelled step time is the fitted pass times per micro-batch, plus
/// [`step_time`]'s optimizer, transfers and collectives.
pub struct MeasuredModel {
    facts: ModelFacts,
    fixes: Vec<Arc<dyn Strategy>>,
    prober: Mutex<Box<dyn Prober>>,
    probe_batches: [usize; 2],
    learnt: Mutex<Learnt>,
}

impl MeasuredModel {
    /// A measured model of a model with `facts` (from its variables:
    /// [`model::facts`]), probed by `prober` at micro-batches
    /// `probe_batches` (two different sizes, e.g. `[1, 2]`), with the
    /// memory hooks of `fixes`.
    pub fn new(
        facts: ModelFacts,
        prober: Box<dyn Prober>,
        probe_batches: [usize; 2],
        fixes: Vec<Arc<dyn Strategy>>,
    ) -> Result<Self> {
        if probe_batches[0] == 0 || probe_batches[0] == probe_batches[1] || probe_batches[1] == 0 {
            return Err(Error::Usage(format!(
                "probes need two different micro-batches of at least 1 (got {probe_batches:?})"
            )));
        }
        Ok(MeasuredModel {
            facts,
            fixes,
            prober: Mutex::new(prober),
            probe_batches,
            learnt: Mutex::new(Learnt::default()),
        })
    }

    /// The probes run so far, in order.
    pub fn probes(&self) -> Vec<Probe> {
        self.learnt.lock().expect("not poisoned").probes.clone()
    }

    /// The fits learnt so far.
    pub fn fits(&self) -> HashMap<Setting, Fit> {
        self.learnt.lock().expect("not poisoned").fits.clone()
    }

    /// The first probe that failed with an error (not an out-of-memory), if any.
    pub fn error(&self) -> Option<String> {
        self.learnt.lock().expect("not poisoned").error.clone()
    }

    /// The fit of `setting`, probing it first if it is new. A failed probe
    /// leaves a fit that nothing fits in, and the error recorded.
    pub fn fit(&self, setting: Setting) -> Fit {
        let mut learnt = self.learnt.lock().expect("not poisoned");
        if let Some(fit) = learnt.fits.get(&setting) {
            return *fit;
        }
        let mut prober = self.prober.lock().expect("not poisoned");
        let mut probes = Vec::new();
        for &micro_batch in &self.probe_batches {
            match prober.probe(setting, micro_batch) {
                Ok(outcome) => {
                    let probe = Probe {
                        setting,
                        micro_batch,
                        outcome,
                    };
                    tracing::info!(%setting, micro_batch, ?outcome, "probe");
                    probes.push(probe);
                    if outcome == ProbeOutcome::OutOfMemory {
                        break; // a larger micro-batch would too
                    }
                }
                Err(e) => {
                    tracing::warn!(%setting, micro_batch, error = %e, "probe failed");
                    learnt
                        .error
                        .get_or_insert_with(|| format!("probing {setting}: {e}"));
                    break;
                }
            }
        }
        let fit = Fit::from_probes(&probes);
        learnt.probes.extend(probes);
        learnt.fits.insert(setting, fit);
        fit
    }

    /// The setting of `plan`, its passes run as the fixes' execution hooks say.
    fn setting(&self, plan: &Plan) -> Setting {
        Setting::of(plan, &Execution::for_plan(plan, &self.fixes))
    }

    /// The training state of `plan` from the fixes' memory hooks.
    fn state(&self, plan: &Plan) -> StateBytes {
        oomfix_strategies::memory::state_of(plan, &self.facts, &self.fixes).1
    }
}

impl Estimator for MeasuredModel {
    fn estimate(&self, _spec: &ModelSpec, plan: &Plan, target: &Target) -> Breakdown {
        let fit = self.fit(self.setting(plan));
        let buffers = self.prober.lock().expect("not poisoned").buffer_bytes();
        let s = self.state(plan);
        let runtime = target.runtime_bytes();
        let communicator = target.communicator_bytes(plan.shard.world_size);
        // Outside the tensors, at every moment.
        let outside = runtime + communicator;
        let exec = Execution::for_plan(plan, &self.fixes);
        let pool_slack = target.pool_slack_bytes(self.facts.layers, 0, plan, &exec);
        let pass = fit.bytes(plan.micro_batch);
        let held =
            s.weights + buffers + s.master_weights + s.optimizer_state + s.accumulated_gradients;
        let backward = pass.map(|p| held + p + outside);
        // As the analytic model: the first step's accumulation (one new sum
        // beside the sums and the fresh gradients), a sharded plan's
        // gradient reduction and the owners' broadcast in the step.
        let after = AfterBackward::of(
            plan,
            &s,
            self.facts.parameters,
            self.facts.largest_tensor,
            target,
        );
        let (first_sum, reduction, reduced) = (after.first_sum, after.buffers, after.reduced);
        let after_backward = held + s.gradients + first_sum.max(reduction + reduced) + outside;
        let step = step_bytes(&s, &after, buffers) + outside;
        let (after_moment, after_buffers) = if reduction > first_sum {
            (PeakMoment::GradientReduction, reduction)
        } else {
            (PeakMoment::Backward, 0)
        };
        let (peak, peak_phase, collective_buffers) = assemble_peak(
            &[
                (backward.unwrap_or(u64::MAX), PeakMoment::Backward, 0),
                (after_backward, after_moment, after_buffers),
                (step, PeakMoment::OptimizerStep, after.broadcast),
            ],
            s.host,
            target,
            pool_slack,
        );
        let pass = pass.unwrap_or(u64::MAX);
        Breakdown {
            weights: s.weights + buffers,
            master_weights: s.master_weights,
            gradients: s.gradients,
            accumulated_gradients: s.accumulated_gradients,
            optimizer_state: s.optimizer_state,
            // The pass's measured bytes beyond the fresh gradients: the
            // activations and the backward's working set, not told apart.
            activations: pass.saturating_sub(s.gradients),
            backward_transient: 0,
            optimizer_transient: s.optimizer_transient,
            runtime,
            pool_slack,
            communicator,
            collective_buffers,
            peak,
            peak_phase,
            host: s.host,
        }
    }

    fn step_time(&self, spec: &ModelSpec, plan: &Plan, target: &Target) -> StepTime {
        let exec = Execution::for_plan(plan, &self.fixes);
        let fit = self.fit(Setting::of(plan, &exec));
        let analytic = step_time(spec, plan, &self.fixes, target);
        let compute = plan.grad_accum as f64 * fit.seconds(plan.micro_batch);
        StepTime {
            compute,
            total: compute + analytic.optimizer + analytic.transfers + analytic.collectives,
            ..analytic
        }
    }
}

/// The real [`Prober`]: builds the model (once per precision, with the
/// caller's builder) and measures passes in this process: on the CPU the
/// heap's high-water mark (the process needs
/// [`crate::track::CountingAlloc`]), on CUDA the memory pool's, where an
/// out-of-memory error is recorded as an outcome and the pool trimmed.
pub struct ModelProber<M, B> {
    build: B,
    device: Device,
    seq_len: usize,
    models: HashMap<Precision, (M, Vec<Var>)>,
    buffers: u64,
    index: u64,
}

impl<M, B> ModelProber<M, B>
where
    M: Model,
    B: Fn(DType, &Device) -> candle_core::Result<M>,
{
    /// A prober of the models `build` makes on `device`, with sequences of
    /// `seq_len` tokens. Builds the fp32 model now (measuring its bytes
    /// beyond its variables on the CPU).
    pub fn new(build: B, device: &Device, seq_len: usize) -> Result<Self> {
        if device.is_cpu() && !alloc::installed() {
            return Err(Error::Usage(
                "measuring on the CPU needs oomfix::track::CountingAlloc as the global allocator"
                    .into(),
            ));
        }
        warm_up_threads()?;
        let before = alloc::current();
        let model = build(DType::F32, device)?;
        let vars = model.vars();
        let built = alloc::current().saturating_sub(before);
        let buffers = if device.is_cpu() {
            built.saturating_sub(model::var_bytes(&vars))
        } else {
            0
        };
        Ok(ModelProber {
            build,
            device: device.clone(),
            seq_len,
            models: HashMap::from([(Precision::F32, (model, vars))]),
            buffers,
            index: 0,
        })
    }

    /// The fp32 model.
    pub fn model(&self) -> &M {
        &self.models[&Precision::F32].0
    }

    /// The fp32 model's variables.
    pub fn vars(&self) -> &[Var] {
        &self.models[&Precision::F32].1
    }

    fn pass(&mut self, setting: Setting, micro_batch: usize) -> Result<ProbeOutcome> {
        if !self.models.contains_key(&setting.precision) {
            let m = (self.build)(model::dtype_of(setting.precision), &self.device)?;
            let vars = m.vars();
            self.models.insert(setting.precision, (m, vars));
        }
        let (m, vars) = &self.models[&setting.precision];
        let batch =
            MicroBatch::new(micro_batch, self.index, setting.exec).with_seq_len(self.seq_len);
        self.index += 1;
        let before = start_peak(&self.device)?;
        let start = Instant::now();
        let out = model::forward_backward(m, vars, &batch)?;
        let peak = read_peak(&self.device)?;
        let seconds = start.elapsed().as_secs_f64();
        drop(out);
        Ok(ProbeOutcome::Measured {
            bytes: peak.saturating_sub(before),
            seconds,
        })
    }
}

impl<M, B> Prober for ModelProber<M, B>
where
    M: Model,
    B: Fn(DType, &Device) -> candle_core::Result<M> + Send,
    M: Send,
{
    fn probe(&mut self, setting: Setting, micro_batch: usize) -> Result<ProbeOutcome> {
        match self.pass(setting, micro_batch) {
            Err(e) if is_device_oom(&e) => {
                trim_device(&self.device)?;
                Ok(ProbeOutcome::OutOfMemory)
            }
            other => other,
        }
    }

    fn buffer_bytes(&self) -> u64 {
        self.buffers
    }
}

/// Resets the high-water mark; returns the bytes live now.
fn start_peak(device: &Device) -> Result<u64> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(cuda) = device {
        crate::track::cuda::reset_peaks(cuda)?;
        return Ok(crate::track::cuda::PoolStats::read(cuda)?.used);
    }
    let _ = device;
    Ok(alloc::reset_peak())
}

/// The high-water mark since [`start_peak`].
fn read_peak(device: &Device) -> Result<u64> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(cuda) = device {
        return Ok(crate::track::cuda::PoolStats::read(cuda)?.used_high);
    }
    let _ = device;
    Ok(alloc::peak())
}

/// Whether `e` is a CUDA out-of-memory error (never on the CPU, where an
/// allocation failure aborts the process).
fn is_device_oom(e: &Error) -> bool {
    #[cfg(feature = "cuda")]
    {
        let candle = match e {
            Error::Candle(c) => Some(c),
            Error::Strategy(oomfix_strategies::Error::Candle(c)) => Some(c),
            _ => None,
        };
        if let Some(c) = candle {
            return crate::track::cuda::is_out_of_memory(c);
        }
    }
    let _ = e;
    false
}

/// Gives the pool's free memory back after an out-of-memory.
fn trim_device(device: &Device) -> Result<()> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(cuda) = device {
        crate::track::cuda::trim(cuda)?;
    }
    let _ = device;
    Ok(())
}

/// Makes the process-wide buffers of the matrix kernels exist before
/// anything is measured (see [`crate::measure`]).
fn warm_up_threads() -> Result<()> {
    crate::measure::warm_up_threads()?;
    // The calling thread's own packing buffer.
    let a = candle_core::Tensor::ones((64, 64), DType::F32, &Device::Cpu)?;
    a.matmul(&a)?;
    Ok(())
}
