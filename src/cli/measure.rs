//! The hidden `measure-step` command, which `--verify` runs on the CPU in a
//! child process under an address-space limit: measure one plan, print its
//! peak bytes.

use super::args::MeasureStepArgs;
use super::{print_stdout, Exit, Failure, Outcome};
use oomfix::{ModelSpec, Target};

/// Runs `oomfix measure-step`.
pub fn run(args: &MeasureStepArgs) -> Outcome {
    if let Some(limit) = args.address_space {
        oomfix::measure::limit_address_space(limit)?;
    }
    let plan = oomfix::measure::parse_plan_arg(&args.plan)?;
    let config: oomfix::ModelConfig =
        serde_json::from_str(&args.config).map_err(|e| Failure::Usage(format!("--config: {e}")))?;
    let spec = ModelSpec::from_config("measured", config);
    let m = oomfix::measure::measure_plan(&spec, &plan, Target::Cpu)?;
    print_stdout(&format!("{}\n", m.peak_bytes))?;
    Ok(Exit::Done)
}
