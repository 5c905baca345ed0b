//! The CUDA kernels of NF4 dequantization (`nf4.cu`): one grid-stride launch
//! writes a frozen weight in the compute dtype from its 4-bit codes and
//! absmax values (fp32, or 8-bit codes with their scales and offset),
//! compiled once per process with NVRTC and loaded through candle's CUDA
//! device, which keeps one module per device.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{CudaStorage, DType, Layout, Result};

use super::nf4;
use crate::cuda::{dtype_name, grid_stride_config};

/// The kernel source (compiled after [`crate::CUDA_HALF_PRELUDE`] and the tables).
const SOURCE: &str = include_str!("nf4.cu");
/// Name of the module in candle's per-device module cache.
const MODULE: &str = "oomfix_nf4";
/// What the error messages call these kernels.
const WHAT: &str = "NF4 dequantize kernel";

/// The source with the CPU's tables defined before it: each f32 written
/// in the shortest form that reads back as the same value.
fn source() -> &'static str {
    static SRC: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    SRC.get_or_init(|| {
        let list = |values: &[f32]| {
            values
                .iter()
                .map(|v| format!("{v:?}f"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        format!(
            "#define NF4_TABLES\n__device__ __constant__ float NF4_LEVELS[16] = {{{}}};\n\
             __device__ __constant__ float DYNAMIC_MAP[256] = {{{}}};\n{SOURCE}",
            list(&nf4::CODEBOOK),
            list(nf4::dynamic_map())
        )
    })
}

/// The PTX, compiled on first use.
fn ptx() -> Result<&'static str> {
    static PTX: crate::cuda::Ptx = crate::cuda::Ptx::new();
    crate::cuda::ptx(&PTX, source(), "oomfix_nf4.cu")
}

/// The absmax values of a weight on the device.
pub(super) enum DeviceAbsmax<'a> {
    /// fp32, one per block.
    Plain(&'a CudaStorage, &'a Layout),
    /// 8-bit codes, one fp32 scale per 256 of them, and the offset.
    Double {
        codes: (&'a CudaStorage, &'a Layout),
        scales: (&'a CudaStorage, &'a Layout),
        offset: f32,
    },
}

/// A storage's contiguous elements as a view of `T`.
fn view<'a, T: CudaDType>(
    s: &'a CudaStorage,
    l: &Layout,
) -> Result<candle_core::cuda_backend::cudarc::driver::CudaView<'a, T>> {
    let (a, b) = l
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg(format!("{WHAT}: a strided input")))?;
    Ok(s.as_cuda_slice::<T>()?.slice(a..b))
}

/// `n` values in `dtype` from their packed `codes` and `absmax`.
pub(super) fn dequantize(
    codes: (&CudaStorage, &Layout),
    absmax: DeviceAbsmax<'_>,
    n: usize,
    dtype: DType,
) -> Result<CudaStorage> {
    match dtype {
        DType::F32 => typed::<f32>(codes, absmax, n),
        DType::BF16 => typed::<half::bf16>(codes, absmax, n),
        DType::F16 => typed::<half::f16>(codes, absmax, n),
        other => candle_core::bail!("{WHAT}: unsupported dtype {other:?}"),
    }
}

fn typed<T: CudaDType + DeviceRepr + candle_core::WithDType>(
    codes: (&CudaStorage, &Layout),
    absmax: DeviceAbsmax<'_>,
    n: usize,
) -> Result<CudaStorage> {
    let dev = codes.0.device().clone();
    let name = dtype_name(T::DTYPE, WHAT)?;
    // SAFETY: every element is written by the launch below before it is read.
    let mut out = unsafe { dev.alloc::<T>(n.max(1)) }?;
    if n == 0 {
        return Ok(CudaStorage::wrap_cuda_slice(out, dev));
    }
    let codes = view::<u8>(codes.0, codes.1)?;
    let n64 = n as u64;
    match absmax {
        DeviceAbsmax::Plain(s, l) => {
            let absmax = view::<f32>(s, l)?;
            let func = dev.get_or_load_custom_func(&format!("nf4_{name}"), MODULE, ptx()?)?;
            let cfg = grid_stride_config(&dev, &func, 256, n.div_ceil(2))?;
            let mut launch = func.builder();
            launch.arg(&codes).arg(&absmax).arg(&n64).arg(&mut out);
            // SAFETY: the arguments match `nf4_*(codes, absmax, n, out)`:
            // codes holds ⌈n/2⌉ bytes, absmax ⌈n/64⌉ values, out n.
            unsafe { launch.launch(cfg) }.w()?;
        }
        DeviceAbsmax::Double {
            codes: q,
            scales,
            offset,
        } => {
            let (q, scales) = (view::<u8>(q.0, q.1)?, view::<f32>(scales.0, scales.1)?);
            let func = dev.get_or_load_custom_func(&format!("nf4dq_{name}"), MODULE, ptx()?)?;
            let cfg = grid_stride_config(&dev, &func, 256, n.div_ceil(2))?;
            let mut launch = func.builder();
            launch
                .arg(&codes)
                .arg(&q)
                .arg(&scales)
                .arg(&offset)
                .arg(&n64)
                .arg(&mut out);
            // SAFETY: the arguments match `nf4dq_*(codes, qabsmax, scales,
            // offset, n, out)`: codes ⌈n/2⌉ bytes, qabsmax ⌈n/64⌉ codes,
            // scales one per 256 of them, out n.
            unsafe { launch.launch(cfg) }.w()?;
        }
    }
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}
