//! `oomfix train` through the real binary: training on a token file,
//! checkpoint directories (`--save`, `--save-every`, `--resume`; a saved
//! directory as a model), resuming with another plan and within the fresh
//! run's memory, refused checkpoints, signals, NaN losses and the exit codes
//! of each.

mod common;

use assert_cmd::Command;
use oomfix::train::TrainingState;
use predicates::prelude::*;
use serde_json::Value;
use std::io::BufReader;
use std::path::PathBuf;
use std::process::{Child, ChildStderr, Stdio};
use std::time::Duration;

/// A run directory with `model.safetensors` (the tiny GPT-2, all zeros:
/// training starts from a random initialisation, `--init random`) and `data.bin` (ids 1..=15 repeated, u16).
struct Run {
    dir: tempfile::TempDir,
}

impl Run {
    fn new() -> Run {
        let dir = tempfile::tempdir().unwrap();
        let model = dir.path().join("model.safetensors");
        common::write_safetensors(
            &model,
            &common::with_dtype(common::gpt2_64(2).tensors(), "F32"),
        );
        let ids = (0..200).flat_map(|_| 1u16..16);
        std::fs::write(dir.path().join("data.bin"), common::token_bin(ids)).unwrap();
        Run { dir }
    }

    /// A run directory in which `train` ran with 1 GiB and `extra`
    /// arguments, logging JSON to `log.json`.
    fn trained(extra: &[&str]) -> Run {
        let run = Run::new();
        run.train("1GiB", extra, "log.json");
        run
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
        common::oomfix_in(self.dir.path())
    }

    /// Runs `train` with `budget` and `extra` arguments, logging JSON to
    /// `log`, and checks that it exited with 0 (the test fails with its
    /// stderr otherwise); returns its stderr and the logged losses by step.
    fn train(&self, budget: &str, extra: &[&str], log: &str) -> (String, Vec<(u64, f64)>) {
        let stderr = common::stderr_of(
            self.oomfix().args(self.args(budget)).args(extra).args([
                "--log-format",
                "json",
                "--log-file",
                log,
            ]),
            0,
        );
        let steps = self.events(log, "step");
        let losses = steps.iter().map(|f| {
            let step = f["step"].as_u64().unwrap();
            (step, f["loss"].as_f64().unwrap())
        });
        (stderr, losses.collect())
    }

