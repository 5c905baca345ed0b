//! The CUDA memory-efficient attention on cuda:0:
//!
//! 1. checks: output and q/k/v gradients of `flash_attention` against the
//!    composed expression (softmax(q·kᵀ·scale + mask)·v through candle's
//!    autograd) evaluated in f64 from the same inputs, for f32, bf16 and f16,
//!    causal and not, grouped-query heads, odd lengths and head dimensions, key
//!    padding; the same composed expression in the input dtype gives the
//!    precision that dtype can reach. One `PASS`/`FAIL` row per case;
//! 2. timing: forward and forward+backward (loss = sum(o · w)) for GPT-2-like
//!    shapes (batch 8, 12 heads, head dim 64, causal) at s = 1024 … 8192, bf16
//!    and f32, with the pool's peak; one `PERF` row each; and TinyLlama-1.1B's
//!    grouped-query shape (batch 4, 32 query and 4 key/value heads, s = 2048,
//!    bf16), one `PERF-gqa` row. Each shape also gets a `LOSS` (`LOSS-gqa`)
//!    row: the step's loss and its backward alone (`o` a variable of the
//!    output's shape, no attention), which the benchmark subtracts on both
//!    sides to compare the attention itself. Llama-3.1-8B's shape (batch 1,
//!    32 query heads on 8 of 128) at `LONG_SEQS` tokens (default
//!    8192,32768): `PERF-long` rows, and `MEM-long` rows with what its
//!    backward adds to the pool's used bytes, the upstream gradient arriving
//!    with the heads merged as in a model, in `[s, 4096]` bf16 tensors (the
//!    memory model's unit at long context).
//!
//! Usage: `gpu_attention [--check-only | --perf-only]`. Exits 1 when a check
//! fails. `HEAD_DIM=128` times another head dimension (heads × head dim stays
//! 768; the heading says which); `PERF_DTYPES=bf16` (or `f32`) times one dtype
//! of the two, `PERF_SEQS=2048,gqa` some lengths (`gqa`: TinyLlama's shape,
//! `long`: Llama-3.1-8B's).
//! Build with `scripts/build-cuda.sh --features cuda --example gpu_attention`;
//! `scripts/bench-attention-gpu.sh` runs it next to PyTorch's SDPA
//! (docs/attention-gpu.md).

use std::time::Instant;

use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor, Var, D};
use oomfix::strategies::attention::{flash_attention, AttentionOptions};
use oomfix::track::cuda::{reset_peaks, PoolStats};

const MIB: f64 = (1u64 << 20) as f64;

/// One check: shapes, masks, dtype.
#[derive(Debug, Clone, Copy)]
struct Case {
    dtype: DType,
    b: usize,
    heads: usize,
    kv_heads: usize,
    s_q: usize,
    s_k: usize,
    d: usize,
    causal: bool,
    /// Keep only the first `s_k - pad * (row + 1)` keys of batch row `row`.
    pad: usize,
}

impl std::fmt::Display for Case {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:<4} b={} h={}/{} s={}x{} d={:<3} {}{}",
            format!("{:?}", self.dtype).to_lowercase(),
            self.b,
            self.heads,
            self.kv_heads,
            self.s_q,
            self.s_k,
            self.d,
            if self.causal { "causal" } else { "full" },
            if self.pad > 0 { " +pad" } else { "" }
        )
    }
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (check, perf) = match args.first().map(String::as_str) {
        None => (true, true),
        Some("--check-only") => (true, false),
        Some("--perf-only") => (false, true),
        Some(other) => {
            anyhow::bail!("unknown argument {other} (expected --check-only or --perf-only)")
        }
    };
    let device = Device::new_cuda(0)?;
    let cuda = device.as_cuda_device()?.clone();
    let ctx = cuda.cuda_stream().context().clone();
    println!(
        "# gpu_attention on {}; OOMFIX_FLASH_SIMT={}",
        ctx.name().unwrap_or_else(|_| "?".into()),
        std::env::var("OOMFIX_FLASH_SIMT").unwrap_or_default()
    );
    let mut failed = 0;
    if check {
        failed = checks(&device)?;
    }
    if perf {
        timings(&device)?;
    }
    if failed > 0 {
        println!("{failed} check(s) FAILED");
        std::process::exit(1);
    }
    Ok(())
}

