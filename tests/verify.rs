//! `--verify`, `--snapshot` and `--plot`: real steps measured next to estimates.

mod common;

use common::*;
use oomfix::measure::StepVerifier;
use oomfix::search::{Measurement, Verifier};
use oomfix::track::CountingAlloc;
use oomfix::{
    Breakdown, Estimator, Headroom, ModelConfig, ModelSpec, Plan, Planner, Target, Verify,
};
use std::path::Path;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

/// An estimator that claims every plan needs one byte.
struct Optimist;
impl Estimator for Optimist {
    fn estimate(&self, _: &ModelSpec, _: &Plan, _: &Target) -> Breakdown {
        Breakdown {
            peak: 1,
            ..Default::default()
        }
    }
}

#[test]
fn a_measured_peak_over_the_budget_is_not_a_fit() {
    let spec = ModelSpec::from_config("tiny", tiny_gpt2());
    let budget = 64 << 10; // the estimate (1 byte) fits, no real step does
    let result = Planner::new(budget)
        .headroom(Headroom::NONE)
        .global_batch(2)
        .seq_len(16)
        .target(Target::Cpu)
        .estimator(Optimist)
        .verify_with(StepVerifier::in_process(Target::Cpu), Verify::Fitting)
        .run(&spec)
        .unwrap();
    assert!(!result.fits());
    let measured: Vec<u64> = result
        .attempts
        .iter()
        .map(|a| a.measured.unwrap().peak_bytes)
        .collect();
    assert!(measured.iter().all(|&m| m > budget), "{measured:?}");
    // the search went on after the baseline's measurement failed it
    assert!(result.attempts.len() > 1);
}

#[test]
fn verify_with_a_verifier_that_reports_oom_is_not_a_fit() {
    struct Oom;
    impl Verifier for Oom {
        fn measure(&self, _: &ModelSpec, _: &Plan) -> oomfix::Result<Measurement> {
            Ok(Measurement {
                peak_bytes: 0,
                reserved_bytes: 0,
                out_of_memory: true,
                step_seconds: None,
            })
        }
    }
    let spec = ModelSpec::from_config("tiny", tiny_gpt2());
    let result = Planner::new(1 << 30)
        .global_batch(2)
        .seq_len(16)
        .target(Target::Cpu)
        .estimator(Optimist)
        .verify_with(Oom, Verify::All)
        .run(&spec)
        .unwrap();
    assert!(!result.fits());
    assert!(result
        .attempts
        .iter()
        .all(|a| a.measured.unwrap().out_of_memory));
    // The report says the closest plan ran out of memory, not that a budget of
    // its (too low) estimate would fit it.
    assert!(
        result.advice[0].contains("ran out of memory when measured"),
        "{:?}",
        result.advice
    );
    let table = oomfix::report::search_table(&spec, &result);
    assert!(table.contains("ran out of memory when measured"), "{table}");
    assert!(!table.contains("0 B over the budget"), "{table}");
}

#[test]
fn cli_verify_records_measured_bytes() {
    let v = verified("256MiB", "--verify", 0);
    let chosen = v["attempts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["fits"] == true)
        .unwrap();
    let measured = chosen["measured_bytes"].as_u64().expect("measured");
    assert!(measured > 100_000, "a real step allocates: {measured}");
}

#[test]
fn cli_verify_all_with_a_budget_too_small_for_any_real_step() {
    // 300 KiB: smaller than weights + AdamW state + one step's activations
    let v = verified("300KiB", "--verify=all", 1);
    assert!(v["attempts"]
        .as_array()
        .unwrap()
        .iter()
        .all(|a| !a["measured_bytes"].is_null() && a["fits"] == false));
}

#[test]
fn snapshot_loads_with_python_pickle_and_plot_is_svg() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_gpt2_file(dir.path());
    let snap = dir.path().join("step.pickle");
    let plot = dir.path().join("step.svg");
    exits(
        oomfix()
            .args(on_cpu("256MiB", "2"))
            .arg("--snapshot")
            .arg(&snap)
            .arg("--plot")
            .arg(&plot)
            .arg(&model),
        0,
    );
    let check = r#"
import pickle, sys
d = pickle.load(open(sys.argv[1], "rb"))
assert set(d) >= {"segments", "device_traces"}, d.keys()
t = d["device_traces"][0]
assert len(t) > 10 and {"action", "addr", "size", "time_us", "frames"} <= set(t[0]), t[0]
assert {e["action"] for e in t} <= {"alloc", "free_completed", "snapshot"}
assert {f["name"] for e in t for f in e["frames"]} >= {"forward", "backward", "optimizer_step"}
print(len(t))
"#;
    python_on(check, &snap);
    replay(&snap, 1);
    let svg = std::fs::read_to_string(&plot).unwrap();
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    assert!(svg.contains("budget"));
}

