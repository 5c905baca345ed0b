//! What the trainer's CUDA kernels share: compilation with NVRTC after
//! [`oomfix_strategies::CUDA_HALF_PRELUDE`], once per process, and the launch
//! shape of a kernel that gives each row one thread block.

use std::sync::OnceLock;

use candle_core::cuda_backend::cudarc::driver::LaunchConfig;
use candle_core::cuda_backend::cudarc::nvrtc::{self, CompileError, CompileOptions};
use candle_core::cuda_backend::WrapErr;
use candle_core::Result;

/// A kernel source's PTX, compiled on first use and kept in `cell`.
pub(crate) type Ptx = OnceLock<std::result::Result<String, CompileError>>;

/// The PTX of `source` (named `name` in compiler messages), compiled after
/// the 16-bit prelude the first time `cell` is asked.
pub(crate) fn ptx(cell: &'static Ptx, source: &str, name: &str) -> Result<&'static str> {
    let compiled = cell.get_or_init(|| {
        let options = CompileOptions {
            name: Some(name.into()),
            ..Default::default()
        };
        nvrtc::compile_ptx_with_opts(
            format!("{}{source}", oomfix_strategies::CUDA_HALF_PRELUDE),
            options,
        )
        .map(|ptx| ptx.to_src())
    });
    compiled.as_deref().map_err(|e| e.clone()).w()
}

/// One block per row of `cols` elements, threads growing with the row (a
/// multiple of 32, at most 1024); `what` names the op in the error for more
/// rows than one launch takes.
pub(crate) fn row_blocks(rows: usize, cols: usize, what: &str) -> Result<LaunchConfig> {
    let rows = u32::try_from(rows)
        .map_err(|_| candle_core::Error::Msg(format!("{what}: too many rows for one launch")))?;
    Ok(LaunchConfig {
        grid_dim: (rows, 1, 1),
        block_dim: ((cols.div_ceil(32) * 32).clamp(32, 1024) as u32, 1, 1),
        shared_mem_bytes: 0,
    })
}
