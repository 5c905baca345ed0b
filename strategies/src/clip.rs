//! Gradient clipping by global norm, as `torch.nn.utils.clip_grad_norm_`.
//!
//! The norm of a step's gradients is the square root of the sum of the
//! squares of all their elements ([`global_norm`]; on several ranks, each
//! rank's [`squared_norm`] of the gradients it owns, summed with a
//! [`Comm`](crate::shard::Comm)). On CUDA it is one pass over the gradients
//! with one device synchronisation. The gradients are then multiplied by
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

use std::ops::Range;

use candle_core::{CpuStorage, DType, Layout, Storage, Tensor};
use rayon::prelude::*;

use crate::float::{is_kernel_dtype, with_float_vec, Float, CHUNK};
use crate::Result;

#[cfg(feature = "cuda")]
mod cuda;

/// Elements per partial sum of the sliced path (bounds the f32 temporaries).
const DEVICE_CHUNK: usize = 1 << 22;

/// The sum of the squares of `t`'s elements, accumulated in f64 (each element
/// widened to f64 before it is squared). [`squared_norm`] of `t` alone.
pub fn sum_of_squares(t: &Tensor) -> Result<f64> {
    squared_norm(std::slice::from_ref(t))
}

/// The squared L2 norm of all of `grads` together: the sum of the squares of
/// all their elements, accumulated in f64. Non-finite when any element is.
///
/// f32, bf16 and f16 tensors are read in place when their layout covers a
/// dense range of their storage (contiguous, or with permuted dimensions such
/// as candle's transposed weight gradients), allocating nothing on the CPU
/// (other strided views are copied to a contiguous tensor first).
/// With the `cuda` feature, those on one CUDA device are read by one kernel
/// launch each, the partial sums added on the device, and the total copied
/// to the host once: one synchronisation for all of them. Tensors of other
/// dtypes are summed one at a time through candle's ops, in slices of at
/// most 4 Mi elements converted to f32 (f64 stays f64).
pub fn squared_norm(grads: &[Tensor]) -> Result<f64> {
    let mut total = 0.0;
    #[cfg(feature = "cuda")]
    let mut on_gpu: Vec<&Tensor> = Vec::new();
    for t in grads {
        #[cfg(feature = "cuda")]
        if cuda::takes(t)
            && on_gpu
                .first()
                .is_none_or(|first| first.device().same_device(t.device()))
        {
            on_gpu.push(t);
            continue;
        }
        total += one_sum_of_squares(t)?;
    }
    #[cfg(feature = "cuda")]
    if let Some(first) = on_gpu.first() {
        total += cuda::sum_of_squares(first.device().as_cuda_device()?, &on_gpu)?;
    }
    Ok(total)
}

/// The sum of squares of one tensor that the batched CUDA path does not take.
fn one_sum_of_squares(t: &Tensor) -> Result<f64> {
    if t.device().is_cpu() && is_kernel_dtype(t.dtype()) {
        // A strided view is copied first, to be read as the others are.
        let dense = match dense_range(t.layout()) {
            Some(_) => t.clone(),
            None => t.contiguous()?,
        };
        let (storage, layout) = dense.storage_and_layout();
        if let (Storage::Cpu(s), Some(range)) = (&*storage, dense_range(layout)) {
            return Ok(cpu_sum_of_squares(s, range)?);
        }
    }
    #[cfg(feature = "cuda")]
    if t.device().is_cuda() && is_kernel_dtype(t.dtype()) {
        let copy = t.contiguous()?;
        return Ok(cuda::sum_of_squares(
            t.device().as_cuda_device()?,
            &[&copy],
        )?);
    }
    sliced_sum_of_squares(t)
}

/// The sum of squares through candle's ops: in slices of at most 4 Mi
/// elements, each converted to f32 (f64 stays f64), squared, summed and read
/// back (one device synchronisation per slice off the CPU).
fn sliced_sum_of_squares(t: &Tensor) -> Result<f64> {
    let flat = t.flatten_all()?;
    let n = flat.elem_count();
    let mut total = 0f64;
    let mut start = 0;
    while start < n {
        let len = DEVICE_CHUNK.min(n - start);
        let part = flat.narrow(0, start, len)?;
        total += if part.dtype() == DType::F64 {
            part.sqr()?.sum_all()?.to_scalar::<f64>()?
        } else {
            let part = part.to_dtype(DType::F32)?;
            f64::from(part.sqr()?.sum_all()?.to_scalar::<f32>()?)
        };
        start += len;
    }
    Ok(total)
}

/// The storage range that layout `l` reads when it visits each element of
/// that range exactly once, in any order: a contiguous layout, or one whose
/// dimensions are a permutation of a contiguous one's (a transposed matrix).
/// `None` for other strided views (a slice of columns, a broadcast).
pub(crate) fn dense_range(l: &Layout) -> Option<Range<usize>> {
    let start = l.start_offset();
    let n = l.shape().elem_count();
    if n == 0 {
        return Some(start..start);
    }
    let mut dims: Vec<(usize, usize)> = (l.dims().iter().copied())
        .zip(l.stride().iter().copied())
        .filter(|&(d, _)| d != 1)
        .map(|(d, s)| (s, d))
        .collect();
    dims.sort_unstable();
    let mut expected = 1;
    for (stride, dim) in dims {
        if stride != expected {
            return None;
        }
        expected *= dim;
    }
    Some(start..start + n)
}

