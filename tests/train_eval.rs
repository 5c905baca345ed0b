//! `oomfix train` through the real binary: evaluation on held-out text
//! (`--eval-data`, `--eval-every`), the learning rate and gradient norm in
//! the step events, gradient clipping (`--max-grad-norm`) and the
//! end-of-run summary (text and `--json`).

mod common;

use assert_cmd::Command;
use serde_json::Value;
use std::path::Path;

/// A run directory with the tiny GPT-2 (vocabulary 256: bytes are tokens,
/// there being no tokenizer) and a small repeated text to train and
/// evaluate on.
fn run_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    common::tiny_gpt2_file(dir.path());
    let text = "the cat sat on the mat. ";
    std::fs::write(dir.path().join("train.txt"), text.repeat(40)).unwrap();
    std::fs::write(dir.path().join("eval.txt"), text.repeat(6)).unwrap();
    dir
}

fn oomfix(dir: &Path) -> Command {
    let mut cmd = Command::cargo_bin("oomfix").unwrap();
    cmd.current_dir(dir).env_remove("RUST_LOG");
    cmd.args([
        "train",
        "tiny.safetensors",
        "--device",
        "cpu",
        "--init",
        "random",
    ])
    .args(["--seq-len", "16", "--global-batch", "2", "--budget", "1GiB"])
    .args(["--data", "train.txt", "--lr", "3e-3"]);
    cmd
}

/// The events of a JSON log named `message`, as their fields.
fn events(log: &Path, message: &str) -> Vec<Value> {
    std::fs::read_to_string(log)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|v| v["fields"]["message"] == message)
        .map(|v| v["fields"].clone())
        .collect()
}

#[test]
fn eval_loss_falls_and_the_summary_reports_it() {
    let dir = run_dir();
    let log = dir.path().join("log.json");
    let out = oomfix(dir.path())
        .args([
            "--steps",
            "8",
            "--eval-data",
            "eval.txt",
            "--eval-every",
            "2",
            "--json",
        ])
        .args(["--log-format", "json", "--log-file"])
        .arg(&log)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["device"], "cpu", "the plan is in the same object");
    let t = &v["training"];
    assert_eq!(t["steps"], 8);
    assert_eq!(t["tokens"], 8 * 2 * 16);
    assert!(t["seconds"].as_f64().unwrap() > 0.0);
    let (first, last) = (
        t["first_loss"].as_f64().unwrap(),
        t["last_loss"].as_f64().unwrap(),
    );
    assert!(last < first, "training loss {first} -> {last}");

    let evals = events(&log, "eval");
    let steps: Vec<u64> = evals.iter().map(|e| e["step"].as_u64().unwrap()).collect();
    // Before the first step (the baseline), every 2 steps.
    assert_eq!(steps, [0, 2, 4, 6, 8]);
    let losses: Vec<f64> = evals
        .iter()
        .map(|e| e["eval_loss"].as_f64().unwrap())
        .collect();
    assert!(losses[4] < losses[0], "eval loss falls: {losses:?}");
    for e in &evals {
        let (loss, ppl) = (
            e["eval_loss"].as_f64().unwrap(),
            e["perplexity"].as_f64().unwrap(),
        );
        assert!((ppl - loss.exp()).abs() <= 1e-9 * ppl, "{e}");
    }
    // The eval text is 144 bytes: 9 windows of 16 tokens, 5 micro-batches of 2.
    assert_eq!(evals[0]["batches"], 5);
    let eval = &t["eval"];
    assert_eq!(eval["step"], 8);
    assert_eq!(eval["loss"].as_f64().unwrap(), losses[4]);
    assert!(
        (eval["perplexity"].as_f64().unwrap() - losses[4].exp()).abs() < 1e-9 * losses[4].exp()
    );
    assert_eq!(t["first_eval"]["step"], 0);
    assert_eq!(t["first_eval"]["loss"].as_f64().unwrap(), losses[0]);
    let estimate = t["estimated_peak_bytes"].as_u64().unwrap();
    assert_eq!(estimate, v["estimate"]["peak_bytes"].as_u64().unwrap());
    // Forward only: no more memory than a training step's forward and backward.
    let step_events = events(&log, "step");
    let step_peak = step_events
        .iter()
        .map(|s| s["forward_backward_peak_bytes"].as_u64().unwrap())
        .max()
        .unwrap();
    let eval_peak = eval["peak_bytes"].as_u64().unwrap();
    assert!(
        eval_peak > 0 && eval_peak <= step_peak,
        "eval peak {eval_peak}, step peak {step_peak}"
    );
    assert!(t["peak_bytes"].as_u64().unwrap() >= step_peak);

    // Every step event carries its learning rate and gradient norm.
    assert_eq!(step_events.len(), 8);
    for s in &step_events {
        assert_eq!(s["lr"].as_f64().unwrap(), 3e-3, "{s}");
        assert!(s["grad_norm"].as_f64().unwrap() > 0.0, "{s}");
    }
}

