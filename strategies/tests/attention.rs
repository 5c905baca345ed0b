//! `flash_attention` against the composed expression (outputs and gradients),
//! and the size of what it keeps for backward (this binary installs a counting
//! global allocator; the memory test runs alone, the others share a lock).

mod common;

use std::sync::{RwLock, RwLockReadGuard};

use candle_core::{DType, Device, Result, Tensor, Var, D};
use common::{allocated, assert_close, det, values, Counting};
use oomfix_strategies::attention::{flash_attention, AttentionOptions};
use oomfix_strategies::nn::ops::{attention_probs, ProbsOptions};

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Tests share this lock; the memory test takes it exclusively.
static ALONE: RwLock<()> = RwLock::new(());

fn shared() -> RwLockReadGuard<'static, ()> {
    ALONE.read().unwrap_or_else(|e| e.into_inner())
}

/// One attention problem: shapes, options and deterministic inputs.
#[derive(Clone, Copy)]
struct Case {
    b: usize,
    heads: usize,
    kv_heads: usize,
    s_q: usize,
    s_k: usize,
    d: usize,
    causal: bool,
}

impl Case {
    fn new(heads: usize, kv_heads: usize, s: usize, causal: bool) -> Self {
        Case {
            b: 2,
            heads,
            kv_heads,
            s_q: s,
            s_k: s,
            d: 16,
            causal,
        }
    }

    fn inputs(&self, seed: u64) -> (Tensor, Tensor, Tensor) {
        let q = det((self.b, self.heads, self.s_q, self.d), seed);
        let k = det((self.b, self.kv_heads, self.s_k, self.d), seed + 1);
        // Spread the scores so the softmax is far from uniform.
        let k = (k * 3.0).unwrap();
        let v = det((self.b, self.kv_heads, self.s_k, self.d), seed + 2);
        (q, k, v)
    }

    fn opts(&self, key_padding: Option<Tensor>) -> AttentionOptions {
        AttentionOptions {
            causal: self.causal,
            scale: None,
            key_padding,
            key_start: None,
        }
    }
}

/// The composed expression in f32: scores, -inf mask, softmax, times v.
/// Rows that see no key are zeroed (the composed softmax would give NaN there).
fn reference(q: &Tensor, k: &Tensor, v: &Tensor, opts: &AttentionOptions) -> Result<Tensor> {
    let (b, heads, s_q, d) = q.dims4()?;
    let (_, kv_heads, s_k, _) = k.dims4()?;
    let repeat = |t: &Tensor| -> Result<Tensor> {
        let g = heads / kv_heads;
        t.unsqueeze(2)?
            .broadcast_as((b, kv_heads, g, s_k, d))?
            .reshape((b, heads, s_k, d))
    };
    let (q, k, v) = (
        q.to_dtype(DType::F32)?,
        repeat(&k.to_dtype(DType::F32)?)?,
        repeat(&v.to_dtype(DType::F32)?)?,
    );
    let scale = opts.scale.unwrap_or(1.0 / (d as f32).sqrt()) as f64;
    let scores = (q.matmul(&k.t()?.contiguous()?)? * scale)?;

    // allowed[b, i, j] as 0/1 f32
    let mut allowed = vec![1f32; b * s_q * s_k];
    let keep = match &opts.key_padding {
        Some(m) => values(m)?,
        None => vec![1.0; b * s_k],
    };
    let start = match &opts.key_start {
        Some(t) => values(t)?,
        None => vec![0.0; b * s_q],
    };
    for bi in 0..b {
        for i in 0..s_q {
            for j in 0..s_k {
                let hidden = opts.causal && j + s_q > i + s_k;
                let before = (j as f32) < start[bi * s_q + i];
                if hidden || before || keep[bi * s_k + j] == 0.0 {
                    allowed[(bi * s_q + i) * s_k + j] = 0.0;
                }
            }
        }
    }
    let allowed = Tensor::from_vec(allowed, (b, 1, s_q, s_k), &Device::Cpu)?;
    let row_any = allowed.max_keepdim(D::Minus1)?; // [b, 1, s_q, 1]
                                                   // -inf where hidden, except in rows that see nothing (kept finite, zeroed below).
    let bias = allowed.broadcast_maximum(&(1.0 - &row_any)?)?;
    let bias = bias.ne(0.0)?.where_cond(
        &Tensor::zeros(bias.shape(), DType::F32, &Device::Cpu)?,
        &Tensor::full(f32::NEG_INFINITY, bias.shape(), &Device::Cpu)?,
    )?;
    let p = candle_nn::ops::softmax(&scores.broadcast_add(&bias)?, D::Minus1)?;
    let p = p.broadcast_mul(&row_any)?;
    p.matmul(&v)
}

