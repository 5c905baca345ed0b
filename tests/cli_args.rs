//! The command line as a new user tries it, through the real binary: every
//! argument checked before any planning output, options before or after the
//! subcommand, `--verify all`, negative and out-of-range numbers, and the
//! device `train` uses by default.

mod common;

use assert_cmd::Command;
use predicates::prelude::*;
use serde_json::Value;
use std::path::Path;
use std::time::{Duration, Instant};

fn oomfix(dir: &Path) -> Command {
    let mut cmd = common::oomfix_in(dir);
    cmd.env("RUST_BACKTRACE", "1")
        .timeout(Duration::from_secs(60));
    cmd
}

/// A directory with the tiny GPT-2 (`tiny.safetensors`) and `data.bin`
/// (u16 ids 1..=15 repeated).
fn run_dir() -> tempfile::TempDir {
    let dir = common::tiny_dir();
    let ids = (0..50).flat_map(|_| 1u16..16);
    std::fs::write(dir.path().join("data.bin"), common::token_bin(ids)).unwrap();
    dir
}

/// Runs `args` and checks the usage error: exit 2, nothing on stdout, one
/// `oomfix: ` line on stderr that contains `says`, no panic.
fn refused(dir: &Path, args: &[&str], says: &str) {
    eprintln!("{args:?}");
    common::refused(&oomfix(dir).args(args).output().unwrap(), &[says]);
}

#[test]
fn train_arguments_are_checked_before_the_plan_is_printed() {
    let d = run_dir();
    let dir = d.path();
    let with = |extra: &[&'static str]| [&common::train_tiny("1GiB")[..], extra].concat();
    let no_model = ["train", "--device", "cpu", "--budget", "1GiB"];
    refused(
        dir,
        &[&no_model[..], &["--init", "pretrained"]].concat(),
        "--init pretrained needs a model file",
    );
    // The former flag is the same request.
    refused(
        dir,
        &[&no_model[..], &["--pretrained"]].concat(),
        "--init pretrained needs a model file",
    );
    std::fs::create_dir(dir.join("ck")).unwrap();
    std::fs::write(dir.join("ck.safetensors"), b"").unwrap();
    // A data file the model cannot read: ids outside its vocabulary of 256.
    std::fs::write(dir.join("wide.bin"), 1000u16.to_le_bytes().repeat(8)).unwrap();
    for (extra, says) in [
        (&["--data", "missing.bin"][..], "missing.bin"),
        (&["--save", "no/such/dir/ck"], "is not a directory"),
        (&["--save", "ck"], "not an earlier output"),
        (&["--save", "ck.safetensors"], "it is a file"),
        #[cfg(target_os = "linux")]
        (
            &["--save", "/proc/oomfix-ck.safetensors"],
            "cannot write /proc/oomfix-ck.safetensors",
        ),
        (&["--steps", "0"], "--steps"),
        (&["--save-every", "0", "--save", "x"], "--save-every"),
        (&["--resume", "missing"], "missing: cannot read checkpoint"),
        (&["--data", "wide.bin"], "outside the model's vocabulary"),
        (&["--plot", "step.gif"], "gif"),
    ] {
        refused(dir, &with(extra), says);
    }
}

#[test]
fn plan_arguments_are_checked_before_anything_is_printed() {
    let d = run_dir();
    let dir = d.path();
    for (args, says) in [
        (&["--budget", "0"][..], "fits nothing"),
        (&["--budget", "-8GiB"], "--budget"),
        (&["--global-batch", "8"], "a budget is required"),
        (
            &["--budget", "8GiB", "--snapshot", "s.pickle"],
            "--device cpu",
        ),
        (
            &[
                "--budget",
                "8GiB",
                "--device",
                "cpu",
                "--snapshot",
                "no/dir/s.pickle",
            ],
            "is not a directory",
        ),
        (
            &["--budget", "8GiB", "--strategies", "accumulate,teleport"],
            "unknown strategy `teleport`",
        ),
        (
            &["--budget", "8GiB", "--seq-len", "4096"],
            "learned positions",
        ),
    ] {
        refused(dir, args, says);
    }
}

#[test]
fn negative_numbers_get_one_clear_line() {
    let d = run_dir();
    let dir = d.path();
    for (args, option) in [
        (
            &["--budget", "8GiB", "--global-batch", "-1"][..],
            "--global-batch",
        ),
        (&["--budget", "8GiB", "--seq-len", "-16"], "--seq-len"),
        (&["--budget", "8GiB", "--gpus", "-2"], "--gpus"),
        (&["train", "--budget", "8GiB", "--steps", "-5"], "--steps"),
        (&["train", "--budget", "8GiB", "--seed", "-1"], "--seed"),
        (&["train", "--budget", "8GiB", "--lr", "-0.1"], "--lr"),
    ] {
        let out = oomfix(dir).args(args).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{args:?}: {stderr}");
        assert!(stderr.contains(option), "{args:?}: {stderr}");
        assert!(!stderr.contains("-- -"), "no `-- -1` tip: {stderr}");
    }
}

#[test]
fn a_huge_global_batch_is_answered_at_once() {
    let d = run_dir();
    let dir = d.path();
    for n in [
        "18446744073709551615",
        "1048577",
        "99999999999999999999999999",
    ] {
        let start = Instant::now();
        refused(
            dir,
            &["--budget", "8GiB", "--global-batch", n],
            "--global-batch",
        );
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{n}: {:?}",
            start.elapsed()
        );
    }
    // The largest accepted batch is planned (it was 2^20 divisions before).
    let start = Instant::now();
    let v = common::json_of(
        oomfix(dir).args(["--budget", "8GiB", "--global-batch", "1048576", "--json"]),
        0,
    );
    let plan = &v["plan"];
    assert_eq!(
        plan["micro_batch"].as_u64().unwrap() * plan["grad_accum"].as_u64().unwrap(),
        1 << 20
    );
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "{:?}",
        start.elapsed()
    );
    refused(
        dir,
        &[
            "--budget",
            "8GiB",
            "--global-batch",
            "65536",
            "--seq-len",
            "65536",
        ],
        "tokens per optimizer step",
    );
}

