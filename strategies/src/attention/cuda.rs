//! The CUDA kernels of [`flash_attention`](super::flash_attention).
//!
//! The kernel source (`flash.cu`) is compiled once per process with NVRTC for
//! the first device's compute capability and loaded through candle's CUDA
//! device, which keeps one module per device.
//!
//! On compute capability 8.0 and newer the tensor-core kernels run
//! (`mma.sync`, f32 accumulation):
//! * bf16 and f16 multiply the 16-bit values (probabilities and their
//!   gradients are rounded to the input type before their products, as
//!   FlashAttention-2 does);
//! * f32 multiplies with three tf32 products per pair of operands (3xTF32:
//!   each operand split into its tf32 rounding and the tf32 rounding of the
//!   remainder), which keeps f32 accuracy; PyTorch's memory-efficient f32
//!   kernel does the same.
//!
//! On Hopper (compute capability 9.0, where the source is compiled for
//! `compute_90a` when NVRTC is 12.0 or newer) 16-bit attention with head
//! dimension up to 64 runs warpgroup kernels instead (`wgmma.mma_async`, tiles
//! in shared memory with the 128-byte swizzle): the forward on two
//! warpgroups per 128-query tile (S = Q·Kᵀ from shared memory, P from
//! registers); the backward on two warpgroups per 128-key tile with the key
//! and value fragments in registers, adding each query tile's dQ while the
//! next tile's products run.
//! `OOMFIX_FLASH_WGMMA=0` runs the `mma.sync` kernels.
//! `OOMFIX_FLASH_SOURCE=path` compiles that file instead of the built-in
//! `flash.cu` (kernel development: variants side by side in one run).
//!
//! Their backward adds dQ up over key tiles with atomics into an f32
//! `[b, heads, s_q, d]` buffer (the order of the additions varies from run to
//! run, so dQ is not bit-reproducible). With grouped-query heads and too few
//! key tiles x key/value heads to fill the device, the query heads of a group
//! are split over several blocks ([`kv_splits`]), which add dK and dV into f32
//! buffers the same way. Older devices, or `OOMFIX_FLASH_SIMT=1`,
//! run the SIMT kernels (f32 arithmetic on CUDA cores, deterministic).
//!
//! Head dimensions up to 128 are supported (kernels for 64 and 128, the tail
//! zero-filled).

use std::sync::OnceLock;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaSlice, CudaView, DeviceRepr, LaunchConfig, PushKernelArg, ValidAsZeroBits,
};
use candle_core::cuda_backend::cudarc::nvrtc::{CompileError, CompileOptions};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::op::BackpropOp;
use candle_core::{bail, CudaDevice, CudaStorage, DType, Layout, Shape, Storage, Tensor};
use half::{bf16, f16};

use super::{Dims, Params};

/// The kernel source (compiled after [`crate::CUDA_HALF_PRELUDE`]).
const SOURCE: &str = include_str!("flash.cu");
/// Name of the module in candle's per-device module cache.
const MODULE: &str = "oomfix_flash_attention";
/// Largest supported head dimension.
pub(super) const MAX_HEAD_DIM: usize = super::CUDA_MAX_HEAD_DIM;
/// Rows of a block tile (queries or keys), as in `flash.cu`.
const TILE: usize = 64;

/// The kernels' `struct Params`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct KernelParams {
    b: i32,
    heads: i32,
    kv_heads: i32,
    s_q: i32,
    s_k: i32,
    d: i32,
    scale: f32,
    causal: i32,
    has_keep: i32,
    kv_splits: i32,
    has_start: i32,
}

// SAFETY: `KernelParams` is `#[repr(C)]` with the field types and order of the
// kernel's `struct Params`.
unsafe impl DeviceRepr for KernelParams {}

