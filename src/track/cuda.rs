//! GPU peak memory: the counters of a CUDA device's default memory pool.
//!
//! candle allocates device memory with `cuMemAllocAsync` from the device's
//! default pool, so the pool's counters are what a training step holds:
//! *used* is live tensor bytes (PyTorch's "allocated"), *reserved* is what the
//! pool has taken from the driver (PyTorch's "reserved"). Both have high-water
//! marks that [`reset_peaks`] sets back to zero; [`trim`] returns the pool's
//! unused memory to the driver (PyTorch's `empty_cache()`).
//!
//! Neither counter includes the CUDA context, module images or library
//! workspaces; `cuMemGetInfo` ([`PoolStats::device_free`]) sees those.
//!
//! ```no_run
//! use candle_core::Device;
//! use oomfix::track::cuda::{reset_peaks, PoolStats};
//!
//! let device = Device::new_cuda(0)?;
//! let cuda = device.as_cuda_device()?;
//! reset_peaks(cuda)?;
//! // ... run a training step ...
//! let stats = PoolStats::read(cuda)?;
//! println!("peak allocated {} B, peak reserved {} B", stats.used_high, stats.reserved_high);
//! # Ok::<(), candle_core::Error>(())
//! ```

use candle_core::cuda_backend::cudarc::cublas::result::CublasError;
use candle_core::cuda_backend::cudarc::cublas::sys::cublasStatus_t;
use candle_core::cuda_backend::cudarc::driver::result::mem_pool;
use candle_core::cuda_backend::cudarc::driver::sys::{CUmemPool_attribute, CUmemoryPool, CUresult};
use candle_core::cuda_backend::cudarc::driver::{result, CudaContext, DriverError};
use candle_core::cuda_backend::{CudaDevice, CudaError, WrapErr};
use serde::Serialize;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// The pool's counters and the device's free memory, read at one moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct PoolStats {
    /// Bytes of live allocations from the pool.
    pub used: u64,
    /// Highest `used` since the last [`reset_peaks`].
    pub used_high: u64,
    /// Bytes the pool holds from the driver (live allocations and cached memory).
    pub reserved: u64,
    /// Highest `reserved` since the last [`reset_peaks`].
    pub reserved_high: u64,
    /// Free device memory (`cuMemGetInfo`), all processes and contexts counted.
    pub device_free: u64,
    /// Total device memory.
    pub device_total: u64,
}

impl PoolStats {
    /// Waits for the device's stream to finish its queued work, then reads the
    /// counters of the device's default pool.
    pub fn read(device: &CudaDevice) -> candle_core::Result<Self> {
        device.cuda_stream().synchronize().w()?;
        let pool = default_pool(device)?;
        let (free, total) = device.cuda_stream().context().mem_get_info().w()?;
        Ok(PoolStats {
            used: get(pool, CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?,
            used_high: get(pool, CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH)?,
            reserved: get(
                pool,
                CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT,
            )?,
            reserved_high: get(pool, CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)?,
            device_free: free as u64,
            device_total: total as u64,
        })
    }
}

/// With `debug` logging enabled for this module, waits for the device and logs
/// the pool's counters and the device's free memory after `moment` (a phase of
/// a training step); otherwise does nothing and does not synchronise.
///
/// `RUST_LOG=oomfix::track::cuda=debug` shows how far the pool's reservation
/// runs ahead of its live bytes, which a hard limit (`--enforce-budget`) feels.
pub fn trace_pool(device: &CudaDevice, moment: &str) {
    if !tracing::enabled!(tracing::Level::DEBUG) {
        return;
    }
    match PoolStats::read(device) {
        Ok(s) => tracing::debug!(
            moment,
            used = s.used,
            reserved = s.reserved,
            used_high = s.used_high,
            reserved_high = s.reserved_high,
            device_free = s.device_free,
            "CUDA pool"
        ),
        Err(e) => tracing::debug!(moment, error = %e, "CUDA pool counters unreadable"),
    }
}

/// Waits for the device's queued work, then sets the pool's high-water marks
/// back to zero: from here on they count up from the current values.
pub fn reset_peaks(device: &CudaDevice) -> candle_core::Result<()> {
    device.cuda_stream().synchronize().w()?;
    let pool = default_pool(device)?;
    for attr in [
        CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
        CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH,
    ] {
        let mut zero: u64 = 0;
        // SAFETY: the pool is the device's default pool; the two high-water
        // attributes take a cuuint64_t, which must be zero.
        unsafe { mem_pool::set_attribute(pool, attr, (&mut zero as *mut u64).cast()) }.w()?;
    }
    Ok(())
}

/// Waits for the device's queued work, then returns all memory the pool holds
/// beyond its live allocations to the driver.
pub fn trim(device: &CudaDevice) -> candle_core::Result<()> {
    device.cuda_stream().synchronize().w()?;
    let pool = default_pool(device)?;
    // SAFETY: the pool is the device's default pool.
    unsafe { mem_pool::trim_to(pool, 0) }.w()
}

/// Lets the device's pool keep the memory it has taken from the driver
/// across synchronisations (release threshold: unlimited), as PyTorch's
/// caching allocator keeps its segments; [`trim`] still returns it on request.
///
/// With CUDA's default threshold of zero, every synchronisation of a step
/// (the loss, the gradient norm, the peak counters) hands all unused pool
/// memory back, and the next phase maps it again: after the backward, the
/// activations' gigabytes. The trainer sets this once when it is built on a
/// CUDA device.
pub fn keep_reserve(device: &CudaDevice) -> candle_core::Result<()> {
    let pool = default_pool(device)?;
    let mut unlimited = u64::MAX;
    // SAFETY: the pool is the device's default pool; the release threshold
    // takes a cuuint64_t.
    unsafe {
        mem_pool::set_attribute(
            pool,
            CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut unlimited as *mut u64).cast(),
        )
    }
    .w()
}

