//! `oomfix train` at world size 2 and 4 on the CPU, as separate processes
//! over MPI: started by `--gpus N` (the binary's launcher) and by `mpirun`
//! by hand, each world size both ways; every ZeRO stage takes the steps of
//! one process with the same global batch; a rank that dies or hangs stops
//! the others; a stop signal stops all with one checkpoint; a wrong
//! environment is a usage error. Needs Open MPI's `mpirun` (the `mpi`
//! feature).
#![cfg(feature = "mpi")]

mod common;

use oomfix::ModelConfig;
use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Threads per rank: the CPU matrix product keeps a packing buffer per
/// thread (megabytes at a wide vocabulary, not in the memory model), so the
/// peaks compared with estimates are the same on every machine.
const THREADS: &str = "1";

const GLOBAL_BATCH: usize = 8;
const STEPS: usize = 3;

/// The plan every run pins but its batches: fp32, fused AdamW, no
/// checkpointing, composed attention.
const PINNED: [&str; 8] = [
    "--precision",
    "fp32",
    "--optimizer",
    "fused-adamw",
    "--checkpoint",
    "none",
    "--attention",
    "composed",
];

struct Run {
    dir: tempfile::TempDir,
}

impl Run {
    fn new() -> Run {
        let dir = tempfile::tempdir().unwrap();
        common::write_safetensors(
            &dir.path().join("model.safetensors"),
            &common::with_dtype(common::gpt2_64(2).tensors(), "F32"),
        );
        // Varied tokens, so that each rank's slice differs.
        let ids = (0u32..4000).map(|i| ((i * 37 + i / 7) % 63 + 1) as u16);
        std::fs::write(dir.path().join("data.bin"), common::token_bin(ids)).unwrap();
        Run { dir }
    }

    /// The planning options every run pins: [`PINNED`], micro-batch 1.
    fn planning() -> Vec<String> {
        let global = GLOBAL_BATCH.to_string();
        let size = [
            "--device",
            "cpu",
            "--seq-len",
            "16",
            "--global-batch",
            &global,
        ];
        let rest = ["--budget", "4GiB", "--micro-batch", "1"];
        size.iter()
            .chain(&PINNED)
            .chain(&rest)
            .map(|s| s.to_string())
            .collect()
    }

    /// `train`'s arguments: [`planning`](Self::planning) but the options
    /// `extra` gives again, then `extra`.
    fn args(&self, steps: usize, extra: &[&str]) -> Vec<String> {
        let steps = steps.to_string();
        let mut a: Vec<String> = vec!["train".into(), "model.safetensors".into()];
        for pair in Self::planning().chunks(2) {
            if !extra.contains(&pair[0].as_str()) {
                a.extend_from_slice(pair);
            }
        }
        // The test's model file holds zeros: start from random weights.
        let rest = [
            "--data",
            "data.bin",
            "--lr",
            "3e-3",
            "--steps",
            &steps,
            "--init",
            "random",
            "--log-format",
            "json",
        ];
        a.extend(
            rest.into_iter()
                .chain(extra.iter().copied())
                .map(String::from),
        );
        a
    }

    fn oomfix(&self) -> Command {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_oomfix"));
        cmd.current_dir(self.dir.path())
            .env_remove("RUST_LOG")
            .env("RAYON_NUM_THREADS", THREADS);
        for v in [
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "MASTER_ADDR",
            "MASTER_PORT",
        ] {
            cmd.env_remove(v);
        }
        cmd
    }

    /// `mpirun -n n` with `options` of its own, on the binary.
    fn mpirun(&self, n: usize, options: &[&str]) -> Command {
        let mut cmd = Command::new("mpirun");
        cmd.current_dir(self.dir.path())
            .env_remove("RUST_LOG")
            .env("RAYON_NUM_THREADS", THREADS)
            .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
            .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
            .args(["-n", &n.to_string(), "--oversubscribe", "--bind-to", "none"])
            .args(options)
            .arg(env!("CARGO_BIN_EXE_oomfix"));
        cmd
    }
}

/// The exit code and the JSON lines on stderr of `cmd`.
fn run(cmd: &mut Command) -> (i32, Vec<Value>, String) {
    let out = cmd.output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let lines = stderr
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .collect();
    (out.status.code().unwrap_or(-1), lines, stderr)
}