#[test]
fn global_options_work_before_or_after_the_subcommand() {
    let d = run_dir();
    let dir = d.path();
    let global = [&["-v"][..], &common::on_cpu("1GiB", "2"), &["--json"]].concat();
    let train = [
        "train",
        "tiny.safetensors",
        "--steps",
        "1",
        "--data",
        "data.bin",
    ];
    let before = oomfix(dir).args(&global).args(train).output().unwrap();
    let after = oomfix(dir).args(train).args(&global).output().unwrap();
    let mut plans = Vec::new();
    for out in [&before, &after] {
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "{stderr}");
        let mut v: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["device"], "cpu");
        assert_eq!(v["plan"]["seq_len"], 16);
        // The run's summary (its times differ from run to run).
        let training = v.as_object_mut().unwrap().remove("training").unwrap();
        assert_eq!(training["steps"], 1);
        plans.push(v);
        // -v: every attempt is logged.
        assert!(stderr.contains("baseline"), "{stderr}");
        assert!(stderr.contains("step 1/1"), "{stderr}");
    }
    assert_eq!(plans[0], plans[1]);
    // The same for `plan` and the logging options.
    let log = dir.join("log.json");
    oomfix(dir)
        .args(["--log-format", "json", "--log-file"])
        .arg(&log)
        .args([
            "--device",
            "cpu",
            "plan",
            "tiny.safetensors",
            "--budget",
            "1GiB",
        ])
        .assert()
        .code(0)
        .stdout(predicate::str::contains("on cpu"));
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.lines().count() >= 1);
    for line in text.lines() {
        serde_json::from_str::<Value>(line).expect(line);
    }
}

#[test]
fn inspect_refuses_planning_options_and_a_misplaced_model_is_named() {
    let d = run_dir();
    let dir = d.path();
    refused(
        dir,
        &["inspect", "tiny.safetensors", "--budget", "8GiB"],
        "--budget is a planning option",
    );
    refused(
        dir,
        &["--device", "cpu", "inspect", "tiny.safetensors"],
        "--device is a planning option",
    );
    oomfix(dir)
        .args(["-v", "--json", "inspect", "tiny.safetensors"])
        .assert()
        .code(0)
        .stdout(predicate::str::contains("\"family\": \"gpt2\""));
    refused(
        dir,
        &["tiny.safetensors", "train", "--budget", "1GiB"],
        "oomfix train tiny.safetensors",
    );
}

#[test]
fn verify_all_works_with_a_space() {
    let d = run_dir();
    let dir = d.path();
    // 64 KiB: nothing fits, so `fitting` measures nothing and `all` everything.
    let measured = |args: &[&str]| -> Vec<bool> {
        let v = common::json_of(
            oomfix(dir)
                .args(common::on_cpu("64KiB", "2"))
                .args(["--strategies", "accumulate", "--json"])
                .args(args),
            1,
        );
        assert_eq!(v["model"]["path"], "tiny.safetensors", "{args:?}");
        let attempts = v["attempts"].as_array().unwrap().iter();
        attempts.map(|a| a["measured_bytes"].is_u64()).collect()
    };
    let space = measured(&["--verify", "all", "tiny.safetensors"]);
    assert_eq!(space, [true, true]);
    assert_eq!(measured(&["--verify=all", "tiny.safetensors"]), space);
    assert_eq!(measured(&["tiny.safetensors", "--verify", "all"]), space);
    // With no value `--verify` measures the fitting attempts (none here),
    // and the model after it stays the model.
    assert_eq!(measured(&["--verify", "tiny.safetensors"]), [false, false]);
}

#[test]
#[cfg(not(feature = "cuda"))]
fn train_without_device_on_a_build_without_cuda_uses_the_cpu_and_says_so() {
    let d = run_dir();
    let dir = d.path();
    let args: Vec<&str> = common::train_tiny("1GiB")
        .into_iter()
        .filter(|a| *a != "--device" && *a != "cpu")
        .collect();
    oomfix(dir)
        .args(&args)
        .args(["--steps", "1"])
        .assert()
        .code(0)
        .stdout(predicate::str::contains("on cpu"))
        .stderr(predicate::str::contains(
            "no --device given and this build has no CUDA: training on the CPU",
        ))
        .stderr(predicate::str::contains("step 1/1"));
    // `plan` still plans for a GPU by default, and says so in --help.
    oomfix(dir)
        .args(["--budget", "8GiB", "tiny.safetensors"])
        .assert()
        .code(0)
        .stdout(predicate::str::contains("on cuda:0"));
    oomfix(dir)
        .arg("--help")
        .assert()
        .code(0)
        .stdout(predicate::str::contains(
            "default: cuda:0; `train` on a build without CUDA: cpu",
        ));
}
