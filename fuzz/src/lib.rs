//! Harness shared by the fuzz targets: runs [`oomfix::inspect`] on a file the
//! fuzzer wrote and checks that it returns a model or an input error, never
//! panics, and allocates at most a bounded multiple of the input's size.
//!
//! Time per input is bounded by libFuzzer's `-timeout`; see `fuzz/README.md`.
#![warn(missing_docs)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

use tempfile::TempDir;

/// Peak heap allocated by one inspection may exceed what was live before it
/// by at most this many bytes…
pub const MEMORY_BASE: usize = 1 << 20;
/// …plus this many bytes per byte of fuzz input (a parsed JSON value takes
/// up to ~16 bytes per input byte, and a growing `Vec` briefly holds twice that).
pub const MEMORY_PER_INPUT_BYTE: usize = 64;

/// The system allocator, counting live and peak bytes.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn grow(bytes: usize) {
    let live = LIVE.fetch_add(bytes, Relaxed) + bytes;
    PEAK.fetch_max(live, Relaxed);
}

// SAFETY: every call is forwarded to `System` unchanged; only counters are added.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc(layout);
        if !p.is_null() {
            grow(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc_zeroed(layout);
        if !p.is_null() {
            grow(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout);
        LIVE.fetch_sub(layout.size(), Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = System.realloc(ptr, layout, new_size);
        if !p.is_null() {
            // Count the new block before releasing the old: both may be live at once.
            grow(new_size);
            LIVE.fetch_sub(layout.size(), Relaxed);
        }
        p
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// A directory for the files of one fuzzing process, removed when it is dropped.
pub struct Workdir {
    dir: TempDir,
}

impl Workdir {
    /// A fresh directory under the system temp directory (`$TMPDIR`).
    pub fn new() -> Self {
        let dir = tempfile::Builder::new()
            .prefix("oomfix-fuzz-")
            .tempdir()
            .expect("create a temp dir for fuzz inputs");
        Workdir { dir }
    }

    /// Writes `bytes` to `name` in the directory and returns its path.
    pub fn write(&self, name: &str, bytes: &[u8]) -> PathBuf {
        let path = self.dir.path().join(name);
        fs::write(&path, bytes).expect("write a fuzz input file");
        path
    }
}

impl Default for Workdir {
    fn default() -> Self {
        Self::new()
    }
}

/// Inspects `path` (whose contents came from an `input_len`-byte fuzz input)
/// the way `oomfix inspect` does, rendering the result as text and JSON, and
/// panics — which libFuzzer reports as a crash — when inspection fails with
/// anything but an input error, or allocates more than the bound.
pub fn check_inspect(path: &Path, input_len: usize) {
    let before = LIVE.load(Relaxed);
    PEAK.store(before, Relaxed);
    match oomfix::inspect(path) {
        Ok(spec) => {
            assert!(!spec.tensors.is_empty(), "a model with no trainable tensors");
            assert!(!oomfix::report::inspect_text(&spec).is_empty());
            assert!(oomfix::report::inspect_json(&spec).is_object());
        }
        Err(e) => {
            assert!(e.is_input(), "not an input error: {e}");
            assert!(!e.to_string().is_empty(), "an empty error message");
        }
    }
    let peak = PEAK.load(Relaxed).saturating_sub(before);
    let limit = MEMORY_BASE + MEMORY_PER_INPUT_BYTE * input_len;
    assert!(
        peak <= limit,
        "inspecting a {input_len}-byte input allocated {peak} bytes at peak (limit {limit})"
    );
}