/// The JSON lines on stderr of `cmd`, and its stderr, once it exited with
/// 0 (the test fails with `what` and its stderr otherwise).
fn ran(cmd: &mut Command, what: &str) -> (Vec<Value>, String) {
    let (code, lines, stderr) = run(cmd);
    assert_eq!(code, 0, "{what}: {stderr}");
    (lines, stderr)
}

/// The losses of the `step` events `cmd` logged, once it exited with 0
/// (the test fails with `what` and its stderr otherwise).
fn step_losses(cmd: &mut Command, what: &str) -> Vec<f64> {
    losses(&ran(cmd, what).0).0
}

/// The JSON object `cmd` prints on stdout (`--json`), once it exited with
/// 0 (the test fails with `what` and its stderr otherwise).
fn json_of(cmd: &mut Command, what: &str) -> Value {
    json_and_stderr(cmd, what).0
}

/// [`json_of`], and the stderr.
fn json_and_stderr(cmd: &mut Command, what: &str) -> (Value, String) {
    let out = cmd.output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(0), "{what}: {stderr}");
    let v = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{what}: not one JSON object on stdout ({e}): {stderr}"));
    (v, stderr)
}

/// The losses of the `step` events, and the ranks that logged them.
fn losses(lines: &[Value]) -> (Vec<f64>, Vec<Value>) {
    let steps: Vec<&Value> = lines
        .iter()
        .filter(|v| v["fields"]["message"] == "step")
        .collect();
    (
        steps
            .iter()
            .map(|v| v["fields"]["loss"].as_f64().unwrap())
            .collect(),
        steps.iter().map(|v| v["span"]["rank"].clone()).collect(),
    )
}

fn assert_close(got: &[f64], want: &[f64], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: {got:?} vs {want:?}");
    for (g, w) in got.iter().zip(want) {
        assert!(
            (g - w).abs() <= 1e-5 * w.abs(),
            "{what}: {got:?} vs {want:?}"
        );
    }
}

#[test]
fn every_stage_at_2_and_4_ranks_takes_the_one_process_steps() {
    let run_dir = Run::new();
    let accum = GLOBAL_BATCH.to_string();
    let (lines, stderr) = ran(
        run_dir
            .oomfix()
            .args(run_dir.args(STEPS, &["--grad-accum", &accum])),
        "one process",
    );
    let (want, _) = losses(&lines);
    assert_eq!(want.len(), STEPS, "{stderr}");
    assert!(
        want[STEPS - 1] < want[0],
        "training lowers the loss: {want:?}"
    );
    // Each world size started both ways: through the launcher and through
    // mpirun by hand (2 and 4 ranks, then 4 and 2, then 2 and 4).
    for (stage, launched, by_hand) in [("1", 2, 4), ("2", 4, 2), ("3", 2, 4)] {
        let extra = ["--zero-stage", stage];
        let gpus = launched.to_string();
        let what = format!("stage {stage}, {launched} ranks");
        let launched = run_dir.args(STEPS, &[&extra[..], &["--gpus", &gpus]].concat());
        let (lines, _) = ran(run_dir.oomfix().args(launched), &what);
        let (got, ranks) = losses(&lines);
        assert_close(&got, &want, &what);
        // The progress comes from rank 0 only, and says so.
        assert!(ranks.iter().all(|r| r == 0), "{ranks:?}");

        let what = format!("stage {stage}, {by_hand} ranks by hand");
        let args = run_dir.args(STEPS, &extra);
        let got = step_losses(run_dir.mpirun(by_hand, &[]).args(args), &what);
        assert_close(&got, &want, &what);
    }
    // Each rank's share of the optimizer offloaded (the same arithmetic).
    let offloaded = [
        "--zero-stage",
        "2",
        "--optimizer",
        "cpu-adamw",
        "--gpus",
        "2",
    ];
    let what = "offloaded, 2 ranks";
    let got = step_losses(run_dir.oomfix().args(run_dir.args(STEPS, &offloaded)), what);
    assert_close(&got, &want, what);
}

/// A long job of 2 ranks started by `train --gpus 2` with `extra` options
/// and `env`, once both ranks joined and one step was logged: the
/// launcher, its stderr's lines so far and to come, and the ranks' pids.
struct Started {
    launcher: std::process::Child,
    lines: std::sync::mpsc::Receiver<String>,
    seen: Vec<String>,
    pids: [u64; 2],
}

