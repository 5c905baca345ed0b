//! Measuring a plan by running real training steps.
//!
//! [`measure_plan`] builds the model with random weights (memory does not
//! depend on the values), runs one step to allocate the optimizer state, then
//! measures the second, steady-state step: the heap high-water mark above what
//! the process held before the model was built.
//!
//! A CPU allocation failure aborts the process, so [`StepVerifier`] can run
//! each measurement in a child process (the `oomfix` binary's hidden
//! `measure-step` command) under an address-space limit: a plan that would
//! exhaust host memory then kills only the child and is recorded as out of memory.

use super::timeline::Timeline;
use super::RunRecording;
use crate::memory::Target;
use crate::search::{Measurement, Verifier};
use crate::spec::ModelSpec;
use crate::track::alloc;
use crate::train::data::DataSource;
use crate::train::{TrainOptions, Trainer};
use crate::{Error, Result};
use candle_core::Device;
use oomfix_strategies::Plan;
use std::path::PathBuf;
use std::process::Command;

/// Slack added to the budget for the child's address-space limit: code,
/// thread stacks and allocator arenas are mapped but are not heap.
pub(crate) const ADDRESS_SPACE_SLACK: u64 = 2 << 30;

/// Measures one steady-state training step of `plan` in this process.
pub fn measure_plan(spec: &ModelSpec, plan: &Plan, target: Target) -> Result<Measurement> {
    measure(spec, plan, target, false).map(|(m, _)| m)
}

/// Measures `plan` as one rank of a job (every rank calls it at once): this
/// rank's trainer over `comm` on `device` takes a warm-up step and a measured
/// step; the ranks' peaks are gathered, and each gets the largest (a plan
/// fits when its fullest rank does) and the slowest rank's step time. On the
/// CPU the peak is the counting allocator's high-water mark above what the
/// process held before (it must be the global allocator), on CUDA the pool's
/// used high-water mark plus the rank's part of the device memory outside
/// the pools (its own GPU's, or an equal part of a GPU it shares).
pub fn measure_sharded(
    spec: &ModelSpec,
    plan: &Plan,
    device: &Device,
    comm: Box<dyn oomfix_strategies::shard::Comm>,
) -> Result<Measurement> {
    if device.is_cpu() && !alloc::installed() {
        return Err(Error::Usage(
            "CPU measurement needs oomfix::track::CountingAlloc as the global allocator".into(),
        ));
    }
    if device.is_cpu() {
        warm_up_threads()?;
    }
    // The trainer's peaks are above the heap it was built on.
    let mut trainer =
        Trainer::new_sharded(&spec.config, *plan, device, &TrainOptions::default(), comm)?;
    let mut data = DataSource::synthetic(0);
    trainer.step(&mut data)?;
    let stats = trainer.step(&mut data)?;
    let comm = trainer
        .comm()
        .expect("a sharded trainer has a communicator");
    // Every rank at rest before the device is read: ranks sharing a GPU
    // then see the same memory outside their pools.
    comm.all_reduce_sum(&candle_core::Tensor::new(&[0f32], &Device::Cpu)?)?;
    let (gpu, outside, reserved) = device_reading(device)?;
    let mine = [stats.peak() as f64, stats.seconds, gpu, outside, reserved];
    let all = comm
        .all_gather(&candle_core::Tensor::new(&mine, &Device::Cpu)?)?
        .iter()
        .map(|t| t.to_vec1::<f64>())
        .collect::<candle_core::Result<Vec<_>>>()?;
    let (mut peak, mut seconds) = (0f64, 0f64);
    for (rank, v) in all.iter().enumerate() {
        // What the device holds outside the pools of the ranks on it, in
        // equal parts (the same program each: context, modules, cuBLAS and
        // NCCL); all of it for a rank alone on its GPU.
        let sharing: Vec<&Vec<f64>> = all.iter().filter(|w| w[2] == v[2]).collect();
        let pools: f64 = sharing.iter().map(|w| w[4]).sum();
        let own_outside = (v[3] - pools).max(0.0) / sharing.len() as f64;
        if rank == comm.rank() && !device.is_cpu() {
            log_outside_pool(v[0] as u64, own_outside as u64, sharing.len());
        }
        peak = peak.max(v[0] + own_outside);
        seconds = seconds.max(v[1]);
    }
    Ok(Measurement {
        peak_bytes: peak as u64,
        reserved_bytes: peak as u64,
        out_of_memory: false,
        step_seconds: Some(seconds),
    })
}

