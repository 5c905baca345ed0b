//! Peak-memory measurement of real training steps, and the allocation
//! timeline of a measured step (module, op and component of every block).

pub mod alloc;
#[cfg(feature = "cuda")]
pub mod cuda;
mod step;
pub mod tag;
pub mod timeline;

pub use alloc::CountingAlloc;
pub use step::{
    limit_address_space, measure_plan, record_plan, StepVerifier, ADDRESS_SPACE_SLACK, MAX_EVENTS,
};
pub use tag::Component;
pub use timeline::Timeline;
