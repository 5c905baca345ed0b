//! Presenting results: one exporter per format.

mod json;
mod plot;
mod snapshot;
mod table;

pub use json::{inspect_json, search_json};
pub use plot::timeline_svg;
pub use snapshot::{snapshot_pickle, snapshot_value};
pub use table::{inspect_text, search_table};