    /// The fields of each event logged with `message` to the JSON log `log`.
    fn events(&self, log: &str, message: &str) -> Vec<Value> {
        common::events(&std::fs::read_to_string(self.path(log)).unwrap(), message)
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

    /// Starts a long `train --save ck` with `extra` arguments and
    /// returns it once it has logged `steps` steps on stderr.
    fn start_long(&self, extra: &[&str], steps: u64) -> (Child, BufReader<ChildStderr>) {
        let (child, err, _) = common::start_until(
            common::oomfix_process(self.dir.path())
                .args(self.args("1GiB"))
                .args(["--steps", "1000000", "--save", "ck"])
                .args(extra),
            |line| line.starts_with(&format!("step {steps}/")),
        );
        (child, err)
    }
}

#[test]
fn training_on_a_repeated_token_file_lowers_the_loss() {
    let run = Run::new();
    let (_, losses) = run.train("1GiB", &["--steps", "8"], "log.json");
    assert_eq!(
        losses.iter().map(|l| l.0).collect::<Vec<_>>(),
        (1..=8).collect::<Vec<_>>()
    );
    let (first, last) = (losses[0].1, losses[7].1);
    assert!(first > 3.5 && last < 0.8 * first, "{losses:?}");
}

/// `--seq-len longest` trains at the length the search found: shorter than
/// the model's 32 positions in 3 MiB, and its steps run.
#[test]
fn train_at_the_longest_length_that_fits() {
    let run = Run::new();
    let out = run
        .oomfix()
        .args(run.args_with("3MiB", &[("--seq-len", "longest")]))
        .args(["--steps", "2", "--json"])
        .output()
        .unwrap();
    common::assert_exit(&out, 0);
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let longest = v["longest"]["seq_len"].as_u64().unwrap();
    assert!(longest > 1 && longest < 32, "{longest}");
    assert_eq!(v["plan"]["seq_len"].as_u64(), Some(longest));
    assert_eq!(v["training"]["steps"], 2, "{}", v["training"]);
}

/// The start-up is reported: the seconds from the process's start to the
/// first step, of which the model's build is a part, in the JSON, the
/// `ready to train` event and the text summary.
#[test]
fn train_reports_its_start_up() {
    let run = Run::new();
    let out = run
        .oomfix()
        .args(run.args_with("1GiB", &[]))
        .args(["--steps", "1", "--json", "--log-format", "json"])
        .output()
        .unwrap();
    common::assert_exit(&out, 0);
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let t = &v["training"];
    let (start, build) = (t["startup_seconds"].as_f64(), t["build_seconds"].as_f64());
    let (Some(start), Some(build)) = (start, build) else {
        panic!("{t}")
    };
    assert!(build > 0.0 && build < start, "{t}");
    let ready = common::events(&String::from_utf8_lossy(&out.stderr), "ready to train");
    assert_eq!(ready.len(), 1);
    assert_eq!(ready[0]["seconds"].as_f64(), Some(start));
    let text = run
        .oomfix()
        .args(run.args_with("1GiB", &[]))
        .args(["--steps", "1"])
        .output()
        .unwrap();
    common::assert_exit(&text, 0);
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains("\nstart   ") && text.contains("s to the first step (the model built in"),
        "{text}"
    );
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
        let (_, straight) = run.train(&budget, &[&p[..], &["--steps", "4"]].concat(), "a.json");
        let (stderr, first) = run.train(
            &budget,
            &[&p[..], &["--steps", "2", "--save", "ck"]].concat(),
            "b.json",
        );
        assert!(
            !stderr.contains("moments"),
            "fused AdamW saves its moments: {stderr}"
        );
        let resume = ["--steps", "4", "--resume", "ck", "--save", "ck"];
        let (stderr, rest) = run.train(&budget, &[&p[..], &resume].concat(), "c.json");
        assert!(stderr.contains("resumed from ck at step 2"), "{stderr}");
        assert!(!stderr.contains("another plan"), "{stderr}");
        let resumed: Vec<_> = first.iter().chain(&rest).copied().collect();
        assert_eq!(resumed.len(), 4, "{resumed:?}");
        for ((s1, a), (s2, b)) in straight.iter().zip(&resumed) {
            assert_eq!(s1, s2);
            assert!(
                (a - b).abs() < 1e-6,
                "{precision} step {s1}: {a} straight, {b} resumed"
            );
        }
        let ck = TrainingState::open(&run.path("ck")).unwrap();
        assert_eq!(ck.state.step, 4);
        assert_eq!(ck.state.optimizer_step, Some(4));
        assert!(ck.optimizer.contains("wte.weight.m") && ck.optimizer.contains("wte.weight.v"));
        // Started from f32 weights: the model file holds the fp32 masters, no copy beside it.
        assert!(!ck.optimizer.contains("master.wte.weight"));
        assert_eq!(
            ck.model.tensor("wte.weight").unwrap().dtype(),
            candle_core::DType::F32
        );
        assert_eq!(ck.state.loss_scaler.is_some(), precision == "fp16");
        assert_eq!(ck.state.plan.precision.to_string(), precision);
    }
}

