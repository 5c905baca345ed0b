//! `oomfix::inspect` on Hub-shaped models (written sparse) and on every class of bad input.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::*;
use oomfix::{inspect, Family, ModelConfig, ModelSpec};
use serde_json::json;
use tempfile::TempDir;

fn ok(path: &Path) -> ModelSpec {
    inspect(path).unwrap_or_else(|e| panic!("{e}"))
}

/// The error for `path`: an input error whose message names `path`.
fn input_error(path: &Path) -> String {
    let err = inspect(path).expect_err("bad input was accepted");
    let msg = err.to_string();
    assert!(err.is_input(), "not an input error: {msg}");
    assert!(
        msg.contains(&path.display().to_string()),
        "message does not name {}: {msg}",
        path.display()
    );
    msg
}

/// Checks that one of `spec`'s assumptions says `phrase`.
fn assumes(spec: &ModelSpec, phrase: &str) {
    let said = spec.assumptions.iter().any(|a| a.contains(phrase));
    assert!(said, "{phrase}: {:?}", spec.assumptions);
}

fn assert_mentions(msg: &str, phrase: &str) {
    assert!(msg.contains(phrase), "expected {phrase:?} in: {msg}");
}

/// The input error for a file whose length field says `length`, then
/// `header` and `data_len` bytes of data.
fn raw_error(length: u64, header: &[u8], data_len: u64) -> String {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("bad.safetensors");
    write_raw(&path, length, header, data_len);
    input_error(&path)
}

/// An input error for a file with `header` and `data_len` bytes of data.
fn header_error(header: &str, data_len: u64) -> String {
    raw_error(header.len() as u64, header.as_bytes(), data_len)
}

// ---- families ----------------------------------------------------------------------------

#[test]
fn gpt2_small_with_mask_buffers() {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("model.safetensors");
    write_safetensors(&path, &gpt2_hub_tensors(&ModelConfig::gpt2_small(), ""));
    let spec = ok(&path);
    assert_eq!(spec.parameters(), 124_439_808);
    assert_eq!(spec.config, ModelConfig::gpt2_small());
    assert_eq!(spec.dtype, "F32");
    assert_eq!(spec.source, path.display().to_string());
    assert!(spec.tensors.iter().all(|t| !t.name.ends_with(".attn.bias")));
    // file_bytes covers every tensor in the file, buffers included.
    assert_eq!(spec.file_bytes, 124_439_808 * 4 + 12 * 1024 * 1024 * 4);
    assumes(&spec, "12 attention heads assumed");
}

#[test]
fn gpt2_with_transformer_prefix_and_stored_lm_head() {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("model.safetensors");
    let c = ModelConfig::gpt2_small();
    let mut tensors = gpt2_hub_tensors(&c, "transformer.");
    tensors.push(("lm_head.weight".into(), "F32", vec![c.vocab, c.hidden]));
    for l in 0..c.layers {
        tensors.push((format!("transformer.h.{l}.attn.masked_bias"), "F32", vec![]));
    }
    write_safetensors(&path, &tensors);
    let spec = ok(&path);
    assert_eq!(spec.config.family, Family::Gpt2);
    assert_eq!(
        spec.parameters(),
        124_439_808,
        "lm_head tied to wte counts once"
    );
    assert!(spec.config.tied_embeddings);
    assert_eq!(spec.config.layers, 12);
}

#[test]
fn gpt2_heads_from_config_json() {
    let dir = TempDir::new().unwrap();
    let c = ModelConfig::gpt2(2, 128, 8);
    write_safetensors(
        &dir.path().join("model.safetensors"),
        &gpt2_hub_tensors(&c, ""),
    );
    write_json(
        &dir.path().join("config.json"),
        &json!({"n_head": 8, "n_positions": 1024, "n_inner": null}),
    );
    let spec = ok(&dir.path().join("model.safetensors"));
    assert_eq!(spec.config, c);
    assert!(spec.assumptions.is_empty(), "{:?}", spec.assumptions);
}