/// Measures one steady-state step like [`measure_plan`] and records its
/// allocation timeline (for `--snapshot` and `--plot`).
///
/// Recording starts before the trainer is built, so the blocks alive when the
/// measured step starts (weights, optimizer state) are known with the op that
/// made them; see [`Timeline`] for how blocks get their components. On CUDA
/// the timeline holds the device's storages and pool
/// ([`Timeline::from_device_events`]), and the measurement is the pool's
/// high-water marks over the step plus the memory outside the pool; a build
/// linking candle-core as released (no memory hook) refuses it.
pub fn record_plan(
    spec: &ModelSpec,
    plan: &Plan,
    target: Target,
) -> Result<(Measurement, Timeline)> {
    let (m, t) = measure(spec, plan, target, true)?;
    Ok((m, t.expect("recorded")))
}

fn measure(
    spec: &ModelSpec,
    plan: &Plan,
    target: Target,
    recorded: bool,
) -> Result<(Measurement, Option<Timeline>)> {
    let device = match target {
        Target::Cpu => Device::Cpu,
        Target::Cuda(i) if !recorded => return measure_cuda(spec, plan, i).map(|m| (m, None)),
        Target::Cuda(i) => return record_cuda(spec, plan, i).map(|(m, t)| (m, Some(t))),
    };
    if !alloc::installed() {
        return Err(Error::Usage(
            "CPU measurement needs oomfix::track::CountingAlloc as the global allocator".into(),
        ));
    }
    warm_up(spec, plan, &device)?;
    let recording = recorded.then(RunRecording::start).transpose()?;
    let run = || -> Result<(Trainer, Result<crate::train::StepStats>)> {
        let mut trainer = Trainer::new(&spec.config, *plan, &device, &TrainOptions::default())?;
        let mut data = DataSource::synthetic(0);
        trainer.step(&mut data)?;
        alloc::mark_step_start();
        let stats = trainer.step(&mut data);
        Ok((trainer, stats))
    };
    // A failed run drops the recording, which stops it.
    let (trainer, stats) = run()?;
    let stats = stats?;
    // Above what was live before the trainer was built.
    let peak = stats.peak();
    let timeline = recording.map(|r| r.finish(&trainer)).transpose()?;
    Ok((
        Measurement {
            peak_bytes: peak,
            reserved_bytes: peak,
            out_of_memory: false,
            step_seconds: Some(stats.seconds),
        },
        timeline,
    ))
}

/// Runs one step of a tiny model of the same family and plan, so that
/// process-wide state allocated on first use (thread pools, kernel caches)
/// exists before the measurement starts and is not counted in it.
fn warm_up(spec: &ModelSpec, plan: &Plan, device: &Device) -> Result<()> {
    warm_up_threads()?;
    let c = &spec.config;
    let mut tiny = crate::ModelConfig {
        layers: 1,
        hidden: 16,
        heads: 2,
        kv_heads: if c.kv_heads < c.heads { 1 } else { 2 },
        intermediate: 32,
        vocab: 128,
        max_positions: 16,
        ..c.clone()
    };
    // longrope's factors are one per rotated pair of the real head: the
    // tiny model's head takes unscaled RoPE (the same ops).
    if tiny.settings.rope_scaling.as_deref() == Some("longrope") {
        tiny.settings.rope_scaling = None;
    }
    let tiny_plan = Plan {
        micro_batch: 1,
        grad_accum: plan.grad_accum.min(2),
        seq_len: 8,
        ..*plan
    };
    let mut trainer = Trainer::new(&tiny, tiny_plan, device, &TrainOptions::default())?;
    trainer.step(&mut DataSource::synthetic(0))?;
    Ok(())
}

