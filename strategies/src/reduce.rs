//! Reductions that stay parallel on CUDA.

use candle_core::Tensor;

/// The sum of all elements of `t`, reduced along its last dimension first.
///
/// candle's CUDA `sum_all` reduces every element in one thread block: over a
/// `b × s × hidden` activation that takes milliseconds on an H200 (2.7 ms for
/// 50 M bf16 values). Summing each row first spreads the work over one block
/// per row and leaves the last reduction small. The gradient with respect to
/// `t` is the same (all ones), so a backward pass started here is unchanged.
pub(crate) fn sum_all(t: &Tensor) -> candle_core::Result<Tensor> {
    match t.rank() {
        0 | 1 => t.sum_all(),
        rank => t.sum_keepdim(rank - 1)?.sum_all(),
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor, Var};

    #[test]
    fn same_sum_and_gradient_as_candles_sum_all() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        for shape in [vec![], vec![5], vec![3, 4], vec![2, 3, 7]] {
            let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, shape.as_slice(), &dev)?)?;
            let w = Tensor::randn(0f32, 1.0, shape.as_slice(), &dev)?;
            let ours = super::sum_all(&x.mul(&w)?)?;
            let theirs = x.mul(&w)?.sum_all()?;
            assert_eq!(ours.dims(), theirs.dims());
            let (a, b) = (ours.to_scalar::<f32>()?, theirs.to_scalar::<f32>()?);
            assert!(
                (a - b).abs() <= 1e-5 * b.abs().max(1.0),
                "{shape:?}: {a} vs {b}"
            );
            let grad = ours.backward()?.remove(&x).expect("x has a gradient");
            // d/dx sum(x * w) = w, exactly.
            let diff = grad
                .sub(&w)?
                .abs()?
                .flatten_all()?
                .max(0)?
                .to_scalar::<f32>()?;
            assert_eq!(diff, 0.0, "{shape:?}");
        }
        Ok(())
    }
}
