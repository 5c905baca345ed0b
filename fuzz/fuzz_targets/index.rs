//! Arbitrary bytes as `model.safetensors.index.json`, next to the two valid
//! shards of a small Llama-style model (`fuzz/models/`), through
//! `oomfix::inspect` (index parsing, shard headers, merging, inference).
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use oomfix::inspect::INDEX_FILE;
use oomfix_fuzz::{check_inspect, Workdir};

const SHARDS: [(&str, &[u8]); 2] = [
    (
        "model-00001-of-00002.safetensors",
        include_bytes!("../models/model-00001-of-00002.safetensors"),
    ),
    (
        "model-00002-of-00002.safetensors",
        include_bytes!("../models/model-00002-of-00002.safetensors"),
    ),
];

static DIR: OnceLock<Workdir> = OnceLock::new();

fn workdir() -> Workdir {
    let dir = Workdir::new();
    for (name, bytes) in SHARDS {
        dir.write(name, bytes);
    }
    dir
}

fuzz_target!(|data: &[u8]| {
    let path = DIR.get_or_init(workdir).write(INDEX_FILE, data);
    check_inspect(&path, data.len());
});
