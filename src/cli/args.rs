//! The command line: clap types, value parsers, and the parse that turns argv
//! into one [`Invocation`] (or a usage error, rendered in one line).
//!
//! Options shared by `plan` and `train` (and the logging options) are clap
//! *global* options: they may come before or after the subcommand
//! (`oomfix -v --device cpu train m.safetensors` and
//! `oomfix train m.safetensors -v --device cpu` are the same). `inspect`
//! refuses the planning options instead of ignoring them.

use super::Failure;
use clap::parser::ValueSource;
use clap::{ArgMatches, Args, CommandFactory, FromArgMatches, Parser, Subcommand, ValueEnum};
use oomfix::strategies::lora::BasePrecision;
use oomfix::strategies::{Attention, Checkpointing, OptimizerImpl};
use oomfix::units::parse_bytes;
use oomfix::Target;
use std::ffi::OsString;
use std::path::PathBuf;

/// The largest `--global-batch` accepted: a million sequences per optimizer
/// step is far beyond any real run, and bounds the search's arithmetic.
pub const MAX_GLOBAL_BATCH: usize = 1 << 20;
pub use oomfix::search::{MAX_SEQ_LEN, MAX_TOKENS_PER_STEP};
/// The largest `--gpus` accepted.
pub const MAX_GPUS: usize = 1 << 16;

/// `--strategies`' default: the built-in fixes in their default order
/// ([`oomfix::strategies::builtins`]), comma-separated.
pub fn default_strategies() -> &'static str {
    static NAMES: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    NAMES.get_or_init(|| oomfix::Pipeline::default().names().join(","))
}

/// Find a training configuration that fits in memory.
///
/// With no subcommand, `oomfix [OPTIONS] [MODEL]` plans (same as `oomfix plan`).
/// Options may come before or after the subcommand.
#[derive(Debug, Parser)]
#[command(
    name = "oomfix",
    version,
    about,
    long_about = None,
    override_usage = "oomfix [OPTIONS] [MODEL]\n       oomfix [OPTIONS] <COMMAND> [MODEL]"
)]
struct Cli {
    /// What to do (default: plan).
    #[command(subcommand)]
    command: Option<Sub>,
    /// The model to plan for when no subcommand is given: a .safetensors
    /// file, a directory of them, or a model.safetensors.index.json
    /// [default: the built-in GPT-2 small shape].
    #[arg(value_name = "MODEL")]
    model: Option<PathBuf>,
    #[command(flatten)]
    output: OutputArgs,
    #[command(flatten)]
    plan: PlanOptions,
    #[command(flatten)]
    log: LogArgs,
}

#[derive(Debug, Subcommand)]
enum Sub {
    /// Find a plan that fits the budget (the default).
    Plan(ModelArg),
    /// Show what a weights file's header says: family, dimensions, parameters.
    Inspect(InspectCmd),
    /// Plan, then run real training steps with the chosen plan.
    Train(TrainCmd),
    /// Measure one plan in this process (used by --verify; prints peak bytes).
    #[command(hide = true)]
    MeasureStep(MeasureStepArgs),
}

/// The positional model of `plan`.
#[derive(Debug, Clone, Args)]
struct ModelArg {
    /// A .safetensors file, a directory of them, or a model.safetensors.index.json
    /// [default: the built-in GPT-2 small shape].
    model: Option<PathBuf>,
}

/// `train`'s own options (the planning options are global).
#[derive(Debug, Clone, Args)]
struct TrainCmd {
    /// A .safetensors file, a directory of them, or a model.safetensors.index.json
    /// [default: the built-in GPT-2 small shape, randomly initialised].
    model: Option<PathBuf>,
    #[command(flatten)]
    train: TrainOptions,
}

