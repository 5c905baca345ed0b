//! `oomfix plan` (the default command): check every option, inspect the
//! model, run the search, write `--snapshot` / `--plot`, print the table or
//! the JSON object.

use super::args::{HalfArg, PlanArgs, PlanOptions, SeqLen, VerifyArg};
use super::{check_writable, logging, print_stdout, Exit, Failure, Outcome};
use oomfix::measure::StepVerifier;
use oomfix::report::{self, PlotFormat};
use oomfix::strategies::lora::{BasePrecision, Lora};
use oomfix::{inspect, Error, ModelSpec, Pipeline, Planner, SearchResult, Target, Verify};
use std::path::Path;

/// Runs `oomfix plan`.
pub fn run(args: &PlanArgs) -> Outcome {
    let target = args.opts.plan_device();
    let prepared = prepare(args, target, &[])?;
    let (_, result) = search(args, prepared)?;
    Ok(Exit::fits(result.fits()))
}

/// The options checked and the model inspected: everything a search needs,
/// found before anything is printed.
pub struct Prepared {
    /// The model.
    pub spec: ModelSpec,
    /// The device planned for.
    pub target: Target,
    /// `--budget`.
    pub budget: u64,
    /// `--lora` and its settings, checked against the model.
    pub lora: Option<Lora>,
    pipeline: Pipeline,
    plot: Option<PlotFormat>,
}

impl Prepared {
    /// The format of `--plot`, checked.
    pub fn plot_format(&self) -> Option<PlotFormat> {
        self.plot
    }
}

/// Checks `args` for planning on `target`, inspects the model and checks the
/// output files (`--snapshot`, `--plot`; never one of the model's files or
/// `inputs`). Nothing is printed.
pub fn prepare(args: &PlanArgs, target: Target, inputs: &[&Path]) -> Result<Prepared, Failure> {
    let o = &args.opts;
    let budget = o.budget.ok_or_else(|| {
        Failure::Usage("a budget is required, e.g. --budget 8GiB (see --help)".into())
    })?;
    let plot = o
        .plot
        .as_deref()
        .map(PlotFormat::from_path)
        .transpose()
        .map_err(Failure::Usage)?;
    if (o.snapshot.is_some() || o.plot.is_some()) && target != Target::Cpu {
        can_record_cuda()?;
    }
    if o.enforce_budget && target == Target::Cpu {
        return Err(Failure::Usage(
            "--enforce-budget limits a CUDA device's memory; with --device cpu there is nothing to limit \
             (use --verify, which measures CPU plans in a child process limited to the budget)"
                .into(),
        ));
    }
    let pipeline =
        Pipeline::from_names(&o.strategies).map_err(|e| Failure::Usage(e.to_string()))?;
    let spec = match &args.model {
        Some(path) => inspect::inspect(path)?,
        None => ModelSpec::default_model(),
    };
    if let (Some(path), Some((field, value, why))) = (&args.model, spec.config.unimplemented()) {
        return Err(Error::input(
            super::data::model_dir(path).join("config.json"),
            format!("\"{field}\" is {value}: {why}; nothing was planned"),
        )
        .into());
    }
    if spec.config.settings.moe.is_some() {
        let measured = [
            ("--verify", o.verify.is_some()),
            ("--snapshot", o.snapshot.is_some()),
            ("--plot", o.plot.is_some()),
        ];
        if let Some((flag, _)) = measured.iter().find(|(_, given)| *given) {
            return Err(Failure::Usage(format!(
                "{flag} measures training steps, and a mixture-of-experts model is planned, \
                 not trained: plan without {flag}"
            )));
        }
    }
    let lora = lora(o, &spec)?;
    let mut all_inputs: Vec<&Path> = spec.files.iter().map(|f| f.as_path()).collect();
    all_inputs.extend(args.model.as_deref());
    all_inputs.extend(inputs);
    for out in [&o.snapshot, &o.plot].into_iter().flatten() {
        check_writable(out, &all_inputs)?;
    }
    Ok(Prepared {
        spec,
        target,
        budget,
        lora,
        pipeline,
        plot,
    })
}

/// Whether this build records CUDA allocations (`--snapshot` / `--plot` on
/// a GPU): the `cuda` feature, and candle-core with the memory hook.
fn can_record_cuda() -> Result<(), Failure> {
    #[cfg(feature = "cuda")]
    let refused =
        (!oomfix::track::cuda::CAN_RECORD).then_some(oomfix::track::cuda::NEEDS_MEMORY_HOOK);
    #[cfg(not(feature = "cuda"))]
    let refused = Some(
        "--snapshot and --plot on CUDA need a build with --features cuda (or use --device cpu)",
    );
    match refused {
        Some(why) => Err(Failure::Usage(why.into())),
        None => Ok(()),
    }
}

