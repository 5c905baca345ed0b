//! The small CPU helpers the crate's in-place kernels share: 16-bit floats
//! read and written through f32, dtype and layout checks, and safe in-place
//! access to a tensor's CPU storage.

use std::cell::Cell;
use std::ops::Range;

use candle_core::{CpuStorage, DType, InplaceOp1, InplaceOp2, Layout, Tensor, Var};
use half::{bf16, f16};

use crate::{Error, Result};

/// Elements per work item when one tensor's update is split across threads.
pub(crate) const CHUNK: usize = 1 << 15;

/// A floating-point element that the CPU kernels read and write through f32.
pub(crate) trait Float: Copy + Send + Sync {
    fn to_f32(self) -> f32;
    fn from_f32(x: f32) -> Self;
}

impl Float for f32 {
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(x: f32) -> Self {
        x
    }
}

impl Float for bf16 {
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
}

impl Float for f16 {
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
}

/// An error unless there are as many gradients as parameters.
pub(crate) fn one_gradient_each(grads: usize, params: usize) -> Result<()> {
    if grads == params {
        Ok(())
    } else {
        Err(Error::Config(format!(
            "{grads} gradients for {params} parameters"
        )))
    }
}

/// An error unless parameter `name` can be updated in place by the kernels of
/// `optimizer`: f32, bf16 or f16, and contiguous.
pub(crate) fn check_param(name: &str, var: &Var, optimizer: &str) -> Result<()> {
    if !is_kernel_dtype(var.dtype()) {
        return Err(Error::Unsupported(format!(
            "parameter `{name}` has dtype {:?}; {optimizer} takes f32, bf16 or f16",
            var.dtype()
        )));
    }
    if !var.is_contiguous() {
        return Err(Error::Unsupported(format!(
            "parameter `{name}` is not contiguous"
        )));
    }
    Ok(())
}

/// Whether the CPU kernels handle `dtype` (f32, bf16, f16).
pub(crate) fn is_kernel_dtype(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::BF16 | DType::F16)
}

/// Evaluates `$body` with `$s` bound to the element vector of a CPU storage of
/// dtype f32, bf16 or f16 (`&Vec<T>` or `&mut Vec<T>`, as `$storage` is borrowed);
/// any other dtype is a candle error.
macro_rules! with_float_vec {
    ($storage:expr, $s:ident => $body:expr) => {
        match $storage {
            candle_core::CpuStorage::F32($s) => $body,
            candle_core::CpuStorage::BF16($s) => $body,
            candle_core::CpuStorage::F16($s) => $body,
            other => candle_core::bail!(
                "expected an f32, bf16 or f16 tensor, got {:?}",
                candle_core::backend::BackendStorage::dtype(other)
            ),
        }
    };
}
pub(crate) use with_float_vec;

/// The element range of a contiguous layout inside its storage.
pub(crate) fn contiguous_range(l: &Layout) -> candle_core::Result<Range<usize>> {
    l.contiguous_offsets()
        .map(|(start, end)| start..end)
        .ok_or_else(|| candle_core::Error::Msg("in-place kernel needs a contiguous tensor".into()))
}

/// Runs `f` on the CPU storage of `t` under the storage's write lock, through
/// `Tensor::inplace_op1`: the safe way to change a tensor's elements in place.
/// Every tensor sharing that storage sees the change.
pub(crate) fn with_cpu_mut<F>(t: &Tensor, f: F) -> candle_core::Result<()>
where
    F: FnOnce(&mut CpuStorage, &Layout) -> candle_core::Result<()>,
{
    t.inplace_op1(&CpuMut(Cell::new(Some(f))))
}

/// Like [`with_cpu_mut`], with read access to a second tensor `src` (which candle
/// rejects if it shares storage with `t`).
pub(crate) fn with_cpu_mut_src<F>(t: &Tensor, src: &Tensor, f: F) -> candle_core::Result<()>
where
    F: FnOnce(&mut CpuStorage, &Layout, &CpuStorage, &Layout) -> candle_core::Result<()>,
{
    t.inplace_op2(src, &CpuMut(Cell::new(Some(f))))
}

/// An in-place op that runs a closure once on the CPU storage.
struct CpuMut<F>(Cell<Option<F>>);

impl<F> CpuMut<F> {
    fn take(&self) -> candle_core::Result<F> {
        self.0
            .take()
            .ok_or_else(|| candle_core::Error::Msg("in-place closure ran twice".into()))
    }
}

impl<F> InplaceOp1 for CpuMut<F>
where
    F: FnOnce(&mut CpuStorage, &Layout) -> candle_core::Result<()>,
{
    fn name(&self) -> &'static str {
        "oomfix-cpu-mut"
    }
    fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> candle_core::Result<()> {
        self.take()?(s, l)
    }
}

impl<F> InplaceOp2 for CpuMut<F>
where
    F: FnOnce(&mut CpuStorage, &Layout, &CpuStorage, &Layout) -> candle_core::Result<()>,
{
    fn name(&self) -> &'static str {
        "oomfix-cpu-mut-src"
    }
    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<()> {
        self.take()?(s1, l1, s2, l2)
    }
}
