//! The training configuration that the strategies rewrite.

use std::fmt;
use std::ops::Range;

/// Numeric precision of the forward and backward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Precision {
    /// Everything in fp32.
    F32,
    /// bf16 compute weights and activations, fp32 master weights and optimizer state.
    Bf16,
    /// f16 compute, fp32 master weights and optimizer state, dynamic loss scaling.
    F16,
}

impl Precision {
    /// Bytes per value of the compute dtype.
    pub fn compute_bytes(self) -> u64 {
        match self {
            Precision::F32 => 4,
            Precision::Bf16 | Precision::F16 => 2,
        }
    }
    /// Whether fp32 master weights are kept beside 16-bit compute weights.
    pub fn is_mixed(self) -> bool {
        self != Precision::F32
    }
    /// Lower-case name (`fp32`, `bf16`, `fp16`).
    pub fn as_str(self) -> &'static str {
        match self {
            Precision::F32 => "fp32",
            Precision::Bf16 => "bf16",
            Precision::F16 => "fp16",
        }
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Precision {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "fp32" | "f32" | "float32" => Ok(Precision::F32),
            "bf16" | "bfloat16" => Ok(Precision::Bf16),
            "fp16" | "f16" | "float16" | "half" => Ok(Precision::F16),
            _ => Err(format!(
                "unknown precision `{s}` (expected fp32, bf16 or fp16)"
            )),
        }
    }
}

/// Activation checkpointing policy (Chen et al. 2016, "Training Deep Nets with
/// Sublinear Memory Cost").
///
/// `Every(k)` groups the blocks into segments of `k` consecutive blocks (the last
/// segment may be shorter). The forward keeps only each segment's input; in
/// backward each segment is recomputed from its input, one segment at a time.
/// `Every(1)` recomputes every block on its own; `Every(k)` with `k >= layers`
/// keeps only the input of the first block and recomputes the whole stack at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Checkpointing {
    /// Plain autograd: every intermediate is kept until backward.
    None,
    /// Segments of `k` consecutive blocks, each recomputed in backward from its
    /// input. `Every(0)` is treated as [`Checkpointing::None`].
    Every(usize),
}

impl Checkpointing {
    /// The recomputed segments of a stack of `layers` blocks, as block index
    /// ranges in order; empty when nothing is recomputed (`None`, `Every(0)`).
    ///
    /// ```
    /// use oomfix_strategies::Checkpointing;
    /// assert_eq!(Checkpointing::Every(2).segments(5), vec![0..2, 2..4, 4..5]);
    /// assert_eq!(Checkpointing::Every(8).segments(5), vec![0..5]);
    /// assert!(Checkpointing::None.segments(5).is_empty());
    /// ```
    pub fn segments(self, layers: usize) -> Vec<Range<usize>> {
        match self {
            Checkpointing::Every(k) if k > 0 => (0..layers)
                .step_by(k)
                .map(|start| start..(start + k).min(layers))
                .collect(),
            _ => Vec::new(),
        }
    }
}

impl fmt::Display for Checkpointing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Checkpointing::None | Checkpointing::Every(0) => f.write_str("none"),
            Checkpointing::Every(1) => f.write_str("every block"),
            Checkpointing::Every(k) => write!(f, "segments of {k} blocks"),
        }
    }
}

/// Which AdamW implementation runs the optimizer step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OptimizerImpl {
    /// `candle_nn::AdamW`: state in the parameter dtype, several temporaries per tensor.
    CandleAdamW,
    /// [`adamw::FusedAdamW`](crate::adamw::FusedAdamW): fp32 state, updated in place.
    FusedAdamW,
    /// [`offload::OffloadedAdamW`](crate::offload::OffloadedAdamW): the fused
    /// step run by the CPU on fp32 master weights and state kept in host
    /// memory; the device holds only compute weights and gradients.
    OffloadedAdamW,
}

