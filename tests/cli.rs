//! Tests of the real `oomfix` binary: exit codes, output, logs.

mod common;

use common::oomfix;
use predicates::prelude::*;
use serde_json::Value;

fn json_of(args: &[&str]) -> (i32, Value) {
    common::code_and_json(oomfix().args(args).arg("--json"))
}

#[test]
fn default_model_fits_in_8gib_and_says_which_model() {
    oomfix()
        .args(["--budget", "8GiB"])
        .assert()
        .code(0)
        .stdout(predicate::str::contains("GPT-2 small shape"))
        .stdout(predicate::str::contains("124,439,808"))
        .stdout(predicate::str::contains("plan "))
        .stderr(predicate::str::contains("no model given"));
}

#[test]
fn plan_subcommand_is_the_default() {
    // The host budget is given: its default follows the machine's available
    // memory, which other tests running alongside move.
    let a = oomfix()
        .args(["--budget", "8GiB", "--host-budget", "16GiB", "--json"])
        .output()
        .unwrap();
    let b = oomfix()
        .args([
            "plan",
            "--budget",
            "8GiB",
            "--host-budget",
            "16GiB",
            "--json",
        ])
        .output()
        .unwrap();
    assert_eq!(a.stdout, b.stdout);
}

#[test]
fn json_has_the_documented_fields() {
    let (code, v) = json_of(&["--budget", "8GiB"]);
    assert_eq!(code, 0);
    assert_eq!(v["fits"], true);
    assert_eq!(v["budget_bytes"], 8u64 << 30);
    for key in [
        "path",
        "family",
        "parameters",
        "layers",
        "hidden",
        "heads",
        "vocab",
        "dtype",
    ] {
        assert!(!v["model"][key].is_null(), "model.{key}");
    }
    assert_eq!(v["model"]["parameters"], 124_439_808u64);
    assert_eq!(v["model"]["family"], "gpt2");
    for key in [
        "micro_batch",
        "grad_accum",
        "seq_len",
        "precision",
        "checkpoint",
        "optimizer",
        "world_size",
        "shard_stage",
    ] {
        assert!(!v["plan"][key].is_null(), "plan.{key}");
    }
    let plan = &v["plan"];
    assert_eq!(
        plan["micro_batch"].as_u64().unwrap() * plan["grad_accum"].as_u64().unwrap(),
        8
    );
    assert!(v["estimate"]["peak_bytes"].as_u64().unwrap() <= 8u64 << 30);
    for key in [
        "weights_bytes",
        "gradients_bytes",
        "optimizer_state_bytes",
        "activations_bytes",
    ] {
        assert!(v["estimate"][key].is_u64(), "estimate.{key}");
    }
    let attempts = v["attempts"].as_array().unwrap();
    assert!(attempts.len() >= 2);
    assert_eq!(attempts[0]["strategy"], "baseline");
    assert_eq!(attempts[0]["fits"], false);
    for a in attempts {
        assert!(a["measured_bytes"].is_null());
        assert!(a["estimated_bytes"].is_u64());
    }
}

#[test]
fn nothing_fits_exits_1_with_the_closest_attempt() {
    oomfix()
        .args(["--budget", "100MiB"])
        .assert()
        .code(1)
        .stdout(predicate::str::contains("nothing fits"))
        .stdout(predicate::str::contains("over the budget"))
        .stdout(predicate::str::contains("dominated by"));
    let (code, v) = json_of(&["--budget", "100MiB"]);
    assert_eq!(code, 1);
    assert_eq!(v["fits"], false);
    assert!(v["plan"].is_null());
    assert!(v["closest"]["estimated_bytes"].as_u64().unwrap() > 100 << 20);
}

#[test]
fn sharding_over_gpus_makes_a_small_budget_fit() {
    let no_offload = "accumulate,precision,flash-attention,checkpoint,fused-adamw,shard";
    let (code, _) = json_of(&["--budget", "3GiB", "--strategies", no_offload]);
    assert_eq!(code, 1);
    let (code, v) = json_of(&["--budget", "3GiB", "--gpus", "8"]);
    assert_eq!(code, 0, "{v:#}");
    assert_eq!(v["plan"]["world_size"], 8);
    assert!(v["plan"]["shard_stage"].as_u64().unwrap() >= 1);
    assert_eq!(v["plan"]["optimizer"], "fused-adamw");
}

