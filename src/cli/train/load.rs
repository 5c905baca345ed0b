//! What a `train` run reads: the data and the evaluation data, read and
//! checked (with `--resume` and `--save`) before the plan is chosen
//! ([`inputs`]); then the model and its trainer for the chosen plan, resumed
//! from `--resume` ([`trainer`]).

use super::plan::{refuse_unsupported, Planned, Planning};
use super::Setup;
use crate::cli::args::{InitArg, SeqLen};
use crate::cli::{check_can_create, data, logging, Failure};
use oomfix::measure::RunRecording;
use oomfix::train::data::DataSource;
use oomfix::train::saved::{self, ModelSource, TrainingState};
use oomfix::train::{TrainOptions, Trainer};
use std::path::Path;

/// The data a run trains and evaluates on.
pub(super) struct Inputs {
    /// The training data (`--data`, else random tokens).
    pub data: DataSource,
    /// `--eval-data`.
    pub eval_data: Option<DataSource>,
}

/// Reads the data and the evaluation data (the sequence length set from
/// the longest example when not given) and checks `--resume` and `--save`;
/// what the model's family does not implement is refused before the data
/// is read.
pub(super) fn inputs(setup: &Setup, planning: &mut Planning) -> Result<Inputs, Failure> {
    let (args, o, rank) = (setup.args, &setup.args.opts, setup.rank());
    let spec = &planning.prepared.spec;
    let model_dir = setup.model_dir.as_deref();
    let seq_len = &mut planning.args.opts.seq_len;
    // `longest`: the length is the search's; a sliding window it exceeds is
    // refused once it is known.
    let refuse = |seq_len: Option<SeqLen>| {
        let tokens = match seq_len {
            Some(SeqLen::Tokens(n)) => n,
            Some(SeqLen::Longest) => 1,
            None => oomfix::Planner::new(1).seq_len_for(spec),
        };
        refuse_unsupported(setup, spec, tokens)
    };
    refuse(*seq_len)?;
    let data = data::data_source(&o.input, o.seed, &spec.config, model_dir)?;
    if let (None, DataSource::Examples(examples)) = (*seq_len, &data) {
        let tokens = data::examples_seq_len(examples, &spec.config);
        if rank == 0 {
            logging::notice(format_args!(
                "sequence length {tokens}: the longest example of {} is {} tokens{}; --seq-len sets it",
                examples.path().display(),
                examples.longest(),
                if tokens + 1 < examples.longest() { ", beyond the model's context" } else { "" }
            ));
        }
        *seq_len = Some(SeqLen::Tokens(tokens));
        refuse(*seq_len)?;
    }
    if let Some(path) = &o.resume {
        TrainingState::check(path)?;
    }
    let eval_data = match &o.eval_data {
        Some(path) => Some(data::load_data(&o.input, path, &spec.config, model_dir)?),
        None => None,
    };
    if let Some(save) = &o.save {
        let mut inputs: Vec<&Path> = spec.files.iter().map(|p| p.as_path()).collect();
        inputs.extend(args.plan.model.as_deref());
        inputs.extend(o.input.data.as_deref());
        inputs.extend(o.eval_data.as_deref());
        // The checkpoint resumed, and the model when it is that checkpoint:
        // replacing them is the point.
        let mut replaceable: Vec<&Path> = o.resume.as_deref().into_iter().collect();
        let same = |a: &Path, b: &Path| a.canonicalize().ok() == b.canonicalize().ok();
        if let (Some(model), Some(resume)) = (args.plan.model.as_deref(), o.resume.as_deref()) {
            if same(model, resume) {
                replaceable.push(model);
                replaceable.extend(spec.files.iter().map(|p| p.as_path()));
            }
        }
        oomfix::output::check_output_dir(save, saved::STATE_FILE, &inputs, &replaceable)?;
        check_can_create(save, true)?;
    }
    if rank == 0 && args.plan.model.is_none() && o.init_given().is_none() && o.resume.is_none() {
        logging::notice(
            "no model file given: the built-in GPT-2 small shape has no weights, training starts from a random initialisation",
        );
    }
    if setup.defaulted && rank == 0 {
        logging::notice("no --device given and this build has no CUDA: training on the CPU");
    }
    Ok(Inputs { data, eval_data })
}