/// Once per process, every thread of the global rayon pool runs one small
/// matrix product. Each thread that ever runs a matrix kernel keeps a packing
/// buffer the size of the L2 cache (gemm's thread-local `L2_SLAB`) for the rest
/// of the process; the tiny warm-up model's products are too small to run on
/// the pool's threads, so without this the first measurement of a process that
/// multiplies large matrices would count one buffer per pool thread.
pub(crate) fn warm_up_threads() -> Result<()> {
    static DONE: std::sync::OnceLock<std::result::Result<(), String>> = std::sync::OnceLock::new();
    let outcome = DONE.get_or_init(|| {
        let product = || -> candle_core::Result<()> {
            let a = candle_core::Tensor::ones((64, 64), candle_core::DType::F32, &Device::Cpu)?;
            a.matmul(&a).map(drop)
        };
        rayon::broadcast(|_| product().map_err(|e| e.to_string()))
            .into_iter()
            .collect()
    });
    outcome
        .clone()
        .map_err(|e| Error::Runtime(format!("warming up the thread pool: {e}")))
}

/// Measures a step on `cuda:i`: the memory pool's allocated and reserved
/// high-water marks, reset after the first step, plus the device memory
/// outside the pool. A CUDA out-of-memory is a
/// measurement (`out_of_memory`), after which the pool is trimmed.
#[cfg(feature = "cuda")]
fn measure_cuda(spec: &ModelSpec, plan: &Plan, ordinal: usize) -> Result<Measurement> {
    use crate::track::cuda::{is_out_of_memory, reset_peaks, trim, PoolStats};
    let device = Device::new_cuda(ordinal)?;
    let Device::Cuda(cuda) = &device else {
        unreachable!("new_cuda gives a CUDA device")
    };
    let run = || -> candle_core::Result<Result<Measurement>> {
        let mut trainer = match Trainer::new(&spec.config, *plan, &device, &TrainOptions::default())
        {
            Ok(t) => t,
            Err(e) => return candle_error(e).map(Err),
        };
        let mut data = DataSource::synthetic(0);
        let mut step = |t: &mut Trainer| match t.step(&mut data) {
            Ok(stats) => Ok(Ok(stats.seconds)),
            Err(e) => candle_error(e).map(Err),
        };
        if let Err(e) = step(&mut trainer)? {
            return Ok(Err(e));
        }
        reset_peaks(cuda)?;
        let seconds = match step(&mut trainer)? {
            Ok(seconds) => seconds,
            Err(e) => return Ok(Err(e)),
        };
        let stats = PoolStats::read(cuda)?;
        let outside = outside_bytes(&stats);
        log_outside_pool(stats.used_high, outside, 1);
        Ok(Ok(Measurement {
            peak_bytes: stats.used_high + outside,
            reserved_bytes: stats.reserved_high + outside,
            out_of_memory: false,
            step_seconds: Some(seconds),
        }))
    };
    let outcome = match run() {
        Ok(m) => m,
        Err(e) if is_out_of_memory(&e) => {
            // Read before trimming: the reservation at the failure says how much
            // of the device the pool held beyond its live bytes.
            let at_end = PoolStats::read(cuda)?;
            tracing::warn!(
                %plan,
                used_high = at_end.used_high,
                reserved_high = at_end.reserved_high,
                device_free = at_end.device_free,
                "CUDA out of memory while measuring"
            );
            Ok(Measurement {
                peak_bytes: at_end.used_high,
                reserved_bytes: at_end.used_high,
                out_of_memory: true,
                step_seconds: None,
            })
        }
        Err(e) => Err(e.into()),
    };
    trim(cuda)?;
    outcome
}

/// Records the second step of `plan` on `cuda:i` (see [`record_plan`]).
#[cfg(feature = "cuda")]
fn record_cuda(spec: &ModelSpec, plan: &Plan, ordinal: usize) -> Result<(Measurement, Timeline)> {
    let device = Device::new_cuda(ordinal)?;
    let mut recording = RunRecording::start_on(&device)?;
    let mut trainer = Trainer::new(&spec.config, *plan, &device, &TrainOptions::default())?;
    let mut data = DataSource::synthetic(0);
    trainer.step(&mut data)?;
    recording.steps_start()?;
    let stats = trainer.step(&mut data)?;
    let timeline = recording.finish(&trainer)?;
    let pool = timeline.pool.clone().unwrap_or_default();
    log_outside_pool(pool.used_high, pool.outside, 1);
    Ok((
        Measurement {
            peak_bytes: pool.used_high + pool.outside,
            reserved_bytes: pool.reserved_high + pool.outside,
            out_of_memory: false,
            step_seconds: Some(stats.seconds),
        },
        timeline,
    ))
}

