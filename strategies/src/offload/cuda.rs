//! Copies between a CUDA tensor and a host tensor of the same dtype, into the
//! destination's existing storage (no allocation on either side), on the
//! device's stream.

use candle_core::cuda_backend::{CudaStorageSlice, WrapErr};
use candle_core::{CpuStorage, Storage, Tensor};

use crate::adamw::{contiguous_range, with_cpu_mut};
use crate::cuda::with_cuda_mut;

/// Copies the contiguous CUDA tensor `src` into the contiguous host tensor
/// `dst`. Returns once the copy is complete (a copy into pageable memory is
/// synchronous), after the work queued before it on the stream.
pub(super) fn download(src: &Tensor, dst: &Tensor) -> candle_core::Result<()> {
    let (storage, layout) = src.storage_and_layout();
    let Storage::Cuda(cuda) = &*storage else {
        candle_core::bail!("offload download: the source is not on a CUDA device")
    };
    let range = contiguous_range(layout)?;
    let stream = cuda.device.cuda_stream();
    with_cpu_mut(dst, |host, hl| {
        let hr = contiguous_range(hl)?;
        match (&cuda.slice, host) {
            (CudaStorageSlice::F32(d), CpuStorage::F32(h)) => {
                stream.memcpy_dtoh(&d.slice(range), &mut h[hr]).w()
            }
            (CudaStorageSlice::BF16(d), CpuStorage::BF16(h)) => {
                stream.memcpy_dtoh(&d.slice(range), &mut h[hr]).w()
            }
            (CudaStorageSlice::F16(d), CpuStorage::F16(h)) => {
                stream.memcpy_dtoh(&d.slice(range), &mut h[hr]).w()
            }
            _ => candle_core::bail!("offload download: dtypes differ or are not f32, bf16, f16"),
        }
    })
}

/// Copies the contiguous host tensor `src` into the storage of the contiguous
/// CUDA tensor `dst`. The host data is staged by the driver before this
/// returns, so `src` may be changed right after.
pub(super) fn upload(src: &Tensor, dst: &Tensor) -> candle_core::Result<()> {
    let (storage, layout) = src.storage_and_layout();
    let Storage::Cpu(host) = &*storage else {
        candle_core::bail!("offload upload: the source is not a host tensor")
    };
    let hr = contiguous_range(layout)?;
    with_cuda_mut(dst, |cuda, dl| {
        let dr = contiguous_range(dl)?;
        let stream = cuda.device.cuda_stream();
        match (&mut cuda.slice, host) {
            (CudaStorageSlice::F32(d), CpuStorage::F32(h)) => {
                stream.memcpy_htod(&h[hr], &mut d.slice_mut(dr)).w()
            }
            (CudaStorageSlice::BF16(d), CpuStorage::BF16(h)) => {
                stream.memcpy_htod(&h[hr], &mut d.slice_mut(dr)).w()
            }
            (CudaStorageSlice::F16(d), CpuStorage::F16(h)) => {
                stream.memcpy_htod(&h[hr], &mut d.slice_mut(dr)).w()
            }
            _ => candle_core::bail!("offload upload: dtypes differ or are not f32, bf16, f16"),
        }
    })
}
