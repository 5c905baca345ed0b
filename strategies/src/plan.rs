//! The training configuration that the strategies rewrite.

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;
use std::ops::Range;

use crate::intern::intern;

/// Numeric precision of the forward and backward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Precision {
    /// Everything in fp32.
    #[serde(rename = "fp32")]
    F32,
    /// bf16 compute weights and activations, fp32 master weights and optimizer state.
    #[serde(rename = "bf16")]
    Bf16,
    /// f16 compute, fp32 master weights and optimizer state, dynamic loss scaling.
    #[serde(rename = "fp16")]
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

impl std::str::FromStr for Checkpointing {
    type Err = String;
    /// `none`, `every-K` (segments of K blocks; `every` is `every-1`).
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("unknown checkpointing `{s}` (expected none, every or every-K)");
        match s {
            "none" => Ok(Checkpointing::None),
            "every" => Ok(Checkpointing::Every(1)),
            _ => match s.strip_prefix("every-").map(str::parse::<usize>) {
                Some(Ok(k)) if k > 0 => Ok(Checkpointing::Every(k)),
                _ => Err(bad()),
            },
        }
    }
}

/// Serialized as `"none"` or `"every-K"`.
impl Serialize for Checkpointing {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Checkpointing::None | Checkpointing::Every(0) => s.serialize_str("none"),
            Checkpointing::Every(k) => s.serialize_str(&format!("every-{k}")),
        }
    }
}

impl<'de> Deserialize<'de> for Checkpointing {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        match s.strip_prefix("every-").map(str::parse::<usize>) {
            _ if s == "none" => Ok(Checkpointing::None),
            Some(Ok(k)) if k > 0 => Ok(Checkpointing::Every(k)),
            _ => Err(serde::de::Error::custom(format!(
                "`{s}` is not a checkpointing policy (none, every-K with K >= 1)"
            ))),
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum OptimizerImpl {
    /// `candle_nn::AdamW`: state in the parameter dtype, several temporaries per tensor.
    #[serde(rename = "adamw")]
    CandleAdamW,
    /// [`adamw::FusedAdamW`](crate::adamw::FusedAdamW): fp32 state, updated in place.
    #[serde(rename = "fused-adamw")]
    FusedAdamW,
    /// [`offload::OffloadedAdamW`](crate::offload::OffloadedAdamW): the fused
    /// step run by the CPU on fp32 master weights and state kept in host
    /// memory; the device holds only compute weights and gradients.
    #[serde(rename = "cpu-adamw")]
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
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

impl std::str::FromStr for Attention {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "composed" => Ok(Attention::Composed),
            "flash" => Ok(Attention::Flash),
            _ => Err(format!(
                "unknown attention `{s}` (expected composed or flash)"
            )),
        }
    }
}

impl fmt::Display for Attention {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// ZeRO-style sharding of training state across data-parallel ranks.
///
/// Serialized as `world_size` and `shard_stage` (flattened into a plan's fields).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Sharding {
    /// Number of ranks (1: no sharding).
    pub world_size: usize,
    /// 0: replicated; 1: optimizer state sharded; 2: also gradients; 3: also parameters.
    #[serde(rename = "shard_stage")]
    pub stage: u8,
    /// The most bytes one collective moves: gradients and parameters travel
    /// in flat buckets of up to this size (a larger tensor is a bucket of
    /// its own). Serialized only when not [`DEFAULT_BUCKET_BYTES`].
    #[serde(
        default = "default_bucket_bytes",
        skip_serializing_if = "is_default_bucket_bytes"
    )]
    pub bucket_bytes: usize,
}

/// The default size of a bucket of a sharded plan's collectives: 25 MiB, as
/// PyTorch's `DistributedDataParallel` buckets gradients.
pub const DEFAULT_BUCKET_BYTES: usize = 25 << 20;

fn default_bucket_bytes() -> usize {
    DEFAULT_BUCKET_BYTES
}

fn is_default_bucket_bytes(bytes: &usize) -> bool {
    *bytes == DEFAULT_BUCKET_BYTES
}

impl Sharding {
    /// One device, nothing sharded.
    pub const NONE: Sharding = Sharding::new(1, 0);

    /// `world_size` ranks at ZeRO `stage`, in buckets of [`DEFAULT_BUCKET_BYTES`].
    pub const fn new(world_size: usize, stage: u8) -> Sharding {
        Sharding {
            world_size,
            stage,
            bucket_bytes: DEFAULT_BUCKET_BYTES,
        }
    }
}