impl Started {
    fn new(run_dir: &Run, extra: &[&str], env: &[(&str, &str)]) -> Started {
        let mut extra = extra.to_vec();
        extra.extend(["--zero-stage", "1", "--gpus", "2"]);
        // A process group of its own, as a terminal's foreground job has.
        let mut launcher =
            std::os::unix::process::CommandExt::process_group(&mut run_dir.oomfix(), 0)
                .args(run_dir.args(1_000_000, &extra))
                .envs(env.iter().copied())
                .stderr(Stdio::piped())
                .stdout(Stdio::null())
                .spawn()
                .unwrap();
        let stderr = launcher.stderr.take().unwrap();
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        // Each rank logs its pid when it has joined; wait for a first step.
        let mut pids = [None, None];
        let mut seen = Vec::new();
        let start = Instant::now();
        let mut stepped = false;
        while !(stepped && pids.iter().all(Option::is_some)) {
            let line = lines
                .recv_timeout(Duration::from_secs(120).saturating_sub(start.elapsed()))
                .unwrap_or_else(|_| panic!("no start in time: {seen:#?}"));
            if let Ok(v) = serde_json::from_str::<Value>(&line) {
                if v["fields"]["message"] == "rank started" {
                    let rank = v["fields"]["rank"].as_u64().unwrap() as usize;
                    pids[rank] = v["fields"]["pid"].as_u64();
                }
                stepped |= v["fields"]["message"] == "step";
            }
            seen.push(line);
        }
        let pids = pids.map(Option::unwrap);
        Started {
            launcher,
            lines,
            seen,
            pids,
        }
    }