/// Without the `cuda` feature there is no GPU to record.
#[cfg(not(feature = "cuda"))]
fn record_cuda(_: &ModelSpec, _: &Plan, _: usize) -> Result<(Measurement, Timeline)> {
    Err(Error::Usage(
        "recording on CUDA needs a build with the `cuda` cargo feature".into(),
    ))
}

/// Device memory outside the CUDA pool (the context, modules, cuBLAS
/// workspaces, NCCL's buffers) by the pool's statistics `stats`, which counts
/// against the budget as the estimate's `runtime` term does; the ballast of
/// `--enforce-budget` is outside the pool too, but not the plan's.
#[cfg(feature = "cuda")]
fn outside_bytes(stats: &crate::track::cuda::PoolStats) -> u64 {
    (stats.device_total - stats.device_free)
        .saturating_sub(stats.reserved)
        .saturating_sub(crate::track::cuda::ballast_bytes())
}

/// One record of what a measured step held on its GPU: the pool's used
/// high-water mark and the process's part of the memory outside the pools
/// (`ranks_on_gpu` processes sharing it), what the estimate's `runtime` term
/// stands for (NCCL's own part, in a sharded plan, is not yet a term).
fn log_outside_pool(pool_used_peak: u64, outside_pool_bytes: u64, ranks_on_gpu: usize) {
    tracing::info!(
        pool_used_peak,
        outside_pool_bytes,
        ranks_on_gpu,
        "device memory outside the pool"
    );
}

/// `(GPU, device memory in use less the ballast, this process's pool's
/// reservation)` of `device` now; `(-1, 0, 0)` on the CPU.
fn device_reading(device: &Device) -> candle_core::Result<(f64, f64, f64)> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(cuda) = device {
        let stats = crate::track::cuda::PoolStats::read(cuda)?;
        let gpu = match device.location() {
            candle_core::DeviceLocation::Cuda { gpu_id } => gpu_id as f64,
            _ => -1.0,
        };
        let used = (stats.device_total - stats.device_free)
            .saturating_sub(crate::track::cuda::ballast_bytes());
        return Ok((gpu, used as f64, stats.reserved as f64));
    }
    let _ = device;
    Ok((-1.0, 0.0, 0.0))
}

/// A candle error, also one inside a strategy's error (a CUDA out-of-memory in
/// the fused AdamW or a checkpointed block), as `Err`; any other error as `Ok`.
#[cfg(feature = "cuda")]
fn candle_error(e: Error) -> candle_core::Result<Error> {
    match e {
        Error::Candle(e) | Error::Strategy(oomfix_strategies::Error::Candle(e)) => Err(e),
        other => Ok(other),
    }
}

/// Without the `cuda` feature there is no GPU to measure on.
#[cfg(not(feature = "cuda"))]
fn measure_cuda(_: &ModelSpec, _: &Plan, _: usize) -> Result<Measurement> {
    Err(Error::Usage(
        "measuring on CUDA needs a build with the `cuda` cargo feature".into(),
    ))
}

/// A [`Verifier`] that runs real steps, in process or in a child process.
#[derive(Debug, Clone)]
pub struct StepVerifier {
    target: Target,
    /// The `oomfix` binary to run `measure-step` in, with the budget as its limit.
    isolate: Option<(PathBuf, u64)>,
    /// The ranks each plan is measured with (an isolated verifier's child starts them).
    ranks: usize,
    /// Whether each rank holds its GPU to the budget.
    enforcing: bool,
}

impl StepVerifier {
    /// Measures in this process (the process needs [`alloc::CountingAlloc`] as its allocator).
    pub fn in_process(target: Target) -> Self {
        StepVerifier {
            target,
            isolate: None,
            ranks: 1,
            enforcing: false,
        }
    }

    /// Measures each plan in a child `oomfix measure-step` process whose address
    /// space is limited to `budget` + `ADDRESS_SPACE_SLACK` (2 GiB).
    pub fn isolated(target: Target, oomfix_binary: PathBuf, budget: u64) -> Self {
        StepVerifier {
            target,
            isolate: Some((oomfix_binary, budget)),
            ranks: 1,
            enforcing: false,
        }
    }

