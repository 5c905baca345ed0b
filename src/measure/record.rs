//! A recording of a real training run's first steps: every heap allocation
//! and free from before the trainer is built through the steps, for a memory
//! snapshot or a plot of the steps a run actually takes (`oomfix train
//! --snapshot`), where [`super::record_plan`] measures a plan apart.

use super::timeline::Timeline;
use super::MAX_EVENTS;
use crate::track::{alloc, tag};
use crate::{Error, Result, Trainer};

/// Records the process's heap while a run builds its trainer and takes its
/// first steps (the CPU; the process needs
/// [`crate::track::CountingAlloc`] as its global allocator).
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
}

impl RunRecording {
    /// Starts recording.
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
        })
    }

    /// Marks where the recorded steps begin: what is alive then (weights,
    /// optimizer state) is the timeline's initial memory.
    pub fn steps_start(&self) {
        alloc::mark_step_start();
    }

    /// Stops recording and replays it into the timeline of the steps,
    /// naming the blocks of `trainer`'s parameters and master weights.
    pub fn finish(mut self, trainer: &Trainer) -> Result<Timeline> {
        let (events, truncated) = alloc::stop_recording();
        self.recording = false;
        if !events.iter().any(|e| e.kind == alloc::EventKind::StepStart) {
            return Err(Error::Runtime(format!(
                "building the model (and any step before the recorded ones) made more than \
                 {MAX_EVENTS} allocations: the recording ended before the recorded steps \
                 (try a smaller sequence length or batch)"
            )));
        }
        if truncated {
            tracing::warn!("the recording filled its {MAX_EVENTS} events; the timeline ends early");
        }
        let names = trainer
            .parameter_buffers()
            .into_iter()
            .filter_map(|(name, t)| Some((tag::storage_addr(&t)?, name)))
            .collect();
        Ok(Timeline::from_events(
            &events,
            &names,
            self.before,
            truncated,
        ))
    }
}

impl Drop for RunRecording {
    fn drop(&mut self) {
        if self.recording {
            alloc::stop_recording();
        }
    }
}
