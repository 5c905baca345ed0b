//! The device a plan is for ([`Target`]): what it costs besides tensors,
//! how its allocator rounds, which kernels and precisions it has.

use oomfix_strategies::{Execution, Plan};
use serde::Serialize;

/// Device memory the CUDA context itself takes (module images, per-thread
/// stacks, the driver's own heap), measured as `cuMemGetInfo` before and after
/// context creation on Hopper with CUDA 12–13: 500–600 MiB.
pub(crate) const CUDA_CONTEXT_BYTES: u64 = 576 << 20;

/// cuBLAS workspace per handle on Hopper (documented default: 32 MiB).
pub(crate) const CUBLAS_WORKSPACE_BYTES: u64 = 32 << 20;

/// Granularity of CUDA's stream-ordered pool reservations (2 MiB pages).
pub(crate) const CUDA_POOL_GRANULARITY: u64 = 2 << 20;

/// What a CUDA device's stream-ordered pool holds at a step's peak beyond its
/// live allocations: blocks freed earlier in the step that later requests
/// of other sizes could not reuse. Fitted when the pool returned them at
/// each synchronisation (release threshold 0); the trainer now lets it keep
/// them (`track::cuda::keep_reserve`), which moved the reserved peaks of
/// the speed guard's four bf16 rows by at most 0.15 GiB (docs/speed.md). A
/// device that must hold the plan needs this much above the live bytes
/// ([`Target::pool_slack_bytes`]): per block of the model, its backward's
/// gradients and activation gradients freed among requests of other sizes ...
pub(crate) const CUDA_POOL_SLACK_PER_BLOCK: u64 = 12 << 20;

/// ... with checkpointing, every segment's recomputed internals freed before
/// the head's and the loss's large tensors are asked for ...
pub(crate) const CUDA_POOL_SLACK_RECOMPUTED: u64 = 176 << 20;

/// ... and with checkpointing or accumulation, a pass's buffers freed before
/// the next pass (a recomputation, or the next micro-batch) asks again.
///
/// The three are fitted to the reserved and used high-water marks of 62
/// steps of the H200 accuracy matrix (GPT-2 6-layer/small/medium, Llama
/// 160M/400M, TinyLlama; docs/pool-reserve-gpu.md, `scripts/fit-pool-slack.py`):
/// the estimate with them is a median 1.1%, at most 5.1%, from the
/// reserved peak (61 of 62 within 3%; the former constant 512 MiB: 3.1%,
/// 9.7%, 31 of 62); on steps it was not fitted to, the matrix measured
/// again 1.0% / 5.4%, the GPT-2 small sweep 1.3% / 11.0% and the
/// Llama-160M sweep 2.0% / 8.1%.
pub(crate) const CUDA_POOL_SLACK_REPEATED: u64 = 120 << 20;

/// At long sequences the pool's slack follows the size of the largest
/// tensors freed and asked for again: the MLP's backward frees and requests
/// `[n, I]` blocks in the compute dtype and in f32, which other sizes cannot
/// reuse. With checkpointing, the slack is at least this many `[n, I]`
/// tensors of the compute dtype (the larger of this and the three terms
/// above; without it, none of the steps the terms above were fitted on
/// held this much). Fitted: Llama-3.1-8B's shape under QLoRA
/// r 32 at 28,769 tokens, every block checkpointed, on an H100: the
/// reserved mark was 2.82 GiB above the used one (20.87 GiB) in the second
/// and third steps (1.69 GiB in the first), 3.7 `[n, I]` bf16 tensors;
/// at 49,640 tokens 1.90 GiB in the first step (docs/long-context.md). At
/// the short sequences the terms above were fitted on, the constant terms
/// are the larger.
pub(crate) const CUDA_POOL_SLACK_MLP_WIDTHS: u64 = 4;

/// What NCCL's communicator keeps on each rank's device for the whole job
/// beside the tensors: work queues, proxy state and its kernels' module (a
/// fixed part) ...
pub(crate) const NCCL_COMMUNICATOR_BYTES: u64 = 316 << 20;

/// ... and its buffers, per channel (send and receive, for its protocols).
/// Both measured with NCCL 2.32.6 on an H100 with 2 ranks on the one GPU
/// (`scripts/comm-memory.sh`: device memory outside the pool of a rank
/// against one process's, with `NCCL_MIN_CTAS = NCCL_MAX_CTAS` = 2, 4, 8,
/// 16 channels: 352, 388, 460 and 604 MiB, docs/zero-stages-gpu.md).
pub(crate) const NCCL_CHANNEL_BYTES: u64 = 18 << 20;

/// The channels assumed when `NCCL_MAX_CTAS` does not set them: NCCL's
/// default ceiling on NVLink machines (it chose 64 for 2 ranks sharing one
/// H100, where `NCCL_MAX_CTAS` is advised anyway).
pub(crate) const NCCL_DEFAULT_CHANNELS: u64 = 32;

/// The channels NCCL's communicators get: `NCCL_MAX_CTAS`, when set, else
/// [`NCCL_DEFAULT_CHANNELS`].
pub(crate) fn nccl_channels() -> u64 {
    std::env::var("NCCL_MAX_CTAS")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(NCCL_DEFAULT_CHANNELS)
}

/// Where the plan runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", content = "ordinal", rename_all = "lowercase")]
pub enum Target {
    /// Host memory (peak = heap high-water mark).
    Cpu,
    /// A CUDA device (`cuda:N`).
    Cuda(usize),
}