/// Options of `oomfix train` besides the planning options.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Training")]
pub struct TrainOptions {
    /// Optimizer steps to reach: with --resume, the checkpoint's steps count
    /// (the same command line continues an interrupted run).
    #[arg(long, default_value_t = 10, value_name = "N", allow_negative_numbers = true, value_parser = parse_steps)]
    pub steps: u64,
    /// The data and how it is read.
    #[command(flatten)]
    pub input: DataOptions,
    /// AdamW's peak learning rate [default: 5e-5 from pretrained weights,
    /// as the Hugging Face Trainer; 3e-4 from a random initialisation].
    #[arg(long, allow_negative_numbers = true, value_parser = parse_lr)]
    pub lr: Option<f64>,
    /// Learning-rate schedule after the warmup: constant, linear or cosine
    /// (the last two decay to 0 at the last of --steps).
    #[arg(long, value_name = "KIND", default_value = "constant", value_parser = parse_decay)]
    pub lr_schedule: oomfix::train::Decay,
    /// Steps of linear warmup to --lr, from lr / (N + 1).
    #[arg(long, value_name = "N", default_value_t = 0, value_parser = parse_seed)]
    pub warmup_steps: u64,
    /// AdamW weight decay, applied to matrices only (not to biases and norm
    /// scales).
    #[arg(long, default_value_t = 0.0, value_name = "WD", allow_negative_numbers = true, value_parser = parse_weight_decay)]
    pub weight_decay: f64,
    /// Clip each step's gradients to this global L2 norm (computed after
    /// accumulation, unscaling and over all ranks); 0 disables clipping.
    #[arg(long, default_value_t = 1.0, value_name = "X", allow_negative_numbers = true, value_parser = parse_max_grad_norm)]
    pub max_grad_norm: f64,
    /// Held-out data for evaluation, in the formats and with the tokenizer
    /// of --data: the mean cross-entropy and perplexity of its windows.
    #[arg(long, value_name = "PATH")]
    pub eval_data: Option<PathBuf>,
    /// Evaluate every N steps [default: once, after the last step].
    #[arg(long, value_name = "N", requires = "eval_data", allow_negative_numbers = true, value_parser = parse_steps)]
    pub eval_every: Option<u64>,
    /// The most micro-batches one evaluation reads (of the plan's
    /// micro-batch size, in order from the start of --eval-data).
    #[arg(long, value_name = "N", default_value_t = 100, allow_negative_numbers = true, value_parser = parse_steps)]
    pub eval_batches: u64,
    /// Seed of the initialisation and of random data.
    #[arg(long, default_value_t = 0, allow_negative_numbers = true, value_parser = parse_seed)]
    pub seed: u64,
    /// Where the weights start: `pretrained` (the model file's weights) or
    /// `random` (a seeded initialisation) [default: pretrained with a model
    /// file; the built-in default model has no weights: random].
    #[arg(long, value_enum, value_name = "FROM")]
    pub init: Option<InitArg>,
    /// The former spelling of `--init pretrained`.
    #[arg(long, hide = true, conflicts_with = "init")]
    pub pretrained: bool,
    /// Write a checkpoint directory here at the end, every --save-every steps,
    /// and when stopped by SIGINT or SIGTERM: a Hugging Face model directory
    /// (model.safetensors, config.json, tokenizer files) with the training
    /// state beside it; with --lora, a PEFT adapter directory
    /// (adapter_config.json, adapter_model.safetensors) instead of the
    /// model. Written atomically; never over the model or data file, nor
    /// over a directory that is not an earlier checkpoint.
    #[arg(long, value_name = "DIR")]
    pub save: Option<PathBuf>,
    /// With --lora and --save: write the merged model (the adapters added
    /// into the base weights, in the base's dtype) instead of the adapters:
    /// a model to load or train, not a checkpoint to resume.
    #[arg(long)]
    pub merge: bool,
    /// With --snapshot or --plot: the run's first N steps are recorded (the
    /// first step's one-off allocations, then steady steps).
    #[arg(long, default_value_t = 2, value_name = "N", allow_negative_numbers = true, value_parser = parse_steps)]
    pub snapshot_steps: u64,
    /// CUDA only: return the memory pool's cached memory to the driver at
    /// every phase change of a step (forward, backward, optimizer step):
    /// lowers the reserved peak when one phase's freed buffers would
    /// otherwise stay reserved into the next, frees no live tensor, and
    /// waits for the device each time (slower steps). Off by default.
    #[arg(long)]
    pub trim_between_phases: bool,
    /// Also write the checkpoint every N steps [default: only at the end].
    #[arg(long, value_name = "N", requires = "save", allow_negative_numbers = true, value_parser = parse_steps)]
    pub save_every: Option<u64>,
    /// Continue from a checkpoint directory written by --save (same model;
    /// the plan may differ).
    #[arg(long, value_name = "DIR")]
    pub resume: Option<PathBuf>,
}

/// `--init`: where training's weights start.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum InitArg {
    /// The model file's weights.
    Pretrained,
    /// A random initialisation, reproducible from `--seed`.
    Random,
}

impl TrainOptions {
    /// `--init` as given (`--pretrained` counts as `--init pretrained`), or
    /// `None` when neither is.
    pub fn init_given(&self) -> Option<InitArg> {
        self.init.or(self.pretrained.then_some(InitArg::Pretrained))
    }
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
    /// Address-space limit in bytes (each rank's).
    #[arg(long)]
    pub address_space: Option<u64>,
    /// The device to measure on.
    #[arg(long, default_value = "cpu")]
    pub device: Target,
    /// Ranks to measure the plan with (more than 1: this command starts
    /// them, as `train --gpus N` does, and prints the fullest rank's peak).
    #[arg(long, default_value_t = 1)]
    pub ranks: usize,
    /// Hold each rank's GPU to this many bytes (`--enforce-budget`).
    #[arg(long, value_name = "BYTES")]
    pub hold_device_to: Option<u64>,
}

