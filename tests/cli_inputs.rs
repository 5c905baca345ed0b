//! Every class of malformed input, through the real binary: exit code 2, one
//! line on stderr naming the file and the problem, nothing on stdout, no panic.

mod common;

use common::*;
use std::path::{Path, PathBuf};

fn rejects(path: &Path, phrase: &str) {
    for args in [vec!["inspect"], vec!["--budget", "8GiB"]] {
        let out = oomfix()
            .args(&args)
            .arg(path)
            .env("RUST_BACKTRACE", "1")
            .output()
            .unwrap();
        // Names the file and says `phrase`.
        let stderr = refused(&out, &[&path.display().to_string()]);
        let said = stderr.to_lowercase().contains(phrase);
        assert!(said, "{args:?}: says `{phrase}`: {stderr}");
        assert!(!stderr.contains("backtrace"), "{stderr}");
    }
}

fn file(dir: &tempfile::TempDir, name: &str) -> PathBuf {
    dir.path().join(name)
}

/// `m.safetensors` in `dir`: a length field of `length`, then `header` and
/// `data_len` bytes of data.
fn raw(dir: &tempfile::TempDir, length: u64, header: &[u8], data_len: u64) -> PathBuf {
    let p = file(dir, "m.safetensors");
    write_raw(&p, length, header, data_len);
    p
}

fn header(dir: &tempfile::TempDir, header: &str, data_len: u64) -> PathBuf {
    raw(dir, header.len() as u64, header.as_bytes(), data_len)
}

const W: &str = r#""w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}"#;

#[test]
fn truncated_files() {
    let d = tempfile::tempdir().unwrap();
    let p = file(&d, "empty.safetensors");
    std::fs::write(&p, b"").unwrap();
    rejects(&p, "empty");
    std::fs::write(&p, b"abc").unwrap();
    rejects(&p, "8");
}

#[test]
fn lying_header_lengths() {
    let d = tempfile::tempdir().unwrap();
    rejects(&raw(&d, 1000, b"{}", 0), "header");
    rejects(&raw(&d, u64::MAX, b"{}", 0), "header");
}

#[test]
fn headers_that_are_not_json_objects() {
    let d = tempfile::tempdir().unwrap();
    rejects(&raw(&d, 4, &[0xff, 0xfe, 0x7b, 0x7d], 0), "utf-8");
    rejects(&header(&d, "{not json", 0), "json");
    rejects(&header(&d, "[1,2]", 0), "object");
}

#[test]
fn bad_tensor_entries() {
    let d = tempfile::tempdir().unwrap();
    for (json, says) in [
        (tensor_w("F33", "[2]", "[0,8]"), "dtype"),
        (tensor_w("F32", "[-2]", "[0,8]"), "shape"),
        (tensor_w("F32", "[1.5]", "[0,8]"), "shape"),
        (tensor_w("F32", "[3]", "[0,8]"), "bytes"),
        (tensor_w("F32", "[4]", "[0,16]"), "data"),
        (
            r#"{"w":{"dtype":"F32","shape":[2]}}"#.into(),
            "data_offsets",
        ),
    ] {
        rejects(&header(&d, &json, 8), says);
    }
}

#[test]
fn overlapping_unordered_and_duplicate_ranges() {
    let d = tempfile::tempdir().unwrap();
    let overlap = format!(r#"{{{W},"v":{{"dtype":"F32","shape":[2,2],"data_offsets":[8,24]}}}}"#);
    rejects(&header(&d, &overlap, 24), "overlap");
    let dup = format!(r#"{{{W},{W}}}"#);
    rejects(&header(&d, &dup, 16), "duplicate");
}

#[test]
fn directories_and_indexes() {
    let d = tempfile::tempdir().unwrap();
    rejects(d.path(), "no");
    let index = file(&d, "model.safetensors.index.json");
    write_index(&index, &[("w", "missing-00001.safetensors")]);
    rejects(&index, "missing-00001.safetensors");
    std::fs::write(&index, b"{\"weight_map\": 3}").unwrap();
    rejects(&index, "weight_map");
}

#[test]
fn missing_path() {
    let d = tempfile::tempdir().unwrap();
    rejects(&file(&d, "nope.safetensors"), "no such file");
}
