//! Peak-memory measurement of real training steps.

pub mod alloc;
#[cfg(feature = "cuda")]
pub mod cuda;
mod step;

pub use alloc::CountingAlloc;
pub use step::{
    limit_address_space, measure_plan, parse_plan_arg, plan_arg, record_plan, StepVerifier, Timeline,
    ADDRESS_SPACE_SLACK, MAX_EVENTS,
};