#[test]
fn llama2_7b() {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("model.safetensors");
    let c = ModelConfig::llama2_7b();
    let mut tensors = with_dtype(c.tensors(), "F16");
    for l in 0..c.layers {
        tensors.push((
            format!("model.layers.{l}.self_attn.rotary_emb.inv_freq"),
            "F32",
            vec![64],
        ));
    }
    write_safetensors(&path, &tensors);
    let spec = ok(&path);
    assert_eq!(spec.parameters(), 6_738_415_616);
    assert_eq!(spec.config.family, Family::Llama);
    assert_eq!((spec.config.layers, spec.config.hidden), (32, 4096));
    assert_eq!((spec.config.heads, spec.config.kv_heads), (32, 32));
    assert_eq!(
        (spec.config.intermediate, spec.config.vocab),
        (11008, 32000)
    );
    assert!(!spec.config.tied_embeddings);
    assert_eq!(spec.dtype, "F16");
    assumes(&spec, "head size 128 assumed");
}

fn write_tinyllama(dir: &Path) {
    let tensors = with_dtype(ModelConfig::tinyllama_1_1b().tensors(), "BF16");
    write_safetensors(&dir.join("model.safetensors"), &tensors);
}

#[test]
fn tinyllama_gqa_from_config_json() {
    let dir = TempDir::new().unwrap();
    write_tinyllama(dir.path());
    write_json(
        &dir.path().join("config.json"),
        &json!({"num_attention_heads": 32, "num_key_value_heads": 4, "max_position_embeddings": 2048,
                "tie_word_embeddings": false, "hidden_size": 2048}),
    );
    let spec = ok(&dir.path().join("model.safetensors"));
    assert_eq!((spec.config.heads, spec.config.kv_heads), (32, 4));
    assert_eq!(spec.config.max_positions, 2048);
    assert_eq!(spec.parameters(), 1_100_048_384);
    assert_eq!(spec.dtype, "BF16");
    assert!(spec.assumptions.is_empty(), "{:?}", spec.assumptions);
}

#[test]
fn tinyllama_without_config_records_the_guess() {
    let dir = TempDir::new().unwrap();
    write_tinyllama(dir.path());
    let spec = ok(&dir.path().join("model.safetensors"));
    // Head size 128 is the guess for hidden 2048: 16 heads, 256 / 128 = 2 KV heads.
    assert_eq!((spec.config.heads, spec.config.kv_heads), (16, 2));
    assumes(&spec, "no config.json");
}

#[test]
fn bert_with_prefix_old_layer_norm_names_and_mlm_head() {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("model.safetensors");
    let c = ModelConfig::bert_base();
    let mut tensors: Vec<_> = with_dtype(c.tensors(), "F32")
        .into_iter()
        .map(|(n, d, s)| {
            (
                n.replace("LayerNorm.weight", "LayerNorm.gamma")
                    .replace("LayerNorm.bias", "LayerNorm.beta"),
                d,
                s,
            )
        })
        .collect();
    assert!(tensors.iter().any(|t| t.0.ends_with("LayerNorm.gamma")));
    let h = c.hidden;
    tensors.extend([
        (
            "bert.embeddings.position_ids".to_string(),
            "I64",
            vec![1, 512],
        ),
        ("bert.pooler.dense.weight".into(), "F32", vec![h, h]),
        ("bert.pooler.dense.bias".into(), "F32", vec![h]),
        (
            "cls.predictions.decoder.weight".into(),
            "F32",
            vec![c.vocab, h],
        ),
        ("cls.predictions.decoder.bias".into(), "F32", vec![c.vocab]),
    ]);
    write_safetensors(&path, &tensors);
    let spec = ok(&path);
    assert_eq!(spec.config, c);
    let pooler = (h * h + h) as u64;
    assert_eq!(
        spec.parameters(),
        c.parameter_count() + pooler,
        "decoder tied, position_ids a buffer, pooler counted"
    );
}

