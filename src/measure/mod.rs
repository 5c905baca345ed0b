//! Peak-memory measurement of real training steps, and the allocation
//! timeline of a measured step (module, op and component of every block).

mod record;
mod step;
pub mod timeline;

pub use record::{RunRecording, MAX_EVENTS};
#[doc(hidden)]
pub use step::limit_address_space;
pub(crate) use step::warm_up_threads;
pub use step::{measure_plan, measure_sharded, record_plan, StepVerifier};
pub use timeline::Timeline;