fn cases() -> Vec<Case> {
    let base = Case {
        dtype: DType::F32,
        b: 2,
        heads: 4,
        kv_heads: 4,
        s_q: 128,
        s_k: 128,
        d: 64,
        causal: true,
        pad: 0,
    };
    let shapes = [
        base,
        Case {
            s_q: 200,
            s_k: 200,
            causal: false,
            ..base
        },
        Case {
            b: 1,
            heads: 8,
            kv_heads: 2,
            s_q: 131,
            s_k: 131,
            ..base
        },
        Case {
            s_q: 97,
            s_k: 160,
            d: 40,
            ..base
        },
        Case {
            b: 3,
            heads: 2,
            kv_heads: 1,
            s_q: 150,
            s_k: 150,
            d: 128,
            pad: 7,
            ..base
        },
        Case {
            b: 2,
            heads: 2,
            kv_heads: 2,
            s_q: 65,
            s_k: 65,
            d: 128,
            causal: false,
            pad: 5,
            ..base
        },
        Case {
            b: 1,
            heads: 3,
            kv_heads: 3,
            s_q: 70,
            s_k: 33,
            d: 72,
            causal: false,
            ..base
        },
        Case {
            b: 1,
            heads: 2,
            kv_heads: 1,
            s_q: 1,
            s_k: 1,
            d: 8,
            ..base
        },
        Case {
            b: 1,
            heads: 4,
            kv_heads: 2,
            s_q: 300,
            s_k: 300,
            d: 96,
            ..base
        },
        Case {
            b: 2,
            heads: 12,
            kv_heads: 12,
            s_q: 256,
            s_k: 256,
            d: 64,
            ..base
        },
    ];
    [DType::F32, DType::BF16, DType::F16]
        .into_iter()
        .flat_map(|dtype| shapes.iter().map(move |c| Case { dtype, ..*c }))
        .collect()
}

/// Runs every case; returns the number of failures.
fn checks(device: &Device) -> Result<usize> {
    println!(
        "\n## checks: relative error ||x - ref|| / ||ref|| against the composed expression in f64"
    );
    println!("## (in brackets: the composed expression in the input dtype)\n");
    let mut failed = 0;
    for case in cases() {
        let errs = check(device, &case).with_context(|| format!("case {case}"))?;
        let tol: f64 = match case.dtype {
            DType::F32 => 1e-5,
            DType::BF16 => 1e-2,
            _ => 2e-3,
        };
        // Flash in a 16-bit dtype may be up to twice as far from f64 as the
        // composed expression in that dtype (it rounds P and dS to it too).
        let ok = errs
            .iter()
            .all(|(flash, composed)| flash.is_finite() && *flash <= tol.max(2.0 * composed));
        failed += usize::from(!ok);
        let cols: Vec<String> = ["o", "dq", "dk", "dv"]
            .iter()
            .zip(&errs)
            .map(|(n, (f, c))| format!("{n} {f:.1e} [{c:.1e}]"))
            .collect();
        println!(
            "{}  {case:<40} {}",
            if ok { "PASS" } else { "FAIL" },
            cols.join("  ")
        );
    }
    let masked = fully_masked_row(device)?;
    failed += usize::from(!masked);
    println!(
        "{}  a batch row with every key padded gives zero output and gradients",
        if masked { "PASS" } else { "FAIL" }
    );
    Ok(failed)
}

/// Random inputs of `case` (q, k, v, the loss weights w, the keep mask).
fn inputs(device: &Device, c: &Case) -> Result<(Tensor, Tensor, Tensor, Tensor, Option<Tensor>)> {
    let q = Tensor::randn(0f32, 1.0, (c.b, c.heads, c.s_q, c.d), device)?;
    let k = Tensor::randn(0f32, 1.0, (c.b, c.kv_heads, c.s_k, c.d), device)?;
    let v = Tensor::randn(0f32, 1.0, (c.b, c.kv_heads, c.s_k, c.d), device)?;
    let w = Tensor::randn(0f32, 1.0, (c.b, c.heads, c.s_q, c.d), device)?;
    let [q, k, v, w] = [q, k, v, w].map(|t| t.to_dtype(c.dtype));
    let keep = (c.pad > 0)
        .then(|| {
            let rows: Vec<f32> = (0..c.b)
                .flat_map(|r| {
                    let kept = c.s_k.saturating_sub(c.pad * (r + 1)).max(1);
                    (0..c.s_k).map(move |j| if j < kept { 1.0 } else { 0.0 })
                })
                .collect();
            Tensor::from_vec(rows, (c.b, c.s_k), device)
        })
        .transpose()?;
    Ok((q?, k?, v?, w?, keep))
}