/// The trainer of the chosen plan, resumed from `--resume`.
pub(super) struct Loaded {
    /// The trainer.
    pub trainer: Trainer,
    /// The recording of the run's first steps, started before the model
    /// was built (`--snapshot`, `--plot`).
    pub recording: Option<RunRecording>,
    /// The learning rate, and where it comes from.
    pub lr: (f64, &'static str),
    /// Seconds the trainer took to build (the model's weights read or drawn,
    /// quantized and moved to the device).
    pub build_seconds: f64,
}

/// Builds the model and the trainer of the chosen plan (this rank's, in a
/// job) and resumes it from `--resume`.
pub(super) fn trainer(
    setup: &Setup,
    planned: &Planned,
    inputs: &mut Inputs,
) -> Result<Loaded, Failure> {
    let (args, o, rank) = (setup.args, &setup.args.opts, setup.rank());
    let (spec, chosen) = (&planned.spec, planned.chosen);
    let lora = chosen.lora.is_some();
    let weights = match (setup.init, &args.plan.model) {
        // A resumed run takes its weights from the checkpoint (a LoRA run
        // its adapters: the base comes from the model).
        (InitArg::Pretrained, Some(_)) if o.resume.is_none() || lora => Some(spec.files.clone()),
        _ => None,
    };
    let (lr, lr_source) = match o.lr {
        Some(lr) => (lr, "--lr"),
        None if setup.init == InitArg::Pretrained => (
            oomfix::train::PRETRAINED_LR,
            "the default from pretrained weights; --lr sets it",
        ),
        None => (
            oomfix::train::RANDOM_INIT_LR,
            "the default from a random initialisation; --lr sets it",
        ),
    };
    if rank == 0 && o.lr.is_none() {
        logging::notice(format_args!("learning rate {lr:e} ({lr_source})"));
    }
    let mut options = TrainOptions::default();
    options.adamw.lr = lr;
    options.adamw.weight_decay = o.weight_decay;
    options.schedule = oomfix::train::LrSchedule {
        warmup_steps: o.warmup_steps,
        decay: o.lr_schedule,
        total_steps: o.steps,
    };
    options.max_grad_norm = (o.max_grad_norm > 0.0).then_some(o.max_grad_norm);
    options.seed = o.seed;
    options.weights = weights;
    options.source = model_source(setup, spec);
    options.trim_between_phases = o.trim_between_phases;
    options.merge_lora = o.merge;
    let recording = planned
        .recording
        .wanted()
        .then(|| RunRecording::start_on(&setup.device))
        .transpose()?;
    let building = std::time::Instant::now();
    let _spinner = (rank == 0).then(|| {
        let values = oomfix::units::group_digits(spec.parameters());
        crate::cli::progress::spinner(format!("building the model ({values} parameters)"))
    });
    let mut trainer = match &setup.joined {
        Some(j) => Trainer::new_sharded(
            &spec.config,
            chosen,
            &setup.device,
            &options,
            Box::new(std::sync::Arc::clone(&j.comm)),
        )?,
        None => Trainer::new(&spec.config, chosen, &setup.device, &options)?,
    };
    let build_seconds = building.elapsed().as_secs_f64();
    if let Some(path) = &o.resume {
        let saved_plan = trainer.resume(path, &mut inputs.data)?;
        if rank == 0 {
            for line in oomfix::train::plan_changes(&saved_plan, trainer.plan()) {
                logging::notice(line);
            }
            logging::say(format_args!(
                "oomfix: resumed from {} at step {}",
                path.display(),
                trainer.steps()
            ));
        }
        tracing::info!(step = trainer.steps(), checkpoint = %path.display(), "resumed");
    }
    if (o.save.is_some() || o.resume.is_some()) && !trainer.saves_optimizer_state() {
        tracing::warn!(
            "the plan uses candle_nn::AdamW, whose moments cannot be read: checkpoints hold the weights, \
             step and data position but not the optimizer moments; a resumed run restarts them from zero"
        );
    }
    Ok(Loaded {
        trainer,
        recording,
        lr: (lr, lr_source),
        build_seconds,
    })
}

/// What a saved directory holds beside the weights: the dtype of the weights
/// the run starts from (f32 from a random initialisation), the model's
/// `config.json` and tokenizer files, and `--tokenizer` as `tokenizer.json`.
fn model_source(setup: &Setup, spec: &oomfix::ModelSpec) -> ModelSource {
    let dtype = match (setup.init, spec.dtype.as_str()) {
        (InitArg::Random, _) => candle_core::DType::F32,
        (_, "BF16") => candle_core::DType::BF16,
        (_, "F16") => candle_core::DType::F16,
        _ => candle_core::DType::F32,
    };
    let mut source = match &setup.model_dir {
        Some(dir) => ModelSource::beside(dir, dtype),
        None => ModelSource {
            dtype,
            ..ModelSource::default()
        },
    };
    let input = &setup.args.opts.input;
    if let Some(t) = &input.tokenizer {
        source.files.retain(|(n, _)| n != "tokenizer.json");
        source.files.push(("tokenizer.json".into(), t.clone()));
    }
    if let Some(t) = &input.chat_template {
        let name = oomfix::train::chat::TEMPLATE_FILE;
        source.files.retain(|(n, _)| n != name);
        source.files.push((name.into(), t.clone()));
    }
    source
}
