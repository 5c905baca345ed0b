//! Copies between a CUDA tensor and a host tensor of the same dtype, into the
//! destination's existing storage (no allocation on either side), on the
//! device's stream; and page-locking of the host tensors, so that those copies
//! run at the bus's speed and asynchronously.

use std::ffi::c_void;
use std::sync::Arc;

use candle_core::cuda_backend::cudarc::driver::{sys, CudaContext};
use candle_core::cuda_backend::{CudaStorageSlice, WrapErr};
use candle_core::{CpuStorage, CudaDevice, Storage, Tensor};

use crate::cuda::with_cuda_mut;
use crate::float::{contiguous_range, with_cpu_mut};

/// Queues a copy of the contiguous CUDA tensor `src` into the contiguous host
/// tensor `dst` on the device's stream, after the work queued before it. Into
/// pageable memory the copy is complete on return; into page-locked memory
/// ([`Pinned`]) it is not: synchronize the device before reading `dst`.
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

/// Queues a copy of the contiguous host tensor `src` into the storage of the
/// contiguous CUDA tensor `dst` on the device's stream. From page-locked
/// memory ([`Pinned`]) the copy may still be running on return: synchronize
/// the device before changing `src`.
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

/// Host tensors smaller than this stay pageable: page-locking them gains
/// nothing measurable, and small heap blocks may share pages with each other.
const PIN_MIN_BYTES: usize = 1 << 20;

/// The storage of a host tensor, page-locked (`cuMemHostRegister`) for as long
/// as this guard lives. The tensor's storage must outlive the guard and not
/// be reallocated meanwhile (its elements may change).
#[derive(Debug)]
pub(super) struct Pinned {
    /// The registered address (kept as an integer: the guard only hands it back to the driver).
    addr: usize,
    ctx: Arc<CudaContext>,
}

impl Pinned {
    /// Page-locks `t`'s storage for copies with `device`; `None` when it is
    /// small ([`PIN_MIN_BYTES`]) or the driver refuses (copies then go through
    /// the driver's bounce buffers, slower but correct).
    pub(super) fn new(t: &Tensor, device: &CudaDevice) -> Option<Self> {
        let (storage, _) = t.storage_and_layout();
        let (ptr, bytes) = match &*storage {
            Storage::Cpu(CpuStorage::F32(v)) => (v.as_ptr() as *mut c_void, 4 * v.len()),
            Storage::Cpu(CpuStorage::BF16(v)) => (v.as_ptr() as *mut c_void, 2 * v.len()),
            Storage::Cpu(CpuStorage::F16(v)) => (v.as_ptr() as *mut c_void, 2 * v.len()),
            _ => return None,
        };
        if bytes < PIN_MIN_BYTES {
            return None;
        }
        let ctx = device.cuda_stream().context().clone();
        ctx.bind_to_thread().ok()?;
        // SAFETY: `ptr..ptr + bytes` is the live allocation of the tensor's
        // vector, which the caller keeps alive and in place until `drop`.
        unsafe { sys::cuMemHostRegister_v2(ptr, bytes, 0) }
            .result()
            .ok()?;
        Some(Pinned {
            addr: ptr as usize,
            ctx,
        })
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `addr` was registered by `new` and not unregistered since.
            // A failure leaves the pages locked until the process ends.
            let _ = unsafe { sys::cuMemHostUnregister(self.addr as *mut c_void) };
        }
    }
}