    /// The launcher's exit code, once it exited within `limit` (the test
    /// fails otherwise), and every line it printed.
    fn exit_within(mut self, limit: Duration) -> (Option<i32>, Vec<String>) {
        let since = Instant::now();
        let status = loop {
            if let Some(status) = self.launcher.try_wait().unwrap() {
                break status;
            }
            if since.elapsed() > limit {
                let _ = self.launcher.kill();
                panic!("the job did not stop within {} s", limit.as_secs());
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        self.seen.extend(self.lines.try_iter());
        (status.code(), self.seen)
    }
}

/// Whether process `pid` is gone (no such process, or a zombie nobody reaps).
fn gone(pid: u64) -> bool {
    let state = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let state = state.rsplit(") ").next().unwrap_or("").chars().next();
    matches!(state, None | Some('Z') | Some('X'))
}

/// The message of rank 0's error record among `lines`.
fn rank_0_error(lines: &[String]) -> String {
    lines
        .iter()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|v| v["level"] == "ERROR" && v["fields"]["rank"] == 0)
        .unwrap_or_else(|| panic!("{lines:#?}"))["fields"]["message"]
        .as_str()
        .unwrap()
        .to_string()
}

/// Sends `sig` to process `pid` (to process group `-pid` when negative).
fn signal(pid: i64, sig: i32) {
    // SAFETY: kill has no memory preconditions; pid is a process of this test's job.
    unsafe { libc::kill(pid as i32, sig) };
}

#[test]
fn a_rank_that_dies_stops_the_others() {
    let run_dir = Run::new();
    let job = Started::new(&run_dir, &[], &[]);
    let [pid0, pid1] = job.pids;
    signal(pid1 as i64, libc::SIGKILL);
    let (code, lines) = job.exit_within(Duration::from_secs(60));
    assert_eq!(code, Some(3), "{lines:#?}");
    // Rank 0 stopped and said why, naming rank 1.
    assert!(gone(pid0), "rank 0 is still there");
    let msg = rank_0_error(&lines);
    assert!(msg.contains("rank 1 failed"), "{msg}");
}

/// A rank that stops answering (SIGSTOP: its process is there, its
/// connections open, but it neither computes nor speaks) stops the job
/// after the rank timeout instead of leaving rank 0 in a collective.
#[test]
fn a_hung_rank_stops_the_others_after_the_rank_timeout() {
    let run_dir = Run::new();
    let job = Started::new(&run_dir, &[], &[("OOMFIX_RANK_TIMEOUT", "5")]);
    let [pid0, pid1] = job.pids;
    signal(pid1 as i64, libc::SIGSTOP);
    let (code, lines) = job.exit_within(Duration::from_secs(60));
    signal(pid1 as i64, libc::SIGKILL);
    assert_eq!(code, Some(3), "{lines:#?}");
    assert!(gone(pid0), "rank 0 is still there");
    let msg = rank_0_error(&lines);
    assert!(
        msg.contains("rank 1 failed: it sent nothing for 5 s"),
        "{msg}"
    );
}

/// SIGTERM to the launcher, and SIGINT to its process group (a Ctrl-C at
/// the terminal), stop every rank at the same step boundary; rank 0 writes
/// the checkpoint once, and it resumes.
#[test]
fn a_stop_signal_stops_every_rank_with_one_checkpoint() {
    for (sig, code, name, group) in [
        (libc::SIGTERM, 143, "SIGTERM", false),
        (libc::SIGINT, 130, "SIGINT", true),
    ] {
        let run_dir = Run::new();
        let job = Started::new(&run_dir, &["--save", "ck"], &[]);
        let pid = i64::from(job.launcher.id());
        signal(if group { -pid } else { pid }, sig);
        let (exit, lines) = job.exit_within(Duration::from_secs(60));
        assert_eq!(exit, Some(code), "{name}: {lines:#?}");
        let stopped: Vec<&String> = lines
            .iter()
            // (mpirun passes a SIGINT on to the ranks as SIGTERM)
            .filter(|l| l.contains("stopped by SIG") && l.contains("after step"))
            .collect();
        assert_eq!(stopped.len(), 1, "{name}: {lines:#?}");
        assert!(
            stopped[0].contains("checkpoint written to ck"),
            "{}",
            stopped[0]
        );
        let state: Value = serde_json::from_str(
            &std::fs::read_to_string(run_dir.dir.path().join("ck/trainer_state.json")).unwrap(),
        )
        .unwrap();
        let step = state["step"].as_u64().unwrap();
        assert!(
            stopped[0].contains(&format!("after step {step};")),
            "{}",
            stopped[0]
        );
        let (lines, stderr) = ran(
            run_dir
                .oomfix()
                .args(run_dir.args(step as usize + 1, &["--zero-stage", "1", "--gpus", "2"]))
                .args(["--resume", "ck"]),
            "resumed",
        );
        assert_eq!(
            losses(&lines).0.len(),
            1,
            "one step after step {step}: {stderr}"
        );
    }
}

/// Every JSON record of a rank names it, also those inside another span (a
/// planning attempt's), so the ranks' lines can be merged and told apart.
#[test]
fn every_record_of_a_rank_carries_its_rank() {
    let run_dir = Run::new();
    let (lines, stderr) = ran(
        run_dir
            .oomfix()
            .args(run_dir.args(1, &["--zero-stage", "2", "--gpus", "2"])),
        "ZeRO 2 over 2 ranks",
    );
    let of_ranks: Vec<&Value> = lines.iter().filter(|v| v.get("spans").is_some()).collect();
    let rank_of = |v: &Value| v["spans"][0]["rank"].as_u64();
    assert!(
        of_ranks
            .iter()
            .all(|v| v["spans"][0]["name"] == "rank" && rank_of(v).is_some()),
        "{stderr}"
    );
    for rank in [0, 1] {
        assert!(
            of_ranks.iter().any(|v| rank_of(v) == Some(rank)),
            "{stderr}"
        );
    }
    let attempts: Vec<&&Value> = of_ranks
        .iter()
        .filter(|v| v["span"]["name"] == "attempt")
        .collect();
    assert!(!attempts.is_empty(), "{stderr}");
    assert!(attempts.iter().all(|v| rank_of(v) == Some(0)), "{stderr}");
    // What is not a rank's is the launcher's.
    assert!(lines
        .iter()
        .filter(|v| v.get("spans").is_none())
        .all(|v| v.get("span").is_none()));
}

/// `train --snapshot` in a job of 2 ranks: each rank records its own first
/// steps into its own file (`NAME.rankR.EXT`), which the snapshot check reads.
#[test]
fn each_rank_writes_its_own_snapshot() {
    let run_dir = Run::new();
    ran(
        run_dir.oomfix().args(run_dir.args(
            2,
            &[
                "--zero-stage",
                "2",
                "--gpus",
                "2",
                "--snapshot",
                "run.pickle",
                "--snapshot-steps",
                "2",
            ],
        )),
        "snapshots",
    );
    assert!(!run_dir.dir.path().join("run.pickle").exists());
    for rank in [0, 1] {
        let file = run_dir.dir.path().join(format!("run.rank{rank}.pickle"));
        eprintln!("rank {rank}:");
        common::run_python_check(
            "python3",
            "check-snapshot.py",
            &[file.as_os_str(), "--steps".as_ref(), "2".as_ref()],
        );
    }
}

/// Rendezvous settings rank 0 cannot use (a port in use, an address not
/// this machine's) are usage errors, at once, for every rank.
#[test]
fn bad_rendezvous_settings_are_usage_errors() {
    let run_dir = Run::new();
    let args = run_dir.args(1, &["--zero-stage", "1"]);
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = format!("MASTER_PORT={}", taken.local_addr().unwrap().port());
    for setting in [port.as_str(), "MASTER_ADDR=192.0.2.1"] {
        let start = Instant::now();
        let (code, _, stderr) = run(run_dir.mpirun(2, &["-x", setting]).args(&args));
        assert_eq!(code, 2, "{setting}: {stderr}");
        assert!(start.elapsed() < Duration::from_secs(60), "{setting}");
        // Rank 0's reason, or rank 1's when mpirun ends the job on it first.
        assert!(
            stderr.contains("rank 0 cannot listen at")
                || stderr.contains(
                    "rank 0 could not open the control connection (MASTER_ADDR, MASTER_PORT)"
                ),
            "{setting}: {stderr}"
        );
    }
}

#[test]
fn a_wrong_environment_is_a_usage_error() {
    let run_dir = Run::new();
    let args = run_dir.args(1, &["--zero-stage", "1"]);
    // WORLD_SIZE that is not mpirun's.
    let start = Instant::now();
    let (code, lines, stderr) = run(run_dir.mpirun(2, &["-x", "WORLD_SIZE=3"]).args(&args));
    assert_eq!(code, 2, "{stderr}");
    assert!(start.elapsed() < Duration::from_secs(60));
    assert!(
        lines.iter().any(|v| v["fields"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("WORLD_SIZE=3"))),
        "{stderr}"
    );
    // --verify in a job mpirun started: rank 0 cannot start the ranks measuring needs.
    let verify = run_dir.args(1, &["--zero-stage", "1", "--verify"]);
    let (code, _, stderr) = run(run_dir.mpirun(2, &[]).args(&verify));
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("another launcher"), "{stderr}");
    // torchrun's variables, by hand: a rank beyond the world, and CPU ranks outside mpirun.
    for (rank, says) in [("2", "RANK=2 is not below WORLD_SIZE=2"), ("0", "mpirun")] {
        let (code, _, stderr) = run(run_dir
            .oomfix()
            .env("RANK", rank)
            .env("WORLD_SIZE", "2")
            .args(&args));
        assert_eq!(code, 2, "{stderr}");
        assert!(stderr.contains(says), "{stderr}");
    }
}