#[test]
fn candle_adamw_checkpoints_say_the_moments_are_not_saved() {
    let run = Run::trained(&["--steps", "1", "--save", "ck", "--optimizer", "adamw"]);
    let log = std::fs::read_to_string(run.path("log.json")).unwrap();
    assert!(
        log.contains("WARN") && log.contains("restarts them from zero"),
        "{log}"
    );
    let ck = TrainingState::open(&run.path("ck")).unwrap();
    assert!(ck.model.contains("wte.weight") && !ck.optimizer.contains("wte.weight.m"));
    assert_eq!(ck.state.optimizer_step, None);
    assert_eq!(
        ck.state.data,
        oomfix::train::saved::DataState::Tokens {
            position: 32,
            tokens: 3000
        }
    );
}

#[test]
fn save_every_writes_along_the_way() {
    let run = Run::trained(&["--steps", "5", "--save", "ck", "--save-every", "2"]);
    let saved = run.events("log.json", "saved");
    let saved: Vec<u64> = saved.iter().map(|f| f["step"].as_u64().unwrap()).collect();
    assert_eq!(saved, [2, 4, 5]);
    run.oomfix()
        .args(run.args("1GiB"))
        .args(["--save-every", "2"])
        .assert()
        .code(2);
}

/// A copy of the directory `from` as `to` in `run`, its file `file` changed by `change`.
fn damaged_copy(run: &Run, from: &str, to: &str, file: &str, change: impl Fn(&mut Vec<u8>)) {
    std::fs::create_dir(run.path(to)).unwrap();
    for entry in std::fs::read_dir(run.path(from)).unwrap() {
        let entry = entry.unwrap();
        let mut bytes = std::fs::read(entry.path()).unwrap();
        if entry.file_name() == file {
            change(&mut bytes);
        }
        std::fs::write(run.path(to).join(entry.file_name()), bytes).unwrap();
    }
}

#[test]
fn damaged_checkpoints_are_refused_with_the_file_named() {
    let run = Run::trained(&["--steps", "1", "--save", "ck"]);
    damaged_copy(&run, "ck", "flipped", "model.safetensors", |b| {
        let mid = b.len() / 2;
        b[mid] ^= 0x10;
    });
    damaged_copy(&run, "ck", "truncated", "optimizer.safetensors", |b| {
        b.truncate(b.len() - 100)
    });
    damaged_copy(&run, "ck", "cut-state", "trainer_state.json", |b| {
        b.truncate(b.len() / 2)
    });
    for (dir, says) in [
        ("flipped/model.safetensors", "is corrupt"),
        (
            "truncated/optimizer.safetensors",
            "not a complete checkpoint",
        ),
        ("cut-state/trainer_state.json", "not valid JSON"),
    ] {
        run.oomfix()
            .args(run.args("1GiB"))
            .args(["--steps", "3", "--resume", dir.split('/').next().unwrap()])
            .assert()
            .code(2)
            .stderr(
                predicate::str::contains(format!("{dir}: ")).and(predicate::str::contains(says)),
            )
            .stderr(predicate::str::contains("step 2/").not());
    }
    // A file, as earlier versions wrote checkpoints, is refused before any work.
    run.oomfix()
        .args(run.args("1GiB"))
        .args(["--resume", "model.safetensors"])
        .assert()
        .code(2)
        .stderr(predicate::str::contains(
            "model.safetensors: is a file; a checkpoint is a directory",
        ))
        .stdout(predicate::str::is_empty());
}

