//! The device a plan is for ([`Target`]): what it costs besides tensors,
//! how its allocator rounds, which kernels and precisions it has.

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
/// live allocations: blocks freed earlier in the step and not yet reused or
/// released (it trims only at synchronisations). A device that must hold the
/// plan needs this much above the live bytes. Measured on the H200 as the
/// pool's reserved minus used high-water marks: 0.43–0.46 GiB for GPT-2
/// medium under a hard 8 GiB limit (`--enforce-budget`), 0.17–1.05 GiB for
/// GPT-2 small and medium steps without one (docs/gpu-8gib.md).
pub(crate) const CUDA_POOL_SLACK: u64 = 512 << 20;

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

    /// Bytes the device's allocator holds beyond live tensors at the peak
    /// (`CUDA_POOL_SLACK`, 512 MiB, on CUDA; the CPU's heap is measured live).
    pub fn pool_slack_bytes(&self) -> u64 {
        match self {
            Target::Cpu => 0,
            Target::Cuda(_) => CUDA_POOL_SLACK,
        }
    }

    /// Bytes a rank's collective backend holds for one call on a bucket of
    /// `elements` in a dtype of `bytes` each, beside the bucket itself.
    /// The CPU's ranks run over MPI (`MpiComm`): a copy of the bucket in
    /// its f32 wire format and the f32 result (measured: 2 × the bucket in
    /// fp32, tests/train_ranks.rs), plus the result cast back to a 16-bit
    /// dtype. CUDA's over NCCL (`NcclComm`): the result only (by the code;
    /// not measured on a GPU; NCCL's own buffers are not counted).
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