#[test]
fn a_checkpoint_of_2_ranks_is_one_directory_that_resumes_on_1_or_4() {
    let run_dir = Run::new();
    let accum = GLOBAL_BATCH.to_string();
    let one = ["--grad-accum", &accum[..]];
    let want = step_losses(
        run_dir.oomfix().args(run_dir.args(STEPS, &one)),
        "one process",
    );
    ran(
        run_dir.oomfix().args(run_dir.args(
            STEPS - 1,
            &["--zero-stage", "3", "--gpus", "2", "--save", "ck"],
        )),
        "saved by 2 ranks",
    );
    let ck = oomfix::train::TrainingState::open(&run_dir.dir.path().join("ck")).unwrap();
    assert_eq!(ck.state.plan.shard.world_size, 2);
    assert_eq!(ck.state.step as usize, STEPS - 1);
    // The last step on 1 process and on 4 ranks, each taking its share.
    let resume = ["--resume", "ck"];
    let what = "resumed on 1 process";
    let one = run_dir.args(STEPS, &[&one[..], &resume].concat());
    assert_close(
        &step_losses(run_dir.oomfix().args(one), what),
        &want[STEPS - 1..],
        what,
    );
    // On 4 ranks, with each rank's moments restored into its offloaded share.
    let four = ["--zero-stage", "1", "--optimizer", "cpu-adamw"];
    let what = "resumed on 4 ranks, offloaded";
    let four = run_dir.args(STEPS, &[&four[..], &resume].concat());
    assert_close(
        &step_losses(run_dir.mpirun(4, &[]).args(four), what),
        &want[STEPS - 1..],
        what,
    );
}

