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
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

static CURRENT: AtomicU64 = AtomicU64::new(0);
static PEAK: AtomicU64 = AtomicU64::new(0);
static INSTALLED: AtomicBool = AtomicBool::new(false);

/// The system allocator, counting live bytes.
#[derive(Debug, Clone, Copy, Default)]
pub struct CountingAlloc;

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
        }
        p
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            INSTALLED.store(true, Ordering::Relaxed);
            add(layout.size() as u64);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        sub(layout.size() as u64);
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            sub(layout.size() as u64);
            add(new_size as u64);
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
