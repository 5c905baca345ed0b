//! A counting global allocator: current and high-water heap bytes, and an
//! optional recording of every allocation and free.
//!
//! Install it in a binary to measure CPU peaks:
//!
//! ```
//! #[global_allocator]
//! static ALLOC: oomfix::track::CountingAlloc = oomfix::track::CountingAlloc;
//! ```
//!
//! The counters are process-wide. [`reset_peak`] sets the high-water mark to the
//! current value, so `peak() - current_at_reset` is what a region added.
//!
//! While [`start_recording`] is on, each allocation and free is written as an
//! [`Event`] into a buffer obtained from the system allocator (neither counted
//! nor recorded), by index: the allocator never allocates while recording. An
//! event carries the [`Phase`] and the [`Tag`](super::tag::Tag) (module path and op, see
//! [`super::tag`]) current when it happened; both are plain atomics, so
//! allocations on worker threads (candle's CPU ops use rayon) carry the tag of
//! the scope the training thread is in. Besides allocations the buffer holds
//! phase changes, [`mark`]s (a buffer's [`Component`], stated by the trainer)
//! and the start of the measured step ([`mark_step_start`]).

use super::tag::{self, Component};
use candle_core::Tensor;
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};

static CURRENT: AtomicU64 = AtomicU64::new(0);
static PEAK: AtomicU64 = AtomicU64::new(0);
static INSTALLED: AtomicBool = AtomicBool::new(false);

/// The system allocator, counting live bytes.
#[derive(Debug, Clone, Copy, Default)]
pub struct CountingAlloc;

pub use super::event::{phase, Event, EventKind, Phase};

/// Marks what the program is doing from now on (tags recorded events, and is
/// itself recorded as an [`EventKind::Phase`] event).
pub fn set_phase(phase: Phase) {
    let old = super::event::swap_phase(phase);
    if old != phase {
        record(EventKind::Phase, 0, 0, current());
        super::device::phase_changed(phase);
    }
}

/// The recording buffer: memory from the system allocator written by index.
static BUFFER: AtomicPtr<Event> = AtomicPtr::new(std::ptr::null_mut());
static CAPACITY: AtomicUsize = AtomicUsize::new(0);
static NEXT: AtomicUsize = AtomicUsize::new(0);
static RECORDING: AtomicBool = AtomicBool::new(false);
static START_NS: AtomicU64 = AtomicU64::new(0);