/// With accumulation, ZeRO 2 reduces each micro-batch to the gradients'
/// owners, so a rank carries half the accumulated gradients of ZeRO 1 at 2
/// ranks: each rank's measured peak (the summary gathers them all) falls
/// from stage 1 to stage 2, and so does the estimate.
#[test]
fn each_ranks_peak_is_reported_and_falls_from_zero_1_to_zero_2_as_estimated() {
    let run_dir = Run::new();
    let summary = |stage: &str| {
        let extra = [
            "--zero-stage",
            stage,
            "--gpus",
            "2",
            "--grad-accum",
            "4",
            "--json",
        ];
        let what = format!("stage {stage}");
        let v = json_of(run_dir.oomfix().args(run_dir.args(2, &extra)), &what);
        let t = &v["training"];
        let ranks: Vec<u64> = t["rank_peak_bytes"]
            .as_array()
            .unwrap_or_else(|| panic!("stage {stage}: {t}"))
            .iter()
            .map(|p| p.as_u64().unwrap())
            .collect();
        assert_eq!(ranks.len(), 2, "stage {stage}: {t}");
        assert!(ranks.iter().all(|&p| p > 0), "stage {stage}: {t}");
        assert_eq!(t["peak_bytes"].as_u64(), ranks.iter().copied().max());
        let estimate = t["estimated_peak_bytes"].as_u64().unwrap();
        eprintln!("stage {stage}: peaks by rank {ranks:?}, estimate {estimate}");
        (ranks.into_iter().max().unwrap(), estimate)
    };
    let (one, one_estimate) = summary("1");
    let (two, two_estimate) = summary("2");
    assert!(
        two_estimate < one_estimate,
        "{two_estimate} vs {one_estimate}"
    );
    assert!(two < one, "measured: stage 2 {two} vs stage 1 {one}");
}

/// A model whose largest bucket is large beside its activations (an untied
/// 32000-token vocabulary, hidden 64, 16-token sequences): at ZeRO 2 a
/// rank peaks while it reduces a micro-batch's gradients, where MPI holds a
/// copy of the bucket and the result besides; the estimate counts them
/// (`collective_buffers`), and without them it would be exceeded.
#[test]
fn each_ranks_peak_counts_the_collectives_buffers() {
    let run_dir = Run::new();
    let config = ModelConfig::llama(2, 64, 2, 1, 128, 32000, false);
    common::write_safetensors(
        &run_dir.dir.path().join("wide.safetensors"),
        &common::with_dtype(config.tensors(), "F32"),
    );
    let mut args = run_dir.args(
        2,
        &[
            "--zero-stage",
            "2",
            "--gpus",
            "2",
            "--grad-accum",
            "4",
            "--json",
        ],
    );
    args[1] = "wide.safetensors".into();
    let v = json_of(run_dir.oomfix().args(&args), "ZeRO 2 over 2 ranks");
    let (t, e) = (&v["training"], &v["estimate"]);
    assert_eq!(e["peak_phase"], "gradient_reduction", "{e}");
    let buffers = e["collective_buffers_bytes"].as_u64().unwrap();
    let estimate = t["estimated_peak_bytes"].as_u64().unwrap();
    let most = t["peak_bytes"].as_u64().unwrap();
    let ratio = most as f64 / estimate as f64;
    eprintln!("{most} measured, {estimate} estimated ({ratio:.3}), buffers {buffers}");
    assert!(
        (0.97..1.06).contains(&ratio),
        "{most} measured, {estimate} estimated"
    );
    // Most of the buffers are really there: the estimate without them is exceeded.
    assert!(
        most > estimate - buffers / 2,
        "{most}, {estimate}, buffers {buffers}"
    );
}

