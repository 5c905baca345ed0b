//! Presenting results: one exporter per format.

mod json;
mod pickle;
#[cfg(feature = "plot")]
mod plot;
mod snapshot;
mod table;
mod train;

pub use json::{inspect_json, search_json};
pub use pickle::snapshot_pickle;
// Feature `plot` (on with the default `cli`).
#[cfg(feature = "plot")]
pub use plot::{timeline_plot, timeline_png, timeline_svg, PlotFormat};
pub use snapshot::{snapshot, snapshot_value, Frame, Snapshot, TraceEntry};
pub use table::{inspect_text, search_table};
pub use train::{train_summary_json, train_summary_text, PoolSummary, Startup, TrainSummary};
