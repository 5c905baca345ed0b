//! Runs of the real `oomfix` binary: the command, the arguments of the tiny
//! model's runs, exit codes, the JSON it prints and logs.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, ChildStderr, Output, Stdio};

use assert_cmd::Command;
use serde_json::Value;

/// The `oomfix` binary, without the caller's `RUST_LOG`.
pub fn oomfix() -> Command {
    let mut cmd = Command::cargo_bin("oomfix").unwrap();
    cmd.env_remove("RUST_LOG");
    cmd
}

/// [`oomfix`] run in `dir`.
pub fn oomfix_in(dir: &Path) -> Command {
    let mut cmd = oomfix();
    cmd.current_dir(dir);
    cmd
}

/// The options of a plan on the CPU within `budget`, at 16 tokens and a
/// global batch of `global_batch`: what the tiny models are planned and
/// trained with.
pub fn on_cpu<'a>(budget: &'a str, global_batch: &'a str) -> [&'a str; 8] {
    [
        "--budget",
        budget,
        "--device",
        "cpu",
        "--seq-len",
        "16",
        "--global-batch",
        global_batch,
    ]
}

/// `train` of the tiny GPT-2 (`tiny.safetensors` in the working directory,
/// [`tiny_dir`]) from random weights, [`on_cpu`] within `budget` (global
/// batch 2).
pub fn train_tiny(budget: &str) -> Vec<&str> {
    let train = ["train", "tiny.safetensors", "--init", "random"];
    [&train[..], &on_cpu(budget, "2")].concat()
}

/// `oomfix train MODEL --data DATA` in `work`: on the CPU, fp32, within
/// 1 GiB.
pub fn train_fp32(work: &Path, model: &Path, data: &Path) -> Command {
    let mut cmd = oomfix_in(work);
    cmd.arg("train").arg(model).arg("--data").arg(data).args([
        "--device",
        "cpu",
        "--precision",
        "fp32",
        "--budget",
        "1GiB",
    ]);
    cmd
}

/// [`train_fp32`] on the fine-tuning fixture's text
/// ([`finetune_dir`](super::finetune_dir)`/train.txt`).
pub fn train_on_finetune_text(work: &Path, model: &Path) -> Command {
    train_fp32(work, model, &super::finetune_dir().join("train.txt"))
}

/// A directory with the tiny GPT-2 as `tiny.safetensors`.
pub fn tiny_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    super::tiny_gpt2_file(dir.path());
    dir
}

/// u16 token ids as nanoGPT writes them (a `--data` file).
pub fn token_bin(ids: impl IntoIterator<Item = u16>) -> Vec<u8> {
    ids.into_iter().flat_map(u16::to_le_bytes).collect()
}

/// Runs `cmd` and checks that it exited with `code` (the test fails
/// showing its stderr otherwise); returns its output.
pub fn exits(cmd: &mut Command, code: i32) -> Output {
    let out = cmd.output().unwrap();
    super::assert_exit(&out, code);
    out
}

/// The JSON object `cmd` prints on stdout, once it exited with `code`.
pub fn json_of(cmd: &mut Command, code: i32) -> Value {
    json_stdout(&exits(cmd, code))
}

/// The one JSON object on a run's stdout.
pub fn json_stdout(out: &Output) -> Value {
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "stdout is not one JSON object ({e}): {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

/// The exit code of `cmd` and the one JSON object it prints on stdout.
pub fn code_and_json(cmd: &mut Command) -> (i32, Value) {
    let out = cmd.output().unwrap();
    (out.status.code().unwrap_or(-1), json_stdout(&out))
}

/// `cmd`'s stderr, once it exited with `code`.
pub fn stderr_of(cmd: &mut Command, code: i32) -> String {
    let out = cmd.output().unwrap();
    super::assert_exit(&out, code)
}

/// `cmd`'s stdout, once it exited with `code`.
pub fn stdout_of(cmd: &mut Command, code: i32) -> String {
    String::from_utf8(exits(cmd, code).stdout).unwrap()
}

/// The fields of each event logged with `message`, from JSON logs (lines
/// that are not JSON are passed over).
pub fn events(log: &str, message: &str) -> Vec<Value> {
    log.lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["fields"]["message"] == message)
        .map(|v| v["fields"].clone())
        .collect()
}

/// The `oomfix` binary as a process to start (for its pipes and signals),
/// in `dir`, without the caller's `RUST_LOG`.
pub fn oomfix_process(dir: &Path) -> std::process::Command {
    let mut cmd = std::process::Command::new(assert_cmd::cargo::cargo_bin("oomfix"));
    cmd.current_dir(dir).env_remove("RUST_LOG");
    cmd
}

/// The loss of each `step` event of JSON logs.
pub fn step_losses(log: &str) -> Vec<f64> {
    let steps = events(log, "step");
    steps.iter().map(|f| f["loss"].as_f64().unwrap()).collect()
}

/// Starts `cmd` (its stdout discarded) and reads its stderr until a line
/// `until` accepts (the test fails if the stderr ends first); returns the
/// child, the rest of its stderr and what was read.
#[allow(clippy::zombie_processes)] // the caller waits for the child
pub fn start_until(
    cmd: &mut std::process::Command,
    until: impl Fn(&str) -> bool,
) -> (Child, BufReader<ChildStderr>, String) {
    let mut child = cmd
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let mut text = String::new();
    loop {
        let mut line = String::new();
        assert!(err.read_line(&mut line).unwrap() > 0, "ended early: {text}");
        text.push_str(&line);
        if until(&line) {
            return (child, err, text);
        }
    }
}

/// Sends `sig` to `child`.
pub fn signal(child: &Child, sig: i32) {
    // SAFETY: kill(2) on our own child's pid.
    assert_eq!(unsafe { libc::kill(child.id() as i32, sig) }, 0);
}
