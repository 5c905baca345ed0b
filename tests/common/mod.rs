//! Helpers shared by the integration tests: safetensors files of any size
//! (written sparse, so a multi-GB model costs a few kilobytes of disk), raw
//! malformed files, the JSON side files of a Hub checkout, tensor values,
//! runs of the binary ([`cli`]) and the reference fixtures ([`fixtures`]).
#![allow(dead_code)] // each test crate uses a subset

mod cli;
mod fixtures;

#[allow(unused_imports)] // each test crate uses a subset
pub use cli::*;
#[allow(unused_imports)]
pub use fixtures::*;

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

use serde_json::{json, Map, Value};

/// Bytes per element of a safetensors dtype the helpers write.
pub fn dtype_size(dtype: &str) -> u64 {
    match dtype {
        "BOOL" | "U8" | "I8" | "F8_E5M2" | "F8_E4M3" => 1,
        "I16" | "U16" | "F16" | "BF16" => 2,
        "I32" | "U32" | "F32" => 4,
        "I64" | "U64" | "F64" => 8,
        other => panic!("test helper: no size for dtype {other}"),
    }
}

/// The header JSON (padded with spaces to a multiple of 8 bytes, as writers do)
/// for `tensors` laid out contiguously in the given order, and the data length.
pub fn header_json<N: AsRef<str>, S: AsRef<[usize]>>(tensors: &[(N, &str, S)]) -> (String, u64) {
    let mut map = Map::new();
    let mut offset = 0u64;
    for (name, dtype, shape) in tensors {
        let shape = shape.as_ref();
        let bytes = shape.iter().map(|&d| d as u64).product::<u64>() * dtype_size(dtype);
        map.insert(
            name.as_ref().to_string(),
            json!({"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + bytes]}),
        );
        offset += bytes;
    }
    map.insert("__metadata__".into(), json!({"format": "pt"}));
    let mut header = Value::Object(map).to_string();
    while !header.len().is_multiple_of(8) {
        header.push(' ');
    }
    (header, offset)
}

/// Writes a valid safetensors file holding `(name, dtype, shape)` tensors; the
/// data region is a hole (`File::set_len`), so the file's size costs nothing.
pub fn write_safetensors<N: AsRef<str>, S: AsRef<[usize]>>(path: &Path, tensors: &[(N, &str, S)]) {
    let (header, data_len) = header_json(tensors);
    write_raw(path, header.len() as u64, header.as_bytes(), data_len);
}

/// Writes `header_len_field` (little-endian), then `header_bytes`, then a sparse
/// data region of `data_len` bytes; the length field need not match the bytes.
pub fn write_raw(path: &Path, header_len_field: u64, header_bytes: &[u8], data_len: u64) {
    let mut f = File::create(path).unwrap();
    f.write_all(&header_len_field.to_le_bytes()).unwrap();
    f.write_all(header_bytes).unwrap();
    f.set_len(8 + header_bytes.len() as u64 + data_len).unwrap();
}

/// The header JSON of one tensor `w` with these fields (JSON text).
pub fn tensor_w(dtype: &str, shape: &str, offsets: &str) -> String {
    format!(r#"{{"w":{{"dtype":"{dtype}","shape":{shape},"data_offsets":{offsets}}}}}"#)
}

/// Writes a file with a correct length field for `header` and `data_len` bytes of data.
pub fn write_header(path: &Path, header: &str, data_len: u64) {
    write_raw(path, header.len() as u64, header.as_bytes(), data_len);
}

/// Writes `value` as a JSON file (a `config.json` or an index).
pub fn write_json(path: &Path, value: &Value) {
    fs::write(path, value.to_string()).unwrap();
}

/// Writes a sharded index mapping each tensor name to its shard file.
pub fn write_index<N: AsRef<str>, S: AsRef<str>>(path: &Path, weight_map: &[(N, S)]) {
    let map: Map<String, Value> = weight_map
        .iter()
        .map(|(n, s)| (n.as_ref().to_string(), json!(s.as_ref())))
        .collect();
    write_json(
        path,
        &json!({"metadata": {"total_size": 0}, "weight_map": map}),
    );
}

/// `(name, shape)` pairs (as [`oomfix::ModelConfig::tensors`] gives them) with one dtype.
pub fn with_dtype(
    tensors: Vec<(String, Vec<usize>)>,
    dtype: &'static str,
) -> Vec<(String, &'static str, Vec<usize>)> {
    tensors.into_iter().map(|(n, s)| (n, dtype, s)).collect()
}

/// GPT-2 tensors as the Hub's `model.safetensors` stores them: F32, with each
/// block's causal-mask buffer `h.N.attn.bias`, and every name under `prefix`
/// (`""` or `"transformer."`).
pub fn gpt2_hub_tensors(
    config: &oomfix::ModelConfig,
    prefix: &str,
) -> Vec<(String, &'static str, Vec<usize>)> {
    let mut tensors = Vec::new();
    for (name, shape) in config.tensors() {
        tensors.push((format!("{prefix}{name}"), "F32", shape));
    }
    for l in 0..config.layers {
        let p = config.max_positions;
        tensors.push((format!("{prefix}h.{l}.attn.bias"), "F32", vec![1, 1, p, p]));
    }
    tensors
}

/// The F32 tensors of an encoder oomfix has no family for: a stem, then
/// five mixing layers of 64 (`encoder.blocks.L.mix.weight`).
pub fn unknown_encoder() -> Vec<(String, &'static str, Vec<usize>)> {
    let blocks = (0..5).map(|l| {
        (
            format!("encoder.blocks.{l}.mix.weight"),
            "F32",
            vec![64, 64],
        )
    });
    std::iter::once(("stem.weight".to_string(), "F32", vec![64, 3]))
        .chain(blocks)
        .collect()
}

/// A two-layer GPT-2 small enough to train in a test (hidden 32, vocabulary
/// 256, 64 positions).
pub fn tiny_gpt2() -> oomfix::ModelConfig {
    oomfix::ModelConfig {
        vocab: 256,
        max_positions: 64,
        ..oomfix::ModelConfig::gpt2(2, 32, 2)
    }
}

/// A two-layer Llama with grouped-query attention (4 heads, 2 key/value
/// heads) and an untied head, small enough to train in a test.
pub fn tiny_llama() -> oomfix::ModelConfig {
    oomfix::ModelConfig {
        family: oomfix::Family::Llama,
        layers: 2,
        hidden: 32,
        heads: 4,
        kv_heads: 2,
        intermediate: 48,
        vocab: 96,
        max_positions: 32,
        tied_embeddings: false,
        qkv_bias: false,
        settings: Default::default(),
    }
}

/// A GPT-2 of `layers` blocks of hidden 64 with one head (as inspect
/// assumes without a `config.json`), a vocabulary of 64 and 32 positions.
pub fn gpt2_64(layers: usize) -> oomfix::ModelConfig {
    oomfix::ModelConfig {
        vocab: 64,
        max_positions: 32,
        ..oomfix::ModelConfig::gpt2(layers, 64, 1)
    }
}

/// `base` (a JSON object) with the fields of `extra` (an object) added, or
/// replacing its own.
pub fn merged(mut base: Value, extra: Value) -> Value {
    let Value::Object(extra) = extra else {
        panic!("not an object: {extra}")
    };
    base.as_object_mut().unwrap().extend(extra);
    base
}

/// [`tiny_gpt2`]'s F32 weights as `dir/tiny.safetensors` (sparse).
pub fn tiny_gpt2_file(dir: &Path) -> PathBuf {
    let path = dir.join("tiny.safetensors");
    write_safetensors(&path, &with_dtype(tiny_gpt2().tensors(), "F32"));
    path
}

/// A tensor's elements as f32, flattened.
pub fn values(t: &candle_core::Tensor) -> Vec<f32> {
    t.flatten_all()
        .unwrap()
        .to_dtype(candle_core::DType::F32)
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// The Python `OOMFIX_PYTHON` names, which has `packages` (the test
/// fails without it).
pub fn oomfix_python(packages: &str) -> String {
    std::env::var("OOMFIX_PYTHON")
        .unwrap_or_else(|_| panic!("OOMFIX_PYTHON names a Python with {packages}"))
}

/// Runs `scripts/SCRIPT` with the Python `python` and `args`, prints what it
/// printed, and fails the test with its output when it fails; returns its
/// standard output.
pub fn run_python_check<S: AsRef<std::ffi::OsStr>>(
    python: &str,
    script: &str,
    args: &[S],
) -> String {
    let script = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("scripts")
        .join(script);
    let check = std::process::Command::new(python)
        .arg(script)
        .args(args)
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&check.stdout);
    eprintln!("{said}");
    assert!(
        check.status.success(),
        "{said}{}",
        String::from_utf8_lossy(&check.stderr)
    );
    said.into_owned()
}

/// The logits of `model` on a fixed batch of 2 × 16 token ids below
/// `vocab`, written with those ids (as i64) to `logits.safetensors` in
/// `work`, for the Python checks to compare with: the file and the logits.
pub fn write_logits(
    model: &oomfix::train::HubModel,
    vocab: usize,
    work: &Path,
) -> (PathBuf, candle_core::Tensor) {
    use candle_core::{DType, Device, Tensor};
    let vocab = vocab as u32;
    let ids: Vec<u32> = (0..2 * 16).map(|i| (i * 37 + 11) % vocab).collect();
    let ids = Tensor::from_vec(ids, (2, 16), &Device::Cpu).unwrap();
    let batch = oomfix::train::TokenBatch {
        input_ids: ids.clone(),
        targets: ids.clone(),
        loss_mask: None,
        attention_mask: None,
        documents: None,
    };
    let logits = model
        .logits(&batch, &oomfix::strategies::Execution::default())
        .unwrap();
    let file = work.join("logits.safetensors");
    let tensors = std::collections::HashMap::from([
        ("input_ids".to_string(), ids.to_dtype(DType::I64).unwrap()),
        ("logits".to_string(), logits.clone()),
    ]);
    candle_core::safetensors::save(&tensors, &file).unwrap();
    (file, logits)
}

/// Asserts that a run of the binary exited with `code`, showing its stderr
/// otherwise; returns the stderr.
pub fn assert_exit(out: &std::process::Output, code: i32) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(code), "{stderr}");
    stderr
}

/// A model directory: `model.safetensors` with `tensors` (F32, sparse) and
/// `config.json`.
pub fn model_dir(tensors: Vec<(String, Vec<usize>)>, config: Value) -> tempfile::TempDir {
    let dir = tempfile::TempDir::new().unwrap();
    write_safetensors(
        &dir.path().join("model.safetensors"),
        &with_dtype(tensors, "F32"),
    );
    write_json(&dir.path().join("config.json"), &config);
    dir
}

/// Exit 2, nothing on stdout, one line `oomfix: ...` on stderr containing
/// every phrase, no panic; returns the stderr.
pub fn refused(out: &std::process::Output, phrases: &[&str]) -> String {
    let stderr = assert_exit(out, 2);
    assert!(
        out.stdout.is_empty(),
        "nothing is printed before the error: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert_eq!(stderr.trim_end().lines().count(), 1, "one line: {stderr}");
    assert!(stderr.starts_with("oomfix: "), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    for p in phrases {
        assert!(stderr.contains(p), "{p}: {stderr}");
    }
    stderr
}

/// `f` run on each of `world` in-process ranks (threads over
/// [`ThreadComm`](oomfix::strategies::shard::ThreadComm)): each rank's
/// result, by rank.
pub fn on_thread_ranks<R: Send>(
    world: usize,
    f: impl Fn(Box<dyn oomfix::strategies::shard::Comm>) -> R + Sync,
) -> Vec<R> {
    use oomfix::strategies::shard::ThreadComm;
    std::thread::scope(|s| {
        let handles: Vec<_> = ThreadComm::group(world)
            .into_iter()
            .map(|comm| {
                let f = &f;
                s.spawn(move || f(Box::new(comm)))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Sets every variable of `model` to seeded N(0, 0.2²) values (LoRA's
/// B starts at zero, which would give A no gradient).
pub fn seeded_variables(model: &oomfix::train::HubModel) {
    use rand::{rngs::StdRng, Rng, SeedableRng};
    let mut rng = StdRng::seed_from_u64(3);
    for (_, var) in model.named_vars() {
        let values: Vec<f32> = (0..var.elem_count())
            .map(|_| rng.sample::<f32, _>(rand_distr::StandardNormal) * 0.2)
            .collect();
        let t =
            candle_core::Tensor::from_vec(values, var.shape(), &candle_core::Device::Cpu).unwrap();
        var.set(&t.to_dtype(var.dtype()).unwrap()).unwrap();
    }
}