/// The device pool's release threshold: the bytes it keeps from the driver
/// across synchronisations ([`keep_reserve`] makes it `u64::MAX`).
pub fn release_threshold(device: &CudaDevice) -> candle_core::Result<u64> {
    get(
        default_pool(device)?,
        CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
    )
}

/// Whether this build can record CUDA allocations ([`start_recording`]): it
/// links the vendored candle-core, whose memory hook
/// (`candle_core::cuda_backend::hook`) tells of every storage and pool
/// allocation. candle-core as released has no such hook.
pub const CAN_RECORD: bool = super::device::MEMORY_HOOK_LINKED;

/// Why a build without the hook refuses to record.
pub const NEEDS_MEMORY_HOOK: &str =
    "recording CUDA allocations (--snapshot, --plot) needs the memory hook of \
     oomfix's vendored candle-core; this build links candle-core as released, which has none \
     (build oomfix's own workspace, whose [patch] uses vendor/candle-core)";

/// The default pool of the device being recorded, as an integer (0: none).
static RECORDED_POOL: AtomicU64 = AtomicU64::new(0);
/// The ordinal of the device being recorded.
static RECORDED_ORDINAL: AtomicU64 = AtomicU64::new(u64::MAX);

/// Starts recording `device`'s allocations into [`super::device`]: every
/// tensor storage allocated and freed, every allocation from its pool, with
/// the pool's counters at each, up to `capacity` events. Refused by a build
/// without candle-core's memory hook ([`CAN_RECORD`]).
pub fn start_recording(device: &CudaDevice, capacity: usize) -> candle_core::Result<()> {
    if !CAN_RECORD {
        candle_core::bail!("{NEEDS_MEMORY_HOOK}");
    }
    let pool = default_pool(device)?;
    RECORDED_POOL.store(pool as u64, Ordering::SeqCst);
    let ordinal = device.cuda_stream().context().ordinal();
    RECORDED_ORDINAL.store(ordinal as u64, Ordering::SeqCst);
    super::device::start(capacity, read_counters);
    #[cfg(candle_memory_hook)]
    candle_core::cuda_backend::hook::set_memory_hook(Some(on_memory));
    Ok(())
}

/// Stops the recording of [`start_recording`]: its events and whether it
/// filled up.
pub fn stop_recording() -> (Vec<super::device::DeviceEvent>, bool) {
    #[cfg(candle_memory_hook)]
    candle_core::cuda_backend::hook::set_memory_hook(None);
    let out = super::device::stop();
    RECORDED_POOL.store(0, Ordering::SeqCst);
    out
}

/// The recorded pool's counters, read without waiting for the device (what
/// the allocations queued so far asked of it).
fn read_counters() -> super::device::PoolCounters {
    let pool = RECORDED_POOL.load(Ordering::Relaxed) as CUmemoryPool;
    if pool.is_null() {
        return super::device::PoolCounters::default();
    }
    let read = |attr| get(pool, attr).unwrap_or(0);
    super::device::PoolCounters {
        used: read(CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT),
        reserved: read(CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT),
        used_high: read(CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH),
        reserved_high: read(CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH),
    }
}

