//! An observer of the CUDA memory candle allocates (not in candle-core as
//! released: a patch of this vendored copy, see the workspace's
//! `vendor/README.md`).
//!
//! With a hook set ([`set_memory_hook`]), candle calls it on the thread that
//! does the work:
//!
//! - [`MemoryEvent::PoolAlloc`] after every allocation from the device's
//!   stream-ordered pool through [`super::CudaDevice`] (`alloc`,
//!   `alloc_zeros`, `clone_htod`): the storage of an op's result and the
//!   op's own temporary buffers (strides, indices), which never become a
//!   storage;
//! - [`MemoryEvent::StorageAlloc`] when a new [`super::CudaStorage`] becomes
//!   a tensor's storage;
//! - [`MemoryEvent::StorageFree`] when a [`super::CudaStorage`] is dropped
//!   (its memory goes back to the pool in stream order).
//!
//! Without a hook each of these places costs one atomic load.

use std::sync::atomic::{AtomicPtr, Ordering};

/// What the hook is told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoryEvent {
    /// `bytes` were allocated from the stream-ordered pool.
    PoolAlloc {
        /// Bytes asked for.
        bytes: u64,
    },
    /// The storage of `bytes` at device address `ptr` became a tensor's.
    StorageAlloc {
        /// Device address.
        ptr: u64,
        /// Size in bytes.
        bytes: u64,
    },
    /// The storage at `ptr` was dropped.
    StorageFree {
        /// Device address.
        ptr: u64,
        /// Size in bytes.
        bytes: u64,
    },
}

/// A hook: the CUDA device's ordinal and the event.
pub type MemoryHook = fn(ordinal: usize, event: MemoryEvent);

static HOOK: AtomicPtr<()> = AtomicPtr::new(std::ptr::null_mut());

/// Sets the hook (`None` removes it). Process-wide.
pub fn set_memory_hook(hook: Option<MemoryHook>) {
    let p = hook.map_or(std::ptr::null_mut(), |f| f as *mut ());
    HOOK.store(p, Ordering::SeqCst);
}

/// Whether a hook is set.
#[inline]
pub(crate) fn active() -> bool {
    !HOOK.load(Ordering::Relaxed).is_null()
}

#[inline]
pub(crate) fn notify(ordinal: usize, event: MemoryEvent) {
    let p = HOOK.load(Ordering::Relaxed);
    if !p.is_null() {
        // SAFETY: `p` was stored from a `MemoryHook` by `set_memory_hook`.
        let hook: MemoryHook = unsafe { std::mem::transmute::<*mut (), MemoryHook>(p) };
        hook(ordinal, event);
    }
}
