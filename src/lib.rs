//! oomfix: find a training configuration that fits in memory.
#![warn(missing_docs)]

mod error;
pub mod spec;
pub mod train;

pub use error::{Error, Result};
pub use oomfix_strategies as strategies;
pub use spec::{Family, ModelConfig, ModelSpec, TensorInfo};
