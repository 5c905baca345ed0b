//! A `config.json` next to a small valid model: the input's first byte picks
//! the model (`fuzz/models/config-<n>.safetensors`: GPT-2, Llama-style, BERT),
//! the rest is the config, through `oomfix::inspect` (config reading and
//! architecture inference with it); a config it accepts must then train one
//! CPU step with a finite loss (`check_trains`).
#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use oomfix_fuzz::{check_inspect, check_trains, Workdir};

const MODELS: [&[u8]; 3] = [
    include_bytes!("../models/config-0.safetensors"),
    include_bytes!("../models/config-1.safetensors"),
    include_bytes!("../models/config-2.safetensors"),
];

/// One directory per model, so each config.json sits next to one model only.
static DIRS: OnceLock<Vec<(Workdir, PathBuf)>> = OnceLock::new();

fn dirs() -> Vec<(Workdir, PathBuf)> {
    MODELS
        .iter()
        .map(|bytes| {
            let dir = Workdir::new();
            let model = dir.write("model.safetensors", bytes);
            (dir, model)
        })
        .collect()
}

fuzz_target!(|data: &[u8]| {
    let Some((&pick, config)) = data.split_first() else {
        return;
    };
    let (dir, model) = &DIRS.get_or_init(dirs)[usize::from(pick) % MODELS.len()];
    dir.write("config.json", config);
    if let Some(spec) = check_inspect(model, data.len()) {
        check_trains(&spec);
    }
});