/// The PTX of [`SOURCE`], compiled on first use for `arch`; for kernel
/// development, of the file `OOMFIX_FLASH_SOURCE` names instead (same entry
/// points and parameters), so that variants of the kernels run without a
/// rebuild.
fn ptx(arch: &'static str) -> candle_core::Result<&'static str> {
    static PTX: OnceLock<Result<String, String>> = OnceLock::new();
    let compiled = PTX.get_or_init(|| {
        let source = match std::env::var_os("OOMFIX_FLASH_SOURCE") {
            Some(path) => std::fs::read_to_string(&path)
                .map_err(|e| format!("OOMFIX_FLASH_SOURCE={}: {e}", path.to_string_lossy()))?,
            None => SOURCE.to_owned(),
        };
        let options = CompileOptions {
            arch: Some(arch),
            name: Some("oomfix_flash.cu".into()),
            ..Default::default()
        };
        crate::cuda::compile(&source, options).map_err(|e| match e {
            CompileError::CompileError { log, .. } => format!("NVRTC:\n{}", log.to_string_lossy()),
            other => format!("{other:?}"),
        })
    });
    compiled
        .as_deref()
        .map_err(|e| candle_core::Error::Msg(format!("flash_attention kernels: {e}")))
}

/// What the launches need to know about the device.
struct DeviceInfo {
    /// `compute_XY` for NVRTC.
    arch: &'static str,
    /// Whether the tensor-core kernels run (compute capability 8.0 or newer).
    mma: bool,
    /// Whether the warpgroup kernels run (compute capability 9.0).
    wgmma: bool,
    /// Largest dynamic shared memory a block may opt in to.
    max_smem: usize,
    /// Streaming multiprocessors.
    sms: usize,
}

fn device_info(dev: &CudaDevice) -> candle_core::Result<&'static DeviceInfo> {
    static INFO: OnceLock<DeviceInfo> = OnceLock::new();
    if let Some(info) = INFO.get() {
        return Ok(info);
    }
    use CUdevice_attribute as A;
    let ctx = dev.cuda_stream().context().clone();
    let attribute = |a: A| ctx.attribute(a).w();
    let major = attribute(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
    let minor = attribute(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
    let max_smem = attribute(A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?;
    let sms = attribute(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
    let simt_forced = std::env::var("OOMFIX_FLASH_SIMT").is_ok_and(|v| v == "1");
    let wgmma_off = std::env::var("OOMFIX_FLASH_WGMMA").is_ok_and(|v| v == "0");
    // wgmma needs the architecture-specific target of compute capability 9.0.
    let hopper = (major, minor) == (9, 0) && nvrtc_knows_sm90a();
    let suffix = if hopper { "a" } else { "" };
    let info = DeviceInfo {
        arch: Box::leak(format!("compute_{major}{minor}{suffix}").into_boxed_str()),
        mma: major >= 8 && !simt_forced,
        wgmma: hopper && !simt_forced && !wgmma_off,
        max_smem: max_smem.max(0) as usize,
        sms: sms.max(1) as usize,
    };
    Ok(INFO.get_or_init(|| info))
}

/// Whether the run-time compiler knows the `compute_90a` target (NVRTC 12.0
/// and newer).
fn nvrtc_knows_sm90a() -> bool {
    use candle_core::cuda_backend::cudarc::nvrtc::sys;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: nvrtcVersion writes two ints through the pointers it is given.
    let status = unsafe { sys::nvrtcVersion(&mut major, &mut minor) };
    status == sys::nvrtcResult::NVRTC_SUCCESS && major >= 12
}

/// The kernels' name suffix of a dtype.
fn dtype_name(dtype: DType) -> candle_core::Result<&'static str> {
    Ok(match dtype {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        other => bail!("flash_attention: unsupported dtype {other:?}"),
    })
}

/// Which kernel family and head-dimension variant a call uses.
#[derive(Debug, Clone, Copy)]
struct Variant {
    mma: bool,
    /// The warpgroup forward and backward (16-bit, d <= 64, 16-byte loads).
    wgmma: bool,
    /// Head dimension the kernel is compiled for (64 or 128).
    d: usize,
    dtype: DType,
}

impl Variant {
    fn of(dims: &Dims, dtype: DType, info: &DeviceInfo) -> candle_core::Result<Self> {
        if dims.d > MAX_HEAD_DIM {
            bail!(
                "flash_attention on CUDA supports head dimensions up to {MAX_HEAD_DIM}, got {}",
                dims.d
            );
        }
        let d = if dims.d <= 64 { 64 } else { 128 };
        Ok(Variant {
            mma: info.mma,
            wgmma: info.wgmma && d == 64 && dtype != DType::F32,
            d,
            dtype,
        })
    }

    fn name(&self, kernel: &str) -> candle_core::Result<String> {
        let family = match (self.mma, self.wgmma) {
            (_, true) => "wgmma",
            (true, false) => "mma",
            (false, false) => "simt",
        };
        Ok(format!(
            "flash_{kernel}_{family}_{}_{}",
            dtype_name(self.dtype)?,
            self.d
        ))
    }

    /// Threads per block.
    fn threads(&self) -> u32 {
        if self.wgmma {
            256
        } else if self.mma {
            128
        } else {
            256
        }
    }

    /// Query rows of a forward block: the 16-bit tensor-core kernels with
    /// d = 64 give each warp two groups of 16 rows (`mma.sync`) or each of
    /// two warpgroups 64 rows (`wgmma`).
    fn fwd_rows(&self) -> usize {
        if self.mma && self.d == 64 && self.dtype != DType::F32 {
            2 * TILE
        } else {
            TILE
        }
    }

    /// Query rows of the tiles the backward kernels stream (32 for the
    /// `mma.sync` kernel).
    fn inner(&self) -> usize {
        if self.mma && !self.wgmma {
            32
        } else {
            TILE
        }
    }

    /// Keys per block of the backward (two warpgroups of 64 for the
    /// warpgroup kernel).
    fn bwd_keys(&self) -> usize {
        if self.wgmma {
            2 * TILE
        } else {
            TILE
        }
    }

    /// Dynamic shared memory of `kernel` (`fwd`, `bwd`; SIMT: `dkdv`, `dq`), as `flash.cu` lays it out.
    fn smem(&self, kernel: &str) -> usize {
        let (d, t, inner) = (self.d, TILE, self.inner());
        if self.wgmma && kernel == "fwd" {
            // Q, K (two), V (three), unpadded; 1024 bytes to align the tiles.
            (self.fwd_rows() + 5 * TILE) * d * 2 + 1024
        } else if self.wgmma {
            // K, V, dS^T; Q, dO (two each), unpadded; lse and delta rows (two
            // each); 1024 bytes to align the tiles.
            3 * self.bwd_keys() * d * 2 + 2 * 2 * inner * d * 2 + 2 * 2 * inner * 4 + 1024
        } else if self.mma {
            // Tiles hold the input type; the ones streamed through the loop
            // are double-buffered.
            let size = self.dtype.size_in_bytes();
            let row = (d + 8) * size;
            match kernel {
                "fwd" => self.fwd_rows() * row + 2 * 2 * t * row,
                // K, V; Q, dO (two each); dS transposed; lse and delta rows (two each).
                _ => 2 * t * row + 2 * 2 * inner * row + t * (inner + 8) * size + 2 * 2 * inner * 4,
            }
        } else {
            let (row, prow) = ((d + 1) * 4, (t + 1) * 4);
            match kernel {
                "fwd" => 3 * t * row + t * prow,
                "dkdv" => 4 * t * row + 2 * t * prow + 2 * t * 4,
                _ => 4 * t * row + t * prow,
            }
        }
    }

    /// The loaded kernel and its launch configuration over `grid`: (tiles,
    /// heads, batch), see [`grid`].
    fn launch(
        &self,
        dev: &CudaDevice,
        info: &DeviceInfo,
        kernel: &str,
        grid: (u32, u32, u32),
    ) -> candle_core::Result<(impl std::ops::Deref<Target = CudaFunction>, LaunchConfig)> {
        let func = dev.get_or_load_custom_func(&self.name(kernel)?, MODULE, ptx(info.arch)?)?;
        let smem = self.smem(kernel);
        if smem > info.max_smem {
            bail!(
                "flash_attention: the {kernel} kernel needs {smem} bytes of shared memory per block, \
                 the device allows {}",
                info.max_smem
            );
        }
        func.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem as i32,
        )
        .w()?;
        let cfg = LaunchConfig {
            grid_dim: grid,
            block_dim: (self.threads(), 1, 1),
            shared_mem_bytes: smem as u32,
        };
        Ok((func, cfg))
    }
}

/// A copy on the device of a contiguous mask of `T` (the key padding flags
/// `[b, s_k]` u8, the key starts `[b, s_q]` u32) and `true`, or a
/// one-element placeholder and `false`; `what` names it in errors.
fn mask_slice<T: CudaDType + DeviceRepr + ValidAsZeroBits>(
    dev: &CudaDevice,
    mask: Option<&Tensor>,
    what: &str,
) -> candle_core::Result<(CudaSlice<T>, bool)> {
    let Some(mask) = mask else {
        return Ok((dev.alloc_zeros::<T>(1)?, false));
    };
    let (storage, layout) = mask.storage_and_layout();
    let Storage::Cuda(s) = &*storage else {
        bail!("flash_attention: {what} are not on the CUDA device");
    };
    let src = s.as_cuda_slice::<T>()?;
    let n = layout.shape().elem_count();
    let mut dst = dev.alloc_zeros::<T>(n.max(1))?;
    let start = layout.start_offset();
    if n > 0 {
        dev.memcpy_dtod(&src.slice(start..start + n), &mut dst.slice_mut(0..n))?;
    }
    Ok((dst, true))
}

/// The device's copies of `masks` (or placeholders) and the kernels'
/// parameters.
fn launch_masks(
    dev: &CudaDevice,
    dims: &Dims,
    params: &Params,
    (keep, start): Masks,
) -> candle_core::Result<(CudaSlice<u8>, CudaSlice<u32>, KernelParams)> {
    let (keep, has_keep) = mask_slice::<u8>(dev, keep, "the key padding flags")?;
    let (start, has_start) = mask_slice::<u32>(dev, start, "the key starts")?;
    let p = kernel_params(dims, params, (has_keep, has_start))?;
    Ok((keep, start, p))
}

/// The key padding flags (`[b, s_k]` u8) and key starts (`[b, s_q]` u32) on
/// the inputs' device, where given.
pub(super) type Masks<'a> = (Option<&'a Tensor>, Option<&'a Tensor>);

fn kernel_params(
    dims: &Dims,
    params: &Params,
    (has_keep, has_start): (bool, bool),
) -> candle_core::Result<KernelParams> {
    let int = |x: usize, what: &str| {
        i32::try_from(x).map_err(|_| {
            candle_core::Error::Msg(format!("flash_attention: {what} {x} is too large"))
        })
    };
    // Grids are (tiles, heads, batch); the y and z dimensions stop at 65535,
    // and the kernels index batch x head with an int.
    int(dims.b * dims.heads, "batch x heads")?;
    if dims.b > 65535 || dims.heads > 65535 {
        bail!(
            "flash_attention on CUDA supports up to 65535 sequences and 65535 heads, got {} and {}",
            dims.b,
            dims.heads
        );
    }
    Ok(KernelParams {
        b: int(dims.b, "batch")?,
        heads: int(dims.heads, "heads")?,
        kv_heads: int(dims.kv_heads, "kv heads")?,
        s_q: int(dims.s_q, "query length")?,
        s_k: int(dims.s_k, "key length")?,
        d: int(dims.d, "head dimension")?,
        scale: params.scale,
        causal: params.causal as i32,
        has_keep: has_keep as i32,
        kv_splits: 1,
        has_start: has_start as i32,
    })
}

/// Blocks per key tile and key/value head in the tensor-core backward: the
/// smallest divisor of the group size that gives about four waves of blocks
/// (as many per multiprocessor as fit), so that grouped-query models with few
/// key/value heads fill the device. `OOMFIX_FLASH_KV_SPLITS=N` sets it to the
/// largest divisor of the group size not above N (1: never split).
fn kv_splits(dims: &Dims, info: &DeviceInfo, var: &Variant) -> candle_core::Result<usize> {
    let group = dims.heads / dims.kv_heads.max(1);
    if let Ok(v) = std::env::var("OOMFIX_FLASH_KV_SPLITS") {
        let cap = match v.parse::<usize>() {
            Ok(n) if n > 0 => n,
            _ => bail!("OOMFIX_FLASH_KV_SPLITS={v} is not a positive integer"),
        };
        return Ok((1..=cap.min(group))
            .rev()
            .find(|n| group.is_multiple_of(*n))
            .unwrap_or(1));
    }
    let blocks = dims.s_k.div_ceil(var.bwd_keys()) * dims.kv_heads * dims.b;
    // Blocks that fit on a multiprocessor at once (by registers).
    let resident = if var.wgmma { 1 } else { 3 };
    let want = 4 * resident * info.sms;
    Ok((1..=group)
        .find(|n| group.is_multiple_of(*n) && blocks * n >= want)
        .unwrap_or(group))
}

/// A kernel grid: tiles of `rows` over a sequence of `len` positions, then
/// heads, then batch (the blocks of one head run side by side and share its
/// tiles in L2). Sizes were checked by [`kernel_params`].
fn grid(len: usize, rows: usize, heads: usize, b: usize) -> (u32, u32, u32) {
    (len.div_ceil(rows) as u32, heads as u32, b as u32)
}

/// Whether rows of `d` elements start on `width`-element boundaries, and so
/// do the operands (at `offsets` elements into their storage).
fn rows_aligned(width: usize, d: usize, offsets: &[usize]) -> bool {
    d.is_multiple_of(width) && offsets.iter().all(|o| o.is_multiple_of(width))
}

/// Whether the kernels' 16-byte loads are safe: rows of `d` elements start on
/// 8-element boundaries, and so do the operands.
fn vectorizable(d: usize, offsets: &[usize]) -> i32 {
    rows_aligned(8, d, offsets) as i32
}

/// A view of a contiguous storage from its layout's start.
fn view<'a, T: CudaDType>(s: &'a CudaStorage, l: &Layout) -> candle_core::Result<CudaView<'a, T>> {
    if !l.is_contiguous() {
        bail!("flash_attention: operands must be contiguous");
    }
    let start = l.start_offset();
    Ok(s.as_cuda_slice::<T>()?
        .slice(start..start + l.shape().elem_count()))
}

