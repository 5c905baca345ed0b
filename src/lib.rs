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
//!
//! # Layout
//!
//! Modules depend only on those above them:
//!
//! * [`units`], [`output`]: byte sizes; atomic output files;
//! * [`inspect`](mod@inspect) → [`spec`]: a weights file's header → the model's shape;
//!   [`Target`]: the device planned for;
//! * [`block`]: a family's block under a plan: its matrix products and the
//!   tensors it keeps, which both models below read;
//! * [`memory`]: `(spec, plan, target)` → bytes per component and the peak
//!   (the fixes' memory hooks, plus activations);
//! * [`speed`]: `(spec, plan, target)` → modelled seconds per optimizer step;
//! * `usable`: whether a plan's fixes can run on a model and a device (each
//!   fix's own rule), which the search and the trainer both ask;
//! * [`search`]: the pipeline of fixes run against a budget;
//! * [`track`]: a running step's allocations (counting allocator, tags,
//!   CUDA pool statistics);
//! * [`train`]: the trainable model families and the trainer;
//! * [`anymodel`]: models given as code, planned by measurement and trained
//!   by the plan's fixes;
//! * [`measure`]: real steps measured for the search's verifier, and their
//!   allocation timelines;
//! * [`report`]: the table, the JSON report, the memory snapshot and plots;
//! * the `oomfix` binary (its own modules, not part of this API): the command
//!   line, logging, signals, the training loop's policy, exit codes.
//!
//! The fixes themselves (the plan, the pipeline, each fix's planner half,
//! memory and execution hooks, and its candle mechanism) are the
//! `oomfix-strategies` crate, re-exported as [`strategies`].
#![warn(missing_docs)]

pub mod anymodel;
pub mod architecture;
pub mod block;
pub mod dist;
pub mod facts;
pub mod inspect;
pub mod measure;
pub mod memory;
pub mod output;
pub mod report;
pub mod search;
pub mod spec;
pub mod speed;
mod state_file;
mod target;
pub mod track;
pub mod train;
pub mod units;
mod usable;

mod error;

/// The README, whose Rust recipe `cargo test --doc` runs as printed.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct Readme;

pub use error::{Error, Result};
pub use inspect::inspect;
pub use measure::StepVerifier;
pub use memory::{Breakdown, Estimator, MemoryModel, Target};
pub use oomfix_strategies as strategies;
pub use oomfix_strategies::{Execution, Pipeline, Plan, Strategy};
pub use search::{
    Attempt, Headroom, Longest, Measurement, Pins, Planner, SearchResult, Verifier, Verify,
};
pub use spec::{
    Family, GemmaSettings, ModelConfig, ModelSettings, ModelSpec, MoeSettings, RopeFactors,
    TensorInfo,
};
pub use train::{TrainOptions, Trainer};
