//! Each exit code of the real binary: 0 done, 1 nothing fits, 2 usage or
//! input (a corrupt checkpoint included), 3 a failure while running (a
//! write that fails). 130/143 (signals) and 3 for a NaN loss are in
//! tests/train_cli.rs.

mod common;

use assert_cmd::Command;
use common::{oomfix_process, start_until, tiny_dir, train_tiny};
use predicates::prelude::*;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

fn oomfix(dir: &Path) -> Command {
    let mut cmd = common::oomfix_in(dir);
    cmd.timeout(Duration::from_secs(120));
    cmd
}

#[test]
fn exit_0_when_a_plan_fits_inspect_succeeds_or_training_ends() {
    let d = tiny_dir();
    let dir = d.path();
    oomfix(dir).args(["--budget", "8GiB"]).assert().code(0);
    oomfix(dir)
        .args(["plan", "tiny.safetensors", "--budget", "2GiB", "--json"])
        .assert()
        .code(0);
    oomfix(dir)
        .args(["inspect", "tiny.safetensors"])
        .assert()
        .code(0);
    oomfix(dir)
        .args(train_tiny("1GiB"))
        .args(["--steps", "2"])
        .assert()
        .code(0)
        .stderr(predicate::str::contains("step 2/2"));
}

#[test]
fn exit_1_when_nothing_fits_and_train_runs_nothing() {
    let d = tiny_dir();
    let dir = d.path();
    oomfix(dir)
        .args(["--budget", "100MiB"])
        .assert()
        .code(1)
        .stdout(predicate::str::contains("nothing fits"));
    oomfix(dir)
        .args(train_tiny("64KiB"))
        .args(["--steps", "2", "--save", "ck"])
        .assert()
        .code(1)
        .stdout(predicate::str::contains("nothing fits"))
        .stderr(predicate::str::contains("step 1/").not());
    assert!(!dir.join("ck").exists());
}

#[test]
fn exit_2_for_usage_and_input_errors() {
    let d = tiny_dir();
    let dir = d.path();
    for args in [
        &["--budget", "8GiB", "--no-such-option"][..],
        &["--budget", "8GiB", "--device", "tpu"],
        &["--global-batch", "8"],
        &["--budget", "8GiB", "missing.safetensors"],
        &["inspect", "missing.safetensors"],
        &["inspect"],
        // ranks on the CPU need MPI, which the default build lacks (refused before measuring)
        &[
            "train",
            "tiny.safetensors",
            "--budget",
            "2GiB",
            "--gpus",
            "2",
            "--verify",
            "--device",
            "cpu",
        ],
    ] {
        oomfix(dir)
            .args(args)
            .assert()
            .code(2)
            .stdout(predicate::str::is_empty())
            .stderr(predicate::str::starts_with("oomfix: "));
    }
    std::fs::write(dir.join("bad.safetensors"), b"not a safetensors file").unwrap();
    oomfix(dir)
        .args(["--budget", "8GiB", "bad.safetensors"])
        .assert()
        .code(2)
        .stderr(predicate::str::contains("bad.safetensors"));
}

#[test]
fn exit_2_for_a_corrupt_checkpoint() {
    let d = tiny_dir();
    let dir = d.path();
    oomfix(dir)
        .args(train_tiny("1GiB"))
        .args(["--steps", "1", "--save", "ck"])
        .assert()
        .code(0);
    std::fs::rename(dir.join("ck"), dir.join("corrupt")).unwrap();
    let file = dir.join("corrupt/optimizer.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x01;
    std::fs::write(&file, &bytes).unwrap();
    oomfix(dir)
        .args(train_tiny("1GiB"))
        .args(["--steps", "2", "--resume", "corrupt"])
        .assert()
        .code(2)
        .stderr(predicate::str::contains("corrupt/optimizer.safetensors: "))
        .stderr(predicate::str::contains("step 2/").not());
}

#[test]
#[cfg(target_os = "linux")]
fn exit_3_when_the_result_cannot_be_written() {
    let d = tiny_dir();
    let dir = d.path();
    for args in [
        &["--budget", "8GiB"][..],
        &["--budget", "8GiB", "--json"],
        &["inspect", "tiny.safetensors"],
    ] {
        let out = oomfix_process(dir)
            .args(args)
            .stdout(std::fs::File::create("/dev/full").unwrap())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(3), "{args:?}: {stderr}");
        assert!(
            stderr.contains("oomfix: writing the result to stdout: no space left on device"),
            "{args:?}: {stderr}"
        );
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
}

#[test]
fn exit_0_when_stdout_is_a_closed_pipe() {
    let d = tiny_dir();
    let mut child = oomfix_process(d.path())
        .args(["--budget", "8GiB"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn exit_3_when_a_checkpoint_cannot_be_written_during_training() {
    let d = tiny_dir();
    let dir = d.path();
    let out_dir = dir.join("out");
    std::fs::create_dir(&out_dir).unwrap();
    let (mut child, mut err, _) = start_until(
        oomfix_process(dir).args(train_tiny("1GiB")).args([
            "--steps",
            "1000000",
            "--save",
            "out/ck",
            "--save-every",
            "1",
        ]),
        |line| line.starts_with("step 2/"),
    );
    // The directory the checkpoints go to disappears: the next save fails.
    while out_dir.exists() {
        let _ = std::fs::remove_dir_all(&out_dir);
    }
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut err, &mut rest).unwrap();
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(3), "{rest}");
    let last = rest.lines().last().unwrap_or_default();
    assert!(
        last.starts_with("oomfix: ") && last.contains("out/ck"),
        "{rest}"
    );
}
