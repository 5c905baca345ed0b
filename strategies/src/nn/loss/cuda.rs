//! The CUDA kernels of [`cross_entropy`](super::cross_entropy): one thread
//! block per row, compiled once per process with NVRTC (`loss.cu`) and loaded
//! through candle's CUDA device, which keeps one module per device.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
use candle_core::cuda_backend::{CudaStorageSlice, WrapErr};
use candle_core::{CudaStorage, Layout, Result, Shape};

use crate::cuda::{row_blocks, Ptx};

/// The kernel source (compiled after [`crate::CUDA_HALF_PRELUDE`]).
const SOURCE: &str = include_str!("loss.cu");
/// Name of the module in candle's per-device module cache.
const MODULE: &str = "oomfix_cross_entropy";

/// The PTX of [`SOURCE`], compiled on first use.
fn ptx() -> Result<&'static str> {
    static PTX: Ptx = Ptx::new();
    crate::cuda::ptx(&PTX, SOURCE, "oomfix_loss.cu")
}

/// The contiguous element range of a layout.
fn range(l: &Layout, what: &str) -> Result<std::ops::Range<usize>> {
    l.contiguous_offsets()
        .map(|(a, b)| a..b)
        .ok_or_else(|| candle_core::Error::Msg(format!("cross_entropy: {what} must be contiguous")))
}

fn targets_slice<'a>(
    s: &'a CudaStorage,
    l: &Layout,
) -> Result<candle_core::cuda_backend::cudarc::driver::CudaView<'a, u32>> {
    match &s.slice {
        CudaStorageSlice::U32(t) => Ok(t.slice(range(l, "targets")?)),
        _ => candle_core::bail!("cross_entropy: targets must be u32"),
    }
}

/// Evaluates `$body` with `$x` bound to the logits' view, `$T` to its element
/// type and `$name` to the kernels' dtype suffix.
macro_rules! with_logits {
    ($s:expr, $r:expr, ($x:ident, $T:ident, $name:ident) => $body:expr) => {
        match &$s.slice {
            CudaStorageSlice::F32(x) => {
                #[allow(dead_code)]
                type $T = f32;
                let ($x, $name) = (x.slice($r), "f32");
                $body
            }
            CudaStorageSlice::BF16(x) => {
                #[allow(dead_code)]
                type $T = half::bf16;
                let ($x, $name) = (x.slice($r), "bf16");
                $body
            }
            CudaStorageSlice::F16(x) => {
                #[allow(dead_code)]
                type $T = half::f16;
                let ($x, $name) = (x.slice($r), "f16");
                $body
            }
            _ => candle_core::bail!("cross_entropy: logits must be f32, bf16 or f16"),
        }
    };
}

/// Forward: per-row losses `[n]` in f32.
pub(super) fn nll(
    s1: &CudaStorage,
    l1: &Layout,
    s2: &CudaStorage,
    l2: &Layout,
    classes: usize,
) -> Result<(CudaStorage, Shape)> {
    let (n, pitch) = l1.shape().dims2()?;
    let dev = s1.device().clone();
    let targets = targets_slice(s2, l2)?;
    // SAFETY: the kernel writes every one of the n elements before they are read.
    let mut out = unsafe { dev.alloc::<f32>(n) }?;
    if n > 0 {
        with_logits!(s1, range(l1, "logits")?, (x, T, name) => {
            let func = dev.get_or_load_custom_func(&format!("nll_{name}"), MODULE, ptx()?)?;
            let (v64, pitch64) = (classes as u64, pitch as u64);
            let mut launch = func.builder();
            launch.arg(&x).arg(&targets).arg(&mut out).arg(&v64).arg(&pitch64);
            // SAFETY: arguments match `nll_*(logits, targets, out, v, pitch)`; logits
            // hold n·pitch elements (v ≤ pitch), targets and out n; one block per row.
            unsafe { launch.launch(row_blocks(n, classes, "cross_entropy")?) }.w()?;
        });
    }
    Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from(n)))
}

/// Backward: the logits' gradient `[n, V]` in the logits' dtype.
pub(super) fn grad(
    s1: &CudaStorage,
    l1: &Layout,
    s2: &CudaStorage,
    l2: &Layout,
    s3: &CudaStorage,
    l3: &Layout,
    classes: usize,
) -> Result<(CudaStorage, Shape)> {
    let (n, v) = l1.shape().dims2()?;
    let dev = s1.device().clone();
    let targets = targets_slice(s2, l2)?;
    let grad = match &s3.slice {
        CudaStorageSlice::F32(g) => g.slice(range(l3, "gradient")?),
        _ => candle_core::bail!("cross_entropy backward: the gradient must be f32"),
    };
    with_logits!(s1, range(l1, "logits")?, (x, T, name) => {
        // SAFETY: the kernel writes every one of the n·v elements before they are read.
        let mut out = unsafe { dev.alloc::<T>(n * v) }?;
        if n * v > 0 {
            let func = dev.get_or_load_custom_func(&format!("nll_grad_{name}"), MODULE, ptx()?)?;
            let (classes64, v64) = (classes as u64, v as u64);
            let mut launch = func.builder();
            launch.arg(&x).arg(&targets).arg(&grad).arg(&mut out).arg(&classes64).arg(&v64);
            // SAFETY: arguments match `nll_grad_*(logits, targets, grad, out, v, pitch)`;
            // logits and out hold n·pitch elements (v ≤ pitch), targets and grad n;
            // one block per row.
            unsafe { launch.launch(row_blocks(n, classes, "cross_entropy")?) }.w()?;
        }
        Ok((CudaStorage::wrap_cuda_slice(out, dev), l1.shape().clone()))
    })
}