/// A complete training configuration: everything the memory model and the
/// trainer need to know about how a step runs.
///
/// Its serde form is the plan's one encoding: the JSON report, the attempt
/// spans, the measuring child's argument and a training state's identity all
/// are `serde_json` of this struct:
///
/// ```
/// use oomfix_strategies::Plan;
/// let plan = Plan::baseline(8, 1024);
/// let json = serde_json::to_string(&plan).unwrap();
/// assert_eq!(
///     json,
///     r#"{"micro_batch":8,"grad_accum":1,"seq_len":1024,"precision":"fp32","checkpoint":"none","attention":"composed","optimizer":"adamw","world_size":1,"shard_stage":0}"#
/// );
/// assert_eq!(serde_json::from_str::<Plan>(&json).unwrap(), plan);
/// ```
///
/// The fields are public and the struct is exhaustive so that a plan can be
/// written as a change of another (`Plan { micro_batch: 2, ..plan }`); what a
/// fix outside the built-in ones needs to record goes in
/// [`extensions`](Plan::extensions).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
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
    #[serde(flatten)]
    pub shard: Sharding,
    /// Settings of fixes that are not built in (empty for the built-in ones).
    #[serde(default, skip_serializing_if = "Extensions::is_empty")]
    pub extensions: Extensions,
    /// Low-rank adapters trained on a frozen base ([`crate::lora`]), when
    /// the user asked for them; `None` trains every parameter.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora: Option<crate::lora::Lora>,
    /// The LM head's product and the cross-entropy computed chunk by chunk
    /// of tokens ([`crate::chunked_loss`]), so that one chunk's logits exist
    /// at a time. Serialized only when set.
    #[serde(default, skip_serializing_if = "is_false")]
    pub chunked_loss: bool,
    /// The checkpointed segments' inputs kept in host memory between the
    /// forward and their recompute ([`crate::offload_activations`]).
    /// Serialized only when set.
    #[serde(default, skip_serializing_if = "is_false")]
    pub offload_activations: bool,
    /// Tokens per tile of each block's MLP, run tile by tile and recomputed
    /// in the backward ([`crate::tiled_mlp`]); `None`: the whole micro-batch
    /// at once. Serialized only when set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mlp_tile: Option<usize>,
}

fn is_false(b: &bool) -> bool {
    !*b
}

impl Plan {
    /// One rank's part of `bytes` of state that the plan shards from ZeRO
    /// stage `from_stage` on: `bytes / world_size` (rounded up) when
    /// sharded, else all.
    ///
    /// ```
    /// use oomfix_strategies::{Plan, Sharding};
    /// let plan = Plan { shard: Sharding::new(4, 2), ..Plan::baseline(8, 16) };
    /// assert_eq!(plan.per_rank(10, 1), 3);
    /// assert_eq!(plan.per_rank(10, 3), 10);
    /// ```
    pub fn per_rank(&self, bytes: u64, from_stage: u8) -> u64 {
        let n = self.shard.world_size.max(1) as u64;
        if n > 1 && self.shard.stage >= from_stage {
            bytes.div_ceil(n)
        } else {
            bytes
        }
    }

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
            extensions: Extensions::EMPTY,
            lora: None,
            chunked_loss: false,
            offload_activations: false,
            mlp_tile: None,
        }
    }

    /// The fields in which `self` differs from `other`, as `(field, self's
    /// value, other's value)` of their serde form, by field name: how a
    /// training state tells which part of a plan changed.
    ///
    /// ```
    /// use oomfix_strategies::Plan;
    /// let a = Plan::baseline(8, 1024);
    /// let b = Plan { micro_batch: 4, grad_accum: 2, ..a };
    /// let diff = a.differences(&b);
    /// assert_eq!(diff.len(), 2);
    /// assert!(diff.contains(&("micro_batch".to_string(), "8".to_string(), "4".to_string())));
    /// ```
    pub fn differences(&self, other: &Plan) -> Vec<(String, String, String)> {
        let fields = |p: &Plan| match serde_json::to_value(p) {
            Ok(serde_json::Value::Object(map)) => map,
            _ => serde_json::Map::new(),
        };
        let (a, b) = (fields(self), fields(other));
        let names: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
        names
            .into_iter()
            .filter(|n| a.get(*n) != b.get(*n))
            .map(|n| {
                let show =
                    |v: Option<&serde_json::Value>| v.map_or("-".to_string(), |v| v.to_string());
                (n.clone(), show(a.get(n)), show(b.get(n)))
            })
            .collect()
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
        if self.chunked_loss {
            f.write_str("chunked loss, ")?;
        }
        if self.offload_activations {
            f.write_str("activations on the host, ")?;
        }
        if let Some(tile) = self.mlp_tile {
            write!(f, "MLP in tiles of {tile}, ")?;
        }
        write!(f, "{}", self.optimizer)?;
        if self.shard.world_size > 1 {
            write!(
                f,
                ", ZeRO-{} over {}",
                self.shard.stage, self.shard.world_size
            )?;
            if self.shard.bucket_bytes != DEFAULT_BUCKET_BYTES {
                write!(f, " in buckets of {} bytes", self.shard.bucket_bytes)?;
            }
        }
        for (name, value) in self.extensions.iter() {
            write!(f, ", {name} {value}")?;
        }
        if let Some(lora) = &self.lora {
            write!(f, ", {lora}")?;
        }
        Ok(())
    }
}

