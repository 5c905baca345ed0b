//! Composed attention vs `flash_attention` on the CPU: forward+backward time
//! (median of several runs) and the bytes the forward leaves alive for backward
//! (measured with a counting global allocator). b=1, heads=12, d=64, f32, causal.
//!
//! Usage: `bench_attention [REPS]` (default 5).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::time::Instant;

use candle_core::{Device, Result, Tensor, Var, D};
use oomfix_strategies::attention::{flash_attention, AttentionOptions};
use oomfix_strategies::compare;

/// Counts live bytes.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            LIVE.fetch_add(layout.size(), Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, layout: Layout) {
        unsafe { System.dealloc(p, layout) };
        LIVE.fetch_sub(layout.size(), Relaxed);
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

const HEADS: usize = 12;
const D_HEAD: usize = 64;

/// An attention function of (q, k, v).
type Attention<'a> = &'a dyn Fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor>;

/// `softmax(q·kᵀ/sqrt(d) + bias)·v` with candle's differentiable ops.
fn composed(q: &Tensor, k: &Tensor, v: &Tensor, bias: &Tensor) -> Result<Tensor> {
    let scores = (q.matmul(&k.t()?)? * (1.0 / (D_HEAD as f64).sqrt()))?;
    let p = candle_nn::ops::softmax(&scores.broadcast_add(bias)?, D::Minus1)?;
    p.matmul(v)
}

/// The causal bias: 0 on and below the diagonal, -inf above.
fn causal_bias(s: usize) -> Result<Tensor> {
    let bias: Vec<f32> = (0..s * s)
        .map(|n| {
            if n % s > n / s {
                f32::NEG_INFINITY
            } else {
                0.0
            }
        })
        .collect();
    Tensor::from_vec(bias, (s, s), &Device::Cpu)
}

/// Seconds for forward + backward of `f`, and the live bytes the forward left behind.
fn measure(vars: &[Var; 3], f: Attention) -> Result<(f64, usize)> {
    let base = LIVE.load(Relaxed);
    let start = Instant::now();
    let o = f(&vars[0], &vars[1], &vars[2])?;
    let kept = LIVE.load(Relaxed).saturating_sub(base);
    let grads = o.sum_all()?.backward()?;
    let secs = start.elapsed().as_secs_f64();
    drop(grads);
    Ok((secs, kept))
}

/// Median seconds over `reps` runs and the kept bytes of the last one.
fn median(reps: usize, vars: &[Var; 3], f: Attention) -> Result<(f64, usize)> {
    let mut times = Vec::with_capacity(reps);
    let mut kept = 0;
    for _ in 0..reps {
        let (t, k) = measure(vars, f)?;
        times.push(t);
        kept = k;
    }
    times.sort_by(f64::total_cmp);
    Ok((times[reps / 2], kept))
}

/// `max |a - b| / max |b|` of the two functions' outputs.
fn rel_diff(vars: &[Var; 3], a: Attention, b: Attention) -> Result<f64> {
    let (a, b) = (
        a(&vars[0], &vars[1], &vars[2])?.detach(),
        b(&vars[0], &vars[1], &vars[2])?.detach(),
    );
    compare::rel_diff(&a, &b)
}

/// Bytes in MiB.
fn mib(bytes: usize) -> f64 {
    bytes as f64 / (1 << 20) as f64
}

fn main() -> Result<()> {
    let reps = match std::env::args().nth(1) {
        Some(a) => a.parse().map_err(|_| {
            candle_core::Error::Msg(format!("REPS must be a positive integer, got {a}"))
        })?,
        None => 5,
    }
    .max(1);
    let opts = AttentionOptions {
        causal: true,
        ..Default::default()
    };
    println!(
        "b=1 heads={HEADS} d={D_HEAD} f32 causal, fwd+bwd median of {reps}, {} threads",
        rayon::current_num_threads()
    );
    println!(
        "{:>6} {:>13} {:>13} {:>9} {:>15} {:>15} {:>10}",
        "s", "composed ms", "flash ms", "speedup", "composed kept", "flash kept", "out diff"
    );
    for s in [256, 512, 1024, 2048] {
        let new = || {
            Var::from_tensor(&Tensor::randn(
                0f32,
                1.0,
                (1, HEADS, s, D_HEAD),
                &Device::Cpu,
            )?)
        };
        let vars = [new()?, new()?, new()?];
        let bias = causal_bias(s)?;
        let comp = |q: &Tensor, k: &Tensor, v: &Tensor| composed(q, k, v, &bias);
        let flash = |q: &Tensor, k: &Tensor, v: &Tensor| flash_attention(q, k, v, &opts);
        let err = rel_diff(&vars, &flash, &comp)?; // also the warm-up
        let (tc, kc) = median(reps, &vars, &comp)?;
        let (tf, kf) = median(reps, &vars, &flash)?;
        println!(
            "{s:>6} {:>13.1} {:>13.1} {:>8.2}x {:>11.1} MiB {:>11.2} MiB {:>10.1e}",
            tc * 1e3,
            tf * 1e3,
            tc / tf,
            mib(kc),
            mib(kf),
            err
        );
    }
    Ok(())
}