/// With every block checkpointed, ZeRO 2 reduces each block's gradients as
/// soon as its backward made them. On a model whose gradients outweigh its
/// activations (8 blocks, 16-token sequences) each rank's peak stays within
/// its estimate, which counts one block's local gradients besides those
/// outside the blocks and the rank's reduced share, and it is lower than
/// without checkpointing by more than half the weights (where the whole
/// local gradient set waits for the end of the backward).
#[test]
fn zero_2_with_checkpointing_reduces_each_blocks_gradients_at_once() {
    let run_dir = Run::new();
    let config = ModelConfig {
        layers: 8,
        hidden: 384,
        intermediate: 1536,
        ..common::gpt2_64(2)
    };
    common::write_safetensors(
        &run_dir.dir.path().join("deep.safetensors"),
        &common::with_dtype(config.tensors(), "F32"),
    );
    let summary = |checkpoint: &str| {
        let extra = [
            "--zero-stage",
            "2",
            "--gpus",
            "2",
            "--checkpoint",
            checkpoint,
            "--json",
        ];
        let mut args = run_dir.args(2, &extra);
        args[1] = "deep.safetensors".into();
        let v = json_of(run_dir.oomfix().args(&args), checkpoint);
        let (t, e) = (&v["training"], &v["estimate"]);
        let measured = t["peak_bytes"].as_u64().unwrap();
        let estimate = t["estimated_peak_bytes"].as_u64().unwrap();
        eprintln!("checkpoint {checkpoint}: {measured} measured, {estimate} estimated; {e}");
        (measured, estimate, e["gradients_bytes"].as_u64().unwrap())
    };
    let parameters: usize = config
        .tensors()
        .iter()
        .map(|(_, s)| s.iter().product::<usize>())
        .sum();
    let weights = parameters as u64 * 4;
    let (whole, _, whole_grads) = summary("none");
    assert_eq!(whole_grads, weights);
    let (units, estimate, grads) = summary("every");
    let ratio = units as f64 / estimate as f64;
    assert!(
        (0.97..1.03).contains(&ratio),
        "{units} measured, {estimate} estimated"
    );
    // One of 8 blocks and half the blocks' reduced sums at most.
    assert!(grads < weights * 3 / 4, "{grads} of {weights}");
    assert!(
        units + weights / 2 < whole,
        "every block {units}, none {whole}"
    );
}

/// `--bucket-size` sets the most one collective moves: smaller buckets make
/// more, smaller collectives over the same bytes, the same steps, and a
/// plan that says so.
#[test]
fn the_bucket_size_sets_what_one_collective_moves() {
    let run_dir = Run::new();
    let step = |bucket: &[&str]| {
        let extra = [&["--zero-stage", "2", "--gpus", "2", "--json"][..], bucket].concat();
        let what = format!("{bucket:?}");
        let (v, stderr) = json_and_stderr(run_dir.oomfix().args(run_dir.args(2, &extra)), &what);
        let last = stderr
            .lines()
            .rev()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .find(|v| v["fields"]["message"] == "step")
            .unwrap_or_else(|| panic!("{bucket:?}: no step record: {stderr}"));
        let f = &last["fields"];
        let calls = f["collective_calls"].as_u64().unwrap();
        let bytes = f["collective_bytes"].as_u64().unwrap();
        (v["plan"].clone(), calls, bytes, f["loss"].as_f64().unwrap())
    };
    let (plan, calls, bytes, loss) = step(&[]);
    assert!(plan.get("bucket_bytes").is_none(), "{plan}");
    let (small_plan, small_calls, small_bytes, small_loss) = step(&["--bucket-size", "16KiB"]);
    assert_eq!(small_plan["bucket_bytes"], 16 * 1024, "{small_plan}");
    assert!(small_calls > 2 * calls, "{small_calls} vs {calls}");
    assert_eq!(small_bytes, bytes);
    assert_eq!(small_loss, loss);
}

/// `plan --gpus 2 --verify` measures each plan it verifies with 2 real
/// ranks: the measured peak is the fullest rank's, as training measures it.
#[test]
fn plan_verify_measures_sharded_plans_with_their_ranks() {
    let run_dir = Run::new();
    let v = json_of(
        run_dir
            .oomfix()
            .args(["plan", "model.safetensors", "--verify"])
            .args(Run::planning())
            .args(["--gpus", "2", "--zero-stage", "2", "--json"]),
        "plan --verify",
    );
    let chosen = v["attempts"]
        .as_array()
        .unwrap()
        .iter()
        .rev()
        .find(|a| a["measured_bytes"].is_u64())
        .unwrap_or_else(|| panic!("no attempt was measured: {v}"));
    assert_eq!(chosen["shard_stage"].as_u64(), Some(2), "{chosen}");
    assert_eq!(chosen["world_size"].as_u64(), Some(2), "{chosen}");
    let measured = chosen["measured_bytes"].as_u64().unwrap();
    // The same plan trained over 2 ranks: its summary's fullest rank.
    let t = json_of(
        run_dir
            .oomfix()
            .args(run_dir.args(2, &["--zero-stage", "2", "--gpus", "2", "--json"])),
        "train",
    );
    let trained = t["training"]["peak_bytes"].as_u64().unwrap();
    let ratio = measured as f64 / trained as f64;
    assert!(
        (0.8..1.25).contains(&ratio),
        "verify {measured} vs training {trained}"
    );
}

