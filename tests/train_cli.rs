//! `oomfix train` through the real binary: training on a token file,
//! checkpoints (`--save`, `--save-every`, `--resume`), refused checkpoints,
//! signals, NaN losses and the exit codes of each.

mod common;

use assert_cmd::Command;
use oomfix::train::StateFile;
use oomfix::{Family, ModelConfig};
use predicates::prelude::*;
use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::time::Duration;

/// A 2-layer GPT-2 of hidden 64 (one head of 64, as inspect assumes), vocabulary 64.
fn tiny_config(layers: usize) -> ModelConfig {
    ModelConfig {
        family: Family::Gpt2,
        layers,
        hidden: 64,
        heads: 1,
        kv_heads: 1,
        intermediate: 256,
        vocab: 64,
        max_positions: 32,
        tied_embeddings: true,
        qkv_bias: false,
        settings: Default::default(),
    }
}

/// A run directory with `model.safetensors` (the tiny GPT-2, all zeros:
/// training starts from a random initialisation, `--init random`) and `data.bin` (ids 1..=15 repeated, u16).
struct Run {
    dir: tempfile::TempDir,
}

impl Run {
    fn new() -> Run {
        let dir = tempfile::tempdir().unwrap();
        let model = dir.path().join("model.safetensors");
        common::write_safetensors(&model, &common::with_dtype(tiny_config(2).tensors(), "F32"));
        let ids: Vec<u8> = (0..200)
            .flat_map(|_| 1u16..16)
            .flat_map(u16::to_le_bytes)
            .collect();
        std::fs::write(dir.path().join("data.bin"), ids).unwrap();
        Run { dir }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// The base arguments of a training run with `budget`.
    fn args(&self, budget: &str) -> Vec<String> {
        self.args_with(budget, &[])
    }

    /// The base arguments with some values replaced: `(flag, value)`, or
    /// `("model", path)` for the model file.
    fn args_with(&self, budget: &str, replace: &[(&str, &str)]) -> Vec<String> {
        let mut a: Vec<String> = [
            "train",
            "model.safetensors",
            "--device",
            "cpu",
            "--seq-len",
            "16",
            "--init",
            "random",
        ]
        .map(String::from)
        .into();
        a.extend(
            [
                "--global-batch",
                "2",
                "--data",
                "data.bin",
                "--lr",
                "3e-3",
                "--budget",
                budget,
            ]
            .map(String::from),
        );
        for (flag, value) in replace {
            let at = if *flag == "model" {
                1
            } else {
                a.iter().position(|x| x == flag).unwrap() + 1
            };
            a[at] = value.to_string();
        }
        a
    }

    fn oomfix(&self) -> Command {
        let mut cmd = Command::cargo_bin("oomfix").unwrap();
        cmd.current_dir(self.dir.path()).env_remove("RUST_LOG");
        cmd
    }

    /// Runs `train` with `budget` and `extra` arguments, logging JSON to
    /// `log`; returns the exit code, stderr and the logged losses by step.
    fn train(&self, budget: &str, extra: &[&str], log: &str) -> (i32, String, Vec<(u64, f64)>) {
        let out = self
            .oomfix()
            .args(self.args(budget))
            .args(extra)
            .args(["--log-format", "json", "--log-file", log])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        (out.status.code().unwrap(), stderr, self.losses(log))
    }

    /// `(step, loss)` of each `step` event in a JSON log.
    fn losses(&self, log: &str) -> Vec<(u64, f64)> {
        let text = std::fs::read_to_string(self.path(log)).unwrap_or_default();
        text.lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap())
            .filter(|v| v["fields"]["message"] == "step")
            .map(|v| {
                (
                    v["fields"]["step"].as_u64().unwrap(),
                    v["fields"]["loss"].as_f64().unwrap(),
                )
            })
            .collect()
    }

    /// A budget whose plan (from the `precision,fused-adamw` pipeline, at
    /// `precision`) is the first with fused AdamW: the estimate of that attempt.
    fn fused_budget(&self, precision: &str) -> String {
        let out = self
            .oomfix()
            .args([
                "plan",
                "model.safetensors",
                "--device",
                "cpu",
                "--seq-len",
                "16",
                "--global-batch",
                "2",
            ])
            .args([
                "--budget",
                "1",
                "--json",
                "--strategies",
                "precision,fused-adamw",
                "--precision",
                precision,
            ])
            .output()
            .unwrap();
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        let attempts = v["attempts"].as_array().unwrap();
        let fused = attempts
            .iter()
            .find(|a| a["optimizer"] == "fused-adamw")
            .expect("a fused-adamw attempt");
        fused["estimated_bytes"].as_u64().unwrap().to_string()
    }

