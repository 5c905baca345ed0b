//! Peak-memory measurement of real training steps.

pub mod alloc;
#[cfg(feature = "cuda")]
pub mod cuda;

pub use alloc::CountingAlloc;