fn cpu_sum_of_squares(s: &CpuStorage, r: Range<usize>) -> candle_core::Result<f64> {
    Ok(with_float_vec!(s, v => v[r]
        .par_chunks(CHUNK)
        .map(|c| c.iter().map(|x| f64::from(x.to_f32()).powi(2)).sum::<f64>())
        .sum::<f64>()))
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
        let expected = plain(&t)?;
        let ours = sum_of_squares(&t)?;
        assert!(
            (ours - expected).abs() <= 1e-9 * expected,
            "{ours} vs {expected}"
        );
        for dtype in [DType::BF16, DType::F16] {
            let h = t.to_dtype(dtype)?;
            let exact = plain(&h)?;
            let ours = sum_of_squares(&h)?;
            assert!(
                (ours - exact).abs() <= 1e-9 * exact,
                "{dtype:?}: {ours} vs {exact}"
            );
        }
        // A transposed view is read in place.
        let m = Tensor::randn(0f32, 1.0, (40, 30), &dev)?.t()?;
        assert!(!m.is_contiguous());
        assert!(dense_range(m.layout()).is_some());
        let looped = plain(&m)?;
        let ours = sum_of_squares(&m)?;
        assert!((ours - looped).abs() <= 1e-5 * looped, "{ours} vs {looped}");
        Ok(())
    }

    /// A plain f64 loop over a tensor's elements.
    fn plain(t: &Tensor) -> Result<f64> {
        Ok(t.flatten_all()?
            .to_dtype(DType::F64)?
            .to_vec1::<f64>()?
            .iter()
            .map(|&x| x * x)
            .sum())
    }

    #[test]
    fn dense_ranges_are_contiguous_layouts_and_their_permutations() -> Result<()> {
        let dev = Device::Cpu;
        let t = Tensor::zeros((4, 6, 5), DType::F32, &dev)?;
        assert_eq!(dense_range(t.layout()), Some(0..120));
        assert_eq!(dense_range(t.t()?.layout()), Some(0..120));
        assert_eq!(dense_range(t.permute((2, 0, 1))?.layout()), Some(0..120));
        // Whole rows of a contiguous tensor: dense, at an offset.
        assert_eq!(dense_range(t.narrow(0, 1, 2)?.layout()), Some(30..90));
        // Some of each row's columns, or a broadcast: strided.
        assert_eq!(dense_range(t.narrow(2, 1, 3)?.layout()), None);
        let row = Tensor::zeros((1, 5), DType::F32, &dev)?;
        assert_eq!(dense_range(row.broadcast_as((3, 5))?.layout()), None);
        // Dimensions of size one carry any stride.
        assert_eq!(dense_range(row.t()?.layout()), Some(0..5));
        let empty = Tensor::zeros((0, 3), DType::F32, &dev)?;
        assert_eq!(dense_range(empty.layout()), Some(0..0));
        Ok(())
    }

    /// The one-pass norm of a step's gradients (contiguous, transposed,
    /// strided, empty; f32, bf16, f16, f64) agrees with the per-tensor
    /// composition through candle's ops that it replaces, and with a plain
    /// loop.
    #[test]
    fn the_one_pass_norm_agrees_with_the_sliced_composition() -> Result<()> {
        let dev = Device::Cpu;
        let big = Tensor::randn(0f32, 1.0, (DEVICE_CHUNK + 1000,), &dev)?;
        let w = Tensor::randn(0f32, 2.0, (64, 48), &dev)?;
        let grads = vec![
            big.clone(),
            big.to_dtype(DType::BF16)?,
            w.t()?.to_dtype(DType::F16)?,
            w.t()?,
            w.narrow(1, 3, 20)?,
            w.to_dtype(DType::F64)?,
            Tensor::zeros((0, 7), DType::BF16, &dev)?,
            Tensor::new(&[3f32], &dev)?,
        ];
        assert!(!grads[3].is_contiguous() && dense_range(grads[3].layout()).is_some());
        assert!(dense_range(grads[4].layout()).is_none());
        let ours = squared_norm(&grads)?;
        let mut composed = 0.0;
        let mut looped = 0.0;
        for g in &grads {
            let sliced = sliced_sum_of_squares(g)?;
            let one = sum_of_squares(g)?;
            let exact = plain(g)?;
            assert!(
                (one - exact).abs() <= 1e-9 * exact.max(1e-300),
                "{:?} {:?}: {one} vs {exact}",
                g.dtype(),
                g.dims()
            );
            // The composition sums each 4 Mi-element slice in f32.
            assert!(
                (sliced - exact).abs() <= 1e-4 * exact.max(1e-300),
                "{:?} {:?}: sliced {sliced} vs {exact}",
                g.dtype(),
                g.dims()
            );
            composed += sliced;
            looped += exact;
        }
        assert!((ours - looped).abs() <= 1e-9 * looped, "{ours} vs {looped}");
        assert!(
            (ours - composed).abs() <= 1e-4 * composed,
            "{ours} vs {composed}"
        );
        // A non-finite element makes the norm non-finite.
        let nan = Tensor::new(&[[1f32, f32::NAN]], &dev)?;
        assert!(squared_norm(&[w.clone(), nan.t()?])?.is_nan());
        let inf = Tensor::new(&[f32::INFINITY], &dev)?.to_dtype(DType::BF16)?;
        assert_eq!(squared_norm(&[w, inf])?, f64::INFINITY);
        Ok(())
    }

    #[test]
    fn the_coefficient_is_torchs() {
        assert_eq!(clip_coefficient(0.5, 1.0), 1.0);
        assert_eq!(clip_coefficient(4.0, 1.0), 1.0 / (4.0 + 1e-6));
        assert_eq!(clip_coefficient(f64::INFINITY, 1.0), 0.0);
    }
}
