//! A recording of a real training run's first steps: every allocation and
//! free from before the trainer is built through the steps, for a memory
//! snapshot or a plot of the steps a run actually takes (`oomfix train
//! --snapshot`), where [`super::record_plan`] measures a plan apart.
//!
//! On the CPU it records the process's heap; on CUDA the device's tensor
//! storages and memory pool (`track::cuda::start_recording`: a build with
//! the vendored candle-core's memory hook).

use super::timeline::Timeline;
use crate::track::{alloc, tag};
use crate::{Error, Result, Trainer};
use candle_core::Device;

/// Capacity of the event buffer of a recording (40 bytes an event; memory is
/// touched only as events are written). A recording holds the trainer's
/// construction, a warm-up step and the measured step: GPT-2 small at 1 × 4
/// micro-batches of 32 tokens makes about 800,000 events.
pub const MAX_EVENTS: usize = 16 << 20;

/// Records a run's memory while it builds its trainer and takes its first
/// steps: on the CPU the process's heap (the process needs
/// [`crate::track::CountingAlloc`] as its global allocator), on CUDA the
/// device's storages and pool.
///
/// Start it before the trainer is built, so that the weights and the
/// optimizer state are known by the op that made them; call
/// [`steps_start`](Self::steps_start) once the trainer is ready (built, and
/// resumed), and [`finish`](Self::finish) after the steps to record. Dropped
/// unfinished, it stops recording.
#[derive(Debug)]
pub struct RunRecording {
    /// Live heap bytes when recording started.
    before: u64,
    recording: bool,
    /// The CUDA device recorded, and the memory outside its pool when the
    /// steps started.
    #[cfg(feature = "cuda")]
    cuda: Option<(candle_core::CudaDevice, u64)>,
}

impl RunRecording {
    /// Starts recording the heap.
    pub fn start() -> Result<Self> {
        if !alloc::installed() {
            return Err(Error::Usage(
                "recording allocations needs oomfix::track::CountingAlloc as the global allocator"
                    .into(),
            ));
        }
        // The (uncounted) event buffer exists before the baseline is taken.
        alloc::start_recording(MAX_EVENTS);
        Ok(RunRecording {
            before: alloc::current(),
            recording: true,
            #[cfg(feature = "cuda")]
            cuda: None,
        })
    }

    /// Starts recording `device`: the heap for the CPU, the device's
    /// storages and memory pool for CUDA.
    pub fn start_on(device: &Device) -> Result<Self> {
        match device {
            Device::Cpu => Self::start(),
            #[cfg(feature = "cuda")]
            Device::Cuda(cuda) => {
                crate::track::cuda::start_recording(cuda, MAX_EVENTS).map_err(|e| {
                    if crate::track::cuda::CAN_RECORD {
                        Error::from(e)
                    } else {
                        Error::Usage(crate::track::cuda::NEEDS_MEMORY_HOOK.into())
                    }
                })?;
                Ok(RunRecording {
                    before: 0,
                    recording: true,
                    cuda: Some((cuda.clone(), 0)),
                })
            }
            _ => Err(Error::Usage(format!(
                "recording allocations on {:?} needs the CPU or a CUDA device (and a build with --features cuda)",
                device.location()
            ))),
        }
    }

    /// Marks where the recorded steps begin: what is alive then (weights,
    /// optimizer state) is the timeline's initial memory. On CUDA it waits
    /// for the device, reads the memory outside the pool and resets the
    /// pool's high-water marks.
    pub fn steps_start(&mut self) -> Result<()> {
        #[cfg(feature = "cuda")]
        if let Some((cuda, outside)) = &mut self.cuda {
            use crate::track::cuda::{ballast_bytes, reset_peaks, PoolStats};
            reset_peaks(cuda)?;
            let s = PoolStats::read(cuda)?;
            *outside = (s.device_total - s.device_free)
                .saturating_sub(s.reserved)
                .saturating_sub(ballast_bytes());
        }
        alloc::mark_step_start();
        Ok(())
    }

    /// Stops recording and replays it into the timeline of the steps,
    /// naming the blocks of `trainer`'s parameters and master weights.
    pub fn finish(mut self, trainer: &Trainer) -> Result<Timeline> {
        self.recording = false;
        #[cfg(feature = "cuda")]
        if let Some((_, outside)) = self.cuda.take() {
            let (events, truncated) = crate::track::cuda::stop_recording();
            check(events.iter().map(|d| d.event.kind), truncated)?;
            let names = parameter_names(trainer);
            return Ok(Timeline::from_device_events(
                &events, &names, outside, truncated,
            ));
        }
        let (events, truncated) = alloc::stop_recording();
        check(events.iter().map(|e| e.kind), truncated)?;
        Ok(Timeline::from_events(
            &events,
            &parameter_names(trainer),
            self.before,
            truncated,
        ))
    }
}

/// The parameters' and master weights' names by the address of their storage.
fn parameter_names(trainer: &Trainer) -> std::collections::HashMap<u64, String> {
    trainer
        .parameter_buffers()
        .into_iter()
        .filter_map(|(name, t)| Some((tag::storage_addr(&t)?, name)))
        .collect()
}

/// The recording reached the recorded steps; a warning when it filled up.
fn check(mut kinds: impl Iterator<Item = alloc::EventKind>, truncated: bool) -> Result<()> {
    if !kinds.any(|k| k == alloc::EventKind::StepStart) {
        return Err(Error::Runtime(format!(
            "building the model (and any step before the recorded ones) made more than \
             {MAX_EVENTS} allocations: the recording ended before the recorded steps \
             (try a smaller sequence length or batch)"
        )));
    }
    if truncated {
        tracing::warn!("the recording filled its {MAX_EVENTS} events; the timeline ends early");
    }
    Ok(())
}

impl Drop for RunRecording {
    fn drop(&mut self) {
        if self.recording {
            #[cfg(feature = "cuda")]
            if self.cuda.is_some() {
                crate::track::cuda::stop_recording();
                return;
            }
            alloc::stop_recording();
        }
    }
}