    /// Starts a long `train --save ck.safetensors` with `extra` arguments and
    /// returns it once it has logged `steps` steps on stderr.
    fn start_long(
        &self,
        extra: &[&str],
        steps: u64,
    ) -> (Child, BufReader<std::process::ChildStderr>) {
        let mut child = std::process::Command::new(assert_cmd::cargo::cargo_bin("oomfix"))
            .current_dir(self.dir.path())
            .env_remove("RUST_LOG")
            .args(self.args("1GiB"))
            .args(["--steps", "1000000", "--save", "ck.safetensors"])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut err = BufReader::new(child.stderr.take().unwrap());
        let mut line = String::new();
        while !line.starts_with(&format!("step {steps}/")) {
            line.clear();
            assert!(
                err.read_line(&mut line).unwrap() > 0,
                "train ended before step {steps}"
            );
        }
        (child, err)
    }
}

fn signal(child: &Child, sig: i32) {
    // SAFETY: kill(2) on our own child's pid.
    assert_eq!(unsafe { libc::kill(child.id() as i32, sig) }, 0);
}

#[test]
fn training_on_a_repeated_token_file_lowers_the_loss() {
    let run = Run::new();
    let (code, stderr, losses) = run.train("1GiB", &["--steps", "8"], "log.json");
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(
        losses.iter().map(|l| l.0).collect::<Vec<_>>(),
        (1..=8).collect::<Vec<_>>()
    );
    let (first, last) = (losses[0].1, losses[7].1);
    assert!(first > 3.5 && last < 0.8 * first, "{losses:?}");
}

#[test]
fn save_then_resume_takes_the_same_steps_as_an_uninterrupted_run() {
    let run = Run::new();
    // bf16 exercises the master weights, fp16 the loss scaler as well.
    for precision in ["bf16", "fp16"] {
        let budget = run.fused_budget(precision);
        // The budget is the fused plan's estimate itself: no headroom.
        let p = [
            "--strategies",
            "precision,fused-adamw",
            "--precision",
            precision,
            "--headroom",
            "0",
        ];
        let (code, stderr, straight) =
            run.train(&budget, &[&p[..], &["--steps", "4"]].concat(), "a.json");
        assert_eq!(code, 0, "{stderr}");
        let (code, stderr, first) = run.train(
            &budget,
            &[&p[..], &["--steps", "2", "--save", "ck.safetensors"]].concat(),
            "b.json",
        );
        assert_eq!(code, 0, "{stderr}");
        assert!(
            !stderr.contains("moments"),
            "fused AdamW saves its moments: {stderr}"
        );
        let resume = [
            "--steps",
            "4",
            "--resume",
            "ck.safetensors",
            "--save",
            "ck.safetensors",
        ];
        let (code, stderr, rest) = run.train(&budget, &[&p[..], &resume].concat(), "c.json");
        assert_eq!(code, 0, "{stderr}");
        assert!(
            stderr.contains("resumed from ck.safetensors at step 2"),
            "{stderr}"
        );
        let resumed: Vec<_> = first.iter().chain(&rest).copied().collect();
        assert_eq!(resumed.len(), 4, "{resumed:?}");
        for ((s1, a), (s2, b)) in straight.iter().zip(&resumed) {
            assert_eq!(s1, s2);
            assert!(
                (a - b).abs() < 1e-6,
                "{precision} step {s1}: {a} straight, {b} resumed"
            );
        }
        let ck = StateFile::open(&run.path("ck.safetensors")).unwrap();
        assert_eq!(ck.scalar_i64("trainer.step").unwrap(), 4);
        assert_eq!(ck.scalar_i64("optim.step").unwrap(), 4);
        assert!(ck.contains("master.wte.weight") && ck.contains("optim.wte.weight.m"));
        assert_eq!(ck.contains("scaler.scale"), precision == "fp16");
        assert!(
            ck.meta("plan").unwrap().contains(precision),
            "{:?}",
            ck.meta("plan")
        );
    }
}

#[test]
fn candle_adamw_checkpoints_say_the_moments_are_not_saved() {
    let run = Run::new();
    let (code, stderr, _) = run.train(
        "1GiB",
        &[
            "--steps",
            "1",
            "--save",
            "ck.safetensors",
            "--optimizer",
            "adamw",
        ],
        "log.json",
    );
    assert_eq!(code, 0, "{stderr}");
    let log = std::fs::read_to_string(run.path("log.json")).unwrap();
    assert!(
        log.contains("WARN") && log.contains("restarts them from zero"),
        "{log}"
    );
    let ck = StateFile::open(&run.path("ck.safetensors")).unwrap();
    assert!(ck.contains("wte.weight") && !ck.contains("optim.step"));
    assert_eq!(ck.scalar_i64("data.position").unwrap(), 32);
}