/// Where the training data comes from and how it is read (`train`'s
/// `--data` and `--eval-data`; `inspect --data`).
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Data")]
pub struct DataOptions {
    /// Training data: a `.bin` of token ids (nanoGPT format), plain text, or
    /// rows in JSON Lines (`.jsonl`), a JSON array (`.json`) or Parquet
    /// (`.parquet`): text
    /// (`{"text": …}`), chats (`{"messages": […]}`), `{"prompt", "completion"}`
    /// or Alpaca's `{"instruction", "input", "output"}`; tokenized with the
    /// model's tokenizer, chats rendered with its chat template
    /// [default: random tokens].
    #[arg(long, value_name = "PATH")]
    pub data: Option<PathBuf>,
    /// The tokenizer for text data [default: tokenizer.json beside the
    /// model's weights; without one, bytes are tokens].
    #[arg(long, value_name = "PATH")]
    pub tokenizer: Option<PathBuf>,
    /// The field of each JSON Lines object that holds its text.
    #[arg(long, value_name = "NAME", default_value = "text")]
    pub text_field: String,
    /// The Jinja chat template chats are rendered with [default: the
    /// model's: chat_template.jinja or the "chat_template" of
    /// tokenizer_config.json beside it]; saved with the model.
    #[arg(long, value_name = "FILE")]
    pub chat_template: Option<PathBuf>,
    /// Which tokens of chat and prompt/completion examples the loss learns:
    /// `completions` (the assistant's messages, the completion) or `all`.
    /// Text data learns every token.
    #[arg(long, value_name = "WHAT", default_value = "completions", value_parser = parse_loss_on)]
    pub loss_on: oomfix::train::examples::LossOn,
    /// Lay several examples into one sequence, kept apart (positions restart
    /// and attention stays within each) [default].
    #[arg(long, overrides_with = "no_packing")]
    pub packing: bool,
    /// One example per sequence, padded.
    #[arg(long, overrides_with = "packing")]
    pub no_packing: bool,
    /// Cut examples longer than the sequence length to it (without: they are
    /// dropped); the count is printed either way.
    #[arg(long)]
    pub truncate: bool,
    /// Token ids in a `.bin` file are u32 instead of u16.
    #[arg(long)]
    pub u32_tokens: bool,
}