/// softmax(q·kᵀ·scale + mask)·v with kv heads repeated for their query heads.
fn composed(q: &Tensor, k: &Tensor, v: &Tensor, c: &Case, keep: Option<&Tensor>) -> Result<Tensor> {
    let group = c.heads / c.kv_heads;
    let rep = |t: &Tensor| -> Result<Tensor> {
        Ok(t.unsqueeze(2)?
            .broadcast_as((c.b, c.kv_heads, group, c.s_k, c.d))?
            .contiguous()?
            .reshape((c.b, c.heads, c.s_k, c.d))?)
    };
    let (k, v) = (rep(k)?, rep(v)?);
    let scale = 1.0 / (c.d as f64).sqrt();
    let scores = (q.matmul(&k.t()?)? * scale)?;
    let mut mask = vec![0f32; c.b * c.s_q * c.s_k];
    let keep: Option<Vec<f32>> = keep.map(|k| k.flatten_all()?.to_vec1()).transpose()?;
    for b in 0..c.b {
        for i in 0..c.s_q {
            for j in 0..c.s_k {
                let hidden = (c.causal && j + c.s_q > i + c.s_k)
                    || keep.as_ref().is_some_and(|k| k[b * c.s_k + j] == 0.0);
                if hidden {
                    mask[(b * c.s_q + i) * c.s_k + j] = f32::NEG_INFINITY;
                }
            }
        }
    }
    let mask = Tensor::from_vec(mask, (c.b, 1, c.s_q, c.s_k), q.device())?.to_dtype(q.dtype())?;
    let p = candle_nn::ops::softmax(&scores.broadcast_add(&mask)?, D::Minus1)?;
    Ok(p.matmul(&v)?)
}

/// Output and gradients of `f` applied to (q, k, v) as variables, loss = sum(o · w).
fn run<F>(q: &Tensor, k: &Tensor, v: &Tensor, w: &Tensor, f: F) -> Result<[Tensor; 4]>
where
    F: Fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor>,
{
    let (qv, kv, vv) = (
        Var::from_tensor(q)?,
        Var::from_tensor(k)?,
        Var::from_tensor(v)?,
    );
    let o = f(qv.as_tensor(), kv.as_tensor(), vv.as_tensor())?;
    let grads = (&o * w)?.sum_all()?.backward()?;
    let g = |x: &Var| grads.get(x).cloned().context("no gradient");
    Ok([o, g(&qv)?, g(&kv)?, g(&vv)?])
}

/// (flash error, composed-in-dtype error) for o, dq, dk, dv.
fn check(device: &Device, c: &Case) -> Result<Vec<(f64, f64)>> {
    let (q, k, v, w, keep) = inputs(device, c)?;
    let opts = AttentionOptions {
        causal: c.causal,
        key_padding: keep.clone(),
        ..Default::default()
    };
    let flash = run(&q, &k, &v, &w, |q, k, v| {
        Ok(flash_attention(q, k, v, &opts)?)
    })?;
    let same = run(&q, &k, &v, &w, |q, k, v| {
        composed(q, k, v, c, keep.as_ref())
    })?;
    let up = |t: &Tensor| t.to_dtype(DType::F64);
    let reference = run(&up(&q)?, &up(&k)?, &up(&v)?, &up(&w)?, |q, k, v| {
        composed(q, k, v, c, keep.as_ref())
    })?;
    flash
        .iter()
        .zip(&same)
        .zip(&reference)
        .map(|((f, s), r)| Ok((rel_err(f, r)?, rel_err(s, r)?)))
        .collect()
}

fn rel_err(x: &Tensor, reference: &Tensor) -> Result<f64> {
    let x = x.to_dtype(DType::F64)?;
    let diff = (&x - reference)?
        .sqr()?
        .sum_all()?
        .to_scalar::<f64>()?
        .sqrt();
    let norm = reference.sqr()?.sum_all()?.to_scalar::<f64>()?.sqrt();
    Ok(if norm > 0.0 { diff / norm } else { diff })
}