/// Output and q/k/v gradients of `f` for the loss `sum(o * w)`.
fn run(
    f: impl Fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor>,
    (q, k, v): &(Tensor, Tensor, Tensor),
    w: &Tensor,
) -> Result<[Tensor; 4]> {
    let (q, k, v) = (
        Var::from_tensor(q)?,
        Var::from_tensor(k)?,
        Var::from_tensor(v)?,
    );
    let o = f(&q, &k, &v)?;
    let grads = (o.to_dtype(DType::F32)? * w)?.sum_all()?.backward()?;
    let g = |x: &Var| grads.get(x).expect("gradient").detach();
    Ok([o.detach(), g(&q), g(&k), g(&v)])
}

/// Checks output and gradients of `flash_attention` against `reference`.
fn check(case: Case, key_padding: Option<Tensor>, dtype: DType, tol: f64) {
    let opts = case.opts(key_padding);
    let (q, k, v) = case.inputs(7);
    let w = det((case.b, case.heads, case.s_q, case.d), 99);
    let cast = |t: &Tensor| t.to_dtype(dtype).unwrap();
    let inputs = (cast(&q), cast(&k), cast(&v));
    let flash = run(|q, k, v| flash_attention(q, k, v, &opts), &inputs, &w).unwrap();
    let composed = run(|q, k, v| reference(q, k, v, &opts), &inputs, &w).unwrap();
    let label = format!(
        "b{} h{} kv{} s_q{} s_k{} d{} causal={} padded={} {dtype:?}",
        case.b,
        case.heads,
        case.kv_heads,
        case.s_q,
        case.s_k,
        case.d,
        case.causal,
        opts.key_padding.is_some()
    );
    for (name, (a, b)) in ["output", "dq", "dk", "dv"]
        .iter()
        .zip(flash.iter().zip(&composed))
    {
        assert_eq!(a.dtype(), dtype, "{label}: {name} dtype");
        assert_eq!(a.dims(), b.dims(), "{label}: {name} shape");
        close(a, b, tol, &format!("{label}: {name}"));
    }
}

/// `assert_close`, except that a reference that is zero up to rounding (dq
/// with a single visible key) needs `a` to be that small too.
fn close(a: &Tensor, b: &Tensor, tol: f64, what: &str) {
    let max_abs = |t: &Tensor| values(t).unwrap().iter().fold(0f32, |m, x| m.max(x.abs()));
    if max_abs(b) < 1e-6 {
        assert!(
            max_abs(a) < 1e-5,
            "{what}: {} where the reference is zero",
            max_abs(a)
        );
    } else {
        assert_close(a, b, tol, what);
    }
}