/// Options of `oomfix inspect`.
#[derive(Debug, Clone, Args)]
struct InspectCmd {
    /// A .safetensors file, a directory of them, or a model.safetensors.index.json.
    model: PathBuf,
    /// The data, read as `train --data` reads it: its token and example counts.
    #[command(flatten)]
    input: DataOptions,
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

/// Planning options, shared by `plan` and `train` (global: before or after
/// the subcommand).
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Planning (plan, train)")]
pub struct PlanOptions {
    /// Memory per device: 8GiB, 7.5GB, 8192MiB, bytes (required).
    #[arg(short, long, value_parser = parse_budget, value_name = "SIZE", global = true, allow_hyphen_values = true)]
    pub budget: Option<u64>,
    /// Tokens per sequence, or `longest`: the longest at which a plan fits,
    /// searched over every fix [default: the model's maximum, at most 1024].
    /// Beyond the model's context (max_position_embeddings) it is refused
    /// (and `longest` stops there) unless --allow-beyond-context is given.
    #[arg(long, value_name = "N|longest", global = true, allow_negative_numbers = true, value_parser = parse_seq_len)]
    pub seq_len: Option<SeqLen>,
    /// Plan (and train) a --seq-len beyond the model's context
    /// (max_position_embeddings): a rotary-position model computes those
    /// positions but was not trained on them. Learned positions stop at the
    /// context either way.
    #[arg(long, global = true)]
    pub allow_beyond_context: bool,
    /// Sequences per optimizer step, held constant by every fix.
    #[arg(long, default_value_t = 8, value_name = "N", global = true, allow_negative_numbers = true, value_parser = parse_global_batch)]
    pub global_batch: usize,
    /// Device to plan for (and train on): cpu, cuda or cuda:N [default:
    /// cuda:0; `train` on a build without CUDA: cpu].
    #[arg(long, value_name = "DEVICE", global = true, value_parser = clap::builder::ValueParser::new(parse_target))]
    pub device: Option<Target>,
    /// GPUs available to the sharding fix.
    #[arg(long, default_value_t = 1, value_name = "N", global = true, allow_negative_numbers = true, value_parser = parse_gpus)]
    pub gpus: usize,
    /// Fixes to apply, in order (subset and order of the default).
    #[arg(
        long,
        value_delimiter = ',',
        value_name = "LIST",
        default_value = default_strategies(),
        global = true
    )]
    pub strategies: Vec<String>,
    /// Compute precision: `auto` lets the search choose; fp32, bf16 or fp16 pin it.
    #[arg(long, value_enum, default_value_t = HalfArg::Auto, global = true)]
    pub precision: HalfArg,
    /// Pin the micro-batch (sequences per forward/backward pass).
    #[arg(long, value_name = "N", global = true, allow_negative_numbers = true, value_parser = parse_positive)]
    pub micro_batch: Option<usize>,
    /// Pin the number of micro-batches accumulated per optimizer step.
    #[arg(long, value_name = "N", global = true, allow_negative_numbers = true, value_parser = parse_positive)]
    pub grad_accum: Option<usize>,
    /// Pin activation checkpointing: none, every (each block) or every-K
    /// (segments of K blocks).
    #[arg(long, value_name = "POLICY", global = true, value_parser = parse_from_str::<Checkpointing>)]
    pub checkpoint: Option<Checkpointing>,
    /// Pin the attention: composed or flash.
    #[arg(long, value_name = "KIND", global = true, value_parser = parse_from_str::<Attention>)]
    pub attention: Option<Attention>,
    /// Pin how the LM loss is computed: whole (all the logits at once) or
    /// chunked (chunk by chunk of tokens, the `chunked-loss` fix).
    #[arg(long, value_name = "HOW", global = true, value_parser = parse_loss)]
    pub loss: Option<bool>,
    /// Pin where the checkpointed blocks' inputs wait for their recompute:
    /// device, or host (host memory, the `offload-activations` fix; GPUs
    /// only, with checkpointing).
    #[arg(long, value_name = "WHERE", global = true, value_parser = parse_activations)]
    pub activations: Option<bool>,
    /// Pin the blocks' MLP in tiles of N tokens, each recomputed in the
    /// backward (the `tiled-mlp` fix), or `none`.
    #[arg(long, value_name = "N|none", global = true, value_parser = parse_mlp_tile)]
    pub mlp_tile: Option<MlpTile>,
    /// Pin the optimizer: adamw, fused-adamw or cpu-adamw (offloaded).
    #[arg(long, value_name = "NAME", global = true, value_parser = parse_from_str::<OptimizerImpl>)]
    pub optimizer: Option<OptimizerImpl>,
    /// Pin the ZeRO stage (0: no sharding; 1–3 over --gpus).
    #[arg(long, value_name = "N", global = true, value_parser = clap::value_parser!(u8).range(0..=3))]
    pub zero_stage: Option<u8>,
    /// Sharded plans: the most one collective moves; gradients and
    /// parameters travel in flat buckets of up to this size (PyTorch DDP's
    /// bucket_cap_mb) [default: 25MiB].
    #[arg(long, value_name = "SIZE", global = true, value_parser = parse_bucket_size)]
    pub bucket_size: Option<usize>,
    /// Memory a plan must leave free below the budget: a percentage of its
    /// estimate (5%), a size (512MiB) or both (64MiB+1%) [default: the
    /// estimate's measured error: 1MiB+1% on the CPU, 192MiB+3% on CUDA].
    #[arg(long, value_name = "SIZE+PCT", global = true, value_parser = parse_from_str::<oomfix::Headroom>)]
    pub headroom: Option<oomfix::Headroom>,
    /// Host memory the offloaded optimizer state and activations may use
    /// [default: the machine's available memory].
    #[arg(long, value_name = "SIZE", global = true, value_parser = parse_budget)]
    pub host_budget: Option<u64>,
    /// Measure plans with real training steps: `fitting` (the default when the
    /// flag is given) measures each attempt whose estimate fits, `all` every
    /// attempt (`--verify all` or `--verify=all`).
    #[arg(long, value_enum, num_args = 0..=1, require_equals = true, default_missing_value = "fitting", global = true)]
    pub verify: Option<VerifyArg>,
    /// CUDA only: before planning, take all device memory except --budget
    /// (context included) for the rest of the process, so that --verify and
    /// `train` run inside the budget for real; more is a CUDA out-of-memory.
    #[arg(long, global = true)]
    pub enforce_budget: bool,
    /// Measure the chosen plan (or the closest) and write every allocation of
    /// its step, tagged with module, op and component, as a PyTorch memory
    /// snapshot (open it in pytorch.org/memory_viz); with `train`, of the
    /// run's own first steps (--snapshot-steps), one file per rank
    /// (`NAME.rankR.EXT`) when there are several. On CUDA: the device's
    /// tensor storages and memory pool (allocated and reserved), which needs
    /// the memory hook of oomfix's vendored candle-core.
    #[arg(long, value_name = "PATH", global = true)]
    pub snapshot: Option<PathBuf>,
    /// Train rank-RANK LoRA adapters on the frozen model instead of every
    /// parameter (PEFT's LoRA): y = W·x + (ALPHA/RANK)·B·A·x, W frozen.
    #[arg(long, value_name = "RANK", global = true, allow_negative_numbers = true, value_parser = parse_lora_rank)]
    pub lora: Option<u32>,
    /// LoRA's alpha: the adapters' output is scaled by ALPHA/RANK
    /// [default: 2 x RANK].
    #[arg(long, value_name = "ALPHA", global = true, allow_negative_numbers = true, value_parser = parse_lora_alpha)]
    pub lora_alpha: Option<u32>,
    /// The projections LoRA adapts, by module name (q_proj,v_proj)
    /// [default: every linear projection of the blocks, PEFT's all-linear].
    #[arg(long, value_delimiter = ',', value_name = "LIST", global = true)]
    pub lora_targets: Option<Vec<String>>,
    /// LoRA's frozen base weights: bf16, nf4 (4-bit NormalFloat, QLoRA) or
    /// nf4-dq (its absmax values in 8 bits too) [default: the search's
    /// choice, from bf16].
    #[arg(long, value_name = "KIND", global = true, value_parser = parse_from_str::<BasePrecision>)]
    pub base_precision: Option<BasePrecision>,
    /// Measure the chosen plan (or the closest) and draw live memory over its
    /// step, stacked by component, phases shaded, budget as a line: an SVG or
    /// a PNG, by the file's extension (.svg, .png); with `train`, of the
    /// run's own first steps, as --snapshot. On CUDA also the pool's
    /// reserved bytes, the memory outside the pool and the fragmentation.
    #[arg(long, value_name = "PATH", global = true)]
    pub plot: Option<PathBuf>,
}

