//! The hidden `measure-step` command, which `--verify` runs on the CPU in a
//! child process under an address-space limit: measure one plan, print its
//! peak bytes and its step's seconds.

use super::args::MeasureStepArgs;
use super::{print_stdout, Exit, Failure, Outcome};
use oomfix::{ModelSpec, Target};

/// Runs `oomfix measure-step`.
pub fn run(args: &MeasureStepArgs) -> Outcome {
    if let Some(limit) = args.address_space {
        oomfix::measure::limit_address_space(limit)?;
    }
    let plan: oomfix::Plan = serde_json::from_str(&args.plan)
        .map_err(|e| Failure::Usage(format!("--plan is not a plan ({e}): {}", args.plan)))?;
    let config: oomfix::ModelConfig =
        serde_json::from_str(&args.config).map_err(|e| Failure::Usage(format!("--config: {e}")))?;
    let spec = ModelSpec::from_config("measured", config);
    let m = oomfix::measure::measure_plan(&spec, &plan, Target::Cpu)?;
    let seconds = m.step_seconds.unwrap_or(f64::NAN);
    print_stdout(&format!("{} {seconds}\n", m.peak_bytes))?;
    Ok(Exit::Done)
}
