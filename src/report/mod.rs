//! Presenting results: one exporter per format.

mod json;
mod table;

pub use json::{inspect_json, search_json};
pub use table::{inspect_text, search_table};
