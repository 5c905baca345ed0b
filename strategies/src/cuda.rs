//! Plumbing shared by this crate's CUDA kernels: NVRTC compilation after the
//! 16-bit prelude ([`crate::CUDA_HALF_PRELUDE`]) (cached once per process with
//! [`ptx`]), in-place closures on a tensor's CUDA storage, a grid sized to what
//! the device keeps resident, and the launch shape of a kernel that gives each
//! row one thread block.

use std::cell::Cell;
use std::sync::OnceLock;

use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute;
use candle_core::cuda_backend::cudarc::driver::{CudaFunction, LaunchConfig};
use candle_core::cuda_backend::cudarc::nvrtc::{self, CompileError, CompileOptions};
use candle_core::cuda_backend::WrapErr;
use candle_core::{
    CpuStorage, CudaDevice, CudaStorage, DType, InplaceOp1, InplaceOp2, Layout, Tensor,
};

/// Compiles `source` after the 16-bit prelude to PTX, or reads the PTX an
/// earlier run compiled from the same source, options and NVRTC
/// ([`crate::kernel_cache`]).
pub(crate) fn compile(source: &str, options: CompileOptions) -> Result<String, CompileError> {
    compile_cached(crate::kernel_cache::directory().as_deref(), source, options)
}

/// [`compile`] with the cache in `dir` (`None`: no cache).
fn compile_cached(
    dir: Option<&std::path::Path>,
    source: &str,
    options: CompileOptions,
) -> Result<String, CompileError> {
    let source = format!("{}{source}", crate::CUDA_HALF_PRELUDE);
    let (mut major, mut minor) = (0, 0);
    // SAFETY: NVRTC writes two ints we own.
    unsafe { nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    let nvrtc = format!("NVRTC {major}.{minor}");
    let opts = format!("{options:?}");
    crate::kernel_cache::cached(
        dir,
        &[nvrtc.as_bytes(), opts.as_bytes(), source.as_bytes()],
        |ptx| ptx.contains(".version") && ptx.contains(".target") && ptx.contains(".entry"),
        || nvrtc::compile_ptx_with_opts(source.clone(), options).map(|ptx| ptx.to_src()),
    )
}

/// A kernel source's PTX, compiled on first use and kept in a `static`.
pub(crate) type Ptx = OnceLock<Result<String, CompileError>>;

/// The PTX of `source` (named `name` in compiler messages), compiled with the
/// default options after the 16-bit prelude the first time `cell` is asked.
pub(crate) fn ptx(
    cell: &'static Ptx,
    source: &str,
    name: &str,
) -> candle_core::Result<&'static str> {
    let compiled = cell.get_or_init(|| {
        let options = CompileOptions {
            name: Some(name.into()),
            ..Default::default()
        };
        compile(source, options)
    });
    compiled.as_deref().map_err(|e| e.clone()).w()
}

/// One block per row of `cols` elements, threads growing with the row (a
/// multiple of 32, at most 1024); `what` names the op in the error for more
/// rows than one launch takes.
pub(crate) fn row_blocks(
    rows: usize,
    cols: usize,
    what: &str,
) -> candle_core::Result<LaunchConfig> {
    let rows = u32::try_from(rows)
        .map_err(|_| candle_core::Error::Msg(format!("{what}: too many rows for one launch")))?;
    Ok(LaunchConfig {
        grid_dim: (rows, 1, 1),
        block_dim: ((cols.div_ceil(32) * 32).clamp(32, 1024) as u32, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// The kernel name suffix of a float dtype (`f32`, `bf16`, `f16`).
pub(crate) fn dtype_name(dtype: DType, what: &str) -> candle_core::Result<&'static str> {
    Ok(match dtype {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        other => candle_core::bail!("{what}: unsupported dtype {other:?}"),
    })
}

/// Evaluates `$body` with `$s` bound to the `CudaSlice` of an f32, bf16 or f16
/// storage slice; any other dtype is a candle error.
macro_rules! with_float_slice {
    ($slice:expr, $s:ident => $body:expr) => {
        match $slice {
            candle_core::cuda_backend::CudaStorageSlice::F32($s) => $body,
            candle_core::cuda_backend::CudaStorageSlice::BF16($s) => $body,
            candle_core::cuda_backend::CudaStorageSlice::F16($s) => $body,
            _ => candle_core::bail!("expected an f32, bf16 or f16 tensor on CUDA"),
        }
    };
}
pub(crate) use with_float_slice;

/// A one-dimensional grid of `block`-thread blocks for a grid-stride loop over
/// `work` items: enough blocks to cover it, at most as many as the device keeps
/// resident at once.
pub(crate) fn grid_stride_config(
    device: &CudaDevice,
    func: &CudaFunction,
    block: u32,
    work: usize,
) -> candle_core::Result<LaunchConfig> {
    let sms = device
        .cuda_stream()
        .context()
        .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .w()?;
    let resident = func
        .occupancy_max_active_blocks_per_multiprocessor(block, 0, None)
        .w()?;
    let blocks = (work.max(1) as u64)
        .div_ceil(block as u64)
        .min(sms.max(1) as u64 * resident.max(1) as u64);
    Ok(LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// Runs `f` on the CUDA storage of `t` under the storage's write lock.
pub(crate) fn with_cuda_mut<F>(t: &Tensor, f: F) -> candle_core::Result<()>
where
    F: FnOnce(&mut CudaStorage, &Layout) -> candle_core::Result<()>,
{
    t.inplace_op1(&CudaMut(Cell::new(Some(f))))
}

/// Like [`with_cuda_mut`], with read access to a second tensor `src`.
pub(crate) fn with_cuda_mut_src<F>(t: &Tensor, src: &Tensor, f: F) -> candle_core::Result<()>
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

#[cfg(test)]
mod tests {
    use super::*;

    /// NVRTC's PTX of a kernel is written to the cache once and read back by
    /// the next compile of the same source and options (NVRTC only: no
    /// device needed).
    #[test]
    fn a_compiled_kernel_is_read_back_from_the_cache() {
        let tmp = tempfile::tempdir().unwrap();
        let source = "extern \"C\" __global__ void twice(float* x) { x[threadIdx.x] *= 2.0f; }";
        let options = || CompileOptions {
            arch: Some("compute_80"),
            ..Default::default()
        };
        let start = std::time::Instant::now();
        let made = compile_cached(Some(tmp.path()), source, options()).unwrap();
        let compiled = start.elapsed();
        let files: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().collect();
        assert_eq!(files.len(), 1);
        let start = std::time::Instant::now();
        let read = compile_cached(Some(tmp.path()), source, options()).unwrap();
        eprintln!(
            "compiled in {compiled:?}, read back in {:?}",
            start.elapsed()
        );
        assert_eq!(read, made);
        assert!(made.contains(".entry twice"), "{made}");
        // Other options are another kernel.
        let other = CompileOptions {
            arch: Some("compute_90"),
            ..Default::default()
        };
        assert_ne!(
            compile_cached(Some(tmp.path()), source, other).unwrap(),
            made
        );
        assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 2);
    }
}
