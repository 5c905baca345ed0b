//! What the allocation recordings hold: the phase of the training step
//! and the events, shared by the heap's ([`super::alloc`]) and a device's
//! ([`super::device`]) recordings.

use super::tag::Tag;
use std::sync::atomic::{AtomicU8, Ordering};

/// What the training step is doing, recorded with each allocation event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[repr(u8)]
pub enum Phase {
    /// Outside a training step (building the model, between steps).
    #[default]
    Setup = 0,
    /// A micro-batch's forward pass (up to and including the loss).
    Forward = 1,
    /// A micro-batch's backward pass (with any recomputation), and the
    /// accumulation of its gradients.
    Backward = 2,
    /// The optimizer step (with unscaling and the copy back to 16-bit weights).
    OptimizerStep = 3,
}

impl Phase {
    /// Lower-case name: `setup`, `forward`, `backward`, `optimizer_step`.
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Setup => "setup",
            Phase::Forward => "forward",
            Phase::Backward => "backward",
            Phase::OptimizerStep => "optimizer_step",
        }
    }

    fn from_u8(v: u8) -> Phase {
        match v {
            1 => Phase::Forward,
            2 => Phase::Backward,
            3 => Phase::OptimizerStep,
            _ => Phase::Setup,
        }
    }
}

static PHASE: AtomicU8 = AtomicU8::new(0);

/// The phase set last.
pub fn phase() -> Phase {
    Phase::from_u8(PHASE.load(Ordering::Relaxed))
}

/// Makes `phase` current; returns the phase it replaces.
pub(super) fn swap_phase(phase: Phase) -> Phase {
    Phase::from_u8(PHASE.swap(phase as u8, Ordering::Relaxed))
}

/// What a recorded [`Event`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[repr(u8)]
pub enum EventKind {
    /// A block of `size` bytes was allocated at `addr`.
    #[default]
    Alloc = 0,
    /// The block at `addr` (`size` bytes) was freed.
    Free = 1,
    /// The phase changed to the event's `phase`.
    Phase = 2,
    /// The live block at `addr` holds the [`Component`](super::tag::Component) numbered `size`
    /// ([`Component::from_index`](super::tag::Component::from_index)).
    Mark = 3,
    /// The measured step starts here.
    StepStart = 4,
    /// An allocation of `size` bytes from a device's memory pool, not (yet)
    /// a tensor's storage (device recordings only, `track::device`).
    Pool = 5,
}

/// One recorded event. All-zero bytes are a valid event (the buffer is
/// zero-initialised memory).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[repr(C)]
pub struct Event {
    /// Nanoseconds since recording started.
    pub time_ns: u64,
    /// Address of the block.
    pub addr: u64,
    /// Size in bytes (for [`EventKind::Mark`]: the component's index).
    pub size: u64,
    /// Live heap bytes after the event (all of the process's heap).
    pub live: u64,
    /// Module path and op current when the event happened.
    pub tag: Tag,
    /// What the event is.
    pub kind: EventKind,
    /// The phase current when the event happened.
    pub phase: Phase,
}