#[test]
fn bert_without_prefix() {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("model.safetensors");
    let c = ModelConfig::bert(2, 128, 2, 1000);
    let tensors: Vec<_> = with_dtype(c.tensors(), "F16")
        .into_iter()
        .filter(|(n, _, _)| n.starts_with("bert."))
        .map(|(n, d, s)| (n["bert.".len()..].to_string(), d, s))
        .collect();
    write_safetensors(&path, &tensors);
    let spec = ok(&path);
    assert_eq!(spec.config.family, Family::Bert);
    assert_eq!(
        (
            spec.config.layers,
            spec.config.hidden,
            spec.config.intermediate
        ),
        (2, 128, 512)
    );
    assert_eq!(
        spec.parameters(),
        tensors
            .iter()
            .map(|t| t.2.iter().product::<usize>() as u64)
            .sum::<u64>()
    );
}

#[test]
fn qwen2_like_biases_and_tied_head() {
    let dir = TempDir::new().unwrap();
    let c = ModelConfig {
        qkv_bias: true,
        max_positions: 32768,
        ..ModelConfig::llama(2, 256, 4, 2, 704, 1000, true)
    };
    write_safetensors(
        &dir.path().join("model.safetensors"),
        &with_dtype(c.tensors(), "BF16"),
    );
    write_json(
        &dir.path().join("config.json"),
        &json!({"num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32768,
                "tie_word_embeddings": true}),
    );
    let spec = ok(dir.path());
    assert_eq!(spec.config, c);
    assert_eq!(spec.parameters(), c.parameter_count());
    assert!(spec
        .tensors
        .iter()
        .any(|t| t.name == "model.layers.1.self_attn.k_proj.bias"));
}

#[test]
fn generic_unknown_model() {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("model.safetensors");
    let mut tensors = unknown_encoder();
    tensors.extend((0..5).map(|l| (format!("encoder.blocks.{l}.step"), "I64", vec![])));
    write_safetensors(&path, &tensors);
    let spec = ok(&path);
    assert_eq!(spec.config.family, Family::Generic);
    assert_eq!(spec.config.layers, 5);
    assert_eq!(
        (spec.config.hidden, spec.config.heads, spec.config.vocab),
        (0, 0, 0)
    );
    assert_eq!(
        spec.parameters(),
        64 * 3 + 5 * 64 * 64,
        "integer tensors are not trainable"
    );
    assumes(&spec, "estimates are generic");
}

// ---- several files ------------------------------------------------------------------------

/// A small Llama split over two shards with an index; returns its config.
fn write_sharded(dir: &Path) -> ModelConfig {
    let c = ModelConfig::llama(4, 256, 4, 4, 512, 1000, false);
    let tensors = with_dtype(c.tensors(), "F16");
    let (first, second) = tensors.split_at(tensors.len() / 2);
    let shards = [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ];
    write_safetensors(&dir.join(shards[0]), first);
    write_safetensors(&dir.join(shards[1]), second);
    let map: Vec<(&str, &str)> = first
        .iter()
        .map(|t| (t.0.as_str(), shards[0]))
        .chain(second.iter().map(|t| (t.0.as_str(), shards[1])))
        .collect();
    write_index(&dir.join("model.safetensors.index.json"), &map);
    c
}

#[test]
fn sharded_index() {
    let dir = TempDir::new().unwrap();
    let c = write_sharded(dir.path());
    let spec = ok(&dir.path().join("model.safetensors.index.json"));
    assert_eq!(spec.config.family, Family::Llama);
    assert_eq!(spec.config.layers, 4);
    assert_eq!(spec.parameters(), c.parameter_count());
    assert_eq!(spec.file_bytes, 2 * c.parameter_count());
}

#[test]
fn directory_uses_its_index() {
    let dir = TempDir::new().unwrap();
    let c = write_sharded(dir.path());
    // A stray file the index does not name is ignored.
    write_safetensors(&dir.path().join("extra.safetensors"), &[("x", "F32", [7])]);
    let spec = ok(dir.path());
    assert_eq!(spec.parameters(), c.parameter_count());
}

#[test]
fn directory_without_index_reads_every_file() {
    let dir = TempDir::new().unwrap();
    let c = ModelConfig::gpt2(2, 64, 1);
    let tensors = gpt2_hub_tensors(&c, "");
    let (a, b) = tensors.split_at(10);
    write_safetensors(&dir.path().join("b.safetensors"), b);
    write_safetensors(&dir.path().join("a.safetensors"), a);
    std::fs::write(dir.path().join("README.md"), "not weights").unwrap();
    let spec = ok(dir.path());
    assert_eq!(spec.parameters(), c.parameter_count());
    assert_eq!(
        spec.tensors[0].name, "wte.weight",
        "files are read in name order"
    );
}