impl PlanOptions {
    /// The device `plan` plans for: `--device`, else cuda:0 (planning a GPU
    /// from a machine without one is the point).
    pub fn plan_device(&self) -> Target {
        self.device.unwrap_or(Target::Cuda(0))
    }
}

/// Output format (global).
#[derive(Debug, Clone, Args)]
struct OutputArgs {
    /// Print one JSON object on stdout instead of the table (or text).
    #[arg(long, global = true)]
    json: bool,
}

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Pretty,
    /// One JSON object per line: every line on stderr (notices, progress and
    /// errors included).
    Json,
}

/// Logging options (global).
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Logging")]
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

impl Default for LogArgs {
    fn default() -> Self {
        LogArgs {
            log_format: LogFormat::Pretty,
            log_file: None,
            verbose: 0,
            quiet: 0,
        }
    }
}

/// `plan`'s arguments, resolved.
#[derive(Debug, Clone)]
pub struct PlanArgs {
    /// The model [default: the built-in one].
    pub model: Option<PathBuf>,
    /// The planning options.
    pub opts: PlanOptions,
    /// `--json`.
    pub json: bool,
}

/// `inspect`'s arguments, resolved.
#[derive(Debug, Clone)]
pub struct InspectArgs {
    /// The model.
    pub model: PathBuf,
    /// `--data` and how it is read.
    pub input: DataOptions,
    /// `--json`.
    pub json: bool,
}

/// `train`'s arguments, resolved.
#[derive(Debug, Clone)]
pub struct TrainArgs {
    /// What to plan (the model and the planning options).
    pub plan: PlanArgs,
    /// The training options.
    pub opts: TrainOptions,
}

/// A command to run.
#[derive(Debug)]
pub enum Command {
    /// `oomfix plan` (or no subcommand; boxed: its options outweigh
    /// `inspect`'s and `measure-step`'s).
    Plan(Box<PlanArgs>),
    /// `oomfix inspect`.
    Inspect(InspectArgs),
    /// `oomfix train` (boxed: its options outweigh the other commands').
    Train(Box<TrainArgs>),
    /// The hidden `oomfix measure-step`.
    MeasureStep(MeasureStepArgs),
}

/// A parsed command line.
#[derive(Debug)]
pub struct Invocation {
    /// What to do.
    pub command: Command,
    /// Where and how to log.
    pub log: LogArgs,
}

/// Why [`parse`] did not give an [`Invocation`].
pub enum ParseStop {
    /// `--help` or `--version`: print this on stdout and exit 0.
    Info(clap::Error),
    /// A usage error, in one line; `json`: argv asked for JSON logs on stderr.
    Usage {
        /// The error.
        failure: Failure,
        /// Whether to report it as a JSON line.
        json: bool,
    },
}

/// Parses this process's arguments.
pub fn parse() -> Result<Invocation, ParseStop> {
    parse_from(std::env::args_os())
}

/// Parses `argv` (the program name first).
pub fn parse_from<I: IntoIterator<Item = OsString>>(argv: I) -> Result<Invocation, ParseStop> {
    let argv = normalize(argv.into_iter().collect());
    let json = wants_json_stderr(&argv);
    parse_normalized(argv).map_err(|e| match e {
        Stop::Info(e) => ParseStop::Info(e),
        Stop::Usage(failure) => ParseStop::Usage { failure, json },
    })
}

enum Stop {
    Info(clap::Error),
    Usage(Failure),
}

fn parse_normalized(argv: Vec<OsString>) -> Result<Invocation, Stop> {
    let matches = Cli::command()
        .try_get_matches_from(argv)
        .map_err(clap_stop)?;
    let cli = Cli::from_arg_matches(&matches).map_err(clap_stop)?;
    if let Some(SeqLen::Tokens(seq)) = cli.plan.seq_len {
        let tokens = seq as u64 * cli.plan.global_batch as u64;
        if tokens > MAX_TOKENS_PER_STEP {
            return Err(Stop::Usage(Failure::Usage(format!(
                "--global-batch {} x --seq-len {seq} is {tokens} tokens per optimizer step; \
                 at most {MAX_TOKENS_PER_STEP} are planned",
                cli.plan.global_batch
            ))));
        }
    }
    let plan = |model: Option<PathBuf>| PlanArgs {
        model,
        opts: cli.plan.clone(),
        json: cli.output.json,
    };
    let command = match cli.command {
        None => Command::Plan(Box::new(plan(cli.model.clone()))),
        Some(sub) => {
            if let Some(model) = &cli.model {
                return Err(Stop::Usage(Failure::Usage(format!(
                    "`{}` before the subcommand: give the model after it (oomfix {} {})",
                    model.display(),
                    matches.subcommand_name().unwrap_or("plan"),
                    model.display()
                ))));
            }
            match sub {
                Sub::Plan(m) => Command::Plan(Box::new(plan(m.model))),
                Sub::Train(t) => Command::Train(Box::new(TrainArgs {
                    plan: plan(t.model),
                    opts: t.train,
                })),
                Sub::Inspect(i) => {
                    refuse_planning_options(&matches, "inspect", "reads only the header")?;
                    Command::Inspect(InspectArgs {
                        model: i.model,
                        input: i.input,
                        json: cli.output.json,
                    })
                }
                Sub::MeasureStep(m) => Command::MeasureStep(m),
            }
        }
    };
    Ok(Invocation {
        command,
        log: cli.log,
    })
}

