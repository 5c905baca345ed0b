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
    let _one_at_a_time = estimate::LOCK.lock().unwrap_or_else(|e| e.into_inner());
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

/// candle-core as released has no CUDA memory hook, and oomfix's build
/// sees that: recording CUDA allocations (`--snapshot` on a GPU) is refused
/// in such a build rather than recording nothing.
#[test]
fn stock_candle_has_no_memory_hook() {
    assert!(!std::hint::black_box(oomfix::track::device::MEMORY_HOOK_LINKED));
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

/// Built with `default-features = false` (no command line), the library
/// plans GPT-2 small for an 8 GiB GPU, and the result says that the linked
/// candle-core is the released one: what the plan needs here and with the
/// patched candle-core the `oomfix` command links, the plan the command
/// would choose, and the `[patch]` line that makes the two the same.
#[test]
fn the_library_alone_plans_gpt2_and_says_how_stock_candle_changes_it() {
    let _one_at_a_time = estimate::LOCK.lock().unwrap_or_else(|e| e.into_inner());
    use oomfix::memory::Backward;
    use oomfix::units::format_bytes;
    let spec = oomfix::ModelSpec::default_model();
    let result = oomfix::Planner::new(8 << 30).run(&spec).unwrap();
    let chosen = result.chosen().expect("GPT-2 small fits in 8 GiB");
    let patched = oomfix::MemoryModel.estimate_with(
        &spec,
        &chosen.plan,
        &result.target,
        Backward::FirstGradientAsIs,
    );
    assert!(
        patched.peak < chosen.estimate.peak,
        "the stock backward holds more: {} vs {}",
        chosen.estimate.peak,
        patched.peak
    );
    // What the command line (patched candle-core) chooses.
    let as_the_command = oomfix::Planner::new(8 << 30)
        .estimator(PatchedBackward)
        .run(&spec)
        .unwrap();
    let command_plan = as_the_command.chosen().unwrap().plan;

    let note = result
        .notes
        .iter()
        .find(|n| n.contains("candle-core as released"))
        .unwrap_or_else(|| panic!("no note on the linked candle-core: {:?}", result.notes));
    eprintln!("{note}");
    assert!(note.contains(&format_bytes(chosen.estimate.peak)), "{note}");
    assert!(note.contains(&format_bytes(patched.peak)), "{note}");
    assert!(
        note.contains("[patch.crates-io]") && note.contains("vendor/candle-core"),
        "{note}"
    );
    if command_plan == chosen.plan {
        assert!(note.contains("chooses the same plan"), "{note}");
    } else {
        assert!(note.contains(&command_plan.to_string()), "{note}");
    }
    // The reports carry it.
    let table = oomfix::report::search_table(&spec, &result);
    assert!(table.contains("candle-core as released"), "{table}");
    let json = oomfix::report::search_json(&spec, &result);
    assert_eq!(json["notes"][0], note.as_str());
}

/// The analytic model with the patched candle-core's backward: the
/// estimates of the `oomfix` command.
struct PatchedBackward;

impl oomfix::Estimator for PatchedBackward {
    fn estimate(
        &self,
        spec: &oomfix::ModelSpec,
        plan: &oomfix::Plan,
        target: &oomfix::Target,
    ) -> oomfix::Breakdown {
        oomfix::MemoryModel.estimate_with(
            spec,
            plan,
            target,
            oomfix::memory::Backward::FirstGradientAsIs,
        )
    }
}
