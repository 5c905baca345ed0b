//! A counting global allocator: current and high-water heap bytes.
//!
//! Install it in a binary to measure CPU peaks:
//!
//! ```
//! #[global_allocator]
//! static ALLOC: oomfix::measure::CountingAlloc = oomfix::measure::CountingAlloc;
//! ```
//!
//! The counters are process-wide. [`reset_peak`] sets the high-water mark to the
//! current value, so `peak() - current_at_reset` is what a region added.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicU8, AtomicUsize, Ordering};

static CURRENT: AtomicU64 = AtomicU64::new(0);
static PEAK: AtomicU64 = AtomicU64::new(0);
static INSTALLED: AtomicBool = AtomicBool::new(false);

/// The system allocator, counting live bytes.
#[derive(Debug, Clone, Copy, Default)]
pub struct CountingAlloc;

/// What the program is doing, recorded with each allocation event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[repr(u8)]
pub enum Phase {
    /// Outside a training step (setup).
    #[default]
    Setup = 0,
    /// Forward and backward passes.
    ForwardBackward = 1,
    /// The optimizer step.
    OptimizerStep = 2,
}

impl Phase {
    /// Lower-case name.
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Setup => "setup",
            Phase::ForwardBackward => "forward_backward",
            Phase::OptimizerStep => "optimizer_step",
        }
    }
    fn from_u8(v: u8) -> Phase {
        match v {
            1 => Phase::ForwardBackward,
            2 => Phase::OptimizerStep,
            _ => Phase::Setup,
        }
    }
}

static PHASE: AtomicU8 = AtomicU8::new(0);

/// Marks what the program is doing from now on (tags recorded events).
pub fn set_phase(phase: Phase) {
    PHASE.store(phase as u8, Ordering::Relaxed);
}

/// One allocation or free, as recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Event {
    /// Nanoseconds since recording started.
    pub time_ns: u64,
    /// Address of the block.
    pub addr: u64,
    /// Size in bytes.
    pub size: u64,
    /// Live heap bytes after the event.
    pub live: u64,
    /// `true` for an allocation, `false` for a free.
    pub alloc: bool,
    /// What the program was doing.
    pub phase: Phase,
}

/// The recording buffer: a leaked slice written by index, so the allocator
/// never allocates while recording.
static BUFFER: AtomicPtr<Event> = AtomicPtr::new(std::ptr::null_mut());
static CAPACITY: AtomicUsize = AtomicUsize::new(0);
static NEXT: AtomicUsize = AtomicUsize::new(0);
static RECORDING: AtomicBool = AtomicBool::new(false);
static START_NS: AtomicU64 = AtomicU64::new(0);

fn now_ns() -> u64 {
    // SAFETY: clock_gettime writes into the timespec we own.
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

#[inline]
fn record(addr: *mut u8, size: u64, alloc: bool, live: u64) {
    if !RECORDING.load(Ordering::Relaxed) {
        return;
    }
    let i = NEXT.fetch_add(1, Ordering::Relaxed);
    if i >= CAPACITY.load(Ordering::Relaxed) {
        return;
    }
    let event = Event {
        time_ns: now_ns().saturating_sub(START_NS.load(Ordering::Relaxed)),
        addr: addr as u64,
        size,
        live,
        alloc,
        phase: Phase::from_u8(PHASE.load(Ordering::Relaxed)),
    };
    // SAFETY: `i < CAPACITY`, the buffer holds CAPACITY events and each index is
    // handed out once by the atomic counter.
    unsafe { BUFFER.load(Ordering::Relaxed).add(i).write(event) };
}

/// Starts recording every allocation and free, up to `capacity` events.
pub fn start_recording(capacity: usize) {
    if BUFFER.load(Ordering::Relaxed).is_null() || CAPACITY.load(Ordering::Relaxed) < capacity {
        let buf: &'static mut [Event] = Box::leak(vec![Event::default(); capacity].into_boxed_slice());
        BUFFER.store(buf.as_mut_ptr(), Ordering::Relaxed);
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
    let events = unsafe { std::slice::from_raw_parts(buf, n.min(cap)) }.to_vec();
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
// updates counters besides.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            INSTALLED.store(true, Ordering::Relaxed);
            add(layout.size() as u64);
            record(p, layout.size() as u64, true, current());
        }
        p
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            INSTALLED.store(true, Ordering::Relaxed);
            add(layout.size() as u64);
            record(p, layout.size() as u64, true, current());
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        sub(layout.size() as u64);
        record(ptr, layout.size() as u64, false, current());
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            sub(layout.size() as u64);
            record(ptr, layout.size() as u64, false, current());
            add(new_size as u64);
            record(p, new_size as u64, true, current());
        }
        p
    }
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
