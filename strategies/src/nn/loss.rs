//! Cross-entropy as one op with its own backward.
//!
//! Composed from candle ops, the loss of `[n, V]` logits keeps an f32 copy of
//! the logits (16-bit logits), the shifted logits and their exponentials alive
//! for backward, and the backward through them allocates several more
//! logits-sized f32 tensors: at GPT-2's vocabulary that is the largest memory of
//! the whole step. [`cross_entropy`] instead computes each row's negative
//! log-likelihood `logsumexp(x) − x[target]` in one pass and keeps nothing but
//! its inputs. Its backward recomputes the row's log-sum-exp and writes the
//! gradient `g · (softmax(x) − onehot(target))` straight into one tensor of the
//! logits' dtype, so the loss adds one logits-sized tensor (the gradient) to
//! what the model already holds.
//!
//! Arithmetic is in f32 whatever the logits' dtype (f32, bf16 or f16). On the
//! CPU rows run in parallel; on CUDA (feature `cuda`) one thread block reduces
//! one row (`loss.cu`, compiled at run time with NVRTC).
//!
//! ```
//! use candle_core::{Device, Tensor, Var};
//! use oomfix_strategies::nn::loss::cross_entropy;
//!
//! let logits = Var::randn(0f32, 1.0, (4, 10), &Device::Cpu)?;
//! let targets = Tensor::new(&[1u32, 0, 9, 3], &Device::Cpu)?;
//! let loss = cross_entropy(logits.as_tensor(), &targets, None)?;
//! let reference = candle_nn::loss::cross_entropy(logits.as_tensor(), &targets)?;
//! let diff = (loss.to_scalar::<f32>()? - reference.to_scalar::<f32>()?).abs();
//! assert!(diff < 1e-5);
//! let grads = loss.backward()?;
//! assert_eq!(grads.get(&logits).unwrap().dims(), &[4, 10]);
//! # Ok::<(), candle_core::Error>(())
//! ```

use candle_core::backend::BackendStorage;
#[cfg(feature = "cuda")]
use candle_core::CudaStorage;
use candle_core::{CpuStorage, DType, Layout, Result, Shape, Tensor, WithDType};
use rayon::prelude::*;

use crate::custom_op::{CustomOp, Input, Kernel};

#[cfg(feature = "cuda")]
mod cuda;

/// Mean cross-entropy of `logits` (`[n, V]`, f32, bf16 or f16) against
/// `targets` (`[n]`, u32 class indices), over the rows where `mask` (`[n]`, f32
/// 0/1) is 1, or over all rows without a mask. Differentiable in `logits`.
///
/// Allocates the per-row losses (`[n]` f32) in forward and the logits' gradient
/// (`[n, V]` in the logits' dtype) in backward; nothing logits-sized is kept.
/// A target outside `0..V` is an error on the CPU and gives a NaN loss on CUDA.
pub fn cross_entropy(logits: &Tensor, targets: &Tensor, mask: Option<&Tensor>) -> Result<Tensor> {
    cross_entropy_padded(logits, logits.dim(1)?, targets, mask)
}

/// [`cross_entropy`] over the first `classes` columns of `logits` (`[n, P]`,
/// `P ≥ classes`); the other columns are padding (a vocabulary rounded up so
/// that the matrix products around the logits are aligned) and get a zero
/// gradient.
pub fn cross_entropy_padded(
    logits: &Tensor,
    classes: usize,
    targets: &Tensor,
    mask: Option<&Tensor>,
) -> Result<Tensor> {
    mean_over_rows(&row_nll(logits, classes, targets)?, mask)
}

/// The mean of per-row losses `nll` (`[n]`, f32) over the rows where `mask`
/// (`[n]`, f32 0/1) is 1, or over all rows without a mask: the reduction
/// [`cross_entropy_padded`] applies to [`row_nll`]. An error when the mask
/// selects no row.
pub fn mean_over_rows(nll: &Tensor, mask: Option<&Tensor>) -> Result<Tensor> {
    match mask {
        None => nll.mean_all(),
        Some(mask) => {
            let count = mask.sum_all()?.to_scalar::<f32>()?;
            if count <= 0.0 {
                candle_core::bail!("the loss mask selects no position");
            }
            nll.mul(mask)?.sum_all()?.affine(1.0 / count as f64, 0.0)
        }
    }
}

