//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

use candle_core::{DType, Device, Result, Shape, Tensor};
use oomfix_strategies::adamw::ParamsAdamW;
use oomfix_strategies::compare::rel_diff;

/// Deterministic pseudo-random values in [-1, 1) (a hash of index and seed).
pub fn det<S: Into<Shape>>(shape: S, seed: u64) -> Tensor {
    let shape = shape.into();
    let data: Vec<f32> = (0..shape.elem_count() as u64)
        .map(|i| {
            let mut x = (i + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)
                ^ seed.wrapping_mul(0xBF58_476D_1CE4_E5B9);
            x ^= x >> 31;
            x = x.wrapping_mul(0x94D0_49BB_1331_11EB);
            x ^= x >> 29;
            (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect();
    Tensor::from_vec(data, shape, &Device::Cpu).unwrap()
}

/// Asserts `rel_diff(a, b) <= tol` with a readable message.
pub fn assert_close(a: &Tensor, b: &Tensor, tol: f64, what: &str) {
    let e = rel_diff(a, b).unwrap();
    assert!(e <= tol, "{what}: relative error {e:e} > {tol:e}");
}

/// A global allocator that counts live bytes and their high-water mark: a
/// test binary that measures memory installs it
/// (`#[global_allocator] static GLOBAL: Counting = Counting;`) and counts
/// with [`allocated`].
pub struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let live = LIVE.fetch_add(layout.size(), Relaxed) + layout.size();
            PEAK.fetch_max(live, Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, layout: Layout) {
        unsafe { System.dealloc(p, layout) };
        LIVE.fetch_sub(layout.size(), Relaxed);
    }
}

/// `f()`, the bytes it leaves allocated (its result still alive) and the
/// most it had allocated at once, both above the level at entry, as
/// [`Counting`] counts them.
pub fn allocated<T>(f: impl FnOnce() -> T) -> (T, usize, usize) {
    let base = LIVE.load(Relaxed);
    PEAK.store(base, Relaxed);
    let out = f();
    let kept = LIVE.load(Relaxed).saturating_sub(base);
    (out, kept, PEAK.load(Relaxed) - base)
}

/// Flattened f32 values.
pub fn values(t: &Tensor) -> Result<Vec<f32>> {
    t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()
}

/// AdamW hyper-parameters of the optimizer tests: every term of the update matters.
pub fn adamw_params() -> ParamsAdamW {
    ParamsAdamW {
        lr: 0.01,
        beta1: 0.9,
        beta2: 0.99,
        eps: 1e-8,
        weight_decay: 0.05,
    }
}
