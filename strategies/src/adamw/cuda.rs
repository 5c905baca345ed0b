//! The CUDA kernel of [`FusedAdamW`](super::FusedAdamW): one launch per
//! parameter tensor, in place.
//!
//! The kernel source (`adamw.cu`) is compiled once per process with NVRTC
//! and loaded through candle's CUDA device, which keeps one module per device.
//! It is compiled without FMA contraction and with IEEE division and square
//! root, so its f32 arithmetic is the CPU kernel's, operation for operation.
//!
//! Each launch is a grid-stride loop over the tensor that moves four elements
//! per access (16-byte loads of f32, 8-byte loads of 16-bit values) when every
//! operand starts on a four-element boundary, and one element per access
//! otherwise. The grid is as many blocks as the device keeps resident at once.

use std::sync::OnceLock;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, PushKernelArg};
use candle_core::cuda_backend::cudarc::nvrtc::{CompileError, CompileOptions};
use candle_core::cuda_backend::{CudaStorageSlice, WrapErr};
use candle_core::{CudaStorage, Tensor};

use super::Coeffs;
use crate::cuda::{
    dtype_name, grid_stride_config, with_cuda_mut, with_cuda_mut_src, with_float_slice,
};
use crate::float::contiguous_range;

/// The kernel source (compiled after [`crate::CUDA_HALF_PRELUDE`]).
const SOURCE: &str = include_str!("adamw.cu");
/// Name of the module in candle's per-device module cache.
const MODULE: &str = "oomfix_fused_adamw";
/// Threads per block.
const BLOCK: u32 = 256;

// SAFETY: `Coeffs` is `#[repr(C)]`, ten f32 fields, the layout of the
// kernel's `struct Coeffs`.
unsafe impl DeviceRepr for Coeffs {}

/// The PTX of [`SOURCE`], compiled on first use.
fn ptx() -> candle_core::Result<&'static str> {
    static PTX: OnceLock<Result<String, CompileError>> = OnceLock::new();
    let compiled = PTX.get_or_init(|| {
        let options = CompileOptions {
            fmad: Some(false),
            prec_div: Some(true),
            prec_sqrt: Some(true),
            ftz: Some(false),
            name: Some("oomfix_adamw.cu".into()),
            ..Default::default()
        };
        crate::cuda::compile(SOURCE, options)
    });
    compiled.as_deref().map_err(|e| e.clone()).w()
}

fn f32_slice_mut(
    s: &mut CudaStorage,
) -> candle_core::Result<&mut candle_core::cuda_backend::cudarc::driver::CudaSlice<f32>> {
    match &mut s.slice {
        CudaStorageSlice::F32(v) => Ok(v),
        _ => candle_core::bail!("optimizer state must be f32"),
    }
}

/// Updates `p`, `m` and `v` in place from `g` on their CUDA device. All four are
/// contiguous and of equal element count; `m` and `v` are f32.
pub(super) fn update(
    p: &Tensor,
    g: &Tensor,
    m: &Tensor,
    v: &Tensor,
    c: Coeffs,
) -> candle_core::Result<()> {
    with_cuda_mut(m, |m, ml| {
        let mr = contiguous_range(ml)?;
        with_cuda_mut(v, |v, vl| {
            let vr = contiguous_range(vl)?;
            with_cuda_mut_src(p, g, |p, pl, g, gl| {
                let (pr, gr) = (contiguous_range(pl)?, contiguous_range(gl)?);
                let n = pr.len();
                if [gr.len(), mr.len(), vr.len()] != [n; 3] {
                    candle_core::bail!("fused AdamW kernel: operands differ in length");
                }
                if n == 0 {
                    return Ok(());
                }
                let vectorized = [pr.start, gr.start, mr.start, vr.start]
                    .iter()
                    .all(|s| s % 4 == 0);
                let name = format!(
                    "adamw_{}_{}",
                    dtype_name(p.dtype(), "fused AdamW")?,
                    dtype_name(g.dtype(), "fused AdamW")?
                );
                let func = p.device.get_or_load_custom_func(&name, MODULE, ptx()?)?;
                let work = if vectorized { n / 4 } else { n };
                let cfg = grid_stride_config(&p.device, &func, BLOCK, work)?;
                let (n, vectorized) = (n as u64, vectorized as i32);
                let mut m = f32_slice_mut(m)?.slice_mut(mr.clone());
                let mut v = f32_slice_mut(v)?.slice_mut(vr.clone());
                with_float_slice!(&mut p.slice, ps => with_float_slice!(&g.slice, gs => {
                    let mut pv = ps.slice_mut(pr.clone());
                    let gv = gs.slice(gr.clone());
                    let mut launch = func.builder();
                    launch.arg(&mut pv).arg(&gv).arg(&mut m).arg(&mut v).arg(&n).arg(&vectorized).arg(&c);
                    // SAFETY: the arguments match the kernel's signature
                    // (p, g, m, v, n, vectorized, coeffs); each view holds n
                    // elements and, with `vectorized` set, starts on a
                    // four-element boundary of a device allocation.
                    unsafe { launch.launch(cfg) }.w()?;
                    Ok(())
                }))
            })
        })
    })
}