/// `--lora` and its settings for `spec`, checked: the other LoRA options
/// need `--lora`; the rank, alpha and targets must suit the model's blocks.
fn lora(o: &PlanOptions, spec: &ModelSpec) -> Result<Option<Lora>, Failure> {
    let Some(rank) = o.lora else {
        let given = [
            ("--lora-alpha", o.lora_alpha.is_some()),
            ("--lora-targets", o.lora_targets.is_some()),
            ("--base-precision", o.base_precision.is_some()),
        ];
        return match given.iter().find(|(_, given)| *given) {
            Some((flag, _)) => Err(Failure::Usage(format!(
                "{flag} sets up LoRA's adapters or frozen base: it needs --lora RANK"
            ))),
            None => Ok(None),
        };
    };
    if !oomfix::memory::analytic_activations(spec) {
        return Err(Failure::Usage(format!(
            "--lora needs a model family oomfix knows (gpt2, llama, bert); {} is not one",
            spec.source
        )));
    }
    let facts = oomfix::memory::model_facts(spec);
    let targets: Option<Vec<&str>> = o
        .lora_targets
        .as_ref()
        .map(|t| t.iter().map(|n| n.trim()).collect());
    Lora::new(
        rank,
        o.lora_alpha,
        targets.as_deref(),
        o.base_precision.unwrap_or(BasePrecision::Bf16),
        &facts,
    )
    .map(Some)
    .map_err(|e| Failure::Usage(format!("--lora: {e}")))
}

/// The plan fields the command line pins.
fn pins(o: &PlanOptions) -> oomfix::Pins {
    use oomfix::strategies::Precision;
    let mut pins = oomfix::Pins::default();
    pins.precision = match o.precision {
        HalfArg::Auto => None,
        HalfArg::Fp32 => Some(Precision::F32),
        HalfArg::Bf16 => Some(Precision::Bf16),
        HalfArg::Fp16 => Some(Precision::F16),
    };
    pins.micro_batch = o.micro_batch;
    pins.grad_accum = o.grad_accum;
    pins.checkpoint = o.checkpoint;
    pins.attention = o.attention;
    pins.chunked_loss = o.loss;
    pins.offload_activations = o.activations;
    pins.mlp_tile = o.mlp_tile.map(|t| t.0);
    pins.optimizer = o.optimizer;
    pins.shard_stage = o.zero_stage;
    pins.bucket_bytes = o.bucket_size;
    pins
}

/// Pins every field of `plan` in `o` (the search then finds `plan` alone).
pub fn pin(o: &mut PlanOptions, plan: &oomfix::Plan) {
    use oomfix::strategies::Precision;
    o.precision = match plan.precision {
        Precision::F32 => HalfArg::Fp32,
        Precision::Bf16 => HalfArg::Bf16,
        Precision::F16 => HalfArg::Fp16,
    };
    o.micro_batch = Some(plan.micro_batch);
    o.grad_accum = Some(plan.grad_accum);
    o.checkpoint = Some(plan.checkpoint);
    o.attention = Some(plan.attention);
    o.loss = Some(plan.chunked_loss);
    o.activations = Some(plan.offload_activations);
    o.mlp_tile = Some(super::args::MlpTile(plan.mlp_tile));
    o.optimizer = Some(plan.optimizer);
    o.zero_stage = Some(plan.shard.stage);
    o.bucket_size = Some(plan.shard.bucket_bytes);
    if let Some(lora) = plan.lora {
        o.lora = Some(lora.rank);
        o.lora_alpha = Some(lora.alpha);
        o.lora_targets = Some(lora.targets.names().map(String::from).collect());
        o.base_precision = Some(lora.base);
    }
}

/// Runs the search of a prepared plan, writes `--snapshot` and `--plot`, and
/// prints the result on stdout; gives back the model with the result.
pub fn search(args: &PlanArgs, prepared: Prepared) -> Result<(ModelSpec, SearchResult), Failure> {
    let (spec, result) = search_quietly(args, prepared)?;
    print_result(args, &spec, &result)?;
    Ok((spec, result))
}

