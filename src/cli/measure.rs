//! The hidden `measure-step` command, which `--verify` runs on the CPU in a
//! child process under an address-space limit: measure one plan, print its
//! peak bytes and its step's seconds. With `--ranks N` it starts N ranks of
//! itself (as `train --gpus N` does); each measures its share of the plan
//! and rank 0 prints the fullest rank's peak and the slowest rank's step.

use super::args::MeasureStepArgs;
use super::{job, print_stdout, Exit, Failure, Outcome};
use oomfix::dist::Job;
use oomfix::{ModelSpec, Target};

/// Runs `oomfix measure-step`.
pub fn run(args: &MeasureStepArgs) -> Outcome {
    let job = Job::from_env()?.filter(|j| j.world_size > 1);
    if job.is_none() && args.ranks > 1 {
        return super::launch::run(args.ranks, args.device);
    }
    if let Some(limit) = args.address_space {
        oomfix::measure::limit_address_space(limit)?;
    }
    let plan: oomfix::Plan = serde_json::from_str(&args.plan)
        .map_err(|e| Failure::Usage(format!("--plan is not a plan ({e}): {}", args.plan)))?;
    let config: oomfix::ModelConfig =
        serde_json::from_str(&args.config).map_err(|e| Failure::Usage(format!("--config: {e}")))?;
    let spec = ModelSpec::from_config("measured", config);
    let Some(job) = job else {
        if args.device != Target::Cpu {
            return Err(Failure::Usage(
                "measure-step measures one rank on the CPU only (--verify measures CUDA plans in process)".into(),
            ));
        }
        let m = oomfix::measure::measure_plan(&spec, &plan, Target::Cpu)?;
        return print_measurement(&m);
    };
    let joined = job::join(job, args.device)?;
    // A refusal to hold the device ends the job on every rank, as any other failure does.
    let held = match args.hold_device_to {
        Some(budget) => job::enforce_budget(&joined, budget),
        None => Ok(()),
    };
    let outcome = held
        .and_then(|()| {
            let comm = Box::new(std::sync::Arc::clone(&joined.comm));
            Ok(oomfix::measure::measure_sharded(
                &spec,
                &plan,
                &joined.device,
                comm,
            )?)
        })
        .and_then(|m| match joined.job.rank {
            0 => print_measurement(&m),
            _ => Ok(Exit::Done),
        });
    job::conclude(outcome)
}

fn print_measurement(m: &oomfix::search::Measurement) -> Outcome {
    let seconds = m.step_seconds.unwrap_or(f64::NAN);
    print_stdout(&format!("{} {seconds}\n", m.peak_bytes))?;
    Ok(Exit::Done)
}