/// candle's memory hook: the recorded device's events into the recording.
#[cfg(candle_memory_hook)]
fn on_memory(ordinal: usize, event: candle_core::cuda_backend::hook::MemoryEvent) {
    use super::alloc::EventKind;
    use candle_core::cuda_backend::hook::MemoryEvent;
    if ordinal as u64 != RECORDED_ORDINAL.load(Ordering::Relaxed) {
        return;
    }
    match event {
        MemoryEvent::PoolAlloc { bytes } => super::device::note(EventKind::Pool, 0, bytes),
        MemoryEvent::StorageAlloc { ptr, bytes } => {
            super::device::note(EventKind::Alloc, ptr, bytes)
        }
        MemoryEvent::StorageFree { ptr, bytes } => super::device::note(EventKind::Free, ptr, bytes),
    }
}

/// The device [`trim_between_phases`] trims.
static TRIM_DEVICE: Mutex<Option<CudaDevice>> = Mutex::new(None);

/// With `Some(device)`, trims `device`'s pool ([`trim`]: waits for the
/// device, then returns all cached memory to the driver) at every phase
/// change of the trainer (forward, backward, optimizer step, between
/// steps) from now on; `None` stops it.
pub fn trim_between_phases(device: Option<&CudaDevice>) {
    *TRIM_DEVICE.lock().unwrap_or_else(|e| e.into_inner()) = device.cloned();
    super::device::set_on_phase_change(device.map(|_| trim_now as fn()));
}

fn trim_now() {
    let held = TRIM_DEVICE.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(device) = held.as_ref() {
        if let Err(e) = trim(device) {
            tracing::warn!(error = %e, "trimming the CUDA pool between phases failed");
        }
    }
}

/// Bytes held by the ballast of [`enforce_budget`] (0 when none is held).
static BALLAST_BYTES: AtomicU64 = AtomicU64::new(0);
/// The ballast itself, held until the process exits.
static BALLAST: Mutex<Option<Ballast>> = Mutex::new(None);

/// One plain device allocation (`cuMemAlloc`, outside the pool) that takes
/// device memory away from everything else in the process.
struct Ballast {
    context: Arc<CudaContext>,
    ptr: u64,
}

impl Drop for Ballast {
    fn drop(&mut self) {
        if self.context.bind_to_thread().is_ok() {
            // SAFETY: `ptr` came from `cuMemAlloc` in this context and is freed once.
            let _ = unsafe { result::free_sync(self.ptr) };
        }
    }
}

/// What [`enforce_budget`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Enforced {
    /// Bytes of the ballast allocation.
    pub ballast: u64,
    /// Device memory this process held before the ballast (context, module
    /// images): `total - free`, which assumes no other process uses the device.
    pub already_used: u64,
    /// Free device memory after the ballast (`cuMemGetInfo`).
    pub free_after: u64,
}

/// Makes only `budget` bytes of the device usable by this process, for the rest
/// of its life: allocates, outside the memory pool, all free memory except
/// `budget` minus what the process already holds on the device (its context).
/// A plan that trains afterwards therefore trains inside `budget`, context included,
/// as the estimate counts it; more is a CUDA out-of-memory.
///
/// The ballast is subtracted from the measured memory outside the pool
/// ([`ballast_bytes`]). Calling it again replaces the earlier ballast.
pub fn enforce_budget(device: &CudaDevice, budget: u64) -> candle_core::Result<Enforced> {
    let mut held = BALLAST.lock().unwrap_or_else(|e| e.into_inner());
    *held = None;
    BALLAST_BYTES.store(0, Ordering::SeqCst);
    trim(device)?;
    let context = device.cuda_stream().context().clone();
    context.bind_to_thread().w()?;
    let (free, total) = context.mem_get_info().w()?;
    let (free, total) = (free as u64, total as u64);
    let already_used = total - free;
    let keep = budget.saturating_sub(already_used);
    if keep == 0 || free < keep {
        candle_core::bail!(
            "cannot enforce a budget of {budget} bytes: this process already holds {already_used} bytes \
             of the device and {free} bytes are free"
        );
    }
    let ballast = free - keep;
    if ballast > 0 {
        // SAFETY: the context is bound to this thread; the pointer is freed by `Ballast::drop`.
        let ptr = unsafe { result::malloc_sync(ballast as usize) }.w()?;
        *held = Some(Ballast {
            context: context.clone(),
            ptr,
        });
    }
    BALLAST_BYTES.store(ballast, Ordering::SeqCst);
    let (free_after, _) = context.mem_get_info().w()?;
    Ok(Enforced {
        ballast,
        already_used,
        free_after: free_after as u64,
    })
}