/// A batch row whose keys are all padded: zeros out, zeros back, nothing NaN.
fn fully_masked_row(device: &Device) -> Result<bool> {
    let mut ok = true;
    for dtype in [DType::F32, DType::BF16] {
        let c = Case {
            dtype,
            b: 2,
            heads: 2,
            kv_heads: 1,
            s_q: 70,
            s_k: 90,
            d: 64,
            causal: false,
            pad: 0,
        };
        let (q, k, v, w, _) = inputs(device, &c)?;
        let keep = Tensor::cat(
            &[
                Tensor::ones((1, 90), DType::F32, device)?,
                Tensor::zeros((1, 90), DType::F32, device)?,
            ],
            0,
        )?;
        let opts = AttentionOptions {
            key_padding: Some(keep),
            ..Default::default()
        };
        let [o, dq, dk, dv] = run(&q, &k, &v, &w, |q, k, v| {
            Ok(flash_attention(q, k, v, &opts)?)
        })?;
        for t in [&o, &dq, &dk, &dv] {
            let t = t.to_dtype(DType::F32)?;
            let masked = t.get(1)?.abs()?.max_all()?.to_scalar::<f32>()?;
            let kept = t.get(0)?.abs()?.max_all()?.to_scalar::<f32>()?;
            ok &= masked == 0.0 && kept.is_finite() && kept > 0.0;
        }
    }
    Ok(ok)
}

/// Median wall time of `f` over `reps` runs after `warm` runs, synchronising around each.
fn time<F: FnMut() -> Result<()>>(
    device: &Device,
    warm: usize,
    reps: usize,
    mut f: F,
) -> Result<f64> {
    for _ in 0..warm {
        f()?;
    }
    device.synchronize()?;
    let mut ms = Vec::with_capacity(reps);
    for _ in 0..reps {
        let t = Instant::now();
        f()?;
        device.synchronize()?;
        ms.push(t.elapsed().as_secs_f64() * 1e3);
    }
    ms.sort_by(f64::total_cmp);
    Ok(ms[reps / 2])
}

/// Random q `[b, heads, s, d]` and k, v `[b, kv_heads, s, d]` variables in
/// `dtype`, for `(batch, heads, kv_heads, seq, head_dim)`.
fn random_qkv(
    device: &Device,
    dtype: DType,
    (b, h, kv, s, d): (usize, usize, usize, usize, usize),
) -> Result<(Var, Var, Var)> {
    let mk = |heads: usize| -> Result<Var> {
        let t = Tensor::randn(0f32, 1.0, (b, heads, s, d), device)?.to_dtype(dtype)?;
        Ok(Var::from_tensor(&t)?)
    };
    Ok((mk(h)?, mk(kv)?, mk(kv)?))
}

/// Causal attention's options.
fn causal() -> AttentionOptions {
    AttentionOptions {
        causal: true,
        ..Default::default()
    }
}

/// Forward ms, forward+backward ms and the pool's peak (MiB) of causal
/// attention over `(batch, heads, kv_heads, seq, head_dim)`.
fn time_shape(
    device: &Device,
    dtype: DType,
    (b, h, kv, s, d): (usize, usize, usize, usize, usize),
) -> Result<(f64, f64, f64)> {
    let (q, k, v) = random_qkv(device, dtype, (b, h, kv, s, d))?;
    let w = Tensor::randn(0f32, 1.0, (b, h, s, d), device)?.to_dtype(dtype)?;
    let opts = causal();
    let fwd = time(device, 3, 10, || {
        flash_attention(&q, &k, &v, &opts)?;
        Ok(())
    })?;
    let step = || -> Result<()> {
        let o = flash_attention(&q, &k, &v, &opts)?;
        // Sum each head first: candle's sum over all elements runs one
        // block (2.7 ms at s = 8192 under ncu), which would outweigh the
        // attention; PyTorch's `sum()` is a parallel reduction.
        let grads = (&o * &w)?.sum_keepdim((2, 3))?.sum_all()?.backward()?;
        drop(grads);
        Ok(())
    };
    let fwd_bwd = time(device, 3, 10, step)?;
    let cuda = device.as_cuda_device()?;
    reset_peaks(cuda)?;
    step()?;
    Ok((fwd, fwd_bwd, PoolStats::read(cuda)?.used_high as f64 / MIB))
}

/// Milliseconds of the timed step's loss alone: sum(o · w) and its backward,
/// with `o` a variable of the attention output's shape `(b, heads, s, d)`.
fn time_loss(device: &Device, dtype: DType, shape: (usize, usize, usize, usize)) -> Result<f64> {
    let o = Var::from_tensor(&Tensor::randn(0f32, 1.0, shape, device)?.to_dtype(dtype)?)?;
    let w = Tensor::randn(0f32, 1.0, shape, device)?.to_dtype(dtype)?;
    time(device, 3, 10, || {
        drop(
            (o.as_tensor() * &w)?
                .sum_keepdim((2, 3))?
                .sum_all()?
                .backward()?,
        );
        Ok(())
    })
}

