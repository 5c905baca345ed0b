//! A backward that starts from a given gradient: differentiating
//! [`seeded`]`(y, g)` gives `y` the gradient `g` as it is, as differentiating
//! `(y * g).sum_all()` would without making the product, the sum's ones and
//! `g`'s own stray gradient, each as large as `y`. A recomputed checkpoint
//! segment ([`crate::checkpoint`]) and a tiled part's tile
//! ([`crate::tiled_mlp`]) start their backward here.

use candle_core::{CpuStorage, Shape, Tensor};

use crate::custom_op::{CustomOp, Input, Kernel};

/// A scalar (zero) computed from `y` whose backward gives `y` the gradient
/// `grad_y`, the tensor itself: the root of a backward that starts from a
/// given gradient. Its own gradient is the backward's seed, 1, and is not
/// read.
pub(crate) fn seeded(y: &Tensor, grad_y: Tensor) -> candle_core::Result<Tensor> {
    if grad_y.shape() != y.shape() || grad_y.dtype() != y.dtype() {
        candle_core::bail!(
            "seeded backward: the gradient {:?} {:?} does not match the output {:?} {:?}",
            grad_y.shape(),
            grad_y.dtype(),
            y.shape(),
            y.dtype()
        );
    }
    y.apply_op1(CustomOp(Seed(grad_y)))
}

/// [`seeded`]'s op: the gradient it hands its input.
struct Seed(Tensor);

impl Kernel<1> for Seed {
    fn name(&self) -> &'static str {
        "oomfix-seed-gradient"
    }

    fn cpu_fwd(
        &self,
        [(y, _)]: [Input<'_, CpuStorage>; 1],
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        use candle_core::backend::{BackendDevice, BackendStorage};
        let zero = candle_core::cpu_backend::CpuDevice.zeros_impl(&Shape::from(()), y.dtype())?;
        Ok((zero, Shape::from(())))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        [(y, _)]: [Input<'_, candle_core::CudaStorage>; 1],
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::{BackendDevice, BackendStorage};
        let zero = y.device().zeros_impl(&Shape::from(()), y.dtype())?;
        Ok((zero, Shape::from(())))
    }

    fn bwd(
        &self,
        _: [&Tensor; 1],
        _: &Tensor,
        _: &Tensor,
    ) -> candle_core::Result<[Option<Tensor>; 1]> {
        Ok([Some(self.0.clone())])
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor, Var};

    /// The input's gradient is the seed's tensor, bit for bit, and the
    /// parameters' gradients are the surrogate's `(y·g).sum()`'s.
    #[test]
    fn the_seed_gives_the_gradient_as_it_is() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let w = Var::randn(0f32, 1.0, (4, 4), &dev)?;
        let x = Var::randn(0f32, 1.0, (3, 4), &dev)?;
        let g = Tensor::randn(0f32, 1.0, (3, 4), &dev)?;
        let y = x.as_tensor().matmul(w.as_tensor())?.tanh()?;
        let seeded = super::seeded(&y, g.clone())?.backward()?;
        let summed = y.mul(&g)?.sum_all()?.backward()?;
        for v in [&w, &x] {
            let (a, b) = (seeded.get(v).unwrap(), summed.get(v).unwrap());
            let diff = (a - b)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(diff < 1e-6, "{diff}");
        }
        let own = super::seeded(x.as_tensor(), g.clone())?.backward()?;
        assert_eq!(own.get(&x).unwrap().to_vec2::<f32>()?, g.to_vec2::<f32>()?);
        assert!(super::seeded(&y, g.narrow(0, 0, 2)?).is_err());
        Ok(())
    }
}