/// Bytes held by the ballast of [`enforce_budget`] (0 when there is none).
pub fn ballast_bytes() -> u64 {
    BALLAST_BYTES.load(Ordering::SeqCst)
}

fn default_pool(device: &CudaDevice) -> candle_core::Result<CUmemoryPool> {
    let cu_device = device.cuda_stream().context().cu_device();
    // SAFETY: the CUdevice comes from a live context.
    unsafe { result::device::get_default_mem_pool(cu_device) }.w()
}

fn get(pool: CUmemoryPool, attr: CUmemPool_attribute) -> candle_core::Result<u64> {
    let mut value: u64 = 0;
    // SAFETY: the byte-count attributes read here are cuuint64_t.
    unsafe { mem_pool::get_attribute(pool, attr, (&mut value as *mut u64).cast()) }.w()?;
    Ok(value)
}

/// Whether `err` is a CUDA out-of-memory error: `CUDA_ERROR_OUT_OF_MEMORY` from
/// the driver or cuBLAS's `CUBLAS_STATUS_ALLOC_FAILED`, also when wrapped in a
/// backtrace, context or path. Such an error is recoverable: free or trim, and
/// go on.
pub fn is_out_of_memory(err: &candle_core::Error) -> bool {
    use candle_core::Error;
    match err {
        Error::WithBacktrace { inner, .. }
        | Error::Context { inner, .. }
        | Error::WithPath { inner, .. } => is_out_of_memory(inner),
        Error::Cuda(e) => match e.downcast_ref::<CudaError>() {
            Some(CudaError::Cuda(d) | CudaError::Load { cuda: d, .. }) => driver_oom(d),
            Some(CudaError::Cublas(CublasError(status))) => {
                *status == cublasStatus_t::CUBLAS_STATUS_ALLOC_FAILED
            }
            Some(_) => false,
            None => e.downcast_ref::<DriverError>().is_some_and(driver_oom),
        },
        Error::WrappedContext { wrapped, .. } => wrapped
            .downcast_ref::<Error>()
            .is_some_and(is_out_of_memory),
        _ => false,
    }
}

fn driver_oom(e: &DriverError) -> bool {
    e.0 == CUresult::CUDA_ERROR_OUT_OF_MEMORY
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Error;

    fn oom() -> Error {
        Error::Cuda(Box::new(CudaError::Cuda(DriverError(
            CUresult::CUDA_ERROR_OUT_OF_MEMORY,
        ))))
    }

    #[test]
    fn driver_out_of_memory_is_recognised_through_wrappers() {
        assert!(is_out_of_memory(&oom()));
        let wrapped = oom()
            .context("allocating activations")
            .with_path("model.safetensors");
        assert!(is_out_of_memory(&wrapped));
        let bt = Error::WithBacktrace {
            inner: Box::new(oom()),
            backtrace: Box::new(std::backtrace::Backtrace::disabled()),
        };
        assert!(is_out_of_memory(&bt));
    }

    #[test]
    fn cublas_alloc_failure_is_out_of_memory() {
        let e = Error::Cuda(Box::new(CudaError::Cublas(CublasError(
            cublasStatus_t::CUBLAS_STATUS_ALLOC_FAILED,
        ))));
        assert!(is_out_of_memory(&e));
    }

    #[test]
    fn other_errors_are_not_out_of_memory() {
        let launch = Error::Cuda(Box::new(CudaError::Cuda(DriverError(
            CUresult::CUDA_ERROR_LAUNCH_FAILED,
        ))));
        let cublas = Error::Cuda(Box::new(CudaError::Cublas(CublasError(
            cublasStatus_t::CUBLAS_STATUS_EXECUTION_FAILED,
        ))));
        for e in [
            launch,
            cublas,
            Error::Msg("out of memory".into()),
            Error::Cuda("CUDA_ERROR_OUT_OF_MEMORY".into()),
        ] {
            assert!(!is_out_of_memory(&e), "{e}");
        }
    }
}