/// The forward pass of `q`, `k` and `v` (storages and layouts): the output
/// and the log-sum-exp of every query row.
pub(super) fn forward(
    dims: &Dims,
    params: &Params,
    masks: Masks,
    qkv: [(&CudaStorage, &Layout); 3],
) -> candle_core::Result<(CudaStorage, Shape, CudaSlice<f32>)> {
    match qkv[0].0.dtype() {
        DType::F32 => forward_t::<f32>(dims, params, masks, qkv),
        DType::BF16 => forward_t::<bf16>(dims, params, masks, qkv),
        DType::F16 => forward_t::<f16>(dims, params, masks, qkv),
        other => bail!("flash_attention: unsupported dtype {other:?}"),
    }
}

fn forward_t<T: CudaDType + DeviceRepr>(
    dims: &Dims,
    params: &Params,
    masks: Masks,
    [(q, ql), (k, kl), (v, vl)]: [(&CudaStorage, &Layout); 3],
) -> candle_core::Result<(CudaStorage, Shape, CudaSlice<f32>)> {
    let dev = &q.device;
    let info = device_info(dev)?;
    let var = Variant::of(dims, q.dtype(), info)?;
    let rows = dims.b * dims.heads * dims.s_q;
    let shape = Shape::from((dims.b, dims.heads, dims.s_q, dims.d));
    // SAFETY: the kernel writes every element of both (zeros and -inf for
    // rows that see no key); with no rows there is nothing to write.
    let mut out = unsafe { dev.alloc::<T>(rows * dims.d) }?;
    let mut lse = unsafe { dev.alloc::<f32>(rows) }?;
    if rows > 0 && dims.d > 0 {
        let (keep, start, p) = launch_masks(dev, dims, params, masks)?;
        let vec = vectorizable(
            dims.d,
            &[ql.start_offset(), kl.start_offset(), vl.start_offset()],
        );
        // The warpgroup kernels load their tiles 16 bytes at a time only.
        let var = Variant {
            wgmma: var.wgmma && vec == 1,
            ..var
        };
        let (qv, kv, vv) = (view::<T>(q, ql)?, view::<T>(k, kl)?, view::<T>(v, vl)?);
        let g = grid(dims.s_q, var.fwd_rows(), dims.heads, dims.b);
        let (func, cfg) = var.launch(dev, info, "fwd", g)?;
        let stream = dev.cuda_stream();
        let mut b = stream.launch_builder(&func);
        b.arg(&qv)
            .arg(&kv)
            .arg(&vv)
            .arg(&mut out)
            .arg(&mut lse)
            .arg(&keep)
            .arg(&start)
            .arg(&p);
        if var.mma {
            b.arg(&vec);
        }
        // SAFETY: the arguments match the kernel's signature; every index the
        // kernel forms stays inside the tensors' sizes given in `p`.
        unsafe { b.launch(cfg) }.w()?;
    }
    Ok((CudaStorage::wrap_cuda_slice(out, dev.clone()), shape, lse))
}

