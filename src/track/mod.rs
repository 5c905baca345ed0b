//! Tracking the memory of a running step: a counting global allocator with
//! phases and a recording of every allocation ([`alloc`]), the module, op and
//! component each allocation belongs to ([`tag`]), and, on CUDA, the memory
//! pool's statistics (`cuda`, with the `cuda` feature). The trainer marks its phases and scopes
//! here; [`crate::measure`] reads the results.

pub mod alloc;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod tag;

pub use alloc::CountingAlloc;
pub use tag::Component;