    /// Measures each plan with its `ranks` real ranks (an isolated verifier
    /// only): the child `oomfix measure-step --ranks N` starts them as
    /// `oomfix train --gpus N` does (under `mpirun` on the CPU), each held to
    /// the budget on the CPU, and reports the fullest rank's peak.
    pub fn over_ranks(self, ranks: usize) -> Self {
        StepVerifier { ranks, ..self }
    }

    /// On CUDA, each rank of [`over_ranks`](Self::over_ranks) holds its GPU
    /// to the budget (`--enforce-budget`): a plan that needs more is a CUDA
    /// out-of-memory, recorded as such.
    pub fn enforcing(self) -> Self {
        StepVerifier {
            enforcing: true,
            ..self
        }
    }
}

impl Verifier for StepVerifier {
    fn measure(&self, spec: &ModelSpec, plan: &Plan) -> Result<Measurement> {
        let Some((exe, budget)) = &self.isolate else {
            return measure_plan(spec, plan, self.target);
        };
        let limit = budget.saturating_add(ADDRESS_SPACE_SLACK);
        let mut cmd = Command::new(exe);
        cmd.arg("measure-step")
            .arg("--plan")
            .arg(serde_json::to_string(plan).expect("a plan serialises"))
            .arg("--config")
            .arg(serde_json::to_string(&spec.config).expect("config serialises"))
            .arg("--device")
            .arg(self.target.to_string())
            .arg("--ranks")
            .arg(self.ranks.to_string());
        match self.target {
            Target::Cpu => cmd.arg("--address-space").arg(limit.to_string()),
            Target::Cuda(_) if self.enforcing => {
                cmd.arg("--hold-device-to").arg(budget.to_string())
            }
            Target::Cuda(_) => &mut cmd,
        };
        let out = cmd
            .env_remove("RUST_BACKTRACE")
            .env("MALLOC_ARENA_MAX", "2")
            .output()
            .map_err(|e| Error::Io {
                context: format!("running {}", exe.display()),
                source: e,
            })?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        if out.status.success() {
            // The child's (and its ranks') log records, as if logged here.
            let _ = std::io::Write::write_all(&mut std::io::stderr(), &out.stderr);
            let printed = stdout.trim();
            let bad = || {
                Error::Runtime(format!(
                    "the measuring child printed `{printed}`, not a byte count and seconds"
                ))
            };
            let (peak, seconds) = printed.split_once(' ').ok_or_else(bad)?;
            let peak: u64 = peak.parse().map_err(|_| bad())?;
            let seconds: f64 = seconds.parse().map_err(|_| bad())?;
            return Ok(Measurement {
                peak_bytes: peak,
                reserved_bytes: peak,
                out_of_memory: false,
                step_seconds: Some(seconds),
            });
        }
        let stderr = String::from_utf8_lossy(&out.stderr);
        // An allocation failure aborts the child (SIGABRT) or is reported by candle.
        if stderr.contains("memory allocation")
            || stderr.contains("out of memory")
            || out.status.code().is_none()
        {
            tracing::warn!(%plan, "out of memory while measuring (limit {limit} bytes)");
            return Ok(Measurement {
                peak_bytes: limit,
                reserved_bytes: limit,
                out_of_memory: true,
                step_seconds: None,
            });
        }
        Err(Error::Runtime(format!(
            "measuring {plan} failed: {}",
            stderr.trim()
        )))
    }
}

/// Limits this process's address space (the `measure-step` child calls it first).
#[cfg(unix)]
pub fn limit_address_space(bytes: u64) -> Result<()> {
    let lim = libc::rlimit {
        rlim_cur: bytes as libc::rlim_t,
        rlim_max: bytes as libc::rlim_t,
    };
    // SAFETY: setrlimit reads the struct we pass and changes only process limits.
    if unsafe { libc::setrlimit(libc::RLIMIT_AS, &lim) } != 0 {
        return Err(Error::Io {
            context: "setrlimit(RLIMIT_AS)".into(),
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(())
}

/// Address-space limits need a Unix host; elsewhere the child runs unlimited.
#[cfg(not(unix))]
pub fn limit_address_space(_bytes: u64) -> Result<()> {
    Ok(())
}