/// `train --gpus 2 --verify`: the launcher measures the candidates with 2
/// real ranks before it starts the job, and the ranks train its choice; with
/// `--json` the run still prints one object (rank 0's).
#[test]
fn train_verify_measures_with_ranks_before_starting_them() {
    let run_dir = Run::new();
    let extra = [
        "--gpus",
        "2",
        "--zero-stage",
        "2",
        "--verify",
        "--json",
        "-v",
    ];
    let (v, stderr) = json_and_stderr(run_dir.oomfix().args(run_dir.args(1, &extra)), "train");
    let measured: Vec<u64> = stderr
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter_map(|l| l["span"]["measured_bytes"].as_u64())
        .collect();
    assert!(
        !measured.is_empty(),
        "the launcher measured no attempt: {stderr}"
    );
    assert!(measured.iter().all(|&m| m > 0), "{measured:?}");
    assert_eq!(
        v["training"]["rank_peak_bytes"].as_array().map(Vec::len),
        Some(2),
        "{v}"
    );
}

/// A rank that fails with an error of its own (here a data file only it is
/// given, missing) tells the others and leaves: nobody waits for it in a
/// collective, the job ends within the timeout, non-zero, and the failing
/// rank names its cause.
#[test]
fn a_rank_that_fails_stops_the_others_without_a_hang() {
    let run_dir = Run::new();
    let bin = env!("CARGO_BIN_EXE_oomfix");
    let good = run_dir.args(3, &["--zero-stage", "1"]);
    let bad: Vec<String> = good
        .iter()
        .map(|a| {
            if a == "data.bin" {
                "missing.bin".to_string()
            } else {
                a.clone()
            }
        })
        .collect();
    let mut cmd = run_dir.mpirun(1, &[]);
    // mpirun's MPMD form: rank 0 runs the first command, rank 1 the second.
    cmd.args(&good)
        .args([":", "-n", "1", "--oversubscribe", "--bind-to", "none", bin])
        .args(&bad)
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let start = Instant::now();
    let mut child = cmd.spawn().unwrap();
    let deadline = start + Duration::from_secs(60);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            child.kill().unwrap();
            panic!("the job still runs after 60 s");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    assert!(!status.success(), "{stderr}");
    assert!(stderr.contains("missing.bin"), "{stderr}");
    assert!(stderr.contains("rank 1 failed"), "{stderr}");
}

/// Chat examples over 2 ranks: each rank's packed row has its own count of
/// learned tokens, and the step's loss and gradient are the mean over the
/// learned tokens of both (transformers' `num_items_in_batch`), so 2 ranks
/// of one row each, and one process accumulating the two rows, take the
/// steps of one process with both rows in one micro-batch; a mean of the
/// ranks' (or micro-batches') means would not.
#[test]
fn chat_examples_over_2_ranks_take_the_one_process_steps() {
    let fixture = common::chat_dir();
    let (model, data) = (fixture.join("model"), fixture.join("messages.jsonl"));
    let args = |extra: &[&str]| -> Vec<String> {
        let run = [
            "train",
            "--device",
            "cpu",
            "--budget",
            "4GiB",
            "--seq-len",
            "128",
        ];
        let steps = ["--global-batch", "2", "--lr", "1e-2", "--steps", "3"];
        let paths = [model.to_str().unwrap(), "--data", data.to_str().unwrap()];
        run.iter()
            .chain(&steps)
            .chain(&PINNED)
            .chain(&["--log-format", "json"])
            .chain(&paths)
            .chain(extra)
            .map(|s| s.to_string())
            .collect()
    };
    let run_dir = Run::new();
    let (lines, stderr) = ran(
        run_dir.oomfix().args(args(&["--micro-batch", "2"])),
        "one process",
    );
    let (want, _) = losses(&lines);
    assert_eq!(want.len(), 3, "{stderr}");
    for (extra, what) in [
        (&["--micro-batch", "1"][..], "accumulated"),
        (
            &["--micro-batch", "1", "--zero-stage", "1", "--gpus", "2"][..],
            "over 2 ranks",
        ),
    ] {
        let got = step_losses(run_dir.oomfix().args(args(extra)), what);
        assert_close(&got, &want, &format!("chat examples {what}"));
    }
}