#[test]
fn offloading_the_optimizer_makes_a_small_budget_fit_one_gpu_not_the_cpu() {
    let (code, v) = json_of(&["--budget", "3GiB"]);
    assert_eq!(code, 0, "{v:#}");
    assert_eq!(v["plan"]["optimizer"], "cpu-adamw");
    assert_eq!(v["plan"]["world_size"], 1);
    assert_eq!(v["estimate"]["optimizer_state_bytes"], 0);
    // 12 bytes per parameter of GPT-2 small's 124M move to the host
    assert!(v["estimate"]["host_bytes"].as_u64().unwrap() > 12 * 124_000_000);
    // the CPU's memory is the host's: nothing to offload to (its closest plan needs 2.55 GiB)
    let (code, v) = json_of(&["--budget", "2GiB", "--device", "cpu"]);
    assert_eq!(code, 1, "{v:#}");
    let optimizers: Vec<&str> = (v["attempts"].as_array().unwrap().iter())
        .map(|a| a["optimizer"].as_str().unwrap())
        .collect();
    assert!(!optimizers.contains(&"cpu-adamw"), "{optimizers:?}");
}

#[test]
fn strategies_choose_subset_and_order() {
    let (_, v) = json_of(&["--budget", "8GiB", "--strategies", "checkpoint,precision"]);
    let names: Vec<&str> = v["attempts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["strategy"].as_str().unwrap())
        .collect();
    assert_eq!(names[0], "baseline");
    assert_eq!(names[1], "checkpoint");
    assert!(!names.contains(&"accumulate"));
    oomfix()
        .args(["--budget", "8GiB", "--strategies", "teleport"])
        .assert()
        .code(2)
        .stderr(predicate::str::contains("unknown strategy `teleport`"));
}

#[test]
fn usage_errors_exit_2() {
    oomfix()
        .assert()
        .code(2)
        .stderr(predicate::str::contains("budget is required"));
    oomfix()
        .args(["--budget", "8 parsecs"])
        .assert()
        .code(2)
        .stderr(predicate::str::contains("unknown unit"));
    oomfix()
        .args(["--budget", "8GiB", "--device", "tpu"])
        .assert()
        .code(2);
    oomfix()
        .args(["--budget", "8GiB", "--global-batch", "0"])
        .assert()
        .code(2);
    oomfix()
        .args(["--budget", "8GiB", "--seq-len", "4096"])
        .assert()
        .code(2)
        .stderr(predicate::str::contains("learned positions"));
    oomfix()
        .args(["--budget", "8GiB", "/nonexistent/model.safetensors"])
        .assert()
        .code(2)
        .stderr(predicate::str::contains("/nonexistent/model.safetensors"));
}

#[test]
fn enforce_budget_on_the_cpu_is_a_usage_error() {
    oomfix()
        .args(["--budget", "8GiB", "--device", "cpu", "--enforce-budget"])
        .assert()
        .code(2)
        .stdout(predicate::str::is_empty())
        .stderr(predicate::str::contains(
            "--enforce-budget limits a CUDA device",
        ));
}

#[test]
fn json_logs_are_one_object_per_line_with_attempt_fields() {
    let stderr = common::stderr_of(
        oomfix().args(["--budget", "8GiB", "--log-format", "json"]),
        0,
    );
    let attempts: Vec<Value> = stderr
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str::<Value>(l).expect("each line is JSON"))
        .filter(|v| v["span"]["name"] == "attempt")
        .collect();
    assert!(attempts.len() >= 2, "{stderr}");
    let span = &attempts[0]["span"];
    assert_eq!(span["strategy"], "baseline");
    for key in [
        "micro_batch",
        "grad_accum",
        "precision",
        "checkpoint",
        "optimizer",
        "world_size",
        "estimated_bytes",
        "budget_bytes",
        "activations_bytes",
        "optimizer_state_bytes",
    ] {
        assert!(!span[key].is_null(), "span.{key} in {span}");
    }
    assert!(attempts.iter().any(|a| a["fields"]["fits"] == true));
    assert!(attempts.iter().all(|a| a["span"]["fits"].is_boolean()));
}

#[test]
fn rust_log_is_respected_and_log_file_gets_the_logs() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("oomfix.log");
    let out = oomfix()
        .args(["--budget", "8GiB", "--log-file"])
        .arg(&log)
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains("baseline"), "{text}");
    let quiet = oomfix()
        .args(["--budget", "8GiB", "-v"])
        .env("RUST_LOG", "error")
        .output()
        .unwrap();
    assert!(!String::from_utf8_lossy(&quiet.stderr).contains("baseline"));
    let loud = oomfix()
        .args(["--budget", "8GiB"])
        .env("RUST_LOG", "info")
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&loud.stderr).contains("baseline"));
}