fn timings(device: &Device) -> Result<()> {
    let d: usize = match std::env::var("HEAD_DIM") {
        Ok(v) => v.parse().context("HEAD_DIM")?,
        Err(_) => 64,
    };
    let (b, h) = (8, 768 / d.max(1));
    println!(
        "\n## timing: batch 8, {h} heads, head dim {d}, causal; median of 10 after 3 warm-up runs"
    );
    println!("## PERF dtype seq fwd_ms fwd_bwd_ms peak_alloc_MiB (pool high-water during fwd+bwd, inputs included)\n");
    // A comma-separated list from the environment, or everything.
    let picked = |var: &str, item: &str| match std::env::var(var) {
        Ok(list) if !list.is_empty() => list.split(',').any(|x| x == item),
        _ => true,
    };
    for dtype in [DType::BF16, DType::F32] {
        let name = format!("{dtype:?}").to_lowercase();
        if !picked("PERF_DTYPES", &name) {
            continue;
        }
        for s in [1024, 2048, 4096, 8192] {
            if !picked("PERF_SEQS", &s.to_string()) {
                continue;
            }
            let (fwd, fwd_bwd, peak) = time_shape(device, dtype, (b, h, h, s, d))?;
            println!("PERF {name} {s} {fwd:.3} {fwd_bwd:.3} {peak:.0}");
            let loss = time_loss(device, dtype, (b, h, s, d))?;
            println!("LOSS {name} {s} {loss:.3}");
        }
    }
    if picked("PERF_SEQS", "gqa") {
        // TinyLlama-1.1B's attention: batch 4, 32 query heads on 4 key/value heads.
        let (fwd, fwd_bwd, peak) = time_shape(device, DType::BF16, (4, 32, 4, 2048, 64))?;
        println!("PERF-gqa bf16 2048 {fwd:.3} {fwd_bwd:.3} {peak:.0}");
        let loss = time_loss(device, DType::BF16, (4, 32, 2048, 64))?;
        println!("LOSS-gqa bf16 2048 {loss:.3}");
    }
    if picked("PERF_SEQS", "long") {
        let seqs = std::env::var("LONG_SEQS").unwrap_or_else(|_| "8192,32768".into());
        println!(
            "\n## Llama-3.1-8B's attention (1 × 32 heads on 8 of 128, causal, bf16); MEM-long: \
             the backward's bytes above what was live when it started, in [s, 4096] bf16 tensors\n"
        );
        for s in seqs.split(',') {
            let s: usize = s.trim().parse().context("LONG_SEQS")?;
            let (fwd, fwd_bwd, peak) = time_shape(device, DType::BF16, (1, 32, 8, s, 128))?;
            println!("PERF-long bf16 {s} {fwd:.3} {fwd_bwd:.3} {peak:.0}");
            let (before, above) = backward_working_set(device, (1, 32, 8, s, 128))?;
            let unit = (s * 4096 * 2) as f64;
            println!(
                "MEM-long bf16 {s} live_at_backward {:.2} backward_above {:.2}",
                before as f64 / unit,
                above as f64 / unit
            );
        }
    }
    Ok(())
}

/// What one causal bf16 attention's backward adds on the pool's used bytes
/// (its peak above the bytes live when it starts: the upstream gradients,
/// the kernel's copies and sums, the input gradients), and the bytes live
/// then, for `(batch, heads, kv_heads, seq, head_dim)`. The upstream
/// gradient arrives as the model's does: the heads merged, `[b, s, H·d]`,
/// and split again (a strided view).
fn backward_working_set(
    device: &Device,
    (b, h, kv, s, d): (usize, usize, usize, usize, usize),
) -> Result<(u64, u64)> {
    let (q, k, v) = random_qkv(device, DType::BF16, (b, h, kv, s, d))?;
    let w = Tensor::randn(0f32, 1.0, (b, s, h * d), device)?.to_dtype(DType::BF16)?;
    let cuda = device.as_cuda_device()?;
    let o = flash_attention(&q, &k, &v, &causal())?;
    let merged = o.transpose(1, 2)?.reshape((b, s, h * d))?;
    let loss = (&merged * &w)?.sum_keepdim((1, 2))?.sum_all()?;
    let before = PoolStats::read(cuda)?.used;
    reset_peaks(cuda)?;
    let grads = loss.backward()?;
    let high = PoolStats::read(cuda)?.used_high;
    drop(grads);
    Ok((before, high.saturating_sub(before)))
}
