//! Peak-memory measurement of real training steps.

pub mod alloc;

pub use alloc::CountingAlloc;