/// [`search`] without printing the result.
pub fn search_quietly(
    args: &PlanArgs,
    prepared: Prepared,
) -> Result<(ModelSpec, SearchResult), Failure> {
    let o = &args.opts;
    let (target, budget) = (prepared.target, prepared.budget);
    // With several ranks each rank holds its own GPU (train's ranks, and
    // --verify's through its verifier), not the planning process.
    if o.enforce_budget && o.gpus <= 1 {
        enforce_budget(target, budget)?;
    }
    let mut pins = pins(o);
    pins.lora = prepared.lora;
    pins.base_precision = o.base_precision;
    let mut planner = Planner::new(budget)
        .global_batch(o.global_batch)
        .target(target)
        .gpus(o.gpus)
        .pipeline(prepared.pipeline)
        .pins(pins)
        .allow_beyond_context(o.allow_beyond_context);
    if let Some(h) = o.headroom {
        planner = planner.headroom(h);
    }
    if let Some(bytes) = o.host_budget.or_else(oomfix::units::available_memory) {
        planner = planner.host_budget(bytes);
    }
    if let Some(SeqLen::Tokens(n)) = o.seq_len {
        planner = planner.seq_len(n);
    }
    if let Some(mode) = o.verify {
        let exe = || {
            std::env::current_exe().map_err(|e| {
                Failure::Usage(format!(
                    "--verify: cannot locate the oomfix binary to run measurements in: {}",
                    super::io_text(&e)
                ))
            })
        };
        // Plans over several ranks are measured with their ranks, started
        // by a child `measure-step` as `train --gpus N` starts them.
        let verifier = match target {
            _ if o.gpus > 1 => {
                let v = StepVerifier::isolated(target, exe()?, budget).over_ranks(o.gpus);
                if o.enforce_budget {
                    v.enforcing()
                } else {
                    v
                }
            }
            Target::Cpu => StepVerifier::isolated(target, exe()?, budget),
            Target::Cuda(_) => StepVerifier::in_process(target),
        };
        let mode = match mode {
            VerifyArg::Fitting => Verify::Fitting,
            VerifyArg::All => Verify::All,
        };
        planner = planner.verify_with(verifier, mode);
    }
    let spec = prepared.spec;
    let result = match o.seq_len {
        Some(SeqLen::Longest) => planner.longest(&spec)?,
        _ => planner.run(&spec)?,
    };
    if o.snapshot.is_some() || o.plot.is_some() {
        timeline_outputs(args, &spec, &result, budget, prepared.plot, target)?;
    }
    if args.model.is_none() && !args.json {
        logging::notice(format_args!(
            "no model given; planning for the {}",
            spec.source
        ));
    }
    Ok((spec, result))
}

/// Prints the search's result on stdout: the table, or with `--json` its
/// JSON object.
pub fn print_result(
    args: &PlanArgs,
    spec: &ModelSpec,
    result: &SearchResult,
) -> Result<(), Failure> {
    if args.json {
        print_stdout(&format!("{:#}\n", report::search_json(spec, result)))
    } else {
        print_stdout(&report::search_table(spec, result))
    }
}

const NEEDS_CUDA: &str = "--enforce-budget on CUDA needs a build with --features cuda";

/// `--enforce-budget`: leaves only `budget` bytes of the CUDA device usable by
/// this process until it exits.
fn enforce_budget(target: Target, budget: u64) -> Result<(), Failure> {
    match target {
        Target::Cuda(_) if !cfg!(feature = "cuda") => Err(Failure::Usage(NEEDS_CUDA.into())),
        Target::Cuda(ordinal) => {
            let device = candle_core::Device::new_cuda(ordinal).map_err(|e| {
                Failure::Usage(format!("--enforce-budget: cannot use cuda:{ordinal}: {e}"))
            })?;
            enforce_on(&device, budget)
        }
        // Refused by `prepare`.
        Target::Cpu => Ok(()),
    }
}

/// Leaves only `budget` bytes of `device` (a CUDA device) usable by this
/// process until it exits; says what it held back.
#[cfg(feature = "cuda")]
pub fn enforce_on(device: &candle_core::Device, budget: u64) -> Result<(), Failure> {
    let ordinal = match device.location() {
        candle_core::DeviceLocation::Cuda { gpu_id } => gpu_id,
        _ => {
            return Err(Failure::Usage(
                "--enforce-budget limits a CUDA device's memory".into(),
            ))
        }
    };
    let cuda = device.as_cuda_device().map_err(Error::from)?;
    let done = oomfix::track::cuda::enforce_budget(cuda, budget)
        .map_err(|e| Failure::Usage(format!("--enforce-budget: {e}")))?;
    tracing::info!(
        ballast_bytes = done.ballast,
        already_used_bytes = done.already_used,
        free_after_bytes = done.free_after,
        "budget enforced"
    );
    logging::say(format_args!(
        "oomfix: enforcing the budget on cuda:{ordinal}: {} held back, {} free for this process \
         (it already holds {})",
        oomfix::units::format_bytes(done.ballast),
        oomfix::units::format_bytes(done.free_after),
        oomfix::units::format_bytes(done.already_used)
    ));
    Ok(())
}

/// Without the `cuda` feature there is no device to hold.
#[cfg(not(feature = "cuda"))]
pub fn enforce_on(_: &candle_core::Device, _: u64) -> Result<(), Failure> {
    Err(Failure::Usage(NEEDS_CUDA.into()))
}

/// Measures the chosen (or closest) plan with its allocations recorded and
/// writes `--snapshot` and `--plot` (checked by [`prepare`]).
fn timeline_outputs(
    args: &PlanArgs,
    spec: &ModelSpec,
    result: &SearchResult,
    budget: u64,
    plot: Option<PlotFormat>,
    target: Target,
) -> Result<(), Failure> {
    let attempt = result.chosen().unwrap_or_else(|| result.closest());
    let (m, timeline) = oomfix::measure::record_plan(spec, &attempt.plan, target)?;
    tracing::info!(
        measured_bytes = m.peak_bytes,
        blocks = timeline.blocks.len(),
        changes = timeline.changes.len(),
        "recorded {}",
        attempt.plan
    );
    let title = format!("{}: {}", spec.source, attempt.plan);
    super::timeline::write_timeline(&args.opts, plot, &timeline, budget, &title, None)
}
