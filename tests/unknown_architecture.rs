//! A `.safetensors` of an unknown architecture through the real binary: a
//! generic estimate, labelled plainly as a lower bound wherever a plan is
//! said to fit.

mod common;

use assert_cmd::Command;
use common::*;
use serde_json::Value;
use tempfile::TempDir;

fn oomfix() -> Command {
    let mut cmd = Command::cargo_bin("oomfix").unwrap();
    cmd.env_remove("RUST_LOG");
    cmd
}

/// An encoder of five mixing layers oomfix has no family for.
fn unknown_model(dir: &TempDir) -> std::path::PathBuf {
    let path = dir.path().join("model.safetensors");
    let mut tensors = vec![("stem.weight".to_string(), "F32", vec![64, 3])];
    for l in 0..5 {
        tensors.push((
            format!("encoder.blocks.{l}.mix.weight"),
            "F32",
            vec![64, 64],
        ));
    }
    write_safetensors(&path, &tensors);
    path
}

#[test]
fn the_table_says_activations_are_not_modelled() {
    let dir = TempDir::new().unwrap();
    let out = oomfix()
        .args(["--budget", "1GiB", "--device", "cpu"])
        .arg(unknown_model(&dir))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    let table = String::from_utf8(out.stdout).unwrap();
    assert!(table.contains("activations are not modelled"), "{table}");
    assert!(table.contains("fits on a lower bound only"), "{table}");
    // No attempt row says a bare `yes`: every fit is marked as a lower bound.
    let rows: Vec<&str> = table
        .lines()
        .filter(|l| l.trim_start().starts_with(|c: char| c.is_ascii_digit()))
        .collect();
    assert!(!rows.is_empty());
    for row in rows {
        assert!(row.contains(" yes* ") || row.contains(" no "), "{row}");
    }
}

#[test]
fn the_json_says_the_estimate_is_a_lower_bound() {
    let dir = TempDir::new().unwrap();
    let out = oomfix()
        .args(["--budget", "1GiB", "--device", "cpu", "--json"])
        .arg(unknown_model(&dir))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["model"]["family"], "generic");
    assert_eq!(v["activations_modelled"], false);
    assert_eq!(v["estimate_is_lower_bound"], true);
    assert_eq!(v["fits"], true);
    let attempts = v["attempts"].as_array().unwrap();
    assert!(attempts.iter().all(|a| a["lower_bound"] == true));
    // The generic estimate is still made: the training state of the tensors.
    let parameters = v["model"]["parameters"].as_u64().unwrap();
    assert_eq!(parameters, 64 * 3 + 5 * 64 * 64);
    assert!(v["estimate"]["peak_bytes"].as_u64().unwrap() >= 16 * parameters);
    assert_eq!(v["estimate"]["activations_bytes"], 0);
}

#[test]
fn a_known_family_is_not_labelled() {
    let dir = TempDir::new().unwrap();
    let out = oomfix()
        .args([
            "--budget",
            "1GiB",
            "--device",
            "cpu",
            "--json",
            "--seq-len",
            "32",
        ])
        .arg(tiny_gpt2_file(dir.path()))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["activations_modelled"], true);
    assert_eq!(v["estimate_is_lower_bound"], false);
    let table = oomfix()
        .args(["--budget", "1GiB", "--device", "cpu", "--seq-len", "32"])
        .arg(tiny_gpt2_file(dir.path()))
        .output()
        .unwrap();
    let table = String::from_utf8(table.stdout).unwrap();
    assert!(
        !table.contains("not modelled") && !table.contains("yes*"),
        "{table}"
    );
}
