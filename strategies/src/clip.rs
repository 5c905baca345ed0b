//! Gradient clipping by global norm, as `torch.nn.utils.clip_grad_norm_`.
//!
//! The norm of a step's gradients is the square root of the sum of the
//! squares of all their elements ([`global_norm`]; on several ranks, each
//! rank's [`sum_of_squares`] of the gradients it owns, summed with a
//! [`Comm`](crate::shard::Comm)). The gradients are then multiplied by
//! [`clip_coefficient`]; the optimizers here take that factor in their update
//! ([`FusedAdamW::step_scaled`](crate::adamw::FusedAdamW::step_scaled)), so no
//! scaled copy of the gradients is made.
//!
//! ```
//! use candle_core::{Device, Tensor};
//! use oomfix_strategies::clip::{clip_coefficient, global_norm};
//!
//! let grads = [Tensor::new(&[3f32], &Device::Cpu)?, Tensor::new(&[[4f32]], &Device::Cpu)?];
//! let norm = global_norm(&grads)?;
//! assert_eq!(norm, 5.0);
//! assert!((clip_coefficient(norm, 1.0) - 0.2).abs() < 1e-6);
//! assert_eq!(clip_coefficient(norm, 10.0), 1.0);
//! # Ok::<(), oomfix_strategies::Error>(())
//! ```

use candle_core::{CpuStorage, DType, Layout, Storage, Tensor};
use rayon::prelude::*;

use crate::float::{contiguous_range, is_kernel_dtype, with_float_vec, Float, CHUNK};
use crate::Result;

/// Elements per partial sum off the CPU (bounds the f32 temporaries).
const DEVICE_CHUNK: usize = 1 << 22;

/// The sum of the squares of `t`'s elements, accumulated in f64 (the squares
/// of 16-bit values are taken in f32). Contiguous f32/bf16/f16 CPU tensors are
/// read in place, allocating nothing; elsewhere the sum is taken in slices of
/// at most 4 Mi elements, converted to f32 one slice at a time.
pub fn sum_of_squares(t: &Tensor) -> Result<f64> {
    if t.device().is_cpu() && t.is_contiguous() && is_kernel_dtype(t.dtype()) {
        let (storage, layout) = t.storage_and_layout();
        if let Storage::Cpu(s) = &*storage {
            return Ok(cpu_sum_of_squares(s, layout)?);
        }
    }
    let flat = t.flatten_all()?;
    let n = flat.elem_count();
    let mut total = Tensor::zeros((), DType::F32, t.device())?;
    let mut start = 0;
    while start < n {
        let len = DEVICE_CHUNK.min(n - start);
        let part = flat.narrow(0, start, len)?.to_dtype(DType::F32)?;
        total = (total + part.sqr()?.sum_all()?)?;
        start += len;
    }
    Ok(f64::from(total.to_scalar::<f32>()?))
}

fn cpu_sum_of_squares(s: &CpuStorage, l: &Layout) -> candle_core::Result<f64> {
    let r = contiguous_range(l)?;
    Ok(with_float_vec!(s, v => v[r]
        .par_chunks(CHUNK)
        .map(|c| c.iter().map(|x| f64::from(x.to_f32()).powi(2)).sum::<f64>())
        .sum::<f64>()))
}

/// The squared L2 norm of all of `grads` together: the sum of their
/// [`sum_of_squares`]. Non-finite when any element is.
pub fn squared_norm(grads: &[Tensor]) -> Result<f64> {
    grads.iter().map(sum_of_squares).sum()
}

/// The L2 norm of all of `grads` together: the square root of
/// [`squared_norm`].
pub fn global_norm(grads: &[Tensor]) -> Result<f64> {
    Ok(squared_norm(grads)?.sqrt())
}

/// The factor that clips gradients of norm `norm` to at most `max_norm`:
/// `min(1, max_norm / (norm + 1e-6))`, as `torch.nn.utils.clip_grad_norm_`
/// computes it. 0 for an infinite norm; 1 for a NaN norm (check the norm
/// before stepping).
pub fn clip_coefficient(norm: f64, max_norm: f64) -> f64 {
    (max_norm / (norm + 1e-6)).min(1.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// The sum of squares read in place, through the sliced path and by a
    /// plain loop agree, in every kernel dtype and for a non-contiguous view.
    #[test]
    fn sum_of_squares_agrees_with_a_plain_loop() -> Result<()> {
        let dev = Device::Cpu;
        let t = Tensor::randn(0f32, 1.0, (3 * CHUNK + 17,), &dev)?;
        let expected: f64 = t
            .to_vec1::<f32>()?
            .iter()
            .map(|&x| f64::from(x) * f64::from(x))
            .sum();
        let ours = sum_of_squares(&t)?;
        assert!(
            (ours - expected).abs() <= 1e-9 * expected,
            "{ours} vs {expected}"
        );
        for dtype in [DType::BF16, DType::F16] {
            let h = t.to_dtype(dtype)?;
            let exact: f64 = h
                .to_dtype(DType::F32)?
                .to_vec1::<f32>()?
                .iter()
                .map(|&x| f64::from(x) * f64::from(x))
                .sum();
            let ours = sum_of_squares(&h)?;
            assert!(
                (ours - exact).abs() <= 1e-9 * exact,
                "{dtype:?}: {ours} vs {exact}"
            );
        }
        // A transposed view takes the sliced path.
        let m = Tensor::randn(0f32, 1.0, (40, 30), &dev)?.t()?;
        assert!(!m.is_contiguous());
        let plain: f64 = m
            .flatten_all()?
            .to_vec1::<f32>()?
            .iter()
            .map(|&x| f64::from(x) * f64::from(x))
            .sum();
        let ours = sum_of_squares(&m)?;
        assert!((ours - plain).abs() <= 1e-5 * plain, "{ours} vs {plain}");
        Ok(())
    }

    #[test]
    fn the_coefficient_is_torchs() {
        assert_eq!(clip_coefficient(0.5, 1.0), 1.0);
        assert_eq!(clip_coefficient(4.0, 1.0), 1.0 / (4.0 + 1e-6));
        assert_eq!(clip_coefficient(f64::INFINITY, 1.0), 0.0);
    }
}