#[test]
fn hundred_gigabyte_sparse_file_inspects_instantly() {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("huge.safetensors");
    write_safetensors(&path, &[("blob.weight", "F16", [50_000, 1_000_000])]);
    assert_eq!(std::fs::metadata(&path).unwrap().len() / 1_000_000_000, 100);
    let start = Instant::now();
    let spec = ok(&path);
    let took = start.elapsed();
    assert_eq!(spec.file_bytes, 100_000_000_000);
    assert_eq!(spec.parameters(), 50_000_000_000);
    assert!(took < Duration::from_millis(500), "took {took:?}");
}

// ---- bad input: one test per class --------------------------------------------------------

#[test]
fn missing_path() {
    let dir = TempDir::new().unwrap();
    assert_mentions(
        &input_error(&dir.path().join("nope.safetensors")),
        "no such file or directory",
    );
}

/// A file the reader may not open. Root opens any file, so as root the
/// check runs `oomfix inspect` as the unprivileged user `nobody` (uid 65534),
/// for whom the mode is enforced.
#[test]
fn unreadable_file() {
    use std::os::unix::fs::PermissionsExt;
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("model.safetensors");
    write_safetensors(&path, &[("w", "F32", [4])]);
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o000)).unwrap();
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        assert_mentions(&input_error(&path), "permission denied");
        return;
    }
    use std::os::unix::process::CommandExt;
    // `nobody` may enter the directory, not read the file.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let out = std::process::Command::new(assert_cmd::cargo::cargo_bin("oomfix"))
        .arg("inspect")
        .arg(&path)
        .uid(65534)
        .gid(65534)
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert_mentions(&stderr, &path.display().to_string());
    assert_mentions(&stderr, "permission denied");
}

#[test]
fn shard_that_is_a_directory() {
    let dir = TempDir::new().unwrap();
    std::fs::create_dir(dir.path().join("shard.safetensors")).unwrap();
    let index = dir.path().join("model.safetensors.index.json");
    write_index(&index, &[("w", "shard.safetensors")]);
    let err = inspect(&index).unwrap_err();
    assert!(err.is_input());
    let shard = dir.path().join("shard.safetensors");
    assert_mentions(
        &err.to_string(),
        &format!("{}: cannot read", shard.display()),
    );
}

#[test]
fn empty_file() {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("empty.safetensors");
    std::fs::write(&path, b"").unwrap();
    assert_mentions(&input_error(&path), "file is empty");
}

#[test]
fn shorter_than_length_field() {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("short.safetensors");
    std::fs::write(&path, b"\x10\x00\x00").unwrap();
    assert_mentions(
        &input_error(&path),
        "only 3 bytes, shorter than the 8-byte header length",
    );
}

#[test]
fn header_length_larger_than_file() {
    assert_mentions(
        &raw_error(1000, b"{}", 0),
        "header length 1000 is larger than the file: only 2 bytes follow",
    );
}

#[test]
fn absurd_header_length_is_refused_before_allocating() {
    assert_mentions(
        &raw_error(u64::MAX, b"{}", 0),
        "over the safetensors limit of 100000000 bytes",
    );
    // Even when the file is long enough to hold it (sparse 1 GiB file).
    assert_mentions(
        &raw_error(200 << 20, b"{}", 1 << 30),
        "header length field says 209715200 bytes, over the safetensors limit of 100000000 bytes",
    );
    // One byte over the reference library's limit (which is under 100 MiB).
    assert_mentions(
        &raw_error(100_000_001, b"{}", 100_000_000),
        "header length field says 100000001 bytes, over the safetensors limit",
    );
}

#[test]
fn header_not_utf8() {
    assert_mentions(&raw_error(4, b"{\"\xc3\x28", 0), "header is not UTF-8");
}

