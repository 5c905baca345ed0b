//! oomfix as a crate that depends on it links it: candle-core 0.11 as
//! released on crates.io, whose backward adds every first gradient to a
//! tensor of zeros (the workspace's `[patch]` does not reach this crate).
//! The same checks as the workspace's, on that backward.

use oomfix::track::CountingAlloc;

#[path = "../../common/estimate.rs"]
mod estimate;
#[path = "../../common/mixer.rs"]
mod mixer;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

/// The start-up probe tells the linked backward apart, and reports say it.
#[test]
fn the_probe_reports_stock_candle() {
    assert!(!oomfix::strategies::model::first_gradient_stored_as_is());
    assert_eq!(
        oomfix::memory::Backward::linked(),
        oomfix::memory::Backward::ZerosPlusGradient
    );
    let spec = oomfix::ModelSpec::default_model();
    let result = oomfix::Planner::new(8 << 30).run(&spec).unwrap();
    let json = oomfix::report::search_json(&spec, &result);
    assert_eq!(json["candle_first_gradient_as_is"], false);
}

/// A model oomfix does not know, planned by measurement: within 3% of the
/// real step, at most 6 probe steps, the fixes it cannot take skipped with
/// their reasons (`common/mixer.rs`).
#[test]
fn a_model_given_as_code_is_planned_by_measurement() {
    let _one_at_a_time = estimate::LOCK.lock().unwrap_or_else(|e| e.into_inner());
    mixer::plan_and_check();
}

/// The analytic model's estimate of a small GPT-2 against real steps, with
/// the stock backward's terms, within the workspace's tolerance.
#[test]
fn gpt2_estimate_within_tolerance() {
    estimate::check("gpt2", estimate::gpt2());
}

/// The same for a small Llama.
#[test]
fn llama_estimate_within_tolerance() {
    estimate::check("llama", estimate::llama());
}

/// Long sequences, where the stock backward's score-sized zeros and sums
/// are most of the peak.
#[test]
fn long_sequence_estimates_within_tolerance() {
    estimate::check_long_sequences();
}
