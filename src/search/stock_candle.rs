//! With candle-core as released linked (not the patched one the `oomfix`
//! command builds with): what the shown plan needs with each, and the plan
//! the command would choose.

use super::{Attempt, Planner, Verify};
use crate::memory::{Backward, Breakdown, Estimator, MemoryModel, Target};
use crate::spec::ModelSpec;
use crate::speed::StepTime;
use crate::Result;
use oomfix_strategies::Plan;

impl Planner {
    /// With candle-core as released linked ([`Backward::linked`]): what
    /// `shown` needs with this candle and with the patched one, and the plan
    /// the search chooses with the patched one (as the `oomfix` command,
    /// which links it, does). `None` with the patched candle-core.
    pub(super) fn stock_candle_note(
        &self,
        spec: &ModelSpec,
        shown: &Attempt,
        fits: bool,
    ) -> Result<Option<String>> {
        if Backward::linked() == Backward::FirstGradientAsIs {
            return Ok(None);
        }
        let patched = MemoryModel::registered(&self.pipeline);
        let patched_peak = patched
            .estimate_with(spec, &shown.plan, &self.target, Backward::FirstGradientAsIs)
            .peak;
        let as_the_command = Planner {
            budget: self.budget,
            global_batch: self.global_batch,
            seq_len: self.seq_len,
            target: self.target,
            gpus: self.gpus,
            pipeline: self.pipeline.clone(),
            estimator: Some(Box::new(PatchedBackward(patched))),
            verifier: None,
            verify: Verify::Off,
            half: self.half,
            capabilities: self.capabilities,
            pins: self.pins,
            headroom: self.headroom,
            host_budget: self.host_budget,
            beyond_context: self.beyond_context,
        }
        .run(spec)?;
        let choice = match (as_the_command.chosen(), fits) {
            (Some(a), true) if a.plan == shown.plan => "it chooses the same plan".to_string(),
            (Some(a), _) => format!("it chooses {}", a.plan),
            (None, _) => "nothing fits there either".to_string(),
        };
        let note = format!(
            "candle-core as released is linked, not the patched one the oomfix command builds \
             with (vendor/README.md): its backward adds each first gradient to a tensor of zeros, \
             and the estimates count that. The {} plan needs {} here and {} with the patched \
             candle-core, with which {choice}. To plan and train as the command does, add to \
             your Cargo.toml: [patch.crates-io] candle-core = {{ path = \
             \"path/to/oomfix/vendor/candle-core\" }}",
            if fits { "chosen" } else { "closest" },
            crate::units::format_bytes(shown.estimate.peak),
            crate::units::format_bytes(patched_peak),
        );
        static WARNED: std::sync::Once = std::sync::Once::new();
        WARNED.call_once(|| tracing::warn!("{note}"));
        Ok(Some(note))
    }
}

/// The analytic model with the patched candle-core's backward.
struct PatchedBackward(crate::memory::WithFixes);

impl Estimator for PatchedBackward {
    fn estimate(&self, spec: &ModelSpec, plan: &Plan, target: &Target) -> Breakdown {
        self.0
            .estimate_with(spec, plan, target, Backward::FirstGradientAsIs)
    }
    fn step_time(&self, spec: &ModelSpec, plan: &Plan, target: &Target) -> StepTime {
        self.0.step_time(spec, plan, target)
    }
}