/// The gradient of the first `classes` columns of `logits` `[n, P]` when each
/// row's loss [`row_nll`] at `targets` has the gradient `grad` (`[n]`, f32):
/// `grad · (softmax(x) − onehot(target))` per row, in the logits' dtype, zero
/// in the padding columns. No graph is built.
pub(crate) fn row_nll_grad(
    logits: &Tensor,
    classes: usize,
    targets: &Tensor,
    grad: &Tensor,
) -> Result<Tensor> {
    logits.contiguous()?.apply_op3_no_bwd(
        &targets.contiguous()?,
        &grad.to_dtype(DType::F32)?.contiguous()?,
        &CustomOp(RowNllGrad { classes }),
    )
}

/// Per-row negative log-likelihood `[n]` (f32) of the first `classes` columns
/// of `logits` `[n, P]` at `targets` `[n]`.
pub fn row_nll(logits: &Tensor, classes: usize, targets: &Tensor) -> Result<Tensor> {
    let (n, p) = logits.dims2()?;
    if classes == 0 || classes > p {
        candle_core::bail!("cross_entropy: {classes} classes in logits of {p} columns");
    }
    if targets.dims() != [n] || targets.dtype() != DType::U32 {
        candle_core::bail!(
            "cross_entropy: targets must be [{n}] u32, got {:?} {:?}",
            targets.dims(),
            targets.dtype()
        );
    }
    logits
        .contiguous()?
        .apply_op2(&targets.contiguous()?, CustomOp(RowNll { classes }))
}

/// Evaluates `$body` with `$x` bound to the contiguous slice of f32, bf16 or
/// f16 logits; any other dtype or a strided layout is an error.
macro_rules! with_cpu_logits {
    ($s:expr, $l:expr, $x:ident => $body:expr) => {{
        let (a, b) = $l.contiguous_offsets().ok_or_else(|| {
            candle_core::Error::Msg("cross_entropy: logits must be contiguous".into())
        })?;
        match $s {
            CpuStorage::F32(x) => {
                let $x = &x[a..b];
                $body
            }
            CpuStorage::BF16(x) => {
                let $x = &x[a..b];
                $body
            }
            CpuStorage::F16(x) => {
                let $x = &x[a..b];
                $body
            }
            other => candle_core::bail!(
                "cross_entropy: logits must be f32, bf16 or f16, got {:?}",
                other.dtype()
            ),
        }
    }};
}

/// Forward: `[n, P]` logits and `[n]` targets → `[n]` f32 losses over the
/// first `classes` columns.
struct RowNll {
    classes: usize,
}

/// Backward: logits, targets and the losses' gradient `[n]` (f32) → the
/// logits' gradient `[n, P]` in the logits' dtype (zero in the padding).
struct RowNllGrad {
    classes: usize,
}

