//! The CUDA kernels of [`GradAccumulator`](super::GradAccumulator): in-place
//! `acc += g`, `acc = g` and `acc *= s` over one tensor per launch (`accumulate.cu`,
//! compiled once per process with NVRTC and loaded through candle's CUDA
//! device, which keeps one module per device).

use std::ops::Deref;

use candle_core::cuda_backend::cudarc::driver::{CudaFunction, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, Tensor};

use crate::cuda::{
    dtype_name, grid_stride_config, with_cuda_mut, with_cuda_mut_src, with_float_slice, Ptx,
};
use crate::float::contiguous_range;

/// The kernel source (compiled after [`crate::CUDA_HALF_PRELUDE`]).
const SOURCE: &str = include_str!("accumulate.cu");
/// Name of the module in candle's per-device module cache.
const MODULE: &str = "oomfix_accumulate";
/// Threads per block.
const BLOCK: u32 = 256;
/// What the error messages call these kernels.
const WHAT: &str = "gradient accumulation kernel";

/// The PTX of [`SOURCE`], compiled on first use.
fn ptx() -> candle_core::Result<&'static str> {
    static PTX: Ptx = Ptx::new();
    crate::cuda::ptx(&PTX, SOURCE, "oomfix_accumulate.cu")
}

/// The kernel `name` on `dev` and its grid-stride launch over `n`
/// elements; `None` for no element.
fn loaded(
    dev: &CudaDevice,
    name: &str,
    n: usize,
) -> candle_core::Result<Option<(impl Deref<Target = CudaFunction>, LaunchConfig)>> {
    if n == 0 {
        return Ok(None);
    }
    let func = dev.get_or_load_custom_func(name, MODULE, ptx()?)?;
    let cfg = grid_stride_config(dev, &func, BLOCK, n)?;
    Ok(Some((func, cfg)))
}

/// `acc += g` in place; both contiguous CUDA tensors of equal element count.
pub(super) fn add(acc: &Tensor, g: &Tensor) -> candle_core::Result<()> {
    elementwise("add", acc, g)
}

/// `acc = g` in place (converted to `acc`'s dtype); both contiguous CUDA
/// tensors of equal element count.
pub(super) fn assign(acc: &Tensor, g: &Tensor) -> candle_core::Result<()> {
    elementwise("assign", acc, g)
}

/// Launches `KERNEL_<acc dtype>_<g dtype>(acc, g, n)`.
fn elementwise(kernel: &str, acc: &Tensor, g: &Tensor) -> candle_core::Result<()> {
    let name = format!(
        "{kernel}_{}_{}",
        dtype_name(acc.dtype(), WHAT)?,
        dtype_name(g.dtype(), WHAT)?
    );
    with_cuda_mut_src(acc, g, |a, al, g, gl| {
        let (ar, gr) = (contiguous_range(al)?, contiguous_range(gl)?);
        if ar.len() != gr.len() {
            candle_core::bail!("{WHAT}: operands differ in length");
        }
        let Some((func, cfg)) = loaded(&a.device, &name, ar.len())? else {
            return Ok(());
        };
        let n = ar.len() as u64;
        let stream = a.device.cuda_stream();
        with_float_slice!(&mut a.slice, as_ => with_float_slice!(&g.slice, gs => {
            let mut av = as_.slice_mut(ar.clone());
            let gv = gs.slice(gr.clone());
            let mut launch = stream.launch_builder(&func);
            launch.arg(&mut av).arg(&gv).arg(&n);
            // SAFETY: the arguments match the kernel's signature (acc, g, n);
            // both views hold n elements of the dtypes the name was built from.
            unsafe { launch.launch(cfg) }.w()?;
            Ok(())
        }))
    })
}

/// `acc *= s` in place; `acc` a contiguous CUDA tensor.
pub(super) fn scale(acc: &Tensor, s: f32) -> candle_core::Result<()> {
    let name = format!("scale_{}", dtype_name(acc.dtype(), WHAT)?);
    with_cuda_mut(acc, |a, al| {
        let ar = contiguous_range(al)?;
        let Some((func, cfg)) = loaded(&a.device, &name, ar.len())? else {
            return Ok(());
        };
        let n = ar.len() as u64;
        let stream = a.device.cuda_stream();
        with_float_slice!(&mut a.slice, as_ => {
            let mut av = as_.slice_mut(ar.clone());
            let mut launch = stream.launch_builder(&func);
            launch.arg(&mut av).arg(&s).arg(&n);
            // SAFETY: the arguments match the kernel's signature (acc, s, n);
            // the view holds n elements of the dtype the name was built from.
            unsafe { launch.launch(cfg) }.w()?;
            Ok(())
        })
    })
}
