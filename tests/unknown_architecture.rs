//! A `.safetensors` of an unknown architecture through the real binary: a
//! generic estimate, labelled plainly as a lower bound wherever a plan is
//! said to fit.

mod common;

use common::*;
use tempfile::TempDir;

/// An encoder of five mixing layers oomfix has no family for.
fn unknown_model(dir: &TempDir) -> std::path::PathBuf {
    let path = dir.path().join("model.safetensors");
    write_safetensors(&path, &unknown_encoder());
    path
}

#[test]
fn the_table_says_activations_are_not_modelled() {
    let dir = TempDir::new().unwrap();
    let table = stdout_of(
        oomfix()
            .args(["--budget", "1GiB", "--device", "cpu"])
            .arg(unknown_model(&dir)),
        0,
    );
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
    let v = json_of(
        oomfix()
            .args(["--budget", "1GiB", "--device", "cpu", "--json"])
            .arg(unknown_model(&dir)),
        0,
    );
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
    let plan = || {
        let mut cmd = oomfix();
        cmd.args(["--budget", "1GiB", "--device", "cpu", "--seq-len", "32"])
            .arg(tiny_gpt2_file(dir.path()));
        cmd
    };
    let v = json_of(plan().arg("--json"), 0);
    assert_eq!(v["activations_modelled"], true);
    assert_eq!(v["estimate_is_lower_bound"], false);
    let table = String::from_utf8(plan().output().unwrap().stdout).unwrap();
    assert!(
        !table.contains("not modelled") && !table.contains("yes*"),
        "{table}"
    );
}
