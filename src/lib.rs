//! oomfix: find a training configuration that fits in memory.
//!
//! Give it a model and a budget; it applies a pipeline of memory fixes in order
//! (smaller micro-batch with gradient accumulation, mixed precision, activation
//! checkpointing, fused AdamW, ZeRO-style sharding) until the estimate fits,
//! then relaxes what is no longer needed.
//!
//! ```
//! use oomfix::{ModelSpec, Planner, Target};
//!
//! let spec = ModelSpec::default_model(); // GPT-2 small shape
//! let result = Planner::new(8 << 30)      // 8 GiB per device
//!     .global_batch(8)
//!     .seq_len(1024)
//!     .target(Target::Cuda(0))
//!     .run(&spec)
//!     .unwrap();
//! let plan = result.chosen().expect("GPT-2 small trains in 8 GiB").plan;
//! assert_eq!(plan.global_batch(), 8);          // the global batch is kept
//! assert!(result.attempts.len() > 1);          // the baseline did not fit
//! println!("{plan}");
//! ```
#![warn(missing_docs)]

pub mod checkpoint_file;
mod error;
pub mod inspect;
pub mod measure;
pub mod memory;
pub mod output;
pub mod report;
pub mod search;
pub mod spec;
pub mod train;
pub mod units;

pub use error::{Error, Result};
pub use inspect::inspect;
pub use memory::{Breakdown, Estimator, MemoryModel, Target};
pub use oomfix_strategies as strategies;
pub use oomfix_strategies::{Pipeline, Plan};
pub use search::{Attempt, Planner, SearchResult, Verify};
pub use spec::{Family, ModelConfig, ModelSpec, TensorInfo};