/// The storage and layout of a CUDA tensor, or an error.
macro_rules! cuda_storage {
    ($t:expr => $s:ident, $l:ident) => {
        let (guard, $l) = $t.storage_and_layout();
        let Storage::Cuda($s) = &*guard else {
            bail!("flash_attention: a backward operand is not on the CUDA device");
        };
    };
}

/// The backward pass: gradients of q, k and v.
#[allow(clippy::too_many_arguments)]
pub(super) fn backward(
    dims: &Dims,
    params: &Params,
    masks: Masks,
    lse: &CudaSlice<f32>,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    o: &Tensor,
    grad_o: &Tensor,
) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
    match q.dtype() {
        DType::F32 => backward_t::<f32>(dims, params, masks, lse, [q, k, v, o, grad_o]),
        DType::BF16 => backward_t::<bf16>(dims, params, masks, lse, [q, k, v, o, grad_o]),
        DType::F16 => backward_t::<f16>(dims, params, masks, lse, [q, k, v, o, grad_o]),
        other => bail!("flash_attention: unsupported dtype {other:?}"),
    }
}

fn backward_t<T: CudaDType + DeviceRepr + ValidAsZeroBits>(
    dims: &Dims,
    params: &Params,
    masks: Masks,
    lse: &CudaSlice<f32>,
    tensors: [&Tensor; 5],
) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
    let [q, k, v, o, grad_o] = tensors.map(|t| t.contiguous());
    let (q, k, v, o, grad_o) = (q?, k?, v?, o?, grad_o?);
    let dev = match q.device() {
        candle_core::Device::Cuda(d) => d.clone(),
        _ => bail!("flash_attention: CUDA backward on a non-CUDA tensor"),
    };
    let info = device_info(&dev)?;
    let var = Variant::of(dims, q.dtype(), info)?;
    let rows = dims.b * dims.heads * dims.s_q;
    let kv_len = dims.b * dims.kv_heads * dims.s_k * dims.d;
    let (dq, dk, dv) = if rows == 0 || dims.d == 0 {
        (
            dev.alloc_zeros::<T>(rows * dims.d)?,
            dev.alloc_zeros::<T>(kv_len)?,
            dev.alloc_zeros::<T>(kv_len)?,
        )
    } else {
        let (keep, start, p) = launch_masks(&dev, dims, params, masks)?;
        cuda_storage!(q => qs, ql);
        cuda_storage!(k => ks, kl);
        cuda_storage!(v => vs, vl);
        cuda_storage!(o => os, ol);
        cuda_storage!(grad_o => gs, gl);
        let vec = vectorizable(
            dims.d,
            &[
                ql.start_offset(),
                kl.start_offset(),
                vl.start_offset(),
                gl.start_offset(),
            ],
        );
        let var = Variant {
            wgmma: var.wgmma && vec == 1,
            ..var
        };
        let (qv, kv, vv) = (view::<T>(qs, ql)?, view::<T>(ks, kl)?, view::<T>(vs, vl)?);
        let (ov, gv) = (view::<T>(os, ol)?, view::<T>(gs, gl)?);
        // D_i = dO_i . O_i
        // SAFETY: the delta kernel writes all `rows` values.
        let mut delta = unsafe { dev.alloc::<f32>(rows) }?;
        {
            let func = dev.get_or_load_custom_func(
                &format!("flash_delta_{}", dtype_name(q.dtype())?),
                MODULE,
                ptx(info.arch)?,
            )?;
            // 16-byte vectors where the rows allow, as many threads per row
            // as a row has vectors (a power of two, at most a warp).
            let width = 16 / q.dtype().size_in_bytes();
            let dvec = rows_aligned(width, dims.d, &[ol.start_offset(), gl.start_offset()]) as i32;
            let per_row = if dvec == 1 { dims.d / width } else { 32 };
            let lg = per_row.clamp(1, 32).ilog2() as i32;
            let cfg = LaunchConfig {
                grid_dim: (((rows as u64) << lg).div_ceil(256) as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            let (n, d) = (rows as i64, dims.d as i32);
            let mut b = func.builder();
            b.arg(&ov)
                .arg(&gv)
                .arg(&mut delta)
                .arg(&n)
                .arg(&d)
                .arg(&lg)
                .arg(&dvec);
            // SAFETY: o and grad_o hold `rows * d` elements, delta `rows`.
            unsafe { b.launch(cfg) }.w()?;
        }
        // SAFETY: the kernels write every element of dk and dv, and of dq
        // (the SIMT kernel directly, the tensor-core path through `dq_acc`).
        let mut dq = unsafe { dev.alloc::<T>(rows * dims.d) }?;
        let mut dk = unsafe { dev.alloc::<T>(kv_len) }?;
        let mut dv = unsafe { dev.alloc::<T>(kv_len) }?;
        let stream = dev.cuda_stream();
        // Launches `kernel` over `grid` with the arguments every backward
        // kernel starts with, then `rest`.
        macro_rules! launch_backward {
            ($kernel:expr, $grid:expr, $($rest:expr),+) => {{
                let (func, cfg) = var.launch(&dev, info, $kernel, $grid)?;
                let mut b = stream.launch_builder(&func);
                b.arg(&qv)
                    .arg(&kv)
                    .arg(&vv)
                    .arg(&gv)
                    .arg(lse)
                    .arg(&delta)
                    .arg(&keep)
                    .arg(&start);
                $(b.arg($rest);)+
                // SAFETY: the arguments match the kernel's signature; every
                // index it forms stays inside the sizes given in `p`.
                unsafe { b.launch(cfg) }.w()?;
            }};
        }
        if var.mma {
            // One kernel for dK, dV and dQ; dQ summed over the key tiles in
            // f32, dK and dV too when the group's heads are split.
            let splits = kv_splits(dims, info, &var)?;
            let p = KernelParams {
                kv_splits: splits as i32,
                ..p
            };
            let mut dq_acc = dev.alloc_zeros::<f32>(rows * dims.d)?;
            let mut dkv_acc = dev.alloc_zeros::<f32>(if splits > 1 { 2 * kv_len } else { 1 })?;
            if kv_len > 0 {
                let g = grid(dims.s_k, var.bwd_keys(), dims.kv_heads * splits, dims.b);
                launch_backward!(
                    "bwd",
                    g,
                    &mut dk,
                    &mut dv,
                    &mut dq_acc,
                    &mut dkv_acc,
                    &p,
                    &vec
                );
            }
            let func = dev.get_or_load_custom_func(
                &format!("flash_dq_convert_{}", dtype_name(q.dtype())?),
                MODULE,
                ptx(info.arch)?,
            )?;
            // dst = src in T (f32 accumulators to the gradients), four
            // elements per thread.
            let convert = |src: CudaView<f32>, dst: &mut CudaSlice<T>| {
                let n = src.len() as i64;
                let cfg = LaunchConfig {
                    grid_dim: ((n as u64).div_ceil(4 * 256).min(65535 * 8) as u32, 1, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                };
                let mut b = stream.launch_builder(&func);
                b.arg(&src).arg(dst).arg(&n);
                // SAFETY: src and dst hold `n` elements.
                unsafe { b.launch(cfg) }.w()
            };
            convert(dq_acc.slice(..), &mut dq)?;
            if splits > 1 && kv_len > 0 {
                convert(dkv_acc.slice(..kv_len), &mut dk)?;
                convert(dkv_acc.slice(kv_len..), &mut dv)?;
            }
        } else {
            if kv_len > 0 {
                let g = grid(dims.s_k, TILE, dims.kv_heads, dims.b);
                launch_backward!("dkdv", g, &mut dk, &mut dv, &p);
            }
            let q_grid = grid(dims.s_q, TILE, dims.heads, dims.b);
            launch_backward!("dq", q_grid, &mut dq, &p);
        }
        (dq, dk, dv)
    };
    let wrap = |s: CudaSlice<T>, like: &Tensor| {
        Tensor::from_storage(
            Storage::Cuda(CudaStorage::wrap_cuda_slice(s, dev.clone())),
            like.shape().clone(),
            BackpropOp::none(),
            false,
        )
    };
    Ok((wrap(dq, &q), wrap(dk, &k), wrap(dv, &v)))
}