impl OptimizerImpl {
    /// Name used in output (`adamw`, `fused-adamw`, `cpu-adamw`).
    pub fn as_str(self) -> &'static str {
        match self {
            OptimizerImpl::CandleAdamW => "adamw",
            OptimizerImpl::FusedAdamW => "fused-adamw",
            OptimizerImpl::OffloadedAdamW => "cpu-adamw",
        }
    }

    /// Whether master weights and optimizer state live in host memory, off the device.
    pub fn is_offloaded(self) -> bool {
        self == OptimizerImpl::OffloadedAdamW
    }
}

impl std::str::FromStr for OptimizerImpl {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        [
            OptimizerImpl::CandleAdamW,
            OptimizerImpl::FusedAdamW,
            OptimizerImpl::OffloadedAdamW,
        ]
        .into_iter()
        .find(|o| o.as_str() == s)
        .ok_or_else(|| {
            format!("unknown optimizer `{s}` (expected adamw, fused-adamw or cpu-adamw)")
        })
    }
}

impl fmt::Display for OptimizerImpl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How the attention of each transformer block is computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Attention {
    /// The probabilities `softmax(q·kᵀ·scale + mask)` as one op (scores made
    /// into probabilities in place), then their product with the values:
    /// autograd keeps one `batch × heads × seq × seq` tensor per block.
    Composed,
    /// [`attention::flash_attention`](crate::attention::flash_attention): blocked,
    /// with the probabilities recomputed in backward; nothing of size `seq × seq` is kept.
    Flash,
}

impl Attention {
    /// Name used in output (`composed`, `flash`).
    pub fn as_str(self) -> &'static str {
        match self {
            Attention::Composed => "composed",
            Attention::Flash => "flash",
        }
    }
}

impl fmt::Display for Attention {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// ZeRO-style sharding of training state across data-parallel ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Sharding {
    /// Number of ranks (1: no sharding).
    pub world_size: usize,
    /// 0: replicated; 1: optimizer state sharded; 2: also gradients; 3: also parameters.
    pub stage: u8,
}

impl Sharding {
    /// One device, nothing sharded.
    pub const NONE: Sharding = Sharding {
        world_size: 1,
        stage: 0,
    };
}

/// A complete training configuration: everything the memory model and the
/// trainer need to know about how a step runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Plan {
    /// Sequences per forward/backward pass on one rank.
    pub micro_batch: usize,
    /// Micro-batches accumulated per optimizer step.
    pub grad_accum: usize,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// Compute precision.
    pub precision: Precision,
    /// Activation checkpointing policy.
    pub checkpoint: Checkpointing,
    /// Attention implementation.
    pub attention: Attention,
    /// Optimizer implementation.
    pub optimizer: OptimizerImpl,
    /// Sharding across ranks.
    pub shard: Sharding,
}

impl Plan {
    /// The plan with no fix applied: the whole global batch in one fp32 pass,
    /// plain autograd, composed attention, `candle_nn::AdamW`, one device.
    pub fn baseline(global_batch: usize, seq_len: usize) -> Plan {
        Plan {
            micro_batch: global_batch.max(1),
            grad_accum: 1,
            seq_len,
            precision: Precision::F32,
            checkpoint: Checkpointing::None,
            attention: Attention::Composed,
            optimizer: OptimizerImpl::CandleAdamW,
            shard: Sharding::NONE,
        }
    }

    /// Sequences per optimizer step over all ranks.
    pub fn global_batch(&self) -> usize {
        self.micro_batch * self.grad_accum * self.shard.world_size
    }
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "micro-batch {} x {} accumulation, seq {}, {}, checkpoint {}, ",
            self.micro_batch, self.grad_accum, self.seq_len, self.precision, self.checkpoint
        )?;
        if self.attention == Attention::Flash {
            f.write_str("flash attention, ")?;
        }
        write!(f, "{}", self.optimizer)?;
        if self.shard.world_size > 1 {
            write!(
                f,
                ", ZeRO-{} over {}",
                self.shard.stage, self.shard.world_size
            )?;
        }
        Ok(())
    }
}