/// `inspect` takes the global planning options (clap propagates globals to
/// every subcommand) but has no use for them: given, they are an error rather
/// than silently ignored.
fn refuse_planning_options(matches: &ArgMatches, sub: &str, why: &str) -> Result<(), Stop> {
    let options = PlanOptions::augment_args(clap::Command::new("options"));
    for arg in options.get_arguments() {
        let id = arg.get_id().as_str();
        let given = |m: &ArgMatches| m.value_source(id) == Some(ValueSource::CommandLine);
        let in_sub = matches.subcommand_matches(sub).is_some_and(given);
        if given(matches) || in_sub {
            let name = arg.get_long().unwrap_or(id);
            return Err(Stop::Usage(Failure::Usage(format!(
                "--{name} is a planning option: `oomfix {sub}` {why}"
            ))));
        }
    }
    Ok(())
}

/// Rewrites `--verify all` / `--verify fitting` as `--verify=…`: `--verify`'s
/// value is optional, so clap only takes it attached; a following word that
/// is one of its values is meant as the value (a model file of that name can
/// be given as `./all`).
fn normalize(argv: Vec<OsString>) -> Vec<OsString> {
    let mut out = Vec::with_capacity(argv.len());
    let mut it = argv.into_iter().peekable();
    while let Some(arg) = it.next() {
        if arg == "--" {
            out.push(arg);
            out.extend(it);
            break;
        }
        if arg == "--verify" {
            if let Some(v) = it.next_if(|v| v == "all" || v == "fitting") {
                let mut joined = OsString::from("--verify=");
                joined.push(v);
                out.push(joined);
                continue;
            }
        }
        out.push(arg);
    }
    out
}

/// `--help` and `--version` go through; every other clap error becomes one
/// line: clap's message and its tips, without the usage block.
fn clap_stop(e: clap::Error) -> Stop {
    use clap::error::ErrorKind;
    match e.kind() {
        ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => Stop::Info(e),
        _ => Stop::Usage(Failure::Usage(one_line(&e.to_string()))),
    }
}

/// Clap's rendered error in one line: the first paragraph (the error, with a
/// value's possible values) and any `tip:` lines; not the usage or the
/// pointer to --help.
fn one_line(rendered: &str) -> String {
    let mut parts: Vec<String> = Vec::new();
    for (i, para) in rendered.split("\n\n").enumerate() {
        let text = para.split_whitespace().collect::<Vec<_>>().join(" ");
        if i == 0 {
            parts.push(text.trim_start_matches("error:").trim().to_string());
        } else if text.starts_with("tip:") {
            parts.push(text);
        }
    }
    parts.join("; ")
}

/// Whether argv asks for JSON logs on stderr (`--log-format json` without
/// `--log-file`): used to report a usage error in that format when argv
/// itself does not parse.
pub fn wants_json_stderr(argv: &[OsString]) -> bool {
    let mut json = false;
    let mut it = argv.iter();
    while let Some(a) = it.next() {
        if a == "--" {
            break;
        }
        if a == "--log-format=json"
            || (a == "--log-format" && it.next().is_some_and(|v| v == "json"))
        {
            json = true;
        }
        if a == "--log-file" || a.to_string_lossy().starts_with("--log-file=") {
            return false;
        }
    }
    json
}

fn whole_number(s: &str, min: u64, max: u64) -> Result<u64, String> {
    let range = if max == u64::MAX {
        format!("a whole number of at least {min}")
    } else {
        format!("a whole number from {min} to {max}")
    };
    match s.trim().parse::<u64>() {
        Ok(n) if (min..=max).contains(&n) => Ok(n),
        Ok(_) => Err(format!("expected {range}")),
        Err(_) if s.trim().parse::<u128>().is_ok() => Err(format!("too large: expected {range}")),
        Err(_) if s.trim().starts_with('-') => Err(format!("negative: expected {range}")),
        Err(_) => Err(format!("not a whole number: expected {range}")),
    }
}

fn parse_global_batch(s: &str) -> Result<usize, String> {
    whole_number(s, 1, MAX_GLOBAL_BATCH as u64).map(|n| n as usize)
}

