//! Harness shared by the fuzz targets: runs [`oomfix::inspect`] on a file the
//! fuzzer wrote and checks that it returns a model or an input error, never
//! panics, and allocates at most a bounded multiple of the input's size; for
//! a `config.json`, that a model it accepts trains a step with a finite loss.
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
/// anything but an input error, or allocates more than the bound. Returns
/// the model inspection found.
pub fn check_inspect(path: &Path, input_len: usize) -> Option<oomfix::ModelSpec> {
    let before = LIVE.load(Relaxed);
    PEAK.store(before, Relaxed);
    let found = match oomfix::inspect(path) {
        Ok(spec) => {
            assert!(!spec.tensors.is_empty(), "a model with no trainable tensors");
            assert!(!oomfix::report::inspect_text(&spec).is_empty());
            assert!(oomfix::report::inspect_json(&spec).is_object());
            Some(spec)
        }
        Err(e) => {
            assert!(e.is_input(), "not an input error: {e}");
            assert!(!e.to_string().is_empty(), "an empty error message");
            None
        }
    };
    let peak = PEAK.load(Relaxed).saturating_sub(before);
    let limit = MEMORY_BASE + MEMORY_PER_INPUT_BYTE * input_len;
    assert!(
        peak <= limit,
        "inspecting a {input_len}-byte input allocated {peak} bytes at peak (limit {limit})"
    );
    found
}

/// Tokens per sequence of [`check_trains`]'s step (at most the model's context).
pub const TRAIN_SEQ_LEN: usize = 8;

/// A model that inspection accepted, and that `oomfix train` would not
/// refuse by name before loading it ([`oomfix::ModelConfig::unsupported`]),
/// trains one CPU step (micro-batch 2, random weights, synthetic tokens) with
/// a finite loss: a config is either refused up front or usable. Panics
/// otherwise.
pub fn check_trains(spec: &oomfix::ModelSpec) {
    let config = &spec.config;
    let seq_len = TRAIN_SEQ_LEN.min(config.max_positions);
    if config.family == oomfix::Family::Generic || config.unsupported(seq_len).is_some() {
        return;
    }
    let plan = oomfix::strategies::Plan::baseline(2, seq_len);
    let device = candle_core::Device::Cpu;
    let options = oomfix::train::TrainOptions::default();
    let mut trainer = oomfix::train::Trainer::new(config, plan, &device, &options)
        .unwrap_or_else(|e| panic!("an accepted config failed to build its model: {e}"));
    let mut data = oomfix::train::data::DataSource::synthetic(0);
    let stats = trainer
        .step(&mut data)
        .unwrap_or_else(|e| panic!("an accepted config failed its first step: {e}"));
    assert!(
        stats.loss.is_finite(),
        "an accepted config trained to a loss of {}",
        stats.loss
    );
}