impl Kernel<2> for RowNll {
    fn name(&self) -> &'static str {
        "oomfix-cross-entropy"
    }

    fn cpu_fwd(
        &self,
        [(s1, l1), (s2, l2)]: [Input<'_, CpuStorage>; 2],
    ) -> Result<(CpuStorage, Shape)> {
        let (n, p) = l1.shape().dims2()?;
        let targets = checked_targets(s2, l2, self.classes)?;
        let nll = with_cpu_logits!(s1, l1, x => nll_rows(x, p, self.classes, targets));
        Ok((CpuStorage::F32(nll), Shape::from(n)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        [(s1, l1), (s2, l2)]: [Input<'_, CudaStorage>; 2],
    ) -> Result<(CudaStorage, Shape)> {
        cuda::nll(s1, l1, s2, l2, self.classes)
    }

    /// The gradient of a mean arrives broadcast (stride 0): [`row_nll_grad`]
    /// makes it a real `[n]` vector.
    fn bwd(
        &self,
        [logits, targets]: [&Tensor; 2],
        _: &Tensor,
        grad: &Tensor,
    ) -> Result<[Option<Tensor>; 2]> {
        Ok([
            Some(row_nll_grad(logits, self.classes, targets, grad)?),
            None,
        ])
    }
}

impl Kernel<3> for RowNllGrad {
    fn name(&self) -> &'static str {
        "oomfix-cross-entropy-backward"
    }

    fn cpu_fwd(
        &self,
        [(s1, l1), (s2, l2), (s3, l3)]: [Input<'_, CpuStorage>; 3],
    ) -> Result<(CpuStorage, Shape)> {
        let (n, p) = l1.shape().dims2()?;
        let targets = checked_targets(s2, l2, self.classes)?;
        let grad = match (s3, l3.contiguous_offsets()) {
            (CpuStorage::F32(g), Some((a, b))) if b - a == n => &g[a..b],
            _ => candle_core::bail!(
                "cross_entropy backward: the gradient must be a contiguous [{n}] f32 vector"
            ),
        };
        let out = with_cpu_logits!(s1, l1, x => grad_rows(x, p, self.classes, targets, grad));
        Ok((out, l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        [(s1, l1), (s2, l2), (s3, l3)]: [Input<'_, CudaStorage>; 3],
    ) -> Result<(CudaStorage, Shape)> {
        cuda::grad(s1, l1, s2, l2, s3, l3, self.classes)
    }
}

/// The targets as a slice, each checked to lie in `0..v`.
fn checked_targets<'a>(s: &'a CpuStorage, l: &Layout, v: usize) -> Result<&'a [u32]> {
    let targets = match (s, l.contiguous_offsets()) {
        (CpuStorage::U32(t), Some((a, b))) => &t[a..b],
        _ => candle_core::bail!("cross_entropy: targets must be a contiguous u32 vector"),
    };
    if let Some(bad) = targets.iter().find(|&&t| t as usize >= v) {
        candle_core::bail!("cross_entropy: target {bad} is out of range for {v} classes");
    }
    Ok(targets)
}

/// The log-sum-exp of a row, in f32.
fn row_lse<T: WithDType>(row: &[T]) -> f32 {
    let max = row
        .iter()
        .fold(f32::NEG_INFINITY, |m, &x| m.max(x.to_f64() as f32));
    if max == f32::NEG_INFINITY {
        return max;
    }
    let sum: f32 = row.iter().map(|&x| (x.to_f64() as f32 - max).exp()).sum();
    max + sum.ln()
}

/// Losses of rows of `p` logits, the first `classes` of them real.
fn nll_rows<T: WithDType>(x: &[T], p: usize, classes: usize, targets: &[u32]) -> Vec<f32> {
    x.par_chunks(p.max(1))
        .zip(targets.par_iter())
        .map(|(row, &t)| row_lse(&row[..classes]) - row[t as usize].to_f64() as f32)
        .collect()
}

/// Gradients of rows of `p` logits, zero past the first `classes`.
fn grad_rows<T: WithDType>(
    x: &[T],
    p: usize,
    classes: usize,
    targets: &[u32],
    grad: &[f32],
) -> CpuStorage {
    let mut out = vec![T::from_f64(0.0); x.len()];
    out.par_chunks_mut(p.max(1))
        .zip(x.par_chunks(p.max(1)))
        .zip(targets.par_iter().zip(grad.par_iter()))
        .for_each(|((o, row), (&t, &g))| {
            let row = &row[..classes];
            let lse = row_lse(row);
            for (j, (o, &x)) in o.iter_mut().zip(row).enumerate() {
                let p = (x.to_f64() as f32 - lse).exp();
                let d = if j == t as usize { p - 1.0 } else { p };
                *o = T::from_f64((g * d) as f64);
            }
        });
    T::to_cpu_storage_owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
        crate::compare::max_diff(a, b).unwrap()
    }

    #[test]
    fn matches_candle_in_value_and_gradient() {
        let logits = Var::randn(0f32, 4.0, (37, 301), &Device::Cpu).unwrap();
        let t: Vec<u32> = (0..37).map(|i| (i * 97 % 301) as u32).collect();
        let targets = Tensor::new(t.as_slice(), &Device::Cpu).unwrap();
        let ours = cross_entropy(logits.as_tensor(), &targets, None).unwrap();
        let theirs = candle_nn::loss::cross_entropy(logits.as_tensor(), &targets).unwrap();
        assert!(max_diff(&ours, &theirs) < 1e-5, "{ours} vs {theirs}");
        let g1 = ours.backward().unwrap();
        let g2 = theirs.backward().unwrap();
        assert!(max_diff(g1.get(&logits).unwrap(), g2.get(&logits).unwrap()) < 1e-7);
    }

    #[test]
    fn sixteen_bit_logits_match_their_f32_widening() {
        for dtype in [DType::BF16, DType::F16] {
            let x = Tensor::randn(0f32, 3.0, (9, 50), &Device::Cpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let logits = Var::from_tensor(&x).unwrap();
            let wide = Var::from_tensor(&x.to_dtype(DType::F32).unwrap()).unwrap();
            let targets = Tensor::new(&[0u32, 49, 3, 3, 7, 11, 20, 30, 40], &Device::Cpu).unwrap();
            let ours = cross_entropy(logits.as_tensor(), &targets, None).unwrap();
            let reference = cross_entropy(wide.as_tensor(), &targets, None).unwrap();
            assert_eq!(ours.dtype(), DType::F32);
            assert!(max_diff(&ours, &reference) < 1e-6);
            let g = ours.backward().unwrap();
            let g = g.get(&logits).unwrap();
            assert_eq!(g.dtype(), dtype);
            let reference = reference.backward().unwrap();
            // one rounding to the 16-bit type: relative 2^-8 (bf16) of values below 1/n
            assert!(
                max_diff(g, reference.get(&wide).unwrap()) < 1e-3,
                "{dtype:?}"
            );
        }
    }

    #[test]
    fn masked_loss_averages_the_selected_rows() {
        let logits = Tensor::randn(0f32, 2.0, (4, 5), &Device::Cpu).unwrap();
        let targets = Tensor::new(&[1u32, 2, 3, 4], &Device::Cpu).unwrap();
        let mask = Tensor::new(&[0f32, 1., 0., 1.], &Device::Cpu).unwrap();
        let masked = cross_entropy(&logits, &targets, Some(&mask))
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        let rows = Tensor::new(&[1u32, 3], &Device::Cpu).unwrap();
        let expected = cross_entropy(
            &logits.index_select(&rows, 0).unwrap(),
            &targets.index_select(&rows, 0).unwrap(),
            None,
        )
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
        assert!((masked - expected).abs() < 1e-6);
        let none = Tensor::zeros(4, DType::F32, &Device::Cpu).unwrap();
        assert!(cross_entropy(&logits, &targets, Some(&none)).is_err());
    }

    #[test]
    fn padded_columns_are_ignored_and_get_no_gradient() {
        let (n, classes, pitch) = (7, 11, 16);
        let x = Tensor::randn(0f32, 2.0, (n, pitch), &Device::Cpu).unwrap();
        let targets = Tensor::new(&[0u32, 10, 3, 5, 7, 9, 1], &Device::Cpu).unwrap();
        let padded = Var::from_tensor(&x).unwrap();
        let first =
            Var::from_tensor(&x.narrow(1, 0, classes).unwrap().contiguous().unwrap()).unwrap();
        let ours = cross_entropy_padded(padded.as_tensor(), classes, &targets, None).unwrap();
        let reference = cross_entropy(first.as_tensor(), &targets, None).unwrap();
        assert!(max_diff(&ours, &reference) < 1e-6);
        let g = ours.backward().unwrap();
        let g = g.get(&padded).unwrap();
        let r = reference.backward().unwrap();
        assert!(max_diff(&g.narrow(1, 0, classes).unwrap(), r.get(&first).unwrap()) < 1e-7);
        let pad = g.narrow(1, classes, pitch - classes).unwrap();
        assert_eq!(
            pad.abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap(),
            0.0
        );
        // A target in the padding is out of range.
        let bad = Tensor::new(&[0u32, 11, 3, 5, 7, 9, 1], &Device::Cpu).unwrap();
        assert!(cross_entropy_padded(&x, classes, &bad, None).is_err());
        assert!(cross_entropy_padded(&x, pitch + 1, &targets, None).is_err());
    }

    #[test]
    fn bad_targets_are_errors() {
        let logits = Tensor::zeros((2, 3), DType::F32, &Device::Cpu).unwrap();
        let out_of_range = Tensor::new(&[0u32, 3], &Device::Cpu).unwrap();
        assert!(cross_entropy(&logits, &out_of_range, None)
            .unwrap_err()
            .to_string()
            .contains("out of range"));
        let wrong_len = Tensor::new(&[0u32], &Device::Cpu).unwrap();
        assert!(cross_entropy(&logits, &wrong_len, None).is_err());
        let wrong_dtype = Tensor::new(&[0i64, 1], &Device::Cpu).unwrap();
        assert!(cross_entropy(&logits, &wrong_dtype, None).is_err());
    }

    #[test]
    fn a_transposed_view_is_made_contiguous() {
        let x = Tensor::randn(0f32, 1.0, (6, 4), &Device::Cpu).unwrap();
        let targets = Tensor::new(&[0u32, 1, 2, 3, 4, 5], &Device::Cpu).unwrap();
        let view = cross_entropy(&x.t().unwrap(), &targets.narrow(0, 0, 4).unwrap(), None).unwrap();
        let copy = cross_entropy(
            &x.t().unwrap().contiguous().unwrap(),
            &targets.narrow(0, 0, 4).unwrap(),
            None,
        )
        .unwrap();
        assert_eq!(
            view.to_scalar::<f32>().unwrap(),
            copy.to_scalar::<f32>().unwrap()
        );
    }
}