/// `--seq-len`: a length, or the longest that fits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqLen {
    /// This many tokens.
    Tokens(usize),
    /// The longest at which a plan fits (`longest`).
    Longest,
}

fn parse_loss_on(s: &str) -> Result<oomfix::train::examples::LossOn, String> {
    use oomfix::train::examples::LossOn;
    match s {
        "completions" => Ok(LossOn::Completions),
        "all" => Ok(LossOn::All),
        _ => Err(format!("expected `completions` or `all`, got `{s}`")),
    }
}

fn parse_seq_len(s: &str) -> Result<SeqLen, String> {
    if s == "longest" {
        return Ok(SeqLen::Longest);
    }
    whole_number(s, 1, MAX_SEQ_LEN as u64)
        .map(|n| SeqLen::Tokens(n as usize))
        .map_err(|e| format!("{e}, or `longest`"))
}

fn parse_gpus(s: &str) -> Result<usize, String> {
    whole_number(s, 1, MAX_GPUS as u64).map(|n| n as usize)
}

fn parse_steps(s: &str) -> Result<u64, String> {
    whole_number(s, 1, u64::MAX)
}

fn parse_seed(s: &str) -> Result<u64, String> {
    whole_number(s, 0, u64::MAX)
}

fn parse_budget(s: &str) -> Result<u64, String> {
    if s.trim().starts_with('-') {
        return Err("a budget is a positive size, like 8GiB".into());
    }
    match parse_bytes(s)? {
        0 => Err("a budget of 0 bytes fits nothing".into()),
        n => Ok(n),
    }
}

fn parse_bucket_size(s: &str) -> Result<usize, String> {
    match parse_bytes(s)? {
        0 => Err("a bucket of 0 bytes holds nothing: give a size like 25MiB (a tensor larger than the bucket travels alone)".into()),
        n => usize::try_from(n).map_err(|_| format!("a bucket of {n} bytes is too large")),
    }
}

fn parse_lr(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(lr) if lr.is_finite() && lr >= 0.0 => Ok(lr),
        _ => Err(format!(
            "`{s}` is not a learning rate (a finite number >= 0)"
        )),
    }
}

fn parse_decay(s: &str) -> Result<oomfix::train::Decay, String> {
    s.trim().parse()
}

fn parse_weight_decay(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(wd) if wd.is_finite() && wd >= 0.0 => Ok(wd),
        _ => Err(format!(
            "`{s}` is not a weight decay (a finite number >= 0)"
        )),
    }
}

fn parse_max_grad_norm(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(x) if x.is_finite() && x >= 0.0 => Ok(x),
        _ => Err(format!(
            "`{s}` is not a gradient norm (a finite number >= 0; 0 disables clipping)"
        )),
    }
}

fn parse_target(s: &str) -> Result<Target, String> {
    s.parse()
}

fn parse_positive(s: &str) -> Result<usize, String> {
    whole_number(s, 1, MAX_GLOBAL_BATCH as u64).map(|n| n as usize)
}

fn parse_lora_rank(s: &str) -> Result<u32, String> {
    match whole_number(s, 0, u64::from(u32::MAX))? {
        0 => Err("a LoRA rank of 0 trains nothing (at least 1)".into()),
        n => Ok(n as u32),
    }
}

fn parse_lora_alpha(s: &str) -> Result<u32, String> {
    whole_number(s, 1, u64::from(u32::MAX)).map(|n| n as u32)
}

/// `whole` or `chunked`: whether the LM loss runs in chunks of tokens.
fn parse_loss(s: &str) -> Result<bool, String> {
    match s {
        "whole" => Ok(false),
        "chunked" => Ok(true),
        _ => Err(format!("unknown loss `{s}` (expected whole or chunked)")),
    }
}

/// `device` or `host`: where the checkpointed blocks' inputs wait.
fn parse_activations(s: &str) -> Result<bool, String> {
    match s {
        "device" => Ok(false),
        "host" => Ok(true),
        _ => Err(format!("unknown place `{s}` (expected device or host)")),
    }
}

/// `--mlp-tile`: tokens per tile, or `none` (`MlpTile(None)`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MlpTile(pub Option<usize>);

fn parse_mlp_tile(s: &str) -> Result<MlpTile, String> {
    match s {
        "none" => Ok(MlpTile(None)),
        _ => match s.parse::<usize>() {
            Ok(0) => Err("a tile holds at least one token".into()),
            Ok(n) => Ok(MlpTile(Some(n))),
            Err(_) => Err(format!("expected a number of tokens or `none`, got `{s}`")),
        },
    }
}

