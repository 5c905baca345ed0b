//! Command-line arguments (clap derive).

use crate as oomfix;
use crate::memory::Target;
use crate::units::parse_bytes;
use clap::{Args, Parser, Subcommand, ValueEnum};
use std::path::PathBuf;

/// Find a training configuration that fits in memory.
///
/// With no subcommand, `oomfix [OPTIONS] [MODEL]` plans (same as `oomfix plan`).
#[derive(Debug, Parser)]
#[command(
    name = "oomfix",
    version,
    about,
    args_conflicts_with_subcommands = true
)]
pub struct Cli {
    /// What to do (default: plan).
    #[command(subcommand)]
    pub command: Option<Command>,
    /// Planning options when no subcommand is given.
    #[command(flatten)]
    pub plan: PlanArgs,
    /// Logging options.
    #[command(flatten)]
    pub log: LogArgs,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Find a plan that fits the budget (the default).
    Plan(PlanArgs),
    /// Show what a weights file's header says: family, dimensions, parameters.
    Inspect(InspectArgs),
    /// Plan, then run real training steps with the chosen plan.
    Train(TrainArgs),
    /// Measure one plan in this process (used by --verify; prints peak bytes).
    #[command(hide = true)]
    MeasureStep(MeasureStepArgs),
}

/// Options of `oomfix train`.
#[derive(Debug, Clone, Args)]
pub struct TrainArgs {
    /// Planning options: the plan trained is the one the search chooses.
    #[command(flatten)]
    pub plan: PlanArgs,
    /// Optimizer steps to reach: with --resume, the checkpoint's steps count
    /// (the same command line continues an interrupted run).
    #[arg(long, default_value_t = 10)]
    pub steps: u64,
    /// Training data: a `.bin` of token ids (nanoGPT format) or a text file
    /// (bytes as tokens) [default: random tokens].
    #[arg(long, value_name = "PATH")]
    pub data: Option<PathBuf>,
    /// Token ids in a `.bin` file are u32 instead of u16.
    #[arg(long)]
    pub u32_tokens: bool,
    /// AdamW learning rate.
    #[arg(long, default_value_t = 3e-4, value_parser = parse_lr)]
    pub lr: f64,
    /// Seed of the initialisation and of random data.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Start from the model file's weights instead of a random initialisation.
    #[arg(long)]
    pub pretrained: bool,
    /// Write a checkpoint (weights, optimizer state, step, data position) here
    /// at the end, every --save-every steps, and when stopped by SIGINT or
    /// SIGTERM. Written atomically; never over the model or data file.
    #[arg(long, value_name = "PATH")]
    pub save: Option<PathBuf>,
    /// Also write the checkpoint every N steps [default: only at the end].
    #[arg(long, value_name = "N", requires = "save", value_parser = clap::value_parser!(u64).range(1..))]
    pub save_every: Option<u64>,
    /// Continue from a checkpoint written by --save (same model and plan).
    #[arg(long, value_name = "PATH")]
    pub resume: Option<PathBuf>,
}

/// Options of the hidden `measure-step` command.
#[derive(Debug, Clone, Args)]
pub struct MeasureStepArgs {
    /// The plan as JSON (a serialized `Plan`).
    #[arg(long)]
    pub plan: String,
    /// The model's shape as JSON (a `ModelConfig`).
    #[arg(long)]
    pub config: String,
    /// Address-space limit in bytes.
    #[arg(long)]
    pub address_space: Option<u64>,
}

/// Which attempts `--verify` measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum VerifyArg {
    /// Every attempt whose estimate fits.
    Fitting,
    /// Every attempt.
    All,
}

/// `--precision`: chosen by the search, or pinned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum HalfArg {
    /// The search chooses (its precision fix uses bf16 where the device supports it, else fp16).
    Auto,
    /// fp32 throughout.
    Fp32,
    /// bf16 compute, fp32 master weights.
    Bf16,
    /// fp16 compute with dynamic loss scaling, fp32 master weights.
    Fp16,
}

/// `--strategies`' default: the names of [`oomfix_strategies::builtins`] in order, comma-separated (a test checks it).
pub const DEFAULT_STRATEGIES: &str =
    "accumulate,precision,flash-attention,checkpoint,fused-adamw,shard,offload";

