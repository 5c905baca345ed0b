//! Arbitrary bytes as a whole `.safetensors` file: header length field, header
//! JSON and data region, through `oomfix::inspect` (header validation, then
//! architecture inference).
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use oomfix_fuzz::{check_inspect, Workdir};

static DIR: OnceLock<Workdir> = OnceLock::new();

fuzz_target!(|data: &[u8]| {
    let path = DIR.get_or_init(Workdir::new).write("model.safetensors", data);
    check_inspect(&path, data.len());
});
