//! No code: this crate's tests (`tests/`) check oomfix against candle-core
//! as released on crates.io, which a crate depending on oomfix links (the
//! workspace's `[patch]` of candle-core does not reach it).
