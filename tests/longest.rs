//! `--seq-len longest`: the longest sequence at which a plan fits. Fitting
//! is monotone in the length on every family (what the bisection relies
//! on), the length found fits and one token more does not, and the command
//! prints it, trains at it, measures it and refuses what cannot be searched.

mod common;

use common::oomfix;
use oomfix::{ModelSpec, Planner, Target};
use serde_json::Value;

#[path = "common/estimate.rs"]
mod estimate;

/// The planner every search of these tests runs: 2 sequences a step.
fn planner(budget: u64, target: Target) -> Planner {
    Planner::new(budget).global_batch(2).target(target)
}

fn fits(spec: &ModelSpec, budget: u64, target: Target, seq_len: usize) -> bool {
    planner(budget, target)
        .seq_len(seq_len)
        .run(spec)
        .unwrap()
        .fits()
}

/// Budgets just below and at the least at which `seq_len` tokens fit
/// (bisection on the budget, to a thousandth).
fn least_budget(spec: &ModelSpec, target: Target, seq_len: usize) -> (u64, u64) {
    let (mut lo, mut hi) = (0u64, 1u64 << 40);
    while hi - lo > hi / 1000 {
        let mid = lo + (hi - lo) / 2;
        if fits(spec, mid, target, seq_len) {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    (lo, hi)
}

/// On every family and both targets, at budgets from just below what one
/// token needs to what the whole context needs: along 16 lengths up to the
/// context, no length fits where a shorter one does not; `longest` fits and
/// the next length does not, and the lengths along the way fit exactly up
/// to it; between the two ends the answer lies strictly inside the context
/// (the bisection ran).
#[test]
fn fitting_is_monotone_in_the_length_on_every_family() {
    for (name, config) in estimate::families() {
        let spec = ModelSpec::from_config(name, config);
        let upper = spec.config.max_positions;
        for target in [Target::Cpu, Target::Cuda(0)] {
            let (none, one) = least_budget(&spec, target, 1);
            let (_, all) = least_budget(&spec, target, upper);
            assert!(one < all, "{name} on {target}: {one} {all}");
            let mut inside = false;
            for quarters in 0..=4 {
                let budget = none + (all - none) * quarters / 4;
                let result = planner(budget, target).longest(&spec).unwrap();
                let longest = result.longest.clone().unwrap();
                assert_eq!(longest.upper, upper, "{name}");
                let mut shorter_fits = true;
                for n in (1..=16).map(|k| (upper * k).div_ceil(16)) {
                    let f = fits(&spec, budget, target, n);
                    assert!(
                        shorter_fits || !f,
                        "{name} on {target} at {budget} bytes: {n} tokens fit, a shorter length does not"
                    );
                    shorter_fits &= f;
                    let expected = longest.seq_len.is_some_and(|l| n <= l);
                    assert_eq!(
                        f, expected,
                        "{name} on {target} at {budget} bytes, {n} tokens"
                    );
                }
                match longest.seq_len {
                    Some(l) => {
                        assert!(fits(&spec, budget, target, l), "{name}: {l} fits");
                        assert_eq!(result.chosen().unwrap().plan.seq_len, l, "{name}");
                        if l < upper {
                            assert!(!fits(&spec, budget, target, l + 1), "{name}: {l} + 1");
                            inside |= l > 1;
                        }
                    }
                    None => {
                        assert_eq!(quarters, 0, "{name} on {target}: nothing fits at {budget}");
                        assert!(!result.fits());
                    }
                }
            }
            assert!(
                inside,
                "{name} on {target}: no budget put the longest inside the context"
            );
        }
    }
}

fn json(args: &[&str]) -> (i32, Value) {
    common::code_and_json(oomfix().args(args).arg("--json"))
}

/// The plan, its JSON and its table: the length found is the plan's, the
/// trail ends where the bisection closed, and the table says it.
#[test]
fn plan_prints_the_longest_length_and_how_it_was_found() {
    let args = [
        "--budget",
        "2090MiB",
        "--device",
        "cpu",
        "--global-batch",
        "1",
        "--seq-len",
        "longest",
    ];
    let (code, v) = json(&args);
    assert_eq!(code, 0);
    let longest = v["longest"]["seq_len"].as_u64().unwrap();
    assert!(longest > 1 && longest < 1024, "{longest}");
    assert_eq!(v["plan"]["seq_len"].as_u64(), Some(longest));
    assert_eq!(v["longest"]["upper"], 1024);
    let trail = v["longest"]["trail"].as_array().unwrap();
    assert_eq!(trail[0], serde_json::json!([1024, false]));
    assert!(trail
        .iter()
        .any(|t| t[0].as_u64() == Some(longest) && t[1] == true));
    assert!(trail
        .iter()
        .any(|t| t[0].as_u64() == Some(longest + 1) && t[1] == false));
    let out = oomfix().args(args).output().unwrap();
    let table = String::from_utf8(out.stdout).unwrap();
    let line = format!(
        "longest that fits: {longest} tokens (of 1,024; {} lengths searched)",
        trail.len()
    );
    assert!(table.contains(&line), "{table}");
}

/// Nothing fits at one token: exit 1, the closest plan and a hint, as any
/// search that fits nothing.
#[test]
fn nothing_fits_at_any_length_exits_1_with_the_closest_plan() {
    let (code, v) = json(&[
        "--budget",
        "100MiB",
        "--device",
        "cpu",
        "--seq-len",
        "longest",
    ]);
    assert_eq!(code, 1);
    assert_eq!(v["fits"], false);
    assert!(v["longest"]["seq_len"].is_null());
    assert!(!v["closest"].is_null());
    assert!(!v["advice"].as_array().unwrap().is_empty());
}

#[test]
fn a_misspelled_length_is_a_usage_error() {
    let err = common::stderr_of(oomfix().args(["--budget", "8GiB", "--seq-len", "long"]), 2);
    assert!(
        err.contains("--seq-len") && err.contains("`longest`"),
        "{err}"
    );
}

/// On the CPU the search's plan at the longest length is measured
/// (`--verify`): its measured peak is within the budget.
#[test]
fn the_longest_plan_measured_on_the_cpu_fits_the_budget() {
    let dir = tempfile::tempdir().unwrap();
    let model = common::tiny_gpt2_file(dir.path());
    let budget = 12u64 << 20;
    let out = oomfix()
        .arg(&model)
        .args([
            "--budget",
            "12MiB",
            "--device",
            "cpu",
            "--global-batch",
            "1",
        ])
        .args(["--seq-len", "longest", "--verify", "--json"])
        .output()
        .unwrap();
    common::assert_exit(&out, 0);
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let longest = v["longest"]["seq_len"].as_u64().unwrap();
    assert_eq!(v["plan"]["seq_len"].as_u64(), Some(longest));
    let chosen = v["attempts"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|a| a["fits"] == true && !a["measured_bytes"].is_null())
        .map(|a| a["measured_bytes"].as_u64().unwrap())
        .collect::<Vec<_>>();
    assert!(!chosen.is_empty(), "a fitting plan was measured");
    assert!(chosen.iter().all(|&m| m <= budget), "{chosen:?}");
}

/// Llama-3.1-8B's shape under QLoRA r 32 on one 24 GiB GPU: with the
/// checkpointed blocks' inputs in host memory (`offload-activations`) the
/// longest length grows by more than a quarter, the plan says so, and its host bytes hold
/// them; without the fix in the pipeline it is the shorter one. On the CPU
/// the pin is refused.
#[test]
fn activations_on_the_host_lengthen_the_longest_sequence() {
    use oomfix::strategies::lora::{BasePrecision, Lora};
    use oomfix::strategies::Pipeline;
    use oomfix::{ModelConfig, Pins};
    let config = ModelConfig {
        max_positions: 131_072,
        ..ModelConfig::llama(32, 4096, 32, 8, 14336, 128_256, false)
    };
    let spec = ModelSpec::from_config("Llama-3.1-8B shape", config);
    let facts = oomfix::memory::model_facts(&spec);
    let longest = |pipeline: Pipeline| {
        let mut pins = Pins::default();
        pins.lora = Some(Lora::new(32, None, None, BasePrecision::Nf4, &facts).unwrap());
        pins.base_precision = Some(BasePrecision::Nf4);
        Planner::new(24 << 30)
            .global_batch(1)
            .host_budget(64 << 30)
            .pins(pins)
            .pipeline(pipeline)
            .longest(&spec)
            .unwrap()
    };
    let all = longest(Pipeline::default());
    let names: Vec<&str> = Pipeline::default()
        .names()
        .into_iter()
        .filter(|n| *n != "offload-activations")
        .collect();
    let kept = longest(Pipeline::from_names(&names).unwrap());
    let length = |r: &oomfix::SearchResult| r.longest.as_ref().unwrap().seq_len.unwrap();
    assert!(
        length(&all) > length(&kept) * 5 / 4,
        "{} {}",
        length(&all),
        length(&kept)
    );
    let chosen = all.chosen().unwrap();
    assert!(chosen.plan.offload_activations, "{}", chosen.plan);
    assert!(!kept.chosen().unwrap().plan.offload_activations);
    // 31 of the 32 blocks' inputs, [s, 4096] in bf16, on the host.
    let inputs = 31 * chosen.plan.seq_len as u64 * 4096 * 2;
    assert!(chosen.estimate.host >= inputs, "{}", chosen.estimate.host);

    let out = oomfix()
        .args([
            "--device",
            "cpu",
            "--activations",
            "host",
            "--budget",
            "8GiB",
        ])
        .output()
        .unwrap();
    let err = common::assert_exit(&out, 2);
    assert!(err.contains("--activations host needs a GPU"), "{err}");
    assert!(out.stdout.is_empty());
}
