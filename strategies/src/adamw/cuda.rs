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

use std::cell::Cell;
use std::sync::OnceLock;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute;
use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::cudarc::nvrtc::{self, CompileError, CompileOptions};
use candle_core::cuda_backend::{CudaStorageSlice, WrapErr};
use candle_core::{CpuStorage, CudaStorage, DType, InplaceOp1, InplaceOp2, Layout, Tensor};

use super::{contiguous_range, Coeffs};

/// The kernel source (compiled after [`crate::CUDA_HALF_PRELUDE`]).
const SOURCE: &str = include_str!("adamw.cu");
/// Name of the module in candle's per-device module cache.
const MODULE: &str = "oomfix_fused_adamw";
/// Threads per block.
const BLOCK: u32 = 256;

// SAFETY: `Coeffs` is `#[repr(C)]`, nine f32 fields, the layout of the
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
        nvrtc::compile_ptx_with_opts(format!("{}{SOURCE}", crate::CUDA_HALF_PRELUDE), options).map(|ptx| ptx.to_src())
    });
    compiled.as_deref().map_err(|e| e.clone()).w()
}

/// The kernel's name suffix of a dtype.
fn dtype_name(dtype: DType) -> candle_core::Result<&'static str> {
    Ok(match dtype {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        other => candle_core::bail!("fused AdamW kernel: unsupported dtype {other:?}"),
    })
}

/// Evaluates `$body` with `$s` bound to the `CudaSlice` of an f32, bf16 or f16
/// storage slice; any other dtype is a candle error.
macro_rules! with_float_slice {
    ($slice:expr, $s:ident => $body:expr) => {
        match $slice {
            CudaStorageSlice::F32($s) => $body,
            CudaStorageSlice::BF16($s) => $body,
            CudaStorageSlice::F16($s) => $body,
            _ => candle_core::bail!("fused AdamW kernel: expected an f32, bf16 or f16 tensor"),
        }
    };
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
                    dtype_name(p.dtype())?,
                    dtype_name(g.dtype())?
                );
                let func = p.device.get_or_load_custom_func(&name, MODULE, ptx()?)?;
                let ctx = p.device.cuda_stream().context().clone();
                let sms = ctx
                    .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
                    .w()?;
                let resident = func
                    .occupancy_max_active_blocks_per_multiprocessor(BLOCK, 0, None)
                    .w()?;
                let work = if vectorized { n / 4 } else { n }.max(1) as u64;
                let blocks = work
                    .div_ceil(BLOCK as u64)
                    .min(sms.max(1) as u64 * resident.max(1) as u64);
                let cfg = LaunchConfig {
                    grid_dim: (blocks as u32, 1, 1),
                    block_dim: (BLOCK, 1, 1),
                    shared_mem_bytes: 0,
                };
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

/// Runs `f` on the CUDA storage of `t` under the storage's write lock.
fn with_cuda_mut<F>(t: &Tensor, f: F) -> candle_core::Result<()>
where
    F: FnOnce(&mut CudaStorage, &Layout) -> candle_core::Result<()>,
{
    t.inplace_op1(&CudaMut(Cell::new(Some(f))))
}

/// Like [`with_cuda_mut`], with read access to a second tensor `src`.
fn with_cuda_mut_src<F>(t: &Tensor, src: &Tensor, f: F) -> candle_core::Result<()>
where
    F: FnOnce(&mut CudaStorage, &Layout, &CudaStorage, &Layout) -> candle_core::Result<()>,
{
    t.inplace_op2(src, &CudaMut(Cell::new(Some(f))))
}

/// An in-place op that runs a closure once on the CUDA storage.
struct CudaMut<F>(Cell<Option<F>>);

impl<F> CudaMut<F> {
    fn take(&self) -> candle_core::Result<F> {
        self.0
            .take()
            .ok_or_else(|| candle_core::Error::Msg("in-place closure ran twice".into()))
    }
}

impl<F> InplaceOp1 for CudaMut<F>
where
    F: FnOnce(&mut CudaStorage, &Layout) -> candle_core::Result<()>,
{
    fn name(&self) -> &'static str {
        "oomfix-cuda-mut"
    }
    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
        candle_core::bail!("oomfix-cuda-mut runs on CUDA tensors only")
    }
    fn cuda_fwd(&self, s: &mut CudaStorage, l: &Layout) -> candle_core::Result<()> {
        self.take()?(s, l)
    }
}

impl<F> InplaceOp2 for CudaMut<F>
where
    F: FnOnce(&mut CudaStorage, &Layout, &CudaStorage, &Layout) -> candle_core::Result<()>,
{
    fn name(&self) -> &'static str {
        "oomfix-cuda-mut-src"
    }
    fn cpu_fwd(
        &self,
        _: &mut CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<()> {
        candle_core::bail!("oomfix-cuda-mut-src runs on CUDA tensors only")
    }
    fn cuda_fwd(
        &self,
        s1: &mut CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
    ) -> candle_core::Result<()> {
        self.take()?(s1, l1, s2, l2)
    }
}
