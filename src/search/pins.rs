//! The plan fields the user fixes, and the baseline plan they make.

use crate::{Error, Result};
use oomfix_strategies::lora::{BasePrecision, Lora};
use oomfix_strategies::{Attention, Checkpointing, OptimizerImpl, Plan, Precision, Sharding};
use serde::Serialize;

/// Plan fields fixed by the user: the search starts from them and never
/// changes them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
#[non_exhaustive]
pub struct Pins {
    /// Sequences per micro-batch.
    pub micro_batch: Option<usize>,
    /// Micro-batches per optimizer step.
    pub grad_accum: Option<usize>,
    /// Compute precision.
    pub precision: Option<Precision>,
    /// Activation checkpointing.
    pub checkpoint: Option<Checkpointing>,
    /// Attention.
    pub attention: Option<Attention>,
    /// Whether the LM loss is computed in chunks of tokens (`chunked-loss`).
    pub chunked_loss: Option<bool>,
    /// Whether the checkpointed segments' inputs wait in host memory
    /// (`offload-activations`).
    pub offload_activations: Option<bool>,
    /// Tokens per tile of the blocks' MLP (`tiled-mlp`); `Some(None)`: untiled.
    pub mlp_tile: Option<Option<usize>>,
    /// Optimizer.
    pub optimizer: Option<OptimizerImpl>,
    /// ZeRO stage (1–3 shard over the planner's GPUs; 0 runs on one).
    pub shard_stage: Option<u8>,
    /// The most bytes one collective of a sharded plan moves (a setting
    /// rather than a searched field: every plan takes it).
    pub bucket_bytes: Option<usize>,
    /// Low-rank adapters to train on the frozen model (`lora`): every plan
    /// carries them; the search starts from their base precision.
    pub lora: Option<Lora>,
    /// The frozen base's storage, kept as given (needs [`lora`](Self::lora)).
    pub base_precision: Option<BasePrecision>,
}

impl Pins {
    /// The names of the pinned fields, as the plan's serde form names them
    /// (`base_precision`: the base of its `lora`).
    pub fn names(&self) -> Vec<&'static str> {
        [
            ("micro_batch", self.micro_batch.is_some()),
            ("grad_accum", self.grad_accum.is_some()),
            ("precision", self.precision.is_some()),
            ("checkpoint", self.checkpoint.is_some()),
            ("attention", self.attention.is_some()),
            ("chunked_loss", self.chunked_loss.is_some()),
            ("offload_activations", self.offload_activations.is_some()),
            ("mlp_tile", self.mlp_tile.is_some()),
            ("optimizer", self.optimizer.is_some()),
            ("shard_stage", self.shard_stage.is_some()),
            ("bucket_bytes", self.bucket_bytes.is_some()),
            ("lora", self.lora.is_some()),
            ("base_precision", self.base_precision.is_some()),
        ]
        .into_iter()
        .filter_map(|(n, pinned)| pinned.then_some(n))
        .collect()
    }

    /// Whether `plan` keeps every pinned field.
    pub fn admit(&self, plan: &Plan) -> bool {
        fn keeps<T: PartialEq>(pin: Option<T>, value: T) -> bool {
            pin.is_none_or(|p| p == value)
        }
        keeps(self.micro_batch, plan.micro_batch)
            && keeps(self.grad_accum, plan.grad_accum)
            && keeps(self.precision, plan.precision)
            && keeps(self.checkpoint, plan.checkpoint)
            && keeps(self.attention, plan.attention)
            && keeps(self.chunked_loss, plan.chunked_loss)
            && keeps(self.offload_activations, plan.offload_activations)
            && keeps(self.mlp_tile, plan.mlp_tile)
            && keeps(self.optimizer, plan.optimizer)
            && keeps(self.shard_stage, plan.shard.stage)
            && self.lora.is_some() == plan.lora.is_some()
            && self
                .base_precision
                .is_none_or(|b| plan.lora.is_some_and(|l| l.base == b))
    }

    /// The baseline plan for `global` sequences of `seq_len` tokens over
    /// `gpus` devices with the pins applied; an error when they contradict
    /// each other or the global batch.
    pub(super) fn baseline(&self, global: usize, seq_len: usize, gpus: usize) -> Result<Plan> {
        let mut plan = Plan::baseline(global, seq_len);
        if let Some(bytes) = self.bucket_bytes {
            if bytes == 0 {
                return Err(Error::Usage("a bucket must hold at least 1 byte".into()));
            }
            plan.shard.bucket_bytes = bytes;
        }
        if let Some(stage) = self.shard_stage {
            if stage > 3 {
                return Err(Error::Usage(format!(
                    "ZeRO stage {stage} does not exist (0 to 3)"
                )));
            }
            if stage > 0 {
                plan.shard = Sharding {
                    world_size: gpus,
                    stage,
                    ..plan.shard
                };
            }
        }
        let world = plan.shard.world_size;
        if !global.is_multiple_of(world) {
            return Err(Error::Usage(format!(
                "a global batch of {global} does not split over {world} GPUs"
            )));
        }
        let per_rank = global / world;
        let split = |part: usize, what: &str| -> Result<usize> {
            if part == 0 || !per_rank.is_multiple_of(part) {
                return Err(Error::Usage(format!(
                    "a {what} of {part} does not divide the {per_rank} sequences per rank and step"
                )));
            }
            Ok(per_rank / part)
        };
        (plan.micro_batch, plan.grad_accum) = match (self.micro_batch, self.grad_accum) {
            (Some(m), Some(a)) if m * a != per_rank => {
                return Err(Error::Usage(format!(
                    "a micro-batch of {m} times {a} accumulation steps is not the {per_rank} sequences per rank and step"
                )))
            }
            (Some(m), _) => (m, split(m, "micro-batch")?),
            (None, Some(a)) => (split(a, "number of accumulation steps")?, a),
            (None, None) => (per_rank, 1),
        };
        plan.precision = self.precision.unwrap_or(plan.precision);
        plan.checkpoint = self.checkpoint.unwrap_or(plan.checkpoint);
        plan.attention = self.attention.unwrap_or(plan.attention);
        plan.chunked_loss = self.chunked_loss.unwrap_or(plan.chunked_loss);
        if self.offload_activations == Some(true) {
            // Host memory holds what checkpointing keeps: every block
            // checkpointed unless the checkpointing is pinned too.
            if self.checkpoint == Some(Checkpointing::None) {
                return Err(Error::Usage(
                    "--activations host keeps the checkpointed blocks' inputs on the host: \
                     it needs checkpointing, not --checkpoint none"
                        .into(),
                ));
            }
            plan.checkpoint = self.checkpoint.unwrap_or(Checkpointing::Every(1));
            plan.offload_activations = true;
        }
        if let Some(Some(tile)) = self.mlp_tile {
            if tile == 0 || tile > seq_len {
                return Err(Error::Usage(format!(
                    "an MLP tile of {tile} tokens is not within the sequence of {seq_len}"
                )));
            }
        }
        plan.mlp_tile = self.mlp_tile.unwrap_or(plan.mlp_tile);
        plan.optimizer = self.optimizer.unwrap_or(plan.optimizer);
        plan.lora = match (self.lora, self.base_precision) {
            (None, Some(base)) => {
                return Err(Error::Usage(format!(
                    "a base precision ({base}) is the storage of LoRA's frozen weights: it needs a LoRA rank (--lora)"
                )))
            }
            (Some(lora), base) => Some(Lora {
                base: base.unwrap_or(lora.base),
                ..lora
            }),
            (None, None) => None,
        };
        Ok(plan)
    }
}
