//! The CUDA kernels of [`squared_norm`](super::squared_norm): one launch per
//! gradient writes each block's partial sum of squares, one more launch adds
//! the partials, and one copy of that sum to the host is the step's only
//! synchronisation (`sumsq.cu`, compiled once per process with NVRTC and
//! loaded through candle's CUDA device, which keeps one module per device).

use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaStorageSlice, WrapErr};
use candle_core::{CudaDevice, Storage, Tensor};

use super::dense_range;
use crate::cuda::{dtype_name, grid_stride_config, Ptx};

/// The kernel source (compiled after [`crate::CUDA_HALF_PRELUDE`]).
const SOURCE: &str = include_str!("sumsq.cu");
/// Name of the module in candle's per-device module cache.
const MODULE: &str = "oomfix_sum_of_squares";
/// Threads per block (`SUMSQ_THREADS` in the source).
const BLOCK: u32 = 256;
/// What the error messages call these kernels.
const WHAT: &str = "sum-of-squares kernel";

/// The PTX of [`SOURCE`], compiled on first use.
fn ptx() -> candle_core::Result<&'static str> {
    static PTX: Ptx = Ptx::new();
    crate::cuda::ptx(&PTX, SOURCE, "oomfix_sumsq.cu")
}

/// Whether the kernels read `t` in place: an f32, bf16 or f16 tensor whose
/// layout covers a dense range of its storage (contiguous, or a permutation
/// of its dimensions such as a transposed matrix).
pub(super) fn takes(t: &Tensor) -> bool {
    t.device().is_cuda() && dtype_name(t.dtype(), WHAT).is_ok() && dense_range(t.layout()).is_some()
}

/// One gradient's launch: its storage range and launch shape.
struct Launch {
    range: std::ops::Range<usize>,
    vectorized: bool,
    cfg: LaunchConfig,
}

/// The sum of the squares of every element of `tensors` (each on `dev` and
/// taken by [`takes`]), in f64: one launch per tensor, one to add the
/// partials, one device-to-host copy of the total.
pub(super) fn sum_of_squares(dev: &CudaDevice, tensors: &[&Tensor]) -> candle_core::Result<f64> {
    let mut launches = Vec::with_capacity(tensors.len());
    let mut partials = 0usize;
    for t in tensors {
        let name = format!("sumsq_{}", dtype_name(t.dtype(), WHAT)?);
        let func = dev.get_or_load_custom_func(&name, MODULE, ptx()?)?;
        let range = dense_range(t.layout())
            .ok_or_else(|| candle_core::Error::Msg(format!("{WHAT}: a strided tensor")))?;
        // The storage's own offset is in elements; 16-byte (f32) or 8-byte
        // (16-bit) accesses need four-element alignment of the view.
        let vectorized = range.start % 4 == 0;
        let work = if vectorized {
            range.len() / 4
        } else {
            range.len()
        };
        let cfg = grid_stride_config(dev, &func, BLOCK, work)?;
        partials += cfg.grid_dim.0 as usize;
        launches.push((
            func,
            Launch {
                range,
                vectorized,
                cfg,
            },
        ));
    }
    if partials == 0 {
        return Ok(0.0);
    }
    // SAFETY: every element is written by one block of one launch below
    // before `sum_partials` reads it (the launches are ordered on one stream).
    let mut sums = unsafe { dev.alloc::<f64>(partials) }?;
    let mut offset = 0;
    for (t, (func, l)) in tensors.iter().zip(&launches) {
        let blocks = l.cfg.grid_dim.0 as usize;
        let mut out = sums.slice_mut(offset..offset + blocks);
        offset += blocks;
        let (storage, _) = t.storage_and_layout();
        let Storage::Cuda(s) = &*storage else {
            candle_core::bail!("{WHAT}: a tensor that is not on CUDA");
        };
        let (n, vectorized) = (l.range.len() as u64, i32::from(l.vectorized));
        match &s.slice {
            CudaStorageSlice::F32(x) => {
                let x = x.slice(l.range.clone());
                let mut launch = func.builder();
                launch.arg(&x).arg(&n).arg(&vectorized).arg(&mut out);
                // SAFETY: the arguments match `sumsq_f32(x, n, vectorized,
                // partials)`; x holds n elements (four-aligned when
                // `vectorized`), `partials` one slot per block.
                unsafe { launch.launch(l.cfg) }.w()?;
            }
            CudaStorageSlice::BF16(x) => {
                let x = x.slice(l.range.clone());
                let mut launch = func.builder();
                launch.arg(&x).arg(&n).arg(&vectorized).arg(&mut out);
                // SAFETY: as for f32, with `sumsq_bf16`.
                unsafe { launch.launch(l.cfg) }.w()?;
            }
            CudaStorageSlice::F16(x) => {
                let x = x.slice(l.range.clone());
                let mut launch = func.builder();
                launch.arg(&x).arg(&n).arg(&vectorized).arg(&mut out);
                // SAFETY: as for f32, with `sumsq_f16`.
                unsafe { launch.launch(l.cfg) }.w()?;
            }
            _ => candle_core::bail!("{WHAT}: expected an f32, bf16 or f16 tensor"),
        }
    }
    let func = dev.get_or_load_custom_func("sum_partials", MODULE, ptx()?)?;
    // SAFETY: written by `sum_partials` before it is read.
    let mut total = unsafe { dev.alloc::<f64>(1) }?;
    let n = partials as u64;
    let mut launch = func.builder();
    launch.arg(&sums).arg(&n).arg(&mut total);
    let cfg = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match `sum_partials(partials, n, out)`; `sums`
    // holds n partials, `total` one double; one block.
    unsafe { launch.launch(cfg) }.w()?;
    Ok(dev.clone_dtoh(&total)?[0])
}