#[test]
fn save_every_writes_along_the_way() {
    let run = Run::new();
    let (code, stderr, _) = run.train(
        "1GiB",
        &[
            "--steps",
            "5",
            "--save",
            "ck.safetensors",
            "--save-every",
            "2",
        ],
        "log.json",
    );
    assert_eq!(code, 0, "{stderr}");
    let log = std::fs::read_to_string(run.path("log.json")).unwrap();
    let saved: Vec<u64> = log
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|v| v["fields"]["message"] == "saved")
        .map(|v| v["fields"]["step"].as_u64().unwrap())
        .collect();
    assert_eq!(saved, [2, 4, 5]);
    run.oomfix()
        .args(run.args("1GiB"))
        .args(["--save-every", "2"])
        .assert()
        .code(2);
}

#[test]
fn damaged_checkpoints_are_refused_with_the_file_named() {
    let run = Run::new();
    let (code, stderr, _) = run.train(
        "1GiB",
        &["--steps", "1", "--save", "ck.safetensors"],
        "log.json",
    );
    assert_eq!(code, 0, "{stderr}");
    let good = std::fs::read(run.path("ck.safetensors")).unwrap();
    let mut flipped = good.clone();
    let mid = good.len() / 2;
    flipped[mid] ^= 0x10;
    std::fs::write(run.path("flipped.safetensors"), flipped).unwrap();
    std::fs::write(run.path("truncated.safetensors"), &good[..good.len() - 100]).unwrap();
    for (file, says) in [
        ("flipped.safetensors", "is corrupt"),
        ("truncated.safetensors", "not a complete checkpoint"),
    ] {
        run.oomfix()
            .args(run.args("1GiB"))
            .args(["--steps", "3", "--resume", file])
            .assert()
            .code(2)
            .stderr(
                predicate::str::contains(format!("{file}: ")).and(predicate::str::contains(says)),
            )
            .stderr(predicate::str::contains("step 2/").not());
    }
    run.oomfix()
        .args(run.args("1GiB"))
        .args(["--resume", "model.safetensors"])
        .assert()
        .code(2)
        .stderr(predicate::str::contains("not an oomfix checkpoint"));
}

#[test]
fn a_checkpoint_of_another_plan_model_or_data_is_refused() {
    let run = Run::new();
    let (code, stderr, _) = run.train(
        "1GiB",
        &["--steps", "1", "--save", "ck.safetensors"],
        "log.json",
    );
    assert_eq!(code, 0, "{stderr}");
    let resume = |replace: &[(&str, &str)]| {
        run.oomfix()
            .args(run.args_with("1GiB", replace))
            .args(["--steps", "2", "--resume", "ck.safetensors"])
            .assert()
            .code(2)
    };
    resume(&[("--global-batch", "4")]).stderr(predicate::str::contains(
        "ck.safetensors: checkpoint was written with the plan",
    ));
    common::write_safetensors(
        &run.path("deeper.safetensors"),
        &common::with_dtype(tiny_config(3).tensors(), "F32"),
    );
    resume(&[("model", "deeper.safetensors")]).stderr(predicate::str::contains("another model"));
    std::fs::write(run.path("other.bin"), [1u8, 0, 2, 0, 3, 0]).unwrap();
    resume(&[("--data", "other.bin")]).stderr(predicate::str::contains("stream of 3000 tokens"));
}

#[test]
fn save_refuses_to_write_over_an_input() {
    let run = Run::new();
    let model = std::fs::read(run.path("model.safetensors")).unwrap();
    for target in ["model.safetensors", "./data.bin"] {
        run.oomfix()
            .args(run.args("1GiB"))
            .args(["--steps", "1", "--save", target])
            .assert()
            .code(2)
            .stderr(
                predicate::str::contains("refusing to write")
                    .and(predicate::str::contains("step 1/").not()),
            );
    }
    assert_eq!(std::fs::read(run.path("model.safetensors")).unwrap(), model);
    run.oomfix()
        .args(run.args("1GiB"))
        .args(["--save", "no/such/dir/ck.safetensors"])
        .assert()
        .code(2);
}

