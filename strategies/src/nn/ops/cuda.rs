//! The CUDA kernels of the fused ops (`fused.cu`): norms one warp per
//! row, elementwise ops grid-stride; compiled once per process with NVRTC and
//! loaded through candle's CUDA device, which keeps one module per device.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaView, DeviceRepr, LaunchConfig, PushKernelArg, ValidAsZeroBits,
};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{CudaDevice, CudaStorage, DType, Layout, Result, Shape, Storage, Tensor};

use super::{GeluForm, Norm, NormGradPart, NormKind};
use crate::cuda::Ptx;

/// The kernel source (compiled after [`crate::CUDA_HALF_PRELUDE`]).
const SOURCE: &str = include_str!("fused.cu");
/// Name of the module in candle's per-device module cache.
const MODULE: &str = "oomfix_fused";

/// The PTX of [`SOURCE`], compiled on first use.
fn ptx() -> Result<&'static str> {
    static PTX: Ptx = Ptx::new();
    crate::cuda::ptx(&PTX, SOURCE, "oomfix_fused.cu")
}

/// A storage's contiguous elements as a view of `T`.
fn view<'a, T: CudaDType>(s: &'a CudaStorage, l: &Layout) -> Result<CudaView<'a, T>> {
    let (a, b) = l
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("fused op: inputs must be contiguous".into()))?;
    Ok(s.as_cuda_slice::<T>()?.slice(a..b))
}

/// Calls the generic `$f::<T>(name, $args)` for the element type of `$dtype`,
/// `name` being the kernels' dtype suffix.
macro_rules! by_dtype {
    ($dtype:expr, $f:ident($($arg:expr),*)) => {
        match $dtype {
            DType::F32 => $f::<f32>("f32", $($arg),*),
            DType::BF16 => $f::<half::bf16>("bf16", $($arg),*),
            DType::F16 => $f::<half::f16>("f16", $($arg),*),
            other => candle_core::bail!("fused op: unsupported dtype {other:?} on CUDA"),
        }
    };
}

