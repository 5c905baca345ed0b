//! The settings of a training run besides the plan.

use crate::train::saved::ModelSource;
use candle_nn::ParamsAdamW;
use oomfix_strategies::Strategy;
use std::path::PathBuf;
use std::sync::Arc;
#[cfg(doc)]
use {
    super::Trainer,
    oomfix_strategies::{model::MicroBatch, Execution},
};

/// Settings of a training run besides the plan.
#[derive(Clone)]
#[non_exhaustive]
pub struct TrainOptions {
    /// AdamW hyper-parameters. Weight decay applies to matrices only, not to
    /// biases and norm scales ([`is_decay_exempt`](oomfix_strategies::adamw::is_decay_exempt)); default 0.
    /// The default learning rate is [`RANDOM_INIT_LR`](crate::train::RANDOM_INIT_LR); from
    /// pretrained [`weights`](Self::weights), [`PRETRAINED_LR`](crate::train::PRETRAINED_LR)
    /// is the usual choice ([`default_lr`](crate::train::default_lr)).
    pub adamw: ParamsAdamW,
    /// Seed of the random initialisation and of synthetic data (a model
    /// given as code gets it in every [`MicroBatch::seed`]; its builder
    /// initialises it).
    pub seed: u64,
    /// Pretrained weights to start from (`None`: random initialisation). A
    /// model given as code loads its own: there it is a usage error.
    pub weights: Option<Vec<PathBuf>>,
    /// The fixes whose execution hooks make the plan's forward/backward pass
    /// ([`Execution::for_plan`]); default: the built-in ones.
    pub fixes: Vec<Arc<dyn Strategy>>,
    /// The learning rate over the run, as a factor of `adamw.lr` (default:
    /// constant).
    pub schedule: crate::train::LrSchedule,
    /// What [`Trainer::save`] writes beside the weights, and their dtype
    /// (default: f32, a configuration made from the shape, no other files).
    pub source: ModelSource,
    /// Clip the gradients of each optimizer step to this global L2 norm
    /// (`torch.nn.utils.clip_grad_norm_`'s `max_norm`); `None` (the
    /// default here; `oomfix train` clips at 1.0): no clipping.
    pub max_grad_norm: Option<f64>,
    /// On CUDA, trim the memory pool at every phase change of a step
    /// (forward, backward, optimizer step, between steps): it waits for the
    /// device and returns the pool's cached memory to the driver
    /// (`track::cuda::trim`, PyTorch's `empty_cache()`). It frees no live
    /// tensor and costs the waits; default off. Nothing elsewhere.
    pub trim_between_phases: bool,
    /// With a LoRA plan, [`Trainer::save`] writes the merged model (the
    /// adapters added into the base weights) instead of the adapters.
    pub merge_lora: bool,
}

impl Default for TrainOptions {
    fn default() -> Self {
        TrainOptions {
            adamw: ParamsAdamW {
                lr: crate::train::RANDOM_INIT_LR,
                // Hugging Face's Trainer default (candle's is 0.01).
                weight_decay: 0.0,
                ..Default::default()
            },
            seed: 0,
            weights: None,
            fixes: oomfix_strategies::builtins(),
            schedule: crate::train::LrSchedule::default(),
            source: ModelSource::default(),
            max_grad_norm: None,
            trim_between_phases: false,
            merge_lora: false,
        }
    }
}