/// Options of `oomfix plan`.
#[derive(Debug, Clone, Args)]
pub struct PlanArgs {
    /// A .safetensors file, a directory of them, or a model.safetensors.index.json
    /// (default: the built-in GPT-2 small shape).
    pub model: Option<PathBuf>,
    /// Memory per device: 8GiB, 7.5GB, 8192MiB, bytes (required).
    #[arg(short, long, value_parser = parse_bytes, value_name = "SIZE")]
    pub budget: Option<u64>,
    /// Tokens per sequence [default: the model's maximum, at most 1024].
    #[arg(long, value_name = "N")]
    pub seq_len: Option<usize>,
    /// Sequences per optimizer step, held constant by every fix.
    #[arg(long, default_value_t = 8, value_name = "N")]
    pub global_batch: usize,
    /// Device to plan for: cpu, cuda or cuda:N.
    #[arg(long, default_value = "cuda:0", value_parser = clap::builder::ValueParser::new(parse_target))]
    pub device: Target,
    /// GPUs available to the sharding fix.
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub gpus: usize,
    /// Fixes to apply, in order (subset and order of the default).
    #[arg(
        long,
        value_delimiter = ',',
        value_name = "LIST",
        default_value = DEFAULT_STRATEGIES
    )]
    pub strategies: Vec<String>,
    /// Compute precision: `auto` lets the search choose; fp32, bf16 or fp16 pin it.
    #[arg(long, value_enum, default_value_t = HalfArg::Auto)]
    pub precision: HalfArg,
    /// Pin the micro-batch (sequences per forward/backward pass).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(usize))]
    pub micro_batch: Option<usize>,
    /// Pin the number of micro-batches accumulated per optimizer step.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(usize))]
    pub grad_accum: Option<usize>,
    /// Pin activation checkpointing: none, every (each block) or every-K (segments of K blocks).
    #[arg(long, value_name = "POLICY", value_parser = parse_from_str::<oomfix::strategies::Checkpointing>)]
    pub checkpoint: Option<oomfix::strategies::Checkpointing>,
    /// Pin the attention: composed or flash.
    #[arg(long, value_name = "KIND", value_parser = parse_from_str::<oomfix::strategies::Attention>)]
    pub attention: Option<oomfix::strategies::Attention>,
    /// Pin the optimizer: adamw, fused-adamw or cpu-adamw (offloaded).
    #[arg(long, value_name = "NAME", value_parser = parse_from_str::<oomfix::strategies::OptimizerImpl>)]
    pub optimizer: Option<oomfix::strategies::OptimizerImpl>,
    /// Pin the ZeRO stage (0: no sharding; 1–3 over --gpus).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u8).range(0..=3))]
    pub zero_stage: Option<u8>,
    /// Memory a plan must leave free below the budget: a percentage of its
    /// estimate (5%) or a size (512MiB) [default: the estimate's measured
    /// error: 8% on the CPU, 5% on CUDA].
    #[arg(long, value_name = "SIZE|PCT", value_parser = parse_from_str::<oomfix::Headroom>)]
    pub headroom: Option<oomfix::Headroom>,
    /// Host memory the offloaded optimizer state may use [default: the
    /// machine's available memory].
    #[arg(long, value_name = "SIZE", value_parser = parse_bytes)]
    pub host_budget: Option<u64>,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Measure plans with real training steps: `fitting` (the default when the
    /// flag is given) measures each attempt whose estimate fits, `all` every attempt.
    #[arg(long, value_enum, num_args = 0..=1, require_equals = true, default_missing_value = "fitting")]
    pub verify: Option<VerifyArg>,
    /// CUDA only: before planning, take all device memory except --budget
    /// (context included) for the rest of the process, so that --verify and
    /// `train` run inside the budget for real; more is a CUDA out-of-memory.
    #[arg(long)]
    pub enforce_budget: bool,
    /// Measure the chosen plan (or the closest) and write every allocation of
    /// its step, tagged with module, op and component, as a PyTorch memory
    /// snapshot (open it in pytorch.org/memory_viz).
    #[arg(long, value_name = "PATH")]
    pub snapshot: Option<PathBuf>,
    /// Measure the chosen plan (or the closest) and draw live memory over its
    /// step, stacked by component, phases shaded, budget as a line: an SVG or
    /// a PNG, by the file's extension (.svg, .png).
    #[arg(long, value_name = "PATH")]
    pub plot: Option<PathBuf>,
}

/// Options of `oomfix inspect`.
#[derive(Debug, Clone, Args)]
pub struct InspectArgs {
    /// A .safetensors file, a directory of them, or a model.safetensors.index.json.
    pub model: PathBuf,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Pretty,
    /// One JSON object per line.
    Json,
}

/// Logging options (global).
#[derive(Debug, Clone, Args)]
pub struct LogArgs {
    /// Log format on stderr (or in --log-file).
    #[arg(long, value_enum, default_value_t = LogFormat::Pretty, global = true)]
    pub log_format: LogFormat,
    /// Write logs to this file instead of stderr.
    #[arg(long, value_name = "PATH", global = true)]
    pub log_file: Option<PathBuf>,
    /// More logs (-v: every attempt, -vv: debug). RUST_LOG overrides.
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    pub verbose: u8,
    /// Fewer logs (errors only).
    #[arg(short, long, action = clap::ArgAction::Count, global = true, conflicts_with = "verbose")]
    pub quiet: u8,
}

fn parse_lr(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(lr) if lr.is_finite() && lr >= 0.0 => Ok(lr),
        _ => Err(format!(
            "`{s}` is not a learning rate (a finite number >= 0)"
        )),
    }
}

fn parse_from_str<T: std::str::FromStr<Err = String>>(s: &str) -> Result<T, String> {
    s.parse()
}

fn parse_target(s: &str) -> Result<Target, String> {
    s.parse()
}

#[cfg(test)]
mod default_tests {
    #[test]
    fn default_strategies_are_the_pipelines_default_order() {
        assert_eq!(
            super::DEFAULT_STRATEGIES,
            oomfix_strategies::Pipeline::default().names().join(",")
        );
    }
}