fn now_ns() -> u64 {
    // SAFETY: clock_gettime writes into the timespec we own.
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Whether events are being recorded now.
#[inline]
pub fn recording() -> bool {
    RECORDING.load(Ordering::Relaxed)
}

#[inline]
fn record(kind: EventKind, addr: u64, size: u64, live: u64) {
    if !recording() {
        return;
    }
    let i = NEXT.fetch_add(1, Ordering::Relaxed);
    if i >= CAPACITY.load(Ordering::Relaxed) {
        return;
    }
    let event = Event {
        time_ns: now_ns().saturating_sub(START_NS.load(Ordering::Relaxed)),
        addr,
        size,
        live,
        tag: tag::current(),
        kind,
        phase: phase(),
    };
    // SAFETY: `i < CAPACITY`, the buffer holds CAPACITY events and each index is
    // handed out once by the atomic counter.
    unsafe { BUFFER.load(Ordering::Relaxed).add(i).write(event) };
}

/// Records that the live block at `addr` holds `component` (no-op when not recording).
pub fn mark(addr: u64, component: Component) {
    record(EventKind::Mark, addr, component as u64, current());
    super::device::note(EventKind::Mark, addr, component as u64);
}

/// Records that the measured step starts now (no-op when not recording).
pub fn mark_step_start() {
    record(EventKind::StepStart, 0, 0, current());
    super::device::note(EventKind::StepStart, 0, 0);
}

/// Starts recording every allocation and free, up to `capacity` events.
///
/// The buffer comes from the system allocator, zeroed (pages are touched only
/// as events are written), and is kept for later recordings; it is neither
/// counted in [`current`] nor recorded.
pub fn start_recording(capacity: usize) {
    let capacity = capacity.max(1);
    if BUFFER.load(Ordering::Relaxed).is_null() || CAPACITY.load(Ordering::Relaxed) < capacity {
        let Ok(layout) = Layout::array::<Event>(capacity) else {
            return;
        };
        // SAFETY: the layout has a non-zero size; a zeroed Event is valid.
        let buf = unsafe { System.alloc_zeroed(layout) }.cast::<Event>();
        if buf.is_null() {
            return;
        }
        // An older, smaller buffer is leaked (recordings are rare and short).
        BUFFER.store(buf, Ordering::Relaxed);
        CAPACITY.store(capacity, Ordering::Relaxed);
    }
    START_NS.store(now_ns(), Ordering::Relaxed);
    NEXT.store(0, Ordering::Relaxed);
    RECORDING.store(true, Ordering::SeqCst);
}

/// Stops recording; returns the events (and whether the buffer overflowed).
pub fn stop_recording() -> (Vec<Event>, bool) {
    RECORDING.store(false, Ordering::SeqCst);
    let n = NEXT.load(Ordering::Relaxed);
    let cap = CAPACITY.load(Ordering::Relaxed);
    let buf = BUFFER.load(Ordering::Relaxed);
    if buf.is_null() {
        return (Vec::new(), false);
    }
    // SAFETY: the first min(n, cap) events were written before recording stopped.
    let mut events = unsafe { std::slice::from_raw_parts(buf, n.min(cap)) }.to_vec();
    // Events are in the order their indices were handed out; a thread stopped
    // between taking its index and reading the clock can stamp a time a few
    // nanoseconds before its predecessor's: raise it to that time.
    let mut latest = 0;
    for e in &mut events {
        latest = latest.max(e.time_ns);
        e.time_ns = latest;
    }
    (events, n > cap)
}

#[inline]
fn add(bytes: u64) {
    let now = CURRENT.fetch_add(bytes, Ordering::Relaxed) + bytes;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

#[inline]
fn sub(bytes: u64) {
    CURRENT.fetch_sub(bytes, Ordering::Relaxed);
}

// SAFETY: every method forwards to `System` with the same arguments and only
// updates counters (and the recording buffer) besides.
//
// A free is recorded before the block goes back to the system: once it is
// back, another thread may get the same address and record its allocation,
// which must come after the free in the recording.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        allocated(unsafe { System.alloc(layout) }, layout)
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        allocated(unsafe { System.alloc_zeroed(layout) }, layout)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        let size = layout.size() as u64;
        freeing(ptr, size);
        unsafe { System.dealloc(ptr, layout) };
        sub(size);
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let (old, new) = (layout.size() as u64, new_size as u64);
        freeing(ptr, old);
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if p.is_null() {
            // The old block is still allocated.
            record(EventKind::Alloc, ptr as u64, old, current());
        } else {
            sub(old);
            add(new);
            record(EventKind::Alloc, p as u64, new, current());
        }
        p
    }
}

/// Counts and records the block `p` of `layout` the system just allocated
/// (nothing when the allocation failed: `p` is null); returns `p`.
fn allocated(p: *mut u8, layout: Layout) -> *mut u8 {
    if !p.is_null() {
        INSTALLED.store(true, Ordering::Relaxed);
        add(layout.size() as u64);
        record(EventKind::Alloc, p as u64, layout.size() as u64, current());
    }
    p
}

/// Records the free of the block `ptr` of `size` bytes, before it goes
/// back to the system.
fn freeing(ptr: *mut u8, size: u64) {
    record(
        EventKind::Free,
        ptr as u64,
        size,
        current().saturating_sub(size),
    );
}

/// Whether a [`CountingAlloc`] is the global allocator of this process.
pub fn installed() -> bool {
    // Force one allocation so a fresh process reports correctly.
    drop(std::hint::black_box(Box::new(0u8)));
    INSTALLED.load(Ordering::Relaxed)
}

/// Live heap bytes now.
pub fn current() -> u64 {
    CURRENT.load(Ordering::Relaxed)
}

/// Highest live heap bytes since the last [`reset_peak`].
pub fn peak() -> u64 {
    PEAK.load(Ordering::Relaxed)
}

/// Starts a new high-water mark at the current value; returns that value.
pub fn reset_peak() -> u64 {
    let now = current();
    PEAK.store(now, Ordering::Relaxed);
    now
}

/// Records that the storage buffers of `tensors` hold `component` (see
/// [`mark`]); does nothing unless recording (the heap or a device).
pub fn mark_tensors<'a>(tensors: impl IntoIterator<Item = &'a Tensor>, component: Component) {
    if !recording() && !super::device::recording() {
        return;
    }
    for t in tensors {
        if let Some(addr) = tag::storage_addr(t) {
            mark(addr, component);
        }
    }
}
