//! How far apart two tensors are, in f64 whatever their dtype: what the
//! crate's tests hold each fused op, layer and fix to against the
//! computation it replaces, and what a model switched to them can be
//! checked with.
//!
//! ```
//! use candle_core::{Device, Tensor};
//! use oomfix_strategies::compare::{max_abs, max_diff, rel_diff};
//!
//! let a = Tensor::new(&[1f32, -4.0, 2.0], &Device::Cpu)?;
//! let b = Tensor::new(&[1f32, -3.0, 2.5], &Device::Cpu)?;
//! assert_eq!(max_abs(&a)?, 4.0);
//! assert_eq!(max_diff(&a, &b)?, 1.0);
//! assert_eq!(rel_diff(&a, &b)?, 1.0 / 3.0);
//! # Ok::<(), candle_core::Error>(())
//! ```

use candle_core::{DType, Result, Tensor};

/// The largest absolute value of the elements of `t`.
pub fn max_abs(t: &Tensor) -> Result<f64> {
    t.to_dtype(DType::F64)?.abs()?.max_all()?.to_scalar::<f64>()
}

/// The largest `|a − b|` over the elements of `a` and `b` (of one shape).
pub fn max_diff(a: &Tensor, b: &Tensor) -> Result<f64> {
    max_abs(&(a.to_dtype(DType::F64)? - b.to_dtype(DType::F64)?)?)
}

/// [`max_diff`] relative to the largest `|b|`: 0 when `a` and `b` are both
/// zero.
pub fn rel_diff(a: &Tensor, b: &Tensor) -> Result<f64> {
    Ok(max_diff(a, b)? / max_abs(b)?.max(f64::MIN_POSITIVE))
}