/// A `[b, s_k]` mask keeping a different prefix-free pattern per batch row.
fn padding(b: usize, s_k: usize, dtype: DType) -> Tensor {
    let keep: Vec<f32> = (0..b * s_k)
        .map(|i| if (i * 7 + i / s_k) % 5 == 2 { 0.0 } else { 1.0 })
        .collect();
    Tensor::from_vec(keep, (b, s_k), &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

#[test]
fn matches_composed_attention_non_causal() {
    let _g = shared();
    for s in [1, 7, 33, 100] {
        check(Case::new(4, 4, s, false), None, DType::F32, 1e-5);
    }
}

#[test]
fn matches_composed_attention_causal() {
    let _g = shared();
    for s in [1, 7, 33, 100, 200] {
        check(Case::new(4, 4, s, true), None, DType::F32, 1e-5);
    }
}

#[test]
fn grouped_query_attention_sums_kv_gradients_over_the_group() {
    let _g = shared();
    for kv_heads in [2, 1] {
        for causal in [false, true] {
            for s in [7, 100] {
                check(Case::new(4, kv_heads, s, causal), None, DType::F32, 1e-5);
            }
        }
    }
}

#[test]
fn different_query_and_key_lengths() {
    let _g = shared();
    // causal with s_q < s_k: queries are the last positions; s_q > s_k: the first
    // rows see no key and must be zero
    for (s_q, s_k) in [(33, 100), (100, 33), (1, 70), (70, 1)] {
        for causal in [false, true] {
            let case = Case {
                s_q,
                s_k,
                ..Case::new(4, 2, 0, causal)
            };
            check(case, None, DType::F32, 1e-5);
        }
    }
}

#[test]
fn key_padding_masks_in_u8_u32_and_f32() {
    let _g = shared();
    for dtype in [DType::U8, DType::U32, DType::F32] {
        for causal in [false, true] {
            for s in [7, 100] {
                let case = Case::new(4, 2, s, causal);
                check(case, Some(padding(case.b, s, dtype)), DType::F32, 1e-5);
            }
        }
    }
}

/// Key starts of packed documents: each batch row's lengths, in order; a
/// query's start is its document's first position (`[b, s]` u32).
fn document_starts(rows: &[&[usize]]) -> Tensor {
    let starts: Vec<Vec<u32>> = rows
        .iter()
        .map(|lengths| {
            let mut first = 0;
            lengths
                .iter()
                .flat_map(|&n| {
                    let start = first as u32;
                    first += n;
                    std::iter::repeat_n(start, n)
                })
                .collect()
        })
        .collect();
    Tensor::new(starts, &Device::Cpu).unwrap()
}

/// Causal attention over packed documents (the key starts: each query's
/// document's first position) against the naive reference and against the
/// composed probabilities with the same starts, in value and gradients:
/// documents within a 64-key block and across blocks (whole key blocks
/// before a query block are skipped), grouped-query heads, with and without
/// key padding on top.
#[test]
fn key_starts_keep_packed_documents_apart() {
    let _g = shared();
    let docs: [&[usize]; 2] = [&[3, 70, 1, 26, 50], &[150]];
    let start = document_starts(&docs);
    for kv_heads in [4, 2] {
        for keep in [None, Some(padding(2, 150, DType::U8))] {
            let case = Case::new(4, kv_heads, 150, true);
            let opts = AttentionOptions {
                key_start: Some(start.clone()),
                ..case.opts(keep.clone())
            };
            let (q, k, v) = case.inputs(5);
            let w = det((case.b, case.heads, case.s_q, case.d), 6);
            let inputs = (q, k, v);
            let flash = run(|q, k, v| flash_attention(q, k, v, &opts), &inputs, &w).unwrap();
            let naive = run(|q, k, v| reference(q, k, v, &opts), &inputs, &w).unwrap();
            let composed = run(
                |q, k, v| {
                    let scale = 1.0 / (case.d as f32).sqrt();
                    let probs = ProbsOptions {
                        scale,
                        causal: true,
                    };
                    let p = attention_probs(q, k, keep.as_ref(), Some(&start), probs)?;
                    let g = case.heads / kv_heads;
                    p.reshape((case.b, kv_heads, g * case.s_q, case.s_k))?
                        .matmul(v)?
                        .reshape((case.b, case.heads, case.s_q, case.d))
                },
                &inputs,
                &w,
            )
            .unwrap();
            let label = format!("kv {kv_heads}, padded {}", keep.is_some());
            for (name, ((f, n), c)) in ["output", "dq", "dk", "dv"]
                .iter()
                .zip(flash.iter().zip(&naive).zip(&composed))
            {
                close(f, n, 1e-5, &format!("{label}: flash {name}"));
                close(c, n, 1e-5, &format!("{label}: composed {name}"));
            }
        }
    }
    // A document of one token sees itself only: its output is its value.
    let case = Case::new(2, 2, 5, true);
    let (q, k, v) = case.inputs(9);
    let opts = AttentionOptions {
        key_start: Some(document_starts(&[&[2, 1, 2], &[4, 1]])),
        ..case.opts(None)
    };
    let o = flash_attention(&q, &k, &v, &opts).unwrap();
    let row = |t: &Tensor, b: usize, i: usize| {
        values(&t.get(b).unwrap().get(0).unwrap().get(i).unwrap()).unwrap()
    };
    assert_eq!(row(&o, 0, 2), row(&v, 0, 2));
    assert_eq!(row(&o, 1, 4), row(&v, 1, 4));
}

#[test]
fn key_starts_of_the_wrong_shape_or_dtype_are_errors() {
    let _g = shared();
    let case = Case::new(2, 2, 5, true);
    let (q, k, v) = case.inputs(1);
    for bad in [
        Tensor::zeros((2, 4), DType::U32, &Device::Cpu).unwrap(),
        Tensor::zeros((2, 5), DType::F32, &Device::Cpu).unwrap(),
    ] {
        let opts = AttentionOptions {
            key_start: Some(bad.clone()),
            ..case.opts(None)
        };
        assert!(flash_attention(&q, &k, &v, &opts).is_err());
        let probs = ProbsOptions {
            scale: 1.0,
            causal: true,
        };
        assert!(attention_probs(&q, &k, None, Some(&bad), probs).is_err());
    }
}

/// The CUDA kernels (the variant the device runs: warpgroup, `mma.sync` or
/// SIMT) with packed documents, and without, against the CPU op, in value
/// and gradients: flash attention in f32, bf16 and f16 at head sizes 64 and
/// 128, and the composed probabilities.
#[cfg(feature = "cuda")]
#[test]
fn key_starts_on_cuda_match_the_cpu() {
    let _g = shared();
    let gpu = Device::new_cuda(0).unwrap();
    let start = document_starts(&[&[3, 70, 1, 26, 50, 10], &[130, 30]]);
    for (d, packed) in [(64, false), (64, true), (128, false), (128, true)] {
        for (dtype, tol) in [(DType::F32, 1e-4), (DType::BF16, 2e-2), (DType::F16, 2e-2)] {
            for kv_heads in [4, 2] {
                let case = Case {
                    d,
                    ..Case::new(4, kv_heads, 160, true)
                };
                let (q, k, v) = case.inputs(3);
                let w = det((case.b, case.heads, case.s_q, d), 4);
                let cast =
                    |t: &Tensor, dev: &Device| t.to_dtype(dtype).unwrap().to_device(dev).unwrap();
                let on = |dev: &Device| (cast(&q, dev), cast(&k, dev), cast(&v, dev));
                let opts = |dev: &Device| AttentionOptions {
                    key_start: packed.then(|| start.to_device(dev).unwrap()),
                    ..case.opts(None)
                };
                let (cpu_opts, gpu_opts) = (opts(&Device::Cpu), opts(&gpu));
                let want = run(
                    |q, k, v| flash_attention(q, k, v, &cpu_opts),
                    &on(&Device::Cpu),
                    &w,
                )
                .unwrap();
                let w_gpu = w.to_device(&gpu).unwrap();
                let got = run(
                    |q, k, v| flash_attention(q, k, v, &gpu_opts),
                    &on(&gpu),
                    &w_gpu,
                )
                .unwrap();
                for (name, (g, c)) in ["output", "dq", "dk", "dv"]
                    .iter()
                    .zip(got.iter().zip(&want))
                {
                    let g = g.to_device(&Device::Cpu).unwrap();
                    close(
                        &g,
                        c,
                        tol,
                        &format!("d {d} {dtype:?} kv {kv_heads} packed {packed}: CUDA {name}"),
                    );
                }
            }
        }
    }
    let case = Case::new(4, 2, 160, true);
    let (q, k, _) = case.inputs(8);
    let probs = ProbsOptions {
        scale: 0.25,
        causal: true,
    };
    let keep = padding(2, 160, DType::U8);
    for keep in [None, Some(&keep)] {
        let cpu = attention_probs(&q, &k, keep, Some(&start), probs).unwrap();
        let to_gpu = |t: &Tensor| t.to_device(&gpu).unwrap();
        let (qg, kg, sg) = (to_gpu(&q), to_gpu(&k), to_gpu(&start));
        let keep_gpu = keep.map(to_gpu);
        let got = attention_probs(&qg, &kg, keep_gpu.as_ref(), Some(&sg), probs).unwrap();
        let what = format!("CUDA composed probabilities, padded {}", keep.is_some());
        close(&got.to_device(&Device::Cpu).unwrap(), &cpu, 1e-4, &what);
    }
}

#[test]
fn fully_masked_rows_give_zeros_and_finite_gradients() {
    let _g = shared();
    let case = Case::new(4, 2, 33, false);
    // batch row 1 has no key left at all
    let mut keep = vec![1u8; 2 * 33];
    keep[33..].fill(0);
    keep[3] = 0;
    let mask = Tensor::from_vec(keep, (2, 33), &Device::Cpu).unwrap();
    check(case, Some(mask.clone()), DType::F32, 1e-5);

    let (q, k, v) = case.inputs(3);
    let [o, dq, dk, dv] = run(
        |q, k, v| flash_attention(q, k, v, &case.opts(Some(mask.clone()))),
        &(q, k, v),
        &Tensor::ones((2, 4, 33, 16), DType::F32, &Device::Cpu).unwrap(),
    )
    .unwrap();
    for t in [&o, &dq, &dk, &dv] {
        assert!(values(t).unwrap().iter().all(|x| x.is_finite()));
    }
    assert!(values(&o.get(1).unwrap())
        .unwrap()
        .iter()
        .all(|&x| x == 0.0));
    assert!(values(&o.get(0).unwrap())
        .unwrap()
        .iter()
        .any(|&x| x != 0.0));
}

#[test]
fn bf16_and_f16_within_two_percent() {
    let _g = shared();
    for dtype in [DType::BF16, DType::F16] {
        check(Case::new(4, 2, 33, true), None, dtype, 2e-2);
        check(
            Case::new(4, 4, 100, false),
            Some(padding(2, 100, DType::U8)),
            dtype,
            2e-2,
        );
    }
}

#[test]
fn explicit_scale_and_non_contiguous_inputs() {
    let _g = shared();
    let case = Case::new(4, 2, 33, true);
    let (q, k, v) = case.inputs(11);
    // [b, s, heads, d] transposed to [b, heads, s, d]: not contiguous
    let strided = |t: &Tensor| {
        t.transpose(1, 2)
            .unwrap()
            .contiguous()
            .unwrap()
            .transpose(1, 2)
            .unwrap()
    };
    let inputs = (strided(&q), strided(&k), strided(&v));
    assert!(!inputs.0.is_contiguous());
    let opts = AttentionOptions {
        scale: Some(0.3),
        ..case.opts(None)
    };
    let w = det((2, 4, 33, 16), 5);
    let flash = run(|q, k, v| flash_attention(q, k, v, &opts), &inputs, &w).unwrap();
    let composed = run(|q, k, v| reference(q, k, v, &opts), &inputs, &w).unwrap();
    for (a, b) in flash.iter().zip(&composed) {
        close(a, b, 1e-5, "scale 0.3, strided inputs");
    }
}

#[test]
fn sum_all_backward_gives_gradients_to_vars() {
    let _g = shared();
    let (q, k, v) = Case::new(2, 1, 10, true).inputs(1);
    let (q, k, v) = (
        Var::from_tensor(&q).unwrap(),
        Var::from_tensor(&k).unwrap(),
        Var::from_tensor(&v).unwrap(),
    );
    let o = flash_attention(&q, &k, &v, &AttentionOptions::default()).unwrap();
    let grads = o.sum_all().unwrap().backward().unwrap();
    for (var, dims) in [
        (&q, [2, 2, 10, 16]),
        (&k, [2, 1, 10, 16]),
        (&v, [2, 1, 10, 16]),
    ] {
        let g = grads.get(var).expect("gradient");
        assert_eq!(g.dims(), dims);
    }
    // d(sum o)/dv is the column sums of the probabilities, summed over the group:
    // every visible key gets a positive share and the total is heads × s_q per batch row.
    let dv = grads
        .get(&v)
        .unwrap()
        .sum_keepdim(3)
        .unwrap()
        .sum_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert!((dv - 16.0 * 2.0 * 2.0 * 10.0).abs() < 1e-2, "{dv}");
}

#[test]
fn invalid_inputs_are_errors() {
    let _g = shared();
    let t = |shape: (usize, usize, usize, usize)| {
        Tensor::zeros(shape, DType::F32, &Device::Cpu).unwrap()
    };
    let opts = AttentionOptions::default();
    let (q, k) = (t((1, 4, 8, 16)), t((1, 2, 8, 16)));
    // heads not a multiple of kv heads
    assert!(flash_attention(&q, &t((1, 3, 8, 16)), &t((1, 3, 8, 16)), &opts).is_err());
    // head dims differ, batch differs, v unlike k
    assert!(flash_attention(&q, &t((1, 2, 8, 8)), &t((1, 2, 8, 8)), &opts).is_err());
    assert!(flash_attention(&q, &t((2, 2, 8, 16)), &t((2, 2, 8, 16)), &opts).is_err());
    assert!(flash_attention(&q, &k, &t((1, 2, 9, 16)), &opts).is_err());
    // rank, dtype
    assert!(flash_attention(&q.squeeze(0).unwrap(), &k, &k, &opts).is_err());
    let k16 = k.to_dtype(DType::F16).unwrap();
    assert!(flash_attention(&q, &k16, &k16, &opts).is_err());
    let qi = q.to_dtype(DType::U32).unwrap();
    assert!(flash_attention(
        &qi,
        &k.to_dtype(DType::U32).unwrap(),
        &k.to_dtype(DType::U32).unwrap(),
        &opts
    )
    .is_err());
    // mask shape, scale
    let bad_mask = AttentionOptions {
        key_padding: Some(Tensor::ones((1, 9), DType::U8, &Device::Cpu).unwrap()),
        ..Default::default()
    };
    assert!(flash_attention(&q, &k, &k, &bad_mask).is_err());
    for scale in [f32::NAN, f32::INFINITY, 0.0, -0.5] {
        let bad_scale = AttentionOptions {
            scale: Some(scale),
            ..Default::default()
        };
        assert!(
            flash_attention(&q, &k, &k, &bad_scale).is_err(),
            "scale {scale}"
        );
    }
    // the valid call works
    assert!(flash_attention(&q, &k, &k, &opts).is_ok());
}

/// Live bytes the forward of `f` leaves behind (output and graph), and the
/// transient peak above the level at entry, for `b=1, heads=2, d=16`; the median
/// of three runs (threads of tests that just ended may still free memory).
fn kept_after_forward(
    s: usize,
    f: impl Fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor>,
) -> (usize, usize) {
    let (q, k, v) = Case {
        b: 1,
        heads: 2,
        kv_heads: 2,
        s_q: s,
        s_k: s,
        d: 16,
        causal: true,
    }
    .inputs(1);
    let (q, k, v) = (
        Var::from_tensor(&q).unwrap(),
        Var::from_tensor(&k).unwrap(),
        Var::from_tensor(&v).unwrap(),
    );
    let mut runs: Vec<(usize, usize)> = (0..3)
        .map(|_| {
            let (o, kept, peak) = allocated(|| f(&q, &k, &v).unwrap());
            drop(o);
            (kept, peak)
        })
        .collect();
    runs.sort_unstable();
    runs[1]
}

#[test]
fn state_kept_for_backward_grows_linearly_in_s() {
    let _g = ALONE.write().unwrap_or_else(|e| e.into_inner());
    let opts = AttentionOptions {
        causal: true,
        ..Default::default()
    };
    let flash = |q: &Tensor, k: &Tensor, v: &Tensor| flash_attention(q, k, v, &opts);
    let composed = |q: &Tensor, k: &Tensor, v: &Tensor| reference(q, k, v, &opts);
    kept_after_forward(64, flash); // warm up the thread pool
    let (f1, fp1) = kept_after_forward(1024, flash);
    let (f2, fp2) = kept_after_forward(2048, flash);
    let (c1, _) = kept_after_forward(1024, composed);
    let (c2, _) = kept_after_forward(2048, composed);
    eprintln!("kept after forward: flash {f1} B -> {f2} B (peak {fp1} -> {fp2}), composed {c1} B -> {c2} B");
    // output (2 heads × s × 16 f32) + log-sum-exp (2 heads × s f32) + small fixed state
    let expected = |s: usize| 2 * s * 16 * 4 + 2 * s * 4;
    assert!(
        f1 >= expected(1024) && f1 < expected(1024) + 4096,
        "flash kept {f1} B at s=1024"
    );
    assert!(
        f2 >= expected(2048) && f2 < expected(2048) + 4096,
        "flash kept {f2} B at s=2048"
    );
    let ratio = f2 as f64 / f1 as f64;
    assert!(
        (1.8..2.2).contains(&ratio),
        "flash kept-bytes ratio {ratio}"
    );
    // the transient peak is linear in s as well (per-thread block buffers, no s×s matrix)
    assert!(fp2 < 2 * 2048 * 2048, "flash forward peak {fp2} B");
    // the counter sees the composed graph's s×s tensors
    let ratio = c2 as f64 / c1 as f64;
    assert!(ratio > 3.5, "composed kept-bytes ratio {ratio}");
}

#[test]
fn empty_sequences_give_empty_or_zero_results() {
    let _g = shared();
    let z =
        |shape: (usize, usize, usize, usize)| Var::zeros(shape, DType::F32, &Device::Cpu).unwrap();
    for (s_q, s_k) in [(0, 5), (3, 0)] {
        let (q, k, v) = (z((1, 2, s_q, 8)), z((1, 1, s_k, 8)), z((1, 1, s_k, 8)));
        let o = flash_attention(&q, &k, &v, &AttentionOptions::default()).unwrap();
        assert_eq!(o.dims(), [1, 2, s_q, 8]);
        assert!(values(&o).unwrap().iter().all(|&x| x == 0.0));
        let grads = o.sum_all().unwrap().backward().unwrap();
        assert_eq!(grads.get(&k).unwrap().dims(), [1, 1, s_k, 8]);
    }
}