#[test]
fn a_nan_loss_stops_training_with_exit_3_and_keeps_the_checkpoint() {
    let run = Run::new();
    let (code, stderr, _) = run.train(
        "1GiB",
        &["--steps", "2", "--save", "ck.safetensors"],
        "log.json",
    );
    assert_eq!(code, 0, "{stderr}");
    let before = std::fs::read(run.path("ck.safetensors")).unwrap();
    // An absurd learning rate overflows the weights after one step.
    let args = [
        "--steps",
        "10",
        "--resume",
        "ck.safetensors",
        "--save",
        "ck.safetensors",
        "--save-every",
        "5",
    ];
    run.oomfix()
        .args(run.args_with("1GiB", &[("--lr", "1e30")]))
        .args(args)
        .assert()
        .code(3)
        .stderr(
            predicate::str::is_match(
                r"oomfix: step 4: the loss is (NaN|inf|-inf); training stopped",
            )
            .unwrap(),
        );
    assert_eq!(std::fs::read(run.path("ck.safetensors")).unwrap(), before);
}

#[test]
fn sigterm_and_sigint_stop_at_a_step_boundary_with_a_checkpoint_that_resumes() {
    let run = Run::new();
    for (sig, code, name) in [
        (libc::SIGTERM, 143, "SIGTERM"),
        (libc::SIGINT, 130, "SIGINT"),
    ] {
        let (mut child, mut err) = run.start_long(&[], 2);
        signal(&child, sig);
        let mut rest = String::new();
        std::io::Read::read_to_string(&mut err, &mut rest).unwrap();
        assert_eq!(child.wait().unwrap().code(), Some(code), "{rest}");
        let stopped = rest
            .lines()
            .find(|l| l.contains(&format!("stopped by {name} after step")))
            .expect(&rest);
        assert!(
            stopped.ends_with("checkpoint written to ck.safetensors"),
            "{stopped}"
        );
        let ck = StateFile::open(&run.path("ck.safetensors")).unwrap();
        let step = ck.scalar_i64("trainer.step").unwrap();
        assert!(
            stopped.contains(&format!("after step {step};")),
            "{stopped}"
        );
        let next = (step + 1).to_string();
        run.oomfix()
            .args(run.args("1GiB"))
            .args(["--steps", &next, "--resume", "ck.safetensors"])
            .assert()
            .code(0)
            .stderr(predicate::str::contains(format!("at step {step}\n")))
            .stderr(predicate::str::contains(format!("\nstep {next}/{next} ")));
    }
}

#[test]
fn sigkill_while_saving_every_step_never_leaves_a_broken_checkpoint() {
    let run = Run::new();
    let ck = run.path("ck.safetensors");
    for delay_ms in [0, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37] {
        // By step 2's line the save of step 1 is complete.
        let (mut child, _err) = run.start_long(&["--save-every", "1"], 2);
        std::thread::sleep(Duration::from_millis(delay_ms));
        signal(&child, libc::SIGKILL);
        child.wait().unwrap();
        // The checkpoint is always a complete one: the first save at step 1 or a later one.
        let step = StateFile::open(&ck)
            .unwrap()
            .scalar_i64("trainer.step")
            .unwrap();
        assert!(step >= 1, "{delay_ms} ms: step {step}");
    }
    // Killed writers may leave their temporary files, never under the target's name.
    let stray: Vec<_> = std::fs::read_dir(run.dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("ck.safetensors") && n != "ck.safetensors")
        .collect();
    assert!(
        stray
            .iter()
            .all(|n| n.starts_with(".ck.safetensors.") && n.ends_with(".tmp")),
        "{stray:?}"
    );
}

#[test]
fn the_learning_rate_follows_the_schedule_and_is_logged() {
    let run = Run::new();
    let (code, stderr, losses) = run.train(
        "1GiB",
        &[
            "--steps",
            "4",
            "--lr-schedule",
            "linear",
            "--warmup-steps",
            "2",
        ],
        "log.json",
    );
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(losses.len(), 4);
    let text = std::fs::read_to_string(run.path("log.json")).unwrap();
    let lrs: Vec<f64> = text
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|v| v["fields"]["message"] == "step")
        .map(|v| v["fields"]["lr"].as_f64().unwrap())
        .collect();
    // --lr 3e-3 (the harness's): warmup (step + 1) / 3, then linear from the
    // peak to 0 after the 4th step
    let want = [1e-3, 2e-3, 3e-3, 1.5e-3];
    assert_eq!(lrs.len(), want.len());
    for (got, want) in lrs.iter().zip(want) {
        assert!((got - want).abs() < 1e-12, "{lrs:?}");
    }
    // A schedule the binary does not know is a usage error.
    run.oomfix()
        .args(run.args("1GiB"))
        .args(["--lr-schedule", "triangle"])
        .assert()
        .code(2);
}