#[test]
fn header_not_json() {
    assert_mentions(
        &header_error("{\"a\": {\"dtype\": ", 0),
        "header is not valid JSON",
    );
}

#[test]
fn header_json_not_an_object() {
    assert_mentions(
        &header_error("[1, 2, 3]", 0),
        "header is JSON but not an object (it is an array)",
    );
}

#[test]
fn tensor_entry_not_an_object() {
    assert_mentions(
        &header_error(r#"{"w": [0, 4]}"#, 4),
        r#"tensor "w": entry is an array, not an object"#,
    );
}

#[test]
fn tensor_entry_missing_fields() {
    let cases = [
        (
            r#"{"w":{"shape":[1],"data_offsets":[0,4]}}"#,
            "missing \"dtype\"",
        ),
        (
            r#"{"w":{"dtype":"F32","data_offsets":[0,4]}}"#,
            "missing \"shape\"",
        ),
        (
            r#"{"w":{"dtype":"F32","shape":[1]}}"#,
            "missing \"data_offsets\"",
        ),
    ];
    for (header, want) in cases {
        assert_mentions(&header_error(header, 4), want);
    }
}

#[test]
fn unknown_dtype() {
    let msg = header_error(&tensor_w("F17", "[1]", "[0,4]"), 4);
    assert_mentions(&msg, r#"tensor "w": unknown dtype "F17""#);
}

#[test]
fn negative_non_integer_and_overflowing_dims() {
    let shape = |dims: &str| tensor_w("F32", dims, "[0,16]");
    let cases = [
        (shape("[2,-2]"), "negative dimension -2"),
        (shape("[2,2.5]"), "non-integer dimension 2.5"),
        (shape(r#"[2,"2"]"#), "is a string, not an integer"),
        (
            shape("[4294967296,4294967296,4]"),
            "overflows a 64-bit byte count",
        ),
    ];
    for (header, want) in cases {
        assert_mentions(&header_error(&header, 16), want);
    }
}

#[test]
fn malformed_data_offsets() {
    let offsets = |range: &str| tensor_w("F32", "[1]", range);
    let cases = [
        (offsets("[0,4,8]"), "two non-negative integers"),
        (offsets("[-4,0]"), "two non-negative integers"),
        (offsets(r#""0-4""#), "two non-negative integers"),
        (offsets("[4,0]"), "data_offsets [4, 0] begin after they end"),
    ];
    for (header, want) in cases {
        assert_mentions(&header_error(&header, 4), want);
    }
}

#[test]
fn shape_and_byte_range_disagree() {
    let msg = header_error(&tensor_w("BF16", "[3,2]", "[0,24]"), 24);
    assert_mentions(
        &msg,
        "shape [3, 2] of BF16 needs 12 bytes but data_offsets [0, 24] span 24",
    );
}

#[test]
fn offsets_past_the_data_region() {
    let msg = header_error(&tensor_w("F32", "[4]", "[0,16]"), 10);
    assert_mentions(
        &msg,
        "data_offsets [0, 16] reach past the end of the data region (10 bytes",
    );
}

#[test]
fn overlapping_ranges() {
    let header = r#"{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},
                     "b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}}"#;
    assert_mentions(
        &header_error(header, 16),
        r#"tensors "a" [0, 16] and "b" [8, 16] overlap"#,
    );
}

#[test]
fn gap_between_ranges_and_unused_tail() {
    // Unordered keys are fine; the gap is what is wrong.
    let header = r#"{"b":{"dtype":"F32","shape":[2],"data_offsets":[20,28]},
                     "a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#;
    assert_mentions(
        &header_error(header, 28),
        r#"gap of 4 unused bytes in the data region before tensor "b""#,
    );
    let tail = r#"{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#;
    assert_mentions(
        &header_error(tail, 20),
        "gap of 4 unused bytes at the end of the data region",
    );
}

#[test]
fn duplicate_tensor_names() {
    let header = r#"{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},
                     "w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}"#;
    assert_mentions(&header_error(header, 8), r#"duplicate tensor name "w""#);
}

#[test]
fn metadata_not_string_to_string() {
    let tensor = r#""w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}"#;
    let msg = header_error(&format!(r#"{{"__metadata__":{{"step":100}},{tensor}}}"#), 4);
    assert_mentions(
        &msg,
        r#""__metadata__" must map strings to strings, but "step" is a number"#,
    );
    let msg = header_error(&format!(r#"{{"__metadata__":["pt"],{tensor}}}"#), 4);
    assert_mentions(
        &msg,
        r#""__metadata__" must be an object of strings, but it is an array"#,
    );
}

#[test]
fn no_trainable_tensors() {
    assert_mentions(&header_error("{}", 0), "holds no floating-point tensors");
}

#[test]
fn directory_without_weights() {
    let dir = TempDir::new().unwrap();
    std::fs::write(dir.path().join("pytorch_model.bin"), b"pickle").unwrap();
    assert_mentions(
        &input_error(dir.path()),
        "directory holds no .safetensors weights",
    );
}

#[test]
fn index_naming_a_missing_shard() {
    let dir = TempDir::new().unwrap();
    write_sharded(dir.path());
    std::fs::remove_file(dir.path().join("model-00002-of-00002.safetensors")).unwrap();
    let msg = input_error(&dir.path().join("model.safetensors.index.json"));
    assert_mentions(
        &msg,
        r#"weight_map names shard "model-00002-of-00002.safetensors", but "#,
    );
    assert_mentions(&msg, "does not exist");
}

#[test]
fn index_naming_a_tensor_its_shard_lacks() {
    let dir = TempDir::new().unwrap();
    write_safetensors(&dir.path().join("s.safetensors"), &[("a", "F32", [2])]);
    let index = dir.path().join("model.safetensors.index.json");
    write_index(&index, &[("a", "s.safetensors"), ("b", "s.safetensors")]);
    assert_mentions(
        &input_error(&index),
        r#"weight_map puts "b" in "s.safetensors", but that shard has no such tensor"#,
    );
}

#[test]
fn index_without_a_weight_map_object() {
    let dir = TempDir::new().unwrap();
    let index = dir.path().join("model.safetensors.index.json");
    write_json(&index, &json!({"metadata": {}}));
    assert_mentions(&input_error(&index), "no \"weight_map\" object");
    write_json(&index, &json!({"weight_map": ["a", "b"]}));
    assert_mentions(
        &input_error(&index),
        "\"weight_map\" is an array, not an object",
    );
    write_json(&index, &json!({"weight_map": {"a": 1}}));
    assert_mentions(
        &input_error(&index),
        "weight_map entry \"a\" is a number, not a shard file name",
    );
    std::fs::write(&index, "{\"weight_map\": ").unwrap();
    assert_mentions(&input_error(&index), "index is not valid JSON");
}

#[test]
fn tensor_in_two_files_of_a_directory() {
    let dir = TempDir::new().unwrap();
    write_safetensors(&dir.path().join("a.safetensors"), &[("w", "F32", [2])]);
    write_safetensors(&dir.path().join("b.safetensors"), &[("w", "F32", [2])]);
    assert_mentions(&input_error(dir.path()), r#"tensor "w" is in both"#);
}

#[test]
fn malformed_config_json_is_named() {
    let dir = TempDir::new().unwrap();
    let weights = dir.path().join("model.safetensors");
    write_safetensors(
        &weights,
        &gpt2_hub_tensors(&ModelConfig::gpt2(1, 64, 1), ""),
    );
    let config = dir.path().join("config.json");
    std::fs::write(&config, "{\"n_head\": 4,").unwrap();
    let err = inspect(&weights).unwrap_err();
    assert!(err.is_input());
    let msg = err.to_string();
    assert!(
        msg.starts_with(&format!("{}: not valid JSON", config.display())),
        "{msg}"
    );
    write_json(&config, &json!({"n_head": "four"}));
    assert_mentions(
        &inspect(&weights).unwrap_err().to_string(),
        "\"n_head\" is \"four\", not a non-negative integer",
    );
    write_json(&config, &json!({"n_head": 3}));
    assert_mentions(
        &inspect(&weights).unwrap_err().to_string(),
        "num_attention_heads 3 does not divide",
    );
}
