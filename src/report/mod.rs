//! Presenting results: one exporter per format.

mod json;
mod pickle;
mod plot;
mod snapshot;
mod table;

pub use json::{inspect_json, search_json};
pub use pickle::snapshot_pickle;
pub use plot::{timeline_plot, timeline_png, timeline_svg, PlotFormat};
pub use snapshot::{snapshot, snapshot_value, Frame, Snapshot, TraceEntry};
pub use table::{inspect_text, search_table};