/// A grid-stride launch over `n` elements.
fn elementwise_config(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(256).clamp(1, 65_535 * 16) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Norm kernels: one warp per row, eight rows per block.
fn warp_rows(rows: usize) -> Result<LaunchConfig> {
    let blocks = u32::try_from(rows.div_ceil(8))
        .map_err(|_| candle_core::Error::Msg("norm: too many rows for one launch".into()))?;
    Ok(LaunchConfig {
        grid_dim: (blocks.max(1), 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// An uninitialised `n`-element output; every caller's kernel writes all of it.
fn output<T: DeviceRepr>(
    dev: &CudaDevice,
    n: usize,
) -> Result<candle_core::cuda_backend::cudarc::driver::CudaSlice<T>> {
    // SAFETY: each kernel below writes every element of its output before it is read.
    unsafe { dev.alloc::<T>(n.max(1)) }
}

fn norm_typed<T: CudaDType + DeviceRepr>(
    name: &str,
    op: Norm,
    x: (&CudaStorage, &Layout),
    w: (&CudaStorage, &Layout),
    b: Option<(&CudaStorage, &Layout)>,
) -> Result<CudaStorage> {
    let dev = x.0.device().clone();
    let h = w.1.shape().elem_count();
    let n = x.1.shape().elem_count();
    let (xv, wv) = (view::<T>(x.0, x.1)?, view::<T>(w.0, w.1)?);
    let bv = b.map(|(s, l)| view::<T>(s, l)).transpose()?;
    let mut y = output::<T>(&dev, n)?;
    if n > 0 {
        let func = dev.get_or_load_custom_func(&format!("norm_{name}"), MODULE, ptx()?)?;
        let (h64, eps, rms) = (h as u64, op.eps, i32::from(op.kind == NormKind::Rms));
        let offset = op.offset;
        let null = 0u64;
        let mut launch = func.builder();
        launch.arg(&xv).arg(&wv);
        match &bv {
            Some(bv) => launch.arg(bv),
            None => launch.arg(&null),
        };
        let rows = n / h.max(1);
        let rows64 = rows as u64;
        launch
            .arg(&mut y)
            .arg(&rows64)
            .arg(&h64)
            .arg(&eps)
            .arg(&rms)
            .arg(&offset);
        // SAFETY: arguments match `norm_*(x, w, b or null, y, rows, h, eps, rms, offset)`; x
        // and y hold rows·h elements, w and b h; one warp per row.
        unsafe { launch.launch(warp_rows(rows)?) }.w()?;
    }
    Ok(CudaStorage::wrap_cuda_slice(y, dev))
}

/// Forward of a layer norm (`b` given) or RMS norm.
pub(super) fn norm(
    op: Norm,
    x: (&CudaStorage, &Layout),
    w: (&CudaStorage, &Layout),
    b: Option<(&CudaStorage, &Layout)>,
) -> Result<(CudaStorage, Shape)> {
    let y = by_dtype!(x.0.dtype(), norm_typed(op, x, w, b))?;
    Ok((y, x.1.shape().clone()))
}

fn norm_grad_typed<T: CudaDType + DeviceRepr>(
    name: &str,
    op: Norm,
    part: NormGradPart,
    x: (&CudaStorage, &Layout),
    w: (&CudaStorage, &Layout),
    dy: (&CudaStorage, &Layout),
) -> Result<CudaStorage> {
    let dev = x.0.device().clone();
    let h = w.1.shape().elem_count();
    let n = x.1.shape().elem_count();
    let (xv, wv, dyv) = (
        view::<T>(x.0, x.1)?,
        view::<T>(w.0, w.1)?,
        view::<T>(dy.0, dy.1)?,
    );
    let (h64, eps, rms) = (h as u64, op.eps, i32::from(op.kind == NormKind::Rms));
    let offset = op.offset;
    let rows = n / h.max(1);
    let (config, rows64) = (warp_rows(rows)?, rows as u64);
    Ok(match part {
        NormGradPart::Input => {
            let mut dx = output::<T>(&dev, n)?;
            if n > 0 {
                let func =
                    dev.get_or_load_custom_func(&format!("norm_dx_{name}"), MODULE, ptx()?)?;
                let mut launch = func.builder();
                launch
                    .arg(&xv)
                    .arg(&wv)
                    .arg(&dyv)
                    .arg(&mut dx)
                    .arg(&rows64)
                    .arg(&h64)
                    .arg(&eps)
                    .arg(&rms)
                    .arg(&offset);
                // SAFETY: arguments match `norm_dx_*(x, w, dy, dx, rows, h, eps, rms,
                // offset)`;
                // x, dy and dx hold rows·h elements, w h; one warp per row.
                unsafe { launch.launch(config) }.w()?;
            }
            CudaStorage::wrap_cuda_slice(dx, dev)
        }
        NormGradPart::Scale => {
            let mut out = output::<f32>(&dev, n)?;
            if n > 0 {
                let func = dev.get_or_load_custom_func(
                    &format!("norm_scale_grad_{name}"),
                    MODULE,
                    ptx()?,
                )?;
                let mut launch = func.builder();
                launch
                    .arg(&xv)
                    .arg(&dyv)
                    .arg(&mut out)
                    .arg(&rows64)
                    .arg(&h64)
                    .arg(&eps)
                    .arg(&rms);
                // SAFETY: arguments match `norm_scale_grad_*(x, dy, out, rows, h, eps,
                // rms)`; x, dy and out hold rows·h elements; one warp per row.
                unsafe { launch.launch(config) }.w()?;
            }
            CudaStorage::wrap_cuda_slice(out, dev)
        }
    })
}

/// Backward of a norm: `dx` or the scale's per-element products.
pub(super) fn norm_grad(
    op: Norm,
    part: NormGradPart,
    x: (&CudaStorage, &Layout),
    w: (&CudaStorage, &Layout),
    dy: (&CudaStorage, &Layout),
) -> Result<(CudaStorage, Shape)> {
    let out = by_dtype!(x.0.dtype(), norm_grad_typed(op, part, x, w, dy))?;
    Ok((out, x.1.shape().clone()))
}

fn add_bias_typed<T: CudaDType + DeviceRepr>(
    name: &str,
    y: &mut CudaStorage,
    rows: usize,
    b: (&CudaStorage, &Layout),
) -> Result<()> {
    let dev = y.device().clone();
    let cols = b.1.shape().elem_count();
    let n = rows * cols;
    let bv = view::<T>(b.0, b.1)?;
    let func = dev.get_or_load_custom_func(&format!("add_bias_{name}"), MODULE, ptx()?)?;
    let ys = y.as_cuda_slice_mut::<T>()?;
    if n > 0 {
        let (n64, cols64) = (n as u64, cols as u64);
        let mut launch = func.builder();
        launch.arg(ys).arg(&bv).arg(&n64).arg(&cols64);
        // SAFETY: arguments match `add_bias_*(y, b, n, cols)`; y holds n = rows·cols
        // elements (a fresh matrix product), b cols.
        unsafe { launch.launch(elementwise_config(n)) }.w()?;
    }
    Ok(())
}

/// Adds the bias `b` (`[cols]`) to every row of the fresh `[rows, cols]` product `y`.
pub(super) fn add_bias(y: &mut CudaStorage, rows: usize, b: (&CudaStorage, &Layout)) -> Result<()> {
    by_dtype!(b.0.dtype(), add_bias_typed(y, rows, b))
}

fn gelu_typed<T: CudaDType + DeviceRepr>(
    name: &str,
    form: GeluForm,
    x: (&CudaStorage, &Layout),
    dy: Option<(&CudaStorage, &Layout)>,
) -> Result<CudaStorage> {
    let dev = x.0.device().clone();
    let n = x.1.shape().elem_count();
    let xv = view::<T>(x.0, x.1)?;
    let dyv = dy.map(|(s, l)| view::<T>(s, l)).transpose()?;
    let mut out = output::<T>(&dev, n)?;
    if n > 0 {
        let kernel = if dyv.is_some() { "gelu_grad" } else { "gelu" };
        let func = dev.get_or_load_custom_func(&format!("{kernel}_{name}"), MODULE, ptx()?)?;
        let (n64, form) = (n as u64, i32::from(form == GeluForm::Erf));
        let mut launch = func.builder();
        launch.arg(&xv);
        if let Some(dyv) = &dyv {
            launch.arg(dyv);
        }
        launch.arg(&mut out).arg(&n64).arg(&form);
        // SAFETY: arguments match `gelu_*(x, y, n, form)` or
        // `gelu_grad_*(x, dy, dx, n, form)`; every tensor holds n elements.
        unsafe { launch.launch(elementwise_config(n)) }.w()?;
    }
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}

/// GELU (`dy` absent) or its backward `dy·gelu'(x)`.
pub(super) fn gelu(
    form: GeluForm,
    x: (&CudaStorage, &Layout),
    dy: Option<(&CudaStorage, &Layout)>,
) -> Result<(CudaStorage, Shape)> {
    let out = by_dtype!(x.0.dtype(), gelu_typed(form, x, dy))?;
    Ok((out, x.1.shape().clone()))
}

fn swiglu_typed<T: CudaDType + DeviceRepr>(
    name: &str,
    g: (&CudaStorage, &Layout),
    u: (&CudaStorage, &Layout),
    dy: Option<(&CudaStorage, &Layout)>,
) -> Result<CudaStorage> {
    let dev = g.0.device().clone();
    let n = g.1.shape().elem_count();
    let (gv, uv) = (view::<T>(g.0, g.1)?, view::<T>(u.0, u.1)?);
    let dyv = dy.map(|(s, l)| view::<T>(s, l)).transpose()?;
    // The backward writes both gradients, stacked.
    let mut out = output::<T>(&dev, if dyv.is_some() { 2 * n } else { n })?;
    if n > 0 {
        let kernel = if dyv.is_some() {
            "swiglu_grad"
        } else {
            "swiglu"
        };
        let func = dev.get_or_load_custom_func(&format!("{kernel}_{name}"), MODULE, ptx()?)?;
        let n64 = n as u64;
        let mut launch = func.builder();
        launch.arg(&gv).arg(&uv);
        if let Some(dyv) = &dyv {
            launch.arg(dyv);
        }
        launch.arg(&mut out).arg(&n64);
        // SAFETY: arguments match `swiglu_*(g, u, y, n)` or
        // `swiglu_grad_*(g, u, dy, out, n)`; inputs hold n elements, out n (2n).
        unsafe { launch.launch(elementwise_config(n)) }.w()?;
    }
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}

/// SwiGLU (`dy` absent) or its backward: the gate's and up's gradients stacked.
pub(super) fn swiglu(
    g: (&CudaStorage, &Layout),
    u: (&CudaStorage, &Layout),
    dy: Option<(&CudaStorage, &Layout)>,
) -> Result<(CudaStorage, Shape)> {
    let out = by_dtype!(g.0.dtype(), swiglu_typed(g, u, dy))?;
    Ok((out, g.1.shape().clone()))
}

fn rope_typed<T: CudaDType + DeviceRepr>(
    name: &str,
    x: (&CudaStorage, &Layout),
    (cos, sin): (&Tensor, &Tensor),
    [b, s, n, d]: [usize; 4],
    back: bool,
    per_token: bool,
) -> Result<CudaStorage> {
    let dev = x.0.device().clone();
    let len = x.1.shape().elem_count();
    let xv = view::<T>(x.0, x.1)?;
    let (cos, sin) = (cos.storage_and_layout(), sin.storage_and_layout());
    let (Storage::Cuda(cs), Storage::Cuda(ss)) = (&*cos.0, &*sin.0) else {
        candle_core::bail!("rope: the tables are not on the CUDA device");
    };
    let (cv, sv) = (view::<f32>(cs, cos.1)?, view::<f32>(ss, sin.1)?);
    let mut y = output::<T>(&dev, len)?;
    if len > 0 {
        let func = dev.get_or_load_custom_func(&format!("rope_{name}"), MODULE, ptx()?)?;
        let [b, s, n, d] = [b, s, n, d].map(|v| v as u64);
        let (back, per_token) = (i32::from(back), i32::from(per_token));
        let mut launch = func.builder();
        launch
            .arg(&xv)
            .arg(&mut y)
            .arg(&cv)
            .arg(&sv)
            .arg(&b)
            .arg(&s)
            .arg(&n)
            .arg(&d)
            .arg(&back)
            .arg(&per_token);
        // SAFETY: arguments match `rope_*(src, dst, cos, sin, b, s, n, d, back,
        // per_token)`; src and dst hold b·s·n·d elements, cos and sin at least
        // s·d (b·s·d when per_token, checked by `super::rope`).
        unsafe { launch.launch(elementwise_config(len / 2)) }.w()?;
    }
    Ok(CudaStorage::wrap_cuda_slice(y, dev))
}

/// [`super::rope`]'s map, or (`back`) its transpose, of `x`, with the
/// `tables` (cos, sin) per position or (`per_token`) per token.
pub(super) fn rope(
    x: (&CudaStorage, &Layout),
    tables: (&Tensor, &Tensor),
    dims: [usize; 4],
    back: bool,
    per_token: bool,
) -> Result<CudaStorage> {
    by_dtype!(x.0.dtype(), rope_typed(x, tables, dims, back, per_token))
}

fn embedding_grad_typed<T: CudaDType + DeviceRepr + ValidAsZeroBits>(
    name: &str,
    dy: (&CudaStorage, &Layout),
    ids: (&CudaStorage, &Layout),
    vocab: usize,
) -> Result<CudaStorage> {
    let dev = dy.0.device().clone();
    let len = dy.1.shape().elem_count();
    let n = ids.1.shape().elem_count();
    let (dyv, idv) = (view::<T>(dy.0, dy.1)?, view::<u32>(ids.0, ids.1)?);
    let (_, h) = dy.1.shape().dims2()?;
    let mut out = dev.alloc_zeros::<T>((vocab * h).max(1))?;
    if len > 0 {
        let func =
            dev.get_or_load_custom_func(&format!("embedding_grad_{name}"), MODULE, ptx()?)?;
        let (n, h, vocab) = (n as u64, h as u64, vocab as u64);
        let mut launch = func.builder();
        launch
            .arg(&dyv)
            .arg(&idv)
            .arg(&mut out)
            .arg(&n)
            .arg(&h)
            .arg(&vocab);
        // SAFETY: arguments match `embedding_grad_*(src, ids, dst, n, h, vocab)`; src
        // holds n·h elements, ids n, dst vocab·h (ids at or past vocab are skipped).
        unsafe { launch.launch(elementwise_config(len)) }.w()?;
    }
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}

/// The embedding lookup's backward: the rows of `dy` `[n, h]` summed into a
/// `[vocab, h]` table by `ids` (u32).
pub(super) fn embedding_grad(
    dy: (&CudaStorage, &Layout),
    ids: (&CudaStorage, &Layout),
    vocab: usize,
) -> Result<CudaStorage> {
    by_dtype!(dy.0.dtype(), embedding_grad_typed(dy, ids, vocab))
}

/// The rows of an attention-probabilities buffer (see `attention_probs` in
/// `fused.cu`).
#[derive(Debug, Clone, Copy)]
pub(super) struct ProbsGeometry {
    /// Rows of `s_k` scores (`b·H·s_q`).
    pub rows: usize,
    /// Query positions: a row's position is its index modulo `s_q`.
    pub s_q: usize,
    /// Keys per row.
    pub s_k: usize,
    /// Rows per batch row (`H·s_q`), which share one row of keep flags.
    pub rows_per_batch: usize,
}

/// The key padding flags (`[b, s_k]` u8) and each query's first visible
/// key (`[b, s_q]` u32) of [`attention_probs`], where given.
pub(super) type ProbsMasks<'a> = (
    Option<(&'a CudaStorage, &'a Layout)>,
    Option<(&'a CudaStorage, &'a Layout)>,
);

fn attention_probs_typed<T: CudaDType + DeviceRepr>(
    name: &str,
    scores: &mut CudaStorage,
    (keep, start): ProbsMasks,
    g: ProbsGeometry,
    opts: super::ProbsOptions,
) -> Result<()> {
    let dev = scores.device().clone();
    let keep = keep.map(|(s, l)| view::<u8>(s, l)).transpose()?;
    let start = start.map(|(s, l)| view::<u32>(s, l)).transpose()?;
    if g.rows * g.s_k == 0 {
        return Ok(());
    }
    let func = dev.get_or_load_custom_func(&format!("attention_probs_{name}"), MODULE, ptx()?)?;
    let p = scores.as_cuda_slice_mut::<T>()?;
    let [rows, s_k, s_q, per_batch] = [g.rows, g.s_k, g.s_q, g.rows_per_batch].map(|v| v as u64);
    let (null, causal) = (0u64, i32::from(opts.causal));
    let mut launch = func.builder();
    launch.arg(p);
    match &keep {
        Some(k) => launch.arg(k),
        None => launch.arg(&null),
    };
    match &start {
        Some(st) => launch.arg(st),
        None => launch.arg(&null),
    };
    launch
        .arg(&rows)
        .arg(&s_k)
        .arg(&s_q)
        .arg(&per_batch)
        .arg(&opts.scale)
        .arg(&causal);
    // SAFETY: arguments match `attention_probs_*(p, keep or null, start or
    // null, rows, n, s_q, rows_per_batch, scale, causal)`; p holds rows·n
    // elements, keep rows/rows_per_batch·n, start rows/rows_per_batch·s_q
    // (checked by `attention_probs`); one warp per row.
    unsafe { launch.launch(warp_rows(g.rows)?) }.w()?;
    Ok(())
}

/// Turns the scores `q·kᵀ` in `scores` into attention probabilities in place.
pub(super) fn attention_probs(
    scores: &mut CudaStorage,
    masks: ProbsMasks,
    g: ProbsGeometry,
    opts: super::ProbsOptions,
) -> Result<()> {
    by_dtype!(
        scores.dtype(),
        attention_probs_typed(scores, masks, g, opts)
    )
}

fn attention_probs_grad_typed<T: CudaDType + DeviceRepr>(
    name: &str,
    p: (&CudaStorage, &Layout),
    dp: (&CudaStorage, &Layout),
    scale: f32,
) -> Result<CudaStorage> {
    let dev = p.0.device().clone();
    let len = p.1.shape().elem_count();
    let n = p.1.dims().last().copied().unwrap_or(1);
    let (pv, dpv) = (view::<T>(p.0, p.1)?, view::<T>(dp.0, dp.1)?);
    let mut ds = output::<T>(&dev, len)?;
    if len > 0 {
        let func =
            dev.get_or_load_custom_func(&format!("attention_probs_grad_{name}"), MODULE, ptx()?)?;
        let rows = len / n;
        let (rows64, n64) = (rows as u64, n as u64);
        let mut launch = func.builder();
        launch
            .arg(&pv)
            .arg(&dpv)
            .arg(&mut ds)
            .arg(&rows64)
            .arg(&n64)
            .arg(&scale);
        // SAFETY: arguments match `attention_probs_grad_*(p, dp, ds, rows, n, scale)`;
        // p, dp and ds hold rows·n elements; one warp per row.
        unsafe { launch.launch(warp_rows(rows)?) }.w()?;
    }
    Ok(CudaStorage::wrap_cuda_slice(ds, dev))
}

/// The softmax's backward `scale·p∘(dp − rowsum(p∘dp))` over the last dimension.
pub(super) fn attention_probs_grad(
    p: (&CudaStorage, &Layout),
    dp: (&CudaStorage, &Layout),
    scale: f32,
) -> Result<CudaStorage> {
    by_dtype!(p.0.dtype(), attention_probs_grad_typed(p, dp, scale))
}
