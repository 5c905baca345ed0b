//! The search's choice among the plans that fit: the fastest by the
//! step-time model (or by measurement with a verifier), a headroom below the
//! budget, a host budget for offloaded state, and fields the user pins.

mod common;

use assert_cmd::Command;
use oomfix::search::{Measurement, Verifier};
use oomfix::speed::step_time;
use oomfix::strategies::{Attention, Checkpointing, OptimizerImpl, Plan, Precision};
use oomfix::{
    Estimator, Headroom, MemoryModel, ModelConfig, ModelSpec, Pins, Planner, Target, Verify,
};
use serde_json::Value;
use std::sync::Mutex;

fn gpt2_small() -> ModelSpec {
    ModelSpec::default_model()
}

#[test]
fn the_chosen_plan_is_the_fastest_fitting_plan_explored() {
    let spec = gpt2_small();
    for budget in [6u64 << 30, 8 << 30, 16 << 30, 40 << 30] {
        let result = Planner::new(budget).run(&spec).unwrap();
        let chosen = result.chosen().expect("GPT-2 small fits");
        // Every recorded attempt that fits is no faster than the chosen one.
        for a in result.attempts.iter().filter(|a| a.fits) {
            assert!(
                a.time.total >= chosen.time.total,
                "{} vs {}",
                a.plan,
                chosen.plan
            );
        }
        assert!(result.explored >= result.attempts.len() - 1);
        let margin = budget - chosen.estimate.peak;
        assert!(margin >= result.headroom.bytes(chosen.estimate.peak));
        assert_eq!(result.margin_bytes(), Some(margin));
    }
}

#[test]
fn a_larger_budget_never_gives_a_slower_plan() {
    let spec = gpt2_small();
    let mut last = f64::INFINITY;
    for gib in [4u64, 6, 8, 12, 16, 24, 40, 80] {
        let result = Planner::new(gib << 30).run(&spec).unwrap();
        if let Some(c) = result.chosen() {
            assert!(c.time.total <= last * (1.0 + 1e-9), "{gib} GiB: {}", c.plan);
            last = c.time.total;
        }
    }
}

#[test]
fn on_the_cpu_fp32_is_chosen_over_bf16_when_both_fit() {
    // The CPU widens 16-bit matrix products to f32: fp32 is faster there.
    let spec = ModelSpec::from_config("tiny", common::tiny_gpt2());
    let result = Planner::new(1 << 30)
        .global_batch(4)
        .seq_len(64)
        .target(Target::Cpu)
        .run(&spec)
        .unwrap();
    let chosen = result.chosen().unwrap().plan;
    assert_eq!(chosen.precision, Precision::F32);
    let bf16 = Plan {
        precision: Precision::Bf16,
        ..chosen
    };
    assert!(
        step_time(&spec, &bf16, oomfix::memory::builtins(), &Target::Cpu).total
            > step_time(&spec, &chosen, oomfix::memory::builtins(), &Target::Cpu).total
    );
}

#[test]
fn the_headroom_is_kept_below_the_budget() {
    let spec = gpt2_small();
    let plan = Plan {
        precision: Precision::Bf16,
        checkpoint: Checkpointing::Every(1),
        attention: Attention::Flash,
        optimizer: OptimizerImpl::FusedAdamW,
        ..Plan::baseline(8, 1024)
    };
    let peak = MemoryModel.estimate(&spec, &plan, &Target::Cuda(0)).peak;
    let pins = pinned(&plan);
    let at = |budget: u64, headroom: Headroom| {
        Planner::new(budget)
            .pins(pins)
            .headroom(headroom)
            .run(&spec)
            .unwrap()
            .fits()
    };
    assert!(at(peak, Headroom::NONE));
    assert!(!at(peak, Headroom::fraction(0.05)));
    assert!(at(peak + peak / 20 + 1, Headroom::fraction(0.05)));
    assert!(!at(peak + (64 << 20) - 1, Headroom::fixed(64 << 20)));
    let both = Headroom {
        fixed: 64 << 20,
        fraction: 0.01,
    };
    let needed = peak + (64 << 20) + peak.div_ceil(100);
    assert!(!at(needed - 1, both) && at(needed, both));
    // The default on CUDA is the estimate's measured error against the
    // reserved peak: 192 MiB + 3%.
    assert_eq!(
        Headroom::default_for(&Target::Cuda(0)),
        Headroom {
            fixed: 192 << 20,
            fraction: 0.03
        }
    );
    assert!(!Planner::new(peak).pins(pins).run(&spec).unwrap().fits());
    assert_eq!("5%".parse::<Headroom>(), Ok(Headroom::fraction(0.05)));
    assert_eq!("1GiB".parse::<Headroom>(), Ok(Headroom::fixed(1 << 30)));
    assert_eq!(" 64MiB + 1% ".parse::<Headroom>(), Ok(both));
    assert_eq!("1%+64MiB".parse::<Headroom>(), Ok(both));
    for bad in ["1%+2%", "1MiB+1MiB", "64MiB+", "+1%", "lots"] {
        assert!(bad.parse::<Headroom>().is_err(), "{bad}");
    }
    assert!("100%".parse::<Headroom>().is_err() && "-1%".parse::<Headroom>().is_err());
}