#[test]
fn another_plan_resumes_and_another_model_or_data_is_refused() {
    let run = Run::trained(&["--steps", "1", "--save", "ck"]);
    let resume = |replace: &[(&str, &str)], extra: &[&str]| {
        run.oomfix()
            .args(run.args_with("1GiB", replace))
            .args(["--steps", "2", "--resume", "ck"])
            .args(extra)
            .assert()
    };
    // Another micro-batch, accumulation, attention, optimizer and precision.
    resume(
        &[],
        &[
            "--micro-batch",
            "1",
            "--attention",
            "composed",
            "--optimizer",
            "adamw",
            "--precision",
            "bf16",
        ],
    )
    .code(0)
    .stderr(
        predicate::str::contains("with another plan: ")
            .and(predicate::str::contains("grad_accum 1 -> 2"))
            .and(predicate::str::contains("micro_batch 2 -> 1"))
            .and(predicate::str::contains(r#"precision "fp32" -> "bf16""#))
            .and(predicate::str::contains("global batch").not())
            .and(predicate::str::contains("\nstep 2/2 ")),
    );
    // Another global batch: accepted, saying what changes.
    resume(&[("--global-batch", "4")], &[])
        .code(0)
        .stderr(predicate::str::contains(
            "the global batch changes from 2 to 4 sequences per optimizer step",
        ));
    common::write_safetensors(
        &run.path("deeper.safetensors"),
        &common::with_dtype(common::gpt2_64(3).tensors(), "F32"),
    );
    resume(&[("model", "deeper.safetensors")], &[])
        .code(2)
        .stderr(predicate::str::contains(
            "ck/trainer_state.json: checkpoint is of another model",
        ))
        .stderr(predicate::str::contains("layers 2 (this run: 3)"));
    std::fs::write(run.path("other.bin"), [1u8, 0, 2, 0, 3, 0]).unwrap();
    resume(&[("--data", "other.bin")], &[])
        .code(2)
        .stderr(predicate::str::contains("stream of 3000 tokens"));
}

#[test]
fn save_refuses_to_write_over_an_input() {
    let run = Run::new();
    let model = std::fs::read(run.path("model.safetensors")).unwrap();
    for (target, says) in [
        ("model.safetensors", "it is a file"),
        ("./data.bin", "it is a file"),
        // The directory holding the model and the data.
        (run.dir.path().to_str().unwrap(), "refusing to write"),
    ] {
        run.oomfix()
            .args(run.args("1GiB"))
            .args(["--steps", "1", "--save", target])
            .assert()
            .code(2)
            .stderr(predicate::str::contains(says).and(predicate::str::contains("step 1/").not()));
    }
    assert_eq!(std::fs::read(run.path("model.safetensors")).unwrap(), model);
    run.oomfix()
        .args(run.args("1GiB"))
        .args(["--save", "no/such/dir/ck"])
        .assert()
        .code(2);
}

#[test]
fn a_nan_loss_stops_training_with_exit_3_and_keeps_the_checkpoint() {
    let run = Run::trained(&["--steps", "2", "--save", "ck"]);
    let files = |dir: &str| -> Vec<(std::ffi::OsString, Vec<u8>)> {
        let mut v: Vec<_> = std::fs::read_dir(run.path(dir))
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                (e.file_name(), std::fs::read(e.path()).unwrap())
            })
            .collect();
        v.sort();
        v
    };
    let before = files("ck");
    // An absurd learning rate overflows the weights after one step.
    let args = [
        "--steps",
        "10",
        "--resume",
        "ck",
        "--save",
        "ck",
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
    assert_eq!(files("ck"), before);
}

#[test]
fn sigterm_and_sigint_stop_at_a_step_boundary_with_a_checkpoint_that_resumes() {
    let run = Run::new();
    for (sig, code, name) in [
        (libc::SIGTERM, 143, "SIGTERM"),
        (libc::SIGINT, 130, "SIGINT"),
    ] {
        let (mut child, mut err) = run.start_long(&[], 2);
        common::signal(&child, sig);
        let mut rest = String::new();
        std::io::Read::read_to_string(&mut err, &mut rest).unwrap();
        assert_eq!(child.wait().unwrap().code(), Some(code), "{rest}");
        let stopped = rest
            .lines()
            .find(|l| l.contains(&format!("stopped by {name} after step")))
            .expect(&rest);
        assert!(stopped.ends_with("checkpoint written to ck"), "{stopped}");
        let step = TrainingState::open(&run.path("ck")).unwrap().state.step;
        assert!(
            stopped.contains(&format!("after step {step};")),
            "{stopped}"
        );
        let next = (step + 1).to_string();
        run.oomfix()
            .args(run.args("1GiB"))
            .args(["--steps", &next, "--resume", "ck"])
            .assert()
            .code(0)
            .stderr(predicate::str::contains(format!("at step {step}\n")))
            .stderr(predicate::str::contains(format!("\nstep {next}/{next} ")));
    }
}

#[test]
fn sigkill_while_saving_every_step_never_leaves_a_broken_checkpoint() {
    let run = Run::new();
    let ck = run.path("ck");
    for delay_ms in [0, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37] {
        // By step 2's line the save of step 1 is complete.
        let (mut child, _err) = run.start_long(&["--save-every", "1"], 2);
        std::thread::sleep(Duration::from_millis(delay_ms));
        common::signal(&child, libc::SIGKILL);
        child.wait().unwrap();
        // The checkpoint is always a complete one: the first save at step 1 or a later one.
        let step = TrainingState::open(&ck).unwrap().state.step;
        assert!(step >= 1, "{delay_ms} ms: step {step}");
    }
    // Killed writers may leave their temporary directories, never under the target's name.
    let stray: Vec<_> = std::fs::read_dir(run.dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("ck") && n != "ck")
        .collect();
    assert!(
        stray
            .iter()
            .all(|n| n.starts_with(".ck.") && n.ends_with(".tmp")),
        "{stray:?}"
    );
}

#[test]
fn the_learning_rate_follows_the_schedule_and_is_logged() {
    let run = Run::new();
    let (_, losses) = run.train(
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
    assert_eq!(losses.len(), 4);
    let steps = run.events("log.json", "step");
    let lrs: Vec<f64> = steps.iter().map(|f| f["lr"].as_f64().unwrap()).collect();
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

/// Runs `oomfix` in `run`'s directory with `args` and gives back its exit
/// code and its peak resident set in bytes (`ru_maxrss` from `wait4`).
#[allow(clippy::zombie_processes)] // reaped by wait4
fn peak_rss(run: &Run, args: &[String]) -> (i32, u64) {
    let child = common::oomfix_process(run.dir.path())
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut status = 0;
    // SAFETY: zeroed rusage is a valid value; wait4 on our own child's pid.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    let pid = unsafe { libc::wait4(child.id() as i32, &mut status, 0, &mut usage) };
    assert_eq!(pid, child.id() as i32);
    assert!(libc::WIFEXITED(status));
    (libc::WEXITSTATUS(status), usage.ru_maxrss as u64 * 1024)
}

#[test]
fn a_resumed_run_peaks_no_higher_than_a_fresh_run_of_the_same_plan() {
    // Large enough that the training state (about 17 MB per copy of the
    // weights) dominates the process's own footprint.
    let run = Run::new();
    let mut config = common::gpt2_64(4);
    config.hidden = 256;
    config.heads = 4;
    config.intermediate = 1024;
    config.vocab = 4096;
    config.max_positions = 64;
    common::write_safetensors(
        &run.path("wide.safetensors"),
        &common::with_dtype(config.tensors(), "F32"),
    );
    let args = |extra: &[&str]| -> Vec<String> {
        let mut a = run.args_with("1GiB", &[("model", "wide.safetensors")]);
        a.extend(["--steps", "3", "--optimizer", "fused-adamw"].map(String::from));
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    let mut first = args(&["--save", "ck"]);
    let at = first.iter().position(|a| a == "3").unwrap();
    first[at] = "2".into();
    assert_eq!(peak_rss(&run, &first).0, 0);
    let (code, fresh) = peak_rss(&run, &args(&["--save", "fresh"]));
    assert_eq!(code, 0);
    let (code, resumed) = peak_rss(&run, &args(&["--resume", "ck", "--save", "resumed"]));
    assert_eq!(code, 0);
    let resumed_from = TrainingState::open(&run.path("resumed")).unwrap();
    assert_eq!(resumed_from.state.step, 3);
    // The same plan, the same state: within 3% (allocator and page noise;
    // two fresh runs differ by under 1%). Reading every moment before
    // setting any, as earlier versions did, peaks 7% above the fresh run here.
    let mb = |b: u64| b as f64 / 1e6;
    assert!(
        resumed as f64 <= fresh as f64 * 1.03,
        "resumed run peaked at {:.1} MB, the fresh run at {:.1} MB",
        mb(resumed),
        mb(fresh)
    );
    eprintln!(
        "peak RSS: fresh {:.1} MB, resumed {:.1} MB",
        mb(fresh),
        mb(resumed)
    );
}

#[test]
fn a_saved_directory_is_a_model_directory_that_trains_and_resumes() {
    let run = Run::new();
    // Side files beside the model are copied; a bf16 model is saved in bf16.
    std::fs::create_dir(run.path("src")).unwrap();
    common::write_safetensors(
        &run.path("src/model.safetensors"),
        &common::with_dtype(common::gpt2_64(2).tensors(), "BF16"),
    );
    for name in [
        "tokenizer_config.json",
        "special_tokens_map.json",
        "merges.txt",
    ] {
        std::fs::write(run.path("src").join(name), format!("{name} of the source")).unwrap();
    }
    let base = run.args_with("1GiB", &[("model", "src"), ("--init", "pretrained")]);
    run.oomfix()
        .args(&base)
        .args(["--steps", "2", "--save", "ck"])
        .assert()
        .code(0);
    let mut names: Vec<String> = std::fs::read_dir(run.path("ck"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(
        names,
        [
            "config.json",
            "merges.txt",
            "model.safetensors",
            "optimizer.safetensors",
            "special_tokens_map.json",
            "tokenizer_config.json",
            "trainer_state.json"
        ]
    );
    assert_eq!(
        std::fs::read_to_string(run.path("ck/merges.txt")).unwrap(),
        "merges.txt of the source"
    );
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(run.path("ck/config.json")).unwrap())
            .unwrap();
    assert_eq!(config["architectures"][0], "GPT2LMHeadModel");
    assert_eq!(config["model_type"], "gpt2");
    assert_eq!(config["n_layer"], 2);
    assert_eq!(config["torch_dtype"], "bfloat16");
    let ck = TrainingState::open(&run.path("ck")).unwrap();
    assert_eq!(ck.model.meta("format"), Some("pt"));
    let mut saved = ck.model.names();
    saved.sort();
    let mut wanted: Vec<String> = common::gpt2_64(2)
        .tensors()
        .into_iter()
        .map(|t| t.0)
        .collect();
    wanted.sort();
    assert_eq!(saved, wanted, "Hub names, every tensor once");
    assert_eq!(
        ck.model.tensor("wte.weight").unwrap().dtype(),
        candle_core::DType::BF16
    );
    // The fp32 weights the bf16 file rounds are beside it.
    let master = ck.optimizer.tensor("master.wte.weight").unwrap();
    assert_eq!(master.dtype(), candle_core::DType::F32);
    let rounded = master.to_dtype(candle_core::DType::BF16).unwrap();
    let saved = ck.model.tensor("wte.weight").unwrap();
    assert_eq!(common::values(&rounded), common::values(&saved));

    // The directory is a model: trained from its weights (a learning rate of
    // 0 leaves them as they are), and the run saved from it says so.
    let from_dir = run.args_with(
        "1GiB",
        &[("model", "ck"), ("--lr", "0"), ("--init", "pretrained")],
    );
    run.oomfix()
        .args(&from_dir)
        .args(["--steps", "1", "--save", "again"])
        .assert()
        .code(0)
        .stdout(predicate::str::contains("gpt2, ").and(predicate::str::contains("(BF16)")));
    let again = TrainingState::open(&run.path("again")).unwrap();
    for name in ["wte.weight", "h.1.mlp.c_fc.weight"] {
        assert_eq!(
            common::values(
                &again
                    .model
                    .tensor(name)
                    .unwrap()
                    .to_dtype(candle_core::DType::F32)
                    .unwrap()
            ),
            common::values(
                &ck.model
                    .tensor(name)
                    .unwrap()
                    .to_dtype(candle_core::DType::F32)
                    .unwrap()
            ),
            "{name}"
        );
    }
    assert_eq!(again.state.step, 1);
    assert_eq!(
        std::fs::read_to_string(run.path("again/merges.txt")).unwrap(),
        "merges.txt of the source"
    );
    // And resumed, in place.
    run.oomfix()
        .args(&base[..1])
        .arg("ck")
        .args(&base[2..])
        .args(["--steps", "3", "--resume", "ck", "--save", "ck"])
        .assert()
        .code(0)
        .stderr(predicate::str::contains("resumed from ck at step 2"));
    assert_eq!(TrainingState::open(&run.path("ck")).unwrap().state.step, 3);
}

/// The first step of an accumulated run adds its second micro-batch's
/// gradients into sums the accumulator does not own yet (the first
/// micro-batch's gradients): one new sum beside both. With an untied
/// 32000-token vocabulary and few activations that moment is the peak; the
/// estimate has it, and later steps (which add in place) peak lower.
#[test]
fn the_first_steps_accumulation_is_in_the_estimate() {
    let run = Run::new();
    let config = oomfix::ModelConfig::llama(2, 64, 2, 1, 128, 32000, false);
    common::write_safetensors(
        &run.path("wide.safetensors"),
        &common::with_dtype(config.tensors(), "F32"),
    );
    let out = Command::cargo_bin("oomfix")
        .unwrap()
        .current_dir(run.dir.path())
        .env_remove("RUST_LOG")
        // The CPU matrix product keeps a packing buffer per thread (about
        // 4.2 MB each for this 32000 x 64 head: 1.026 of the estimate with
        // one thread, 1.071 with two, 1.118 with four), which the memory
        // model does not have: one thread makes the peak the same on every
        // machine.
        .env("RAYON_NUM_THREADS", "1")
        .args([
            "train",
            "wide.safetensors",
            "--device",
            "cpu",
            "--init",
            "random",
        ])
        .args([
            "--seq-len",
            "16",
            "--global-batch",
            "4",
            "--micro-batch",
            "1",
        ])
        .args(["--precision", "fp32", "--optimizer", "fused-adamw"])
        .args([
            "--attention",
            "composed",
            "--checkpoint",
            "none",
            "--budget",
            "1GiB",
        ])
        .args(["--steps", "3", "--json", "--log-format", "json"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let t = &v["training"];
    let (most, estimate) = (
        t["peak_bytes"].as_u64().unwrap(),
        t["estimated_peak_bytes"].as_u64().unwrap(),
    );
    let ratio = most as f64 / estimate as f64;
    eprintln!("{most} measured, {estimate} estimated ({ratio:.3})");
    // Measured 1.026 (a few vocabulary-sized tensors of the loss's are not
    // modelled at this tiny hidden size); without the extra sum it is 1.13.
    assert!(
        (0.97..1.05).contains(&ratio),
        "{most} measured, {estimate} estimated"
    );
    let peaks: Vec<u64> = stderr
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|l| l["fields"]["message"] == "step")
        .map(|l| l["fields"]["forward_backward_peak_bytes"].as_u64().unwrap())
        .collect();
    assert_eq!(peaks.len(), 3, "{stderr}");
    // The first step's extra sum is the embedding's (32000 x 64 f32); the
    // later steps peak at another moment, 5.4 MB lower here.
    let extra = peaks[0].saturating_sub(peaks[1]);
    assert!(extra >= 32000 * 64 * 4 / 2, "{peaks:?}");
    // (steady from the second step on, up to the matrix kernels' per-thread
    // buffers, made when a thread first joins in)
    assert!(peaks[2].abs_diff(peaks[1]) < peaks[1] / 100, "{peaks:?}");
}