/// `--snapshot` and `--trim-between-phases` on a device this build cannot
/// record or trim: one line, exit 2, nothing written.
#[test]
fn cuda_recording_and_trimming_are_refused_where_the_build_cannot() {
    let dir = tempfile::tempdir().unwrap();
    let snap = dir.path().join("step.pickle");
    let stderr = stderr_of(
        oomfix()
            .args(["--budget", "8GiB", "--device", "cuda:0", "--snapshot"])
            .arg(&snap),
        2,
    );
    let expected = if cfg!(feature = "cuda") {
        "memory hook"
    } else {
        "--features cuda"
    };
    assert!(
        stderr.contains(expected) || cfg!(feature = "cuda"),
        "{stderr}"
    );
    assert!(!snap.exists());
    let stderr = stderr_of(
        oomfix().args([
            "train",
            "--budget",
            "256MiB",
            "--device",
            "cpu",
            "--trim-between-phases",
        ]),
        2,
    );
    assert!(stderr.contains("CUDA"), "{stderr}");
}

#[test]
fn snapshot_refuses_to_overwrite_the_model() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_gpt2_file(dir.path());
    let before = std::fs::read(&model).unwrap();
    oomfix()
        .args(on_cpu("256MiB", "2"))
        .arg("--plot")
        .arg(&model)
        .arg(&model)
        .assert()
        .code(2);
    assert_eq!(std::fs::read(&model).unwrap(), before);
}

#[test]
fn a_host_out_of_memory_while_verifying_is_one_failed_attempt() {
    // A tiny model with GPT-2's vocabulary: at batch 8 × 1024 its logits alone
    // are 1.6 GB a copy, past the measuring child's address-space limit
    // (budget + 2 GiB), so the child dies on an allocation failure.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("wide.safetensors");
    let config = ModelConfig {
        vocab: 50257,
        max_positions: 1024,
        ..ModelConfig::gpt2(1, 32, 2)
    };
    write_safetensors(&path, &with_dtype(config.tensors(), "F32"));
    let v = json_of(
        oomfix()
            .args(["--budget", "64MiB", "--device", "cpu", "--seq-len", "1024"])
            .args(["--global-batch", "8", "--strategies", "precision"])
            .args(["--verify=all", "--json"])
            .arg(&path),
        1,
    );
    let attempts = v["attempts"].as_array().unwrap();
    assert_eq!(
        attempts.len(),
        2,
        "the planner went on after the first out-of-memory"
    );
    assert!(
        attempts
            .iter()
            .all(|a| a["out_of_memory"] == true && a["fits"] == false),
        "{attempts:?}"
    );
}

/// `train --snapshot` records the run's own first `--snapshot-steps` steps:
/// the snapshot holds that many optimizer steps (each a run of events in
/// the optimizer step's phase), and the plot is drawn beside it.
#[test]
fn train_snapshot_records_the_runs_first_steps() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_gpt2_file(dir.path());
    let count = r#"
import pickle, sys
d = pickle.load(open(sys.argv[1], "rb"))
t = d["device_traces"][0]
phases = ("forward", "backward", "optimizer_step")
seq = [n for e in t for n in [next((f["name"] for f in e["frames"] if f["name"] in phases), None)] if n]
print(sum(1 for a, b in zip([None] + seq, seq) if b == "optimizer_step" and a != b))
"#;
    for steps in [1, 2] {
        let snap = dir.path().join(format!("run{steps}.pickle"));
        let plot = dir.path().join(format!("run{steps}.svg"));
        exits(
            oomfix()
                .arg("train")
                .args(on_cpu("256MiB", "2"))
                .args(["--steps", "3", "--init", "random"])
                .args(["--snapshot-steps", &steps.to_string(), "--snapshot"])
                .arg(&snap)
                .arg("--plot")
                .arg(&plot)
                .arg(&model),
            0,
        );
        assert_eq!(python_on(count, &snap).trim(), steps.to_string());
        replay(&snap, steps);
        let svg = std::fs::read_to_string(&plot).unwrap();
        assert!(
            svg.contains(&format!("steps 1-{steps}")),
            "the plot's title names the steps"
        );
    }
}

/// The JSON result of `oomfix VERIFY` on the tiny GPT-2 on the CPU within
/// `budget`, which exits with `code`.
fn verified(budget: &str, verify: &str, code: i32) -> serde_json::Value {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_gpt2_file(dir.path());
    let args = on_cpu(budget, "2");
    json_of(
        oomfix().args(args).args([verify, "--json"]).arg(&model),
        code,
    )
}

/// The standard output of Python's `code` run on `snapshot` (the test
/// fails with its stderr unless it succeeds).
fn python_on(code: &str, snapshot: &Path) -> String {
    let py = std::process::Command::new("python3")
        .arg("-c")
        .arg(code)
        .arg(snapshot)
        .output()
        .unwrap();
    assert!(
        py.status.success(),
        "{}",
        String::from_utf8_lossy(&py.stderr)
    );
    String::from_utf8_lossy(&py.stdout).into_owned()
}

/// The replay check of a snapshot of `steps` steps
/// (scripts/check-snapshot.py: frees match allocations, times in order;
/// PyTorch's readers where installed).
fn replay(snapshot: &Path, steps: usize) {
    let steps = steps.to_string();
    run_python_check(
        "python3",
        "check-snapshot.py",
        &[snapshot.as_os_str(), "--steps".as_ref(), steps.as_ref()],
    );
}