#[test]
fn an_offloaded_plan_must_fit_the_host_budget_too() {
    let spec = ModelSpec::from_config("tinyllama", ModelConfig::tinyllama_1_1b());
    let budget = 8 << 30;
    let roomy = Planner::new(budget)
        .host_budget(64 << 30)
        .run(&spec)
        .unwrap();
    let chosen = roomy.chosen().expect("offloaded into 8 GiB");
    assert!(chosen.plan.optimizer.is_offloaded());
    let host = chosen.estimate.host;
    let tight = Planner::new(budget)
        .host_budget(host - 1)
        .run(&spec)
        .unwrap();
    assert!(tight
        .attempts
        .iter()
        .filter(|a| a.fits)
        .all(|a| a.estimate.host < host));
    assert!(tight
        .chosen()
        .is_none_or(|c| !c.plan.optimizer.is_offloaded()));
}

fn pinned(plan: &Plan) -> Pins {
    let mut pins = Pins::default();
    pins.micro_batch = Some(plan.micro_batch);
    pins.grad_accum = Some(plan.grad_accum);
    pins.precision = Some(plan.precision);
    pins.checkpoint = Some(plan.checkpoint);
    pins.attention = Some(plan.attention);
    pins.chunked_loss = Some(plan.chunked_loss);
    pins.offload_activations = Some(plan.offload_activations);
    pins.optimizer = Some(plan.optimizer);
    pins
}

#[test]
fn pinned_fields_are_kept_and_the_rest_is_searched() {
    let spec = gpt2_small();
    let mut pins = Pins::default();
    pins.micro_batch = Some(2);
    pins.precision = Some(Precision::F32);
    let result = Planner::new(8 << 30).pins(pins).run(&spec).unwrap();
    assert_eq!(result.pins.names(), ["micro_batch", "precision"]);
    for a in &result.attempts {
        assert_eq!(
            (a.plan.micro_batch, a.plan.grad_accum),
            (2, 4),
            "{}",
            a.plan
        );
        assert_eq!(a.plan.precision, Precision::F32);
    }
    assert!(
        result.fits(),
        "fp32 at 2 x 4 fits 8 GiB with the other fixes"
    );
    // Contradicting pins are the user's error.
    let refused = |pins| Planner::new(8 << 30).pins(pins).run(&spec).unwrap_err();
    pins.grad_accum = Some(3);
    assert!(refused(pins).is_input());
    let mut pins = Pins::default();
    pins.micro_batch = Some(3);
    assert!(refused(pins).is_input());
}

/// Reports step times that reverse the model's order: the slowest modelled
/// plan is the fastest measured.
struct Reversed {
    seen: Mutex<Vec<Plan>>,
}

impl Verifier for Reversed {
    fn measure(&self, spec: &ModelSpec, plan: &Plan) -> oomfix::Result<Measurement> {
        self.seen.lock().unwrap().push(*plan);
        let estimate = MemoryModel.estimate(spec, plan, &Target::Cuda(0));
        Ok(Measurement {
            peak_bytes: estimate.peak,
            reserved_bytes: estimate.peak,
            out_of_memory: false,
            step_seconds: Some(
                1.0 / step_time(spec, plan, oomfix::memory::builtins(), &Target::Cuda(0)).total,
            ),
        })
    }
}

#[test]
fn with_a_verifier_the_fastest_measured_candidate_is_chosen() {
    let spec = gpt2_small();
    let plain = Planner::new(16 << 30).run(&spec).unwrap();
    let modelled_best = plain.chosen().unwrap().plan;
    let verifier = Reversed {
        seen: Mutex::new(Vec::new()),
    };
    let result = Planner::new(16 << 30)
        .verify_with(verifier, Verify::Fitting)
        .run(&spec)
        .unwrap();
    let chosen = result.chosen().unwrap();
    let measured: Vec<_> = result
        .attempts
        .iter()
        .filter(|a| a.fits && a.measured.and_then(|m| m.step_seconds).is_some())
        .collect();
    assert!(measured.len() >= 2, "several candidates measured");
    let fastest = measured
        .iter()
        .min_by(|a, b| {
            let t = |x: &&&oomfix::Attempt| x.measured.unwrap().step_seconds.unwrap();
            t(a).total_cmp(&t(b))
        })
        .unwrap();
    assert_eq!(chosen.plan, fastest.plan);
    assert_ne!(chosen.plan, modelled_best);
}

#[test]
fn the_command_line_pins_fields_and_reports_time_and_margin() {
    let out = Command::cargo_bin("oomfix")
        .unwrap()
        .args([
            "--budget",
            "8GiB",
            "--json",
            "--micro-batch",
            "4",
            "--optimizer",
            "fused-adamw",
            "--headroom",
            "10%",
        ])
        .output()
        .unwrap();
    common::assert_exit(&out, 0);
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["pinned"], serde_json::json!(["micro_batch", "optimizer"]));
    assert_eq!(v["plan"]["micro_batch"], 4);
    assert_eq!(v["plan"]["optimizer"], "fused-adamw");
    let peak = v["estimate"]["peak_bytes"].as_u64().unwrap();
    assert_eq!(
        v["headroom_bytes"].as_u64().unwrap(),
        (peak as f64 * 0.1).ceil() as u64
    );
    assert_eq!(v["margin_bytes"].as_u64().unwrap(), (8u64 << 30) - peak);
    assert!(v["estimated_step_seconds"].as_f64().unwrap() > 0.0);
    let attempts = v["attempts"].as_array().unwrap();
    assert!(attempts
        .iter()
        .all(|a| a["tokens_per_second"].as_f64().unwrap() > 0.0));

    // A pin that contradicts the global batch is refused before planning.
    let bad = Command::cargo_bin("oomfix")
        .unwrap()
        .args(["--budget", "8GiB", "--micro-batch", "3"])
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("micro-batch of 3"));
}