fn parse_from_str<T: std::str::FromStr<Err = String>>(s: &str) -> Result<T, String> {
    s.trim().parse()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Invocation, String> {
        let argv = std::iter::once("oomfix")
            .chain(args.iter().copied())
            .map(OsString::from);
        parse_from(argv).map_err(|e| match e {
            ParseStop::Info(e) => format!("info: {e}"),
            ParseStop::Usage { failure, .. } => failure.to_string(),
        })
    }

    #[test]
    fn the_command_line_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn global_options_before_or_after_the_subcommand_are_the_same() {
        let train = |args: &[&str]| match parse(args).unwrap().command {
            Command::Train(t) => t,
            other => panic!("{other:?}"),
        };
        let a = train(&[
            "-v", "--device", "cpu", "--budget", "1GiB", "train", "m", "--steps", "3",
        ]);
        let b = train(&[
            "train", "m", "--steps", "3", "-v", "--device", "cpu", "--budget", "1GiB",
        ]);
        for t in [&a, &b] {
            assert_eq!(t.plan.model.as_deref(), Some(std::path::Path::new("m")));
            assert_eq!(t.plan.opts.device, Some(Target::Cpu));
            assert_eq!(t.plan.opts.budget, Some(1 << 30));
            assert_eq!(t.opts.steps, 3);
        }
        let log = |args: &[&str]| parse(args).unwrap().log.verbose;
        assert_eq!(log(&["-v", "train"]), 1);
        assert_eq!(log(&["train", "-vv"]), 2);
    }

    #[test]
    fn verify_takes_its_value_with_a_space_or_an_equals_sign() {
        for args in [
            &["--verify", "all", "m.safetensors"][..],
            &["--verify=all", "m.safetensors"],
            &["m.safetensors", "--verify", "all"],
        ] {
            let Command::Plan(p) = parse(args).unwrap().command else {
                panic!()
            };
            assert_eq!(p.opts.verify, Some(VerifyArg::All), "{args:?}");
            assert_eq!(
                p.model.as_deref(),
                Some(std::path::Path::new("m.safetensors"))
            );
        }
        let Command::Plan(p) = parse(&["--verify", "m.safetensors"]).unwrap().command else {
            panic!()
        };
        assert_eq!(p.opts.verify, Some(VerifyArg::Fitting));
        assert_eq!(
            p.model.as_deref(),
            Some(std::path::Path::new("m.safetensors"))
        );
        // After `--`, `all` is a file name.
        let Command::Plan(p) = parse(&["--verify", "--", "all"]).unwrap().command else {
            panic!()
        };
        assert_eq!(p.model.as_deref(), Some(std::path::Path::new("all")));
    }

    #[test]
    fn numbers_out_of_range_are_one_line_errors() {
        for (args, says) in [
            (&["--global-batch", "-1"][..], "negative"),
            (&["--global-batch", "0"], "from 1 to"),
            (
                &["--global-batch", "18446744073709551615"],
                "from 1 to 1048576",
            ),
            (&["--global-batch", "99999999999999999999999"], "too large"),
            (&["--seq-len", "-5"], "negative"),
            (&["--seq-len", "1048577"], "from 1 to 1048576"),
            (
                &["--seq-len", "16384", "--global-batch", "16385"],
                "tokens per optimizer step",
            ),
            (&["--gpus", "-1"], "negative"),
            (&["--budget", "0"], "fits nothing"),
            (&["--budget", "-1GiB"], "positive size"),
            (&["train", "--steps", "0"], "at least 1"),
            (&["train", "--steps", "-3"], "negative"),
            (&["train", "--seed", "-1"], "negative"),
            (&["train", "--lr", "-1"], "not a learning rate"),
            (&["train", "--weight-decay", "-0.1"], "not a weight decay"),
            (&["train", "--init", "scratch"], "invalid value 'scratch'"),
        ] {
            let e = parse(args).unwrap_err();
            assert!(!e.contains('\n'), "{args:?}: {e}");
            assert!(e.contains(says), "{args:?}: {e}");
            assert!(!e.contains("-- -"), "{args:?}: {e}");
        }
    }

    #[test]
    fn inspect_refuses_planning_options() {
        let e = parse(&["inspect", "m.safetensors", "--budget", "8GiB"]).unwrap_err();
        assert!(e.contains("--budget is a planning option"), "{e}");
        let e = parse(&["--device", "cpu", "inspect", "m.safetensors"]).unwrap_err();
        assert!(e.contains("--device"), "{e}");
        assert!(parse(&["inspect", "m.safetensors", "--json", "-v"]).is_ok());
    }

    #[test]
    fn a_model_before_the_subcommand_is_refused() {
        let e = parse(&["m.safetensors", "train"]).unwrap_err();
        assert!(e.contains("oomfix train m.safetensors"), "{e}");
    }

    #[test]
    fn json_logs_are_recognised_before_parsing() {
        let v = |a: &[&str]| a.iter().map(OsString::from).collect::<Vec<_>>();
        assert!(wants_json_stderr(&v(&[
            "oomfix",
            "--log-format",
            "json",
            "--bad"
        ])));
        assert!(wants_json_stderr(&v(&[
            "oomfix",
            "train",
            "--log-format=json"
        ])));
        assert!(!wants_json_stderr(&v(&[
            "oomfix",
            "--",
            "--log-format=json"
        ])));
        assert!(!wants_json_stderr(&v(&[
            "oomfix",
            "--log-format",
            "pretty"
        ])));
        assert!(!wants_json_stderr(&v(&[
            "oomfix",
            "--log-format",
            "json",
            "--log-file",
            "x"
        ])));
    }
}