/// How many settings of fixes outside the built-in ones a plan can hold.
pub const MAX_EXTENSIONS: usize = 4;

/// Settings of fixes that are not built in: up to [`MAX_EXTENSIONS`] pairs of
/// a fix's name and a number (a level, a size, a flag as 0/1), kept sorted by
/// name so that equal settings compare and hash equal.
///
/// A fix registered from outside this crate records what it changed here
/// (its planner half) and reads it back in its memory and execution hooks
/// ([`crate::Strategy`]). Serialized as a map from name to number.
///
/// ```
/// use oomfix_strategies::Plan;
/// let mut plan = Plan::baseline(8, 1024);
/// plan.extensions.set("paged-optimizer", Some(1)).unwrap();
/// assert_eq!(plan.extensions.get("paged-optimizer"), Some(1));
/// let json = serde_json::to_string(&plan).unwrap();
/// assert!(json.ends_with(r#""extensions":{"paged-optimizer":1}}"#));
/// assert_eq!(serde_json::from_str::<Plan>(&json).unwrap(), plan);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Extensions {
    slots: [Option<(&'static str, u32)>; MAX_EXTENSIONS],
}

impl Extensions {
    /// No settings.
    pub const EMPTY: Extensions = Extensions {
        slots: [None; MAX_EXTENSIONS],
    };

    /// The value recorded for `name`.
    pub fn get(&self, name: &str) -> Option<u32> {
        self.iter().find(|(n, _)| *n == name).map(|(_, v)| v)
    }

    /// Records `value` for `name` (`None` removes it). Fails when
    /// [`MAX_EXTENSIONS`] other names are already recorded.
    pub fn set(&mut self, name: &'static str, value: Option<u32>) -> crate::Result<()> {
        let mut pairs: Vec<(&'static str, u32)> = self.iter().filter(|(n, _)| *n != name).collect();
        pairs.extend(value.map(|v| (name, v)));
        if pairs.len() > MAX_EXTENSIONS {
            return Err(crate::Error::Config(format!(
                "a plan holds at most {MAX_EXTENSIONS} settings of other fixes; `{name}` is one too many"
            )));
        }
        pairs.sort_unstable();
        *self = Extensions::EMPTY;
        for (slot, pair) in self.slots.iter_mut().zip(pairs) {
            *slot = Some(pair);
        }
        Ok(())
    }

    /// The recorded `(name, value)` pairs, sorted by name.
    pub fn iter(&self) -> impl Iterator<Item = (&'static str, u32)> + '_ {
        self.slots.iter().flatten().copied()
    }

    /// Whether nothing is recorded.
    pub fn is_empty(&self) -> bool {
        self.slots[0].is_none()
    }
}

impl Serialize for Extensions {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_map(self.iter())
    }
}

impl<'de> Deserialize<'de> for Extensions {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let map = std::collections::BTreeMap::<String, u32>::deserialize(d)?;
        let mut out = Extensions::EMPTY;
        for (name, value) in map {
            out.set(intern(name), Some(value))
                .map_err(serde::de::Error::custom)?;
        }
        Ok(out)
    }
}