impl Target {
    /// Bytes the runtime needs outside of tensors.
    pub fn runtime_bytes(&self) -> u64 {
        match self {
            Target::Cpu => 0,
            Target::Cuda(_) => CUDA_CONTEXT_BYTES + CUBLAS_WORKSPACE_BYTES,
        }
    }

    /// Bytes the device's allocator holds beyond live tensors at the peak of
    /// `plan` (run as `exec` says) on a model of `blocks` blocks whose MLP is
    /// `mlp_width` wide (0 where unknown): on CUDA what the stream-ordered
    /// pool keeps of the blocks freed in the step (`CUDA_POOL_SLACK_*`), in
    /// whole 2 MiB pages; 0 on the CPU, whose heap is measured live.
    pub fn pool_slack_bytes(
        &self,
        blocks: usize,
        mlp_width: usize,
        plan: &Plan,
        exec: &Execution,
    ) -> u64 {
        match self {
            Target::Cpu => 0,
            Target::Cuda(_) => {
                let recomputed = !exec.checkpoint.segments(blocks).is_empty();
                let repeated = recomputed || plan.grad_accum > 1;
                let constant = blocks as u64 * CUDA_POOL_SLACK_PER_BLOCK
                    + u64::from(recomputed) * CUDA_POOL_SLACK_RECOMPUTED
                    + u64::from(repeated) * CUDA_POOL_SLACK_REPEATED;
                // A tiled MLP makes `[tile, I]` blocks instead (assumed,
                // not yet measured on a GPU).
                let tokens = (plan.micro_batch * plan.seq_len) as u64;
                let tokens = exec.mlp_tile().map_or(tokens, |t| tokens.min(t as u64));
                let widths = u64::from(recomputed)
                    * CUDA_POOL_SLACK_MLP_WIDTHS
                    * tokens
                    * mlp_width as u64
                    * plan.precision.compute_bytes();
                self.round_up(constant.max(widths))
            }
        }
    }

    /// Bytes a rank's collective backend keeps for the whole job, beside the
    /// tensors, when the plan runs on `world_size` ranks: on CUDA NCCL's
    /// communicator (`NCCL_COMMUNICATOR_BYTES` and `NCCL_CHANNEL_BYTES` per
    /// channel: `NCCL_MAX_CTAS`'s, else 32, `NCCL_DEFAULT_CHANNELS`); 0 for
    /// one process, and on the CPU, whose MPI buffers are measured per call
    /// ([`collective_buffer_bytes`](Self::collective_buffer_bytes)).
    pub fn communicator_bytes(&self, world_size: usize) -> u64 {
        match self {
            Target::Cuda(_) if world_size > 1 => {
                NCCL_COMMUNICATOR_BYTES + nccl_channels() * NCCL_CHANNEL_BYTES
            }
            _ => 0,
        }
    }

    /// Bytes a rank's collective backend holds for one call on a bucket of
    /// `elements` in a dtype of `bytes` each, beside the bucket itself.
    /// The CPU's ranks run over MPI (`MpiComm`): a copy of the bucket in
    /// its f32 wire format and the f32 result (measured: 2 × the bucket in
    /// fp32, tests/train_ranks.rs), plus the result cast back to a 16-bit
    /// dtype. CUDA's over NCCL (`NcclComm`): the result only (by the code;
    /// NCCL's own buffers are [`communicator_bytes`](Self::communicator_bytes)).
    pub fn collective_buffer_bytes(&self, elements: u64, bytes: u64) -> u64 {
        match self {
            Target::Cpu => elements * (8 + if bytes < 4 { bytes } else { 0 }),
            Target::Cuda(_) => elements * bytes,
        }
    }

    /// Rounds a peak up to what the allocator reserves for it.
    pub fn round_up(&self, bytes: u64) -> u64 {
        match self {
            Target::Cpu => bytes,
            Target::Cuda(_) => bytes.div_ceil(CUDA_POOL_GRANULARITY) * CUDA_POOL_GRANULARITY,
        }
    }

    /// Whether the memory-efficient attention op runs on this device for heads of
    /// `head_dim`: on the CPU always, on CUDA devices up to
    /// [`CUDA_MAX_HEAD_DIM`](oomfix_strategies::attention::CUDA_MAX_HEAD_DIM).
    pub fn has_flash_attention(&self, head_dim: usize) -> bool {
        match self {
            Target::Cpu => true,
            Target::Cuda(_) => head_dim <= oomfix_strategies::attention::CUDA_MAX_HEAD_DIM,
        }
    }

    /// Whether the device computes in bf16 (CPU via f32 widening; CUDA on sm_80+).
    pub fn supports_bf16(&self) -> bool {
        true
    }

    /// Whether the device's memory is apart from the host's, so that the
    /// optimizer can be offloaded to the host (CUDA devices; not the CPU).
    pub fn has_host_memory(&self) -> bool {
        matches!(self, Target::Cuda(_))
    }
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Cpu => f.write_str("cpu"),
            Target::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

impl std::str::FromStr for Target {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cpu" => Ok(Target::Cpu),
            "cuda" => Ok(Target::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Target::Cuda)
                .ok_or_else(|| format!("unknown device `{s}` (expected cpu, cuda or cuda:N)")),
        }
    }
}
