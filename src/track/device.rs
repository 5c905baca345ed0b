//! A recording of a device's memory pool: every allocation and free of a
//! tensor's storage, every allocation from the pool, and the trainer's phase
//! changes, marks and step start, each with the pool's counters (used,
//! reserved, and their high-water marks) read when it happened.
//!
//! The recorder knows no CUDA: in CUDA builds `track::cuda` feeds it from
//! candle's memory hook and reads the counters; tests feed it by hand. An
//! event carries the [`Tag`](super::tag::Tag) and [`Phase`] current when it
//! happened, as the heap recording's do ([`super::alloc`]), so
//! [`crate::measure::Timeline`] gives the blocks the same components.

use super::event::{Event, EventKind, Phase};
use super::tag;
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};
use std::sync::Mutex;
use std::time::Instant;

/// Whether the candle-core linked has the CUDA memory hook
/// (`candle_core::cuda_backend::hook`, from oomfix's vendored copy), without
/// which CUDA allocations cannot be recorded; candle-core as released has
/// none. Known at build time (oomfix's build script).
pub const MEMORY_HOOK_LINKED: bool = cfg!(candle_memory_hook);

/// The pool's counters at one moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PoolCounters {
    /// Bytes of live allocations from the pool (PyTorch's "allocated").
    pub used: u64,
    /// Bytes the pool holds from the driver (PyTorch's "reserved").
    pub reserved: u64,
    /// Highest `used` since the pool's marks were last reset.
    pub used_high: u64,
    /// Highest `reserved` since the pool's marks were last reset.
    pub reserved_high: u64,
}

/// One recorded event and the pool's counters right after it. `event.live`
/// is `pool.used`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DeviceEvent {
    /// What happened: [`EventKind::Alloc`] / [`EventKind::Free`] of a
    /// storage, [`EventKind::Pool`] (an allocation from the pool that is not
    /// yet, or never becomes, a storage), a phase change, a mark, the step start.
    pub event: Event,
    /// The pool's counters.
    pub pool: PoolCounters,
}

/// Reads the pool's counters without waiting for the device.
pub type CounterReader = fn() -> PoolCounters;

struct Recorder {
    events: Vec<DeviceEvent>,
    capacity: usize,
    truncated: bool,
    start: Instant,
    read: CounterReader,
}

static ACTIVE: AtomicBool = AtomicBool::new(false);
static RECORDER: Mutex<Option<Recorder>> = Mutex::new(None);

/// Starts recording, up to `capacity` events, reading the counters with `read`.
pub fn start(capacity: usize, read: CounterReader) {
    let mut r = RECORDER.lock().unwrap_or_else(|e| e.into_inner());
    *r = Some(Recorder {
        events: Vec::with_capacity(capacity.min(1 << 16)),
        capacity: capacity.max(1),
        truncated: false,
        start: Instant::now(),
        read,
    });
    ACTIVE.store(true, Ordering::SeqCst);
}

/// Whether a device recording is on.
#[inline]
pub fn recording() -> bool {
    ACTIVE.load(Ordering::Relaxed)
}

/// Records an event of `kind` (with the current tag and phase) and the
/// pool's counters; does nothing unless recording.
pub fn note(kind: EventKind, addr: u64, size: u64) {
    if !recording() {
        return;
    }
    let mut guard = RECORDER.lock().unwrap_or_else(|e| e.into_inner());
    let Some(r) = guard.as_mut() else {
        return;
    };
    if r.events.len() >= r.capacity {
        r.truncated = true;
        return;
    }
    let pool = (r.read)();
    let event = Event {
        time_ns: r.start.elapsed().as_nanos() as u64,
        addr,
        size,
        live: pool.used,
        tag: tag::current(),
        kind,
        phase: super::event::phase(),
    };
    r.events.push(DeviceEvent { event, pool });
}

/// Stops recording; returns the events and whether the buffer filled up.
pub fn stop() -> (Vec<DeviceEvent>, bool) {
    ACTIVE.store(false, Ordering::SeqCst);
    let mut r = RECORDER.lock().unwrap_or_else(|e| e.into_inner());
    match r.take() {
        Some(r) => (r.events, r.truncated),
        None => (Vec::new(), false),
    }
}

/// What runs at every phase change (`--trim-between-phases`: trimming the
/// pool), before the change is recorded.
static ON_PHASE_CHANGE: AtomicPtr<()> = AtomicPtr::new(std::ptr::null_mut());

/// Sets (or, with `None`, removes) what runs at every phase change.
pub fn set_on_phase_change(f: Option<fn()>) {
    let p = f.map_or(std::ptr::null_mut(), |f| f as *mut ());
    ON_PHASE_CHANGE.store(p, Ordering::SeqCst);
}

/// Called by [`super::alloc::set_phase`] when the phase changes to `phase`.
pub(crate) fn phase_changed(phase: Phase) {
    let p = ON_PHASE_CHANGE.load(Ordering::Relaxed);
    if !p.is_null() {
        // SAFETY: `p` was stored from a `fn()` by `set_on_phase_change`.
        let f: fn() = unsafe { std::mem::transmute::<*mut (), fn()>(p) };
        f();
    }
    let _ = phase;
    note(EventKind::Phase, 0, 0);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;

    static USED: AtomicU64 = AtomicU64::new(0);

    fn fake() -> PoolCounters {
        let used = USED.load(Ordering::SeqCst);
        PoolCounters {
            used,
            reserved: used + 10,
            used_high: used,
            reserved_high: used + 10,
        }
    }

    #[test]
    fn this_workspace_links_the_memory_hook() {
        // The workspace's [patch] uses vendor/candle-core; tests/stock-candle
        // checks the other way round.
        assert!(std::hint::black_box(MEMORY_HOOK_LINKED));
    }

    // Other unit tests change phases and mark buffers while these run: the
    // checks look at this test's own events only.
    #[test]
    fn records_events_with_counters_tag_and_phase() {
        start(1 << 20, fake);
        USED.store(100, Ordering::SeqCst);
        note(EventKind::Pool, 0, 100);
        {
            let _s = tag::Scope::op(tag::Op::Matmul);
            note(EventKind::Alloc, 0xa0a0, 100);
        }
        USED.store(0, Ordering::SeqCst);
        note(EventKind::Free, 0xa0a0, 100);
        let (events, truncated) = stop();
        assert!(!truncated);
        assert!(!recording());
        let mine: Vec<&DeviceEvent> = events
            .iter()
            .filter(|e| e.event.kind == EventKind::Pool || e.event.addr == 0xa0a0)
            .collect();
        let kinds: Vec<EventKind> = mine.iter().map(|e| e.event.kind).collect();
        assert_eq!(kinds, [EventKind::Pool, EventKind::Alloc, EventKind::Free]);
        assert_eq!(mine[1].event.tag.op(), tag::Op::Matmul);
        assert_eq!(mine[1].pool.used, 100);
        assert_eq!(mine[1].event.live, 100);
        assert_eq!(mine[2].pool.reserved, 10);
        assert!(events
            .windows(2)
            .all(|w| w[0].event.time_ns <= w[1].event.time_ns));
        // Not recording: nothing is kept.
        note(EventKind::Alloc, 0xc, 1);
        assert_eq!(stop().0.len(), 0);
        // A full buffer says so.
        start(1, fake);
        note(EventKind::Pool, 0, 1);
        note(EventKind::Pool, 0, 1);
        let (events, truncated) = stop();
        assert_eq!(events.len(), 1);
        assert!(truncated);
    }
}