#[test]
fn the_text_summary_follows_the_plan() {
    let dir = run_dir();
    let out = oomfix(dir.path())
        .args(["--steps", "3", "--eval-data", "eval.txt"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let summary = stdout
        .split("\ntrained ")
        .nth(1)
        .expect("a summary after the plan");
    assert!(summary.starts_with("3 steps, 96 tokens in "), "{stdout}");
    assert!(
        summary.contains("\nloss    ") && summary.contains(" at step 1 -> "),
        "{stdout}"
    );
    let eval = summary
        .lines()
        .find(|l| l.starts_with("eval    loss "))
        .expect("an eval line");
    assert!(
        eval.contains(") at step 0 -> ") && eval.contains("after step 3"),
        "{eval}"
    );
    assert!(
        summary.contains("\npeak    ") && summary.contains("estimated"),
        "{stdout}"
    );
    // Progress shows the rate and the gradient norm; evaluated before the
    // first step and at the end.
    assert!(
        stderr.contains("lr 3.000e-3") && stderr.contains("grad norm "),
        "{stderr}"
    );
    assert_eq!(stderr.matches("eval after step").count(), 2, "{stderr}");
    assert!(stderr.contains("eval after step 0:"), "{stderr}");

    let plain = oomfix(dir.path()).args(["--steps", "1"]).output().unwrap();
    let stdout = String::from_utf8_lossy(&plain.stdout);
    assert!(
        stdout.contains("\ntrained 1 steps") && !stdout.contains("\neval "),
        "{stdout}"
    );
}

#[test]
fn clipping_changes_the_steps_and_zero_disables_it() {
    let dir = run_dir();
    let losses = |norm: &str| -> Vec<(f64, f64)> {
        let log = dir.path().join(format!("log-{norm}.json"));
        let out = oomfix(dir.path())
            .args([
                "--steps",
                "4",
                "--max-grad-norm",
                norm,
                "--log-format",
                "json",
                "--log-file",
            ])
            .arg(&log)
            .output()
            .unwrap();
        common::assert_exit(&out, 0);
        events(&log, "step")
            .iter()
            .map(|s| {
                (
                    s["loss"].as_f64().unwrap(),
                    s["grad_norm"].as_f64().unwrap(),
                )
            })
            .collect()
    };
    let off = losses("0");
    let huge = losses("1e9");
    let tight = losses("0.01");
    assert!(
        off[0].1 > 0.01,
        "the first norm {} exceeds the limit",
        off[0].1
    );
    // A limit far above the norm clips nothing.
    assert_eq!(off, huge);
    // The first step is the same (same gradients); the weights it makes differ.
    assert_eq!(off[0], tight[0]);
    assert_ne!(off[1..], tight[1..]);
}

#[test]
fn bad_clipping_and_eval_options_are_usage_errors() {
    let dir = run_dir();
    for (args, needle) in [
        (&["--max-grad-norm", "-1"][..], "max-grad-norm"),
        (&["--max-grad-norm", "nan"][..], "max-grad-norm"),
        (&["--eval-every", "2"][..], "eval-data"),
        (&["--eval-data", "missing.txt"][..], "missing.txt"),
        (
            &["--eval-data", "eval.txt", "--eval-batches", "0"][..],
            "eval-batches",
        ),
    ] {
        let out = oomfix(dir.path()).args(args).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
        assert!(out.stdout.is_empty(), "{args:?}");
    }
}
