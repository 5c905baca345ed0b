//! Tracking the memory of a running step: a counting global allocator with
//! phases and a recording of every allocation ([`alloc`]), the module, op and
//! component each allocation belongs to ([`tag`]), a recording of a device
//! memory pool's allocations ([`device`]), and, on CUDA, the memory pool's
//! statistics and the feed of that recording (`cuda`, with the `cuda` feature). The trainer marks its phases and scopes
//! here; [`crate::measure`] reads the results.

pub mod alloc;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod device;
pub mod event;
pub mod tag;

pub use alloc::CountingAlloc;
pub use tag::Component;

use crate::Result;
use candle_core::Device;

/// Sets the device's high-water marks back to what is in use: on CUDA the
/// memory pool's (the heap's is [`alloc::reset_peak`]); nothing elsewhere.
pub(crate) fn reset_device_peak(device: &Device) -> Result<()> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(cuda) = device {
        cuda::reset_peaks(cuda)?;
    }
    let _ = device;
    Ok(())
}

/// On CUDA, lets the device's pool keep its memory between the step's
/// synchronisations ([`cuda::keep_reserve`]); nothing elsewhere.
pub(crate) fn keep_device_reserve(device: &Device) -> Result<()> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(cuda) = device {
        cuda::keep_reserve(cuda)?;
    }
    let _ = device;
    Ok(())
}

/// Bytes live now: the heap's, or on CUDA the memory pool's.
pub(crate) fn live_bytes(device: &Device) -> Result<u64> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(cuda) = device {
        return Ok(cuda::PoolStats::read(cuda)?.used);
    }
    let _ = device;
    Ok(alloc::current())
}

/// The peak of a trainer's phase since the marks were reset, above `base`,
/// what was live before the trainer was built ([`live_bytes`]: on the CPU
/// the process's data, logging and collective backend, as
/// [`crate::measure`] counts a step and no estimate does): on CUDA the
/// pool's used high-water mark, elsewhere the heap's (0 without the
/// counting allocator).
pub(crate) fn phase_peak(device: &Device, base: u64) -> Result<u64> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(cuda) = device {
        return Ok(cuda::PoolStats::read(cuda)?.used_high.saturating_sub(base));
    }
    let _ = device;
    Ok(alloc::peak().saturating_sub(base))
}
