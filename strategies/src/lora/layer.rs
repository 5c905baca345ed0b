//! The adapted projection ([`LoraLinear`]): a frozen weight with a trained
//! low-rank adapter, as PEFT's `lora.Linear`; a fresh adapter as PEFT
//! initialises one ([`fresh_adapter`]) and the merged weight
//! ([`merged_weight`]).

use candle_core::{CustomOp3, DType, Device, Tensor, Var};
use rand::rngs::StdRng;
use rand::Rng;
use std::sync::{Arc, Mutex};

use super::frozen::{self, hand_over_output, FrozenWeight};
use super::BasePrecision;
use crate::{Error, Result};

/// Where a fresh adapter's `A` draws its values (uniform in ±1/√in) from.
#[derive(Debug)]
pub enum Draw<'a> {
    /// The device's generator ([`Tensor::rand`], in f32): unseeded.
    Device,
    /// A seeded generator, one value after another in row-major order, on
    /// the host (then sent to the device).
    Seeded(&'a mut StdRng),
}

/// A fresh rank-`rank` adapter for a projection of `dims` (`(out, in)`),
/// as PEFT's: `A` `[r, in]` Kaiming-uniform with `a = √5` (a gain of
/// √(2 / (1 + 5)) and a bound of gain·√(3 / in) = 1/√in) drawn as `draw`
/// says, `B` `[out, r]` zeros, so that the adapted projection starts as the
/// frozen one; in `dtype` on `device`. A rank of 0 or above the smaller of
/// `out` and `in` is refused.
pub fn fresh_adapter(
    (out, d_in): (usize, usize),
    rank: usize,
    dtype: DType,
    device: &Device,
    draw: Draw,
) -> Result<(Var, Var)> {
    if rank == 0 || rank > out.min(d_in) {
        return Err(Error::Config(format!(
            "a LoRA rank of {rank} on a {out} x {d_in} projection (1 to {})",
            out.min(d_in)
        )));
    }
    let bound = 1.0 / (d_in as f64).sqrt();
    let a = match draw {
        Draw::Device => {
            Tensor::rand(-bound as f32, bound as f32, (rank, d_in), device)?.to_dtype(dtype)?
        }
        Draw::Seeded(rng) => {
            let values: Vec<f32> = (0..rank * d_in)
                .map(|_| rng.random_range(-bound..bound) as f32)
                .collect();
            Tensor::from_vec(values, (rank, d_in), &Device::Cpu)?
                .to_dtype(dtype)?
                .to_device(device)?
        }
    };
    let b = Tensor::zeros((out, rank), dtype, device)?;
    Ok((Var::from_tensor(&a)?, Var::from_tensor(&b)?))
}

/// `W + s·B·A` in f32 on the frozen weight's device: the weight of the
/// adapted projection merged into one (PEFT's `merge_and_unload`), from
/// `A` `[r, in]` and `B` `[out, r]` (in any dtype, on any device) and the
/// scale `s = alpha / r`.
pub fn merged_weight(frozen: &FrozenWeight, a: &Tensor, b: &Tensor, scale: f64) -> Result<Tensor> {
    let w = frozen.weight(DType::F32)?;
    let device = w.device().clone();
    let ba = b
        .to_dtype(DType::F32)?
        .to_device(&device)?
        .matmul(&a.to_dtype(DType::F32)?.to_device(&device)?)?;
    Ok((w + ba.affine(scale, 0.0)?)?)
}

/// A linear projection with a LoRA adapter: `y = x·Wᵀ + b + s·(x·Aᵀ)·Bᵀ`
/// with `W` (and the bias `b`) frozen, `A` `[r, in]` and `B` `[out, r]`
/// trained and `s = alpha / r`, as PEFT's `lora.Linear` computes it
/// (without dropout).
///
/// A fresh adapter is PEFT's: `A` Kaiming-uniform with `a = √5` (uniform in
/// ±1/√in), `B` zeros, so the projection computes the frozen one's function.
///
/// The projection is one op for candle's autograd: it keeps its input (and
/// `A`, `B`), as a plain projection keeps its input and weight, and nothing
/// else. Its forward converts `W` to the input's dtype (dequantizes an NF4
/// weight), multiplies and frees it; its backward does so again for the
/// input's gradient, and recomputes `x·Aᵀ` (`[n, r]`) for the adapter's.
///
/// ```
/// use candle_core::{DType, Device, Tensor};
/// use oomfix_strategies::lora::{BasePrecision, LoraLinear};
/// let dev = Device::Cpu;
/// let w = Tensor::randn(0f32, 0.1, (6, 4), &dev)?;
/// let x = Tensor::randn(0f32, 1.0, (3, 4), &dev)?;
/// let layer = LoraLinear::new(&w, None, 2, 4.0, BasePrecision::Bf16)?;
/// // At step 0 the adapter adds nothing.
/// let base = x.matmul(&w.t()?)?;
/// assert_eq!(layer.forward(&x)?.to_vec2::<f32>()?, base.to_vec2::<f32>()?);
/// # Ok::<(), oomfix_strategies::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct LoraLinear {
    frozen: Arc<FrozenWeight>,
    bias: Option<Tensor>,
    a: Var,
    b: Var,
    scale: f64,
}

impl LoraLinear {
    /// An adapted projection of `weight` (`[out, in]`) and `bias`, frozen
    /// as `base`, with a fresh rank-`rank` adapter scaled by `alpha / rank`,
    /// its variables in `weight`'s dtype and on its device.
    pub fn new(
        weight: &Tensor,
        bias: Option<&Tensor>,
        rank: usize,
        alpha: f64,
        base: BasePrecision,
    ) -> Result<LoraLinear> {
        let (dtype, device) = (weight.dtype(), weight.device());
        let (a, b) = fresh_adapter(weight.dims2()?, rank, dtype, device, Draw::Device)?;
        LoraLinear::with_adapter(
            FrozenWeight::new(weight, base)?,
            bias.map(Tensor::detach),
            a,
            b,
            alpha / rank as f64,
        )
    }

    /// An adapted projection of a frozen weight with the adapter `a`
    /// (`[r, in]`), `b` (`[out, r]`) and scale `scale`.
    pub fn with_adapter(
        frozen: FrozenWeight,
        bias: Option<Tensor>,
        a: Var,
        b: Var,
        scale: f64,
    ) -> Result<LoraLinear> {
        let (out, d_in) = frozen.dims()?;
        let (r, a_in) = a.dims2()?;
        if a_in != d_in || b.dims2()? != (out, r) {
            return Err(Error::Config(format!(
                "a LoRA adapter of A {:?} and B {:?} on a {out} x {d_in} weight",
                a.dims(),
                b.dims()
            )));
        }
        Ok(LoraLinear {
            frozen: Arc::new(frozen),
            bias,
            a,
            b,
            scale,
        })
    }

    /// `A`, `[r, in]`.
    pub fn a(&self) -> &Var {
        &self.a
    }

    /// `B`, `[out, r]`.
    pub fn b(&self) -> &Var {
        &self.b
    }

    /// `alpha / r`.
    pub fn scale(&self) -> f64 {
        self.scale
    }

    /// The frozen weight.
    pub fn frozen(&self) -> &FrozenWeight {
        &self.frozen
    }

    /// `W + s·B·A` in `dtype`: the weight of the merged projection.
    pub fn merged(&self, dtype: DType) -> Result<Tensor> {
        let w = merged_weight(
            &self.frozen,
            self.a.as_tensor(),
            self.b.as_tensor(),
            self.scale,
        )?;
        Ok(w.to_dtype(dtype)?)
    }

    /// `x` `[..., in]` to `[..., out]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        frozen::on_rows(x, &self.frozen, |x2| {
            // The output, computed off the graph: the frozen product (its
            // weight freed at once), the bias, the adapter's.
            let y = {
                let xd = x2.detach();
                let y = frozen::frozen_product(&xd, &self.frozen, self.bias.as_ref())?;
                let t = xd.matmul(&self.a.as_tensor().detach().t()?)?;
                let u = t.matmul(&self.b.as_tensor().detach().t()?)?;
                (y + u.affine(self.scale, 0.0)?)?
            };
            let op = Adapted {
                output: Mutex::new(Some(y)),
                frozen: Arc::clone(&self.frozen),
                scale: self.scale,
            };
            Ok(x2.apply_op3(self.a.as_tensor(), self.b.as_tensor(), op)?)
        })
    }
}

/// The adapted projection as one op of `x` `[n, in]`, `A`, `B`: its forward
/// hands over the output computed beforehand; its backward gives the
/// gradients of all three.
struct Adapted {
    output: Mutex<Option<Tensor>>,
    frozen: Arc<FrozenWeight>,
    scale: f64,
}

impl CustomOp3 for Adapted {
    fn name(&self) -> &'static str {
        "oomfix-lora-linear"
    }

    hand_over_output!(_x, _a, _b);

    /// `dx = g·W + s·(g·B)·A`, `dA = s·(g·B)ᵀ·x`, `dB = s·gᵀ·(x·Aᵀ)`, from
    /// detached tensors, `W` converted again and freed.
    fn bwd(
        &self,
        x: &Tensor,
        a: &Tensor,
        b: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (x, a, b, g) = (x.detach(), a.detach(), b.detach(), g.detach());
        let w = self
            .frozen
            .weight(g.dtype())
            .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        let dx = g.matmul(&w)?;
        drop(w);
        let t = x.matmul(&a.t()?)?;
        let db = g.t()?.matmul(&t)?.affine(self.scale, 0.0)?;
        drop(t);
        let gt = g.matmul(&b)?.affine(self.scale, 0.0)?;
        let da = gt.t()?.matmul(&x)?;
        let dx = (dx + gt.matmul(&a)?)?;
        Ok((Some(dx), Some(da), Some(db)))
    }
}

#[cfg(test)]
mod tests {
    use super::super::nf4;
    use super::*;
    use crate::lora::testing::{max_diff, values};
    use candle_core::Device;

    #[test]
    fn a_fresh_adapter_computes_the_frozen_function() {
        let dev = Device::Cpu;
        let w = Tensor::randn(0f32, 0.2, (24, 16), &dev).unwrap();
        let bias = Tensor::randn(0f32, 0.2, 24, &dev).unwrap();
        let x = Tensor::randn(0f32, 1.0, (2, 5, 16), &dev).unwrap();
        let layer = LoraLinear::new(&w, Some(&bias), 8, 16.0, BasePrecision::Bf16).unwrap();
        let y = layer.forward(&x).unwrap();
        assert_eq!(y.dims(), [2, 5, 24]);
        let base = x
            .broadcast_matmul(&w.t().unwrap())
            .unwrap()
            .broadcast_add(&bias)
            .unwrap();
        assert_eq!(max_diff(&y, &base), 0.0);
        // PEFT's initialisation: A uniform in ±1/√in, B zeros.
        let a = values(layer.a().as_tensor());
        let bound = 1.0 / 4.0;
        assert!(a.iter().all(|v| v.abs() <= bound));
        assert!(a.iter().any(|v| v.abs() > bound / 2.0));
        assert!(values(layer.b().as_tensor()).iter().all(|v| *v == 0.0));
        assert_eq!(layer.scale(), 2.0);
        // On an NF4 base: the dequantized weight's function.
        let q = LoraLinear::new(&w, None, 8, 16.0, BasePrecision::Nf4).unwrap();
        let deq = q.frozen().weight(DType::F32).unwrap();
        let wv = values(&w);
        let expected = Tensor::from_vec(nf4::quantize(&wv).dequantize(), (24, 16), &dev).unwrap();
        assert_eq!(max_diff(&deq, &expected), 0.0);
        let yq = q.forward(&x).unwrap();
        assert_eq!(
            max_diff(&yq, &x.broadcast_matmul(&deq.t().unwrap()).unwrap()),
            0.0
        );
        assert!(LoraLinear::new(&w, None, 17, 1.0, BasePrecision::Bf16).is_err());
        assert!(LoraLinear::new(&w, None, 0, 1.0, BasePrecision::Bf16).is_err());
    }

    /// A seeded adapter draws the same `A` from the same seed, within
    /// ±1/√in, in the dtype asked; `B` is zeros; a rank of 0 or above the
    /// projection's width is refused.
    #[test]
    fn a_seeded_adapter_is_drawn_again_from_its_seed() {
        use rand::SeedableRng;
        let dev = Device::Cpu;
        let draw = |seed: u64| {
            let mut rng = StdRng::seed_from_u64(seed);
            fresh_adapter((6, 9), 3, DType::F32, &dev, Draw::Seeded(&mut rng)).unwrap()
        };
        let ((a, b), (again, _), (other, _)) = (draw(7), draw(7), draw(8));
        assert_eq!(a.dims(), [3, 9]);
        assert_eq!(values(&a), values(&again));
        assert_ne!(values(&a), values(&other));
        assert!(values(&a).iter().all(|v| v.abs() <= 1.0 / 3.0));
        assert_eq!(b.dims(), [6, 3]);
        assert!(values(&b).iter().all(|v| *v == 0.0));
        for rank in [0, 7] {
            assert!(fresh_adapter((6, 9), rank, DType::F32, &dev, Draw::Device).is_err());
        }
    }

    /// The adapted op's gradients (of its input, `A` and `B`) against
    /// candle's autograd through the composed formula, on a 16-bit and an
    /// NF4 base, fp32.
    #[test]
    fn gradients_equal_the_composed_reference() {
        let dev = Device::Cpu;
        for base in [BasePrecision::Bf16, BasePrecision::Nf4] {
            let w = Tensor::randn(0f32, 0.2, (12, 10), &dev).unwrap();
            let frozen = FrozenWeight::new(&w, base).unwrap();
            let wq = frozen.weight(DType::F32).unwrap();
            let a0 = Tensor::randn(0f32, 0.3, (4, 10), &dev).unwrap();
            let b0 = Tensor::randn(0f32, 0.3, (12, 4), &dev).unwrap();
            let x0 = Tensor::randn(0f32, 1.0, (3, 7, 10), &dev).unwrap();
            let r = Tensor::randn(0f32, 1.0, (3, 7, 12), &dev).unwrap();
            let scale = 0.75;
            let grads = |fused: bool| {
                let (x, a, b) = (
                    Var::from_tensor(&x0).unwrap(),
                    Var::from_tensor(&a0).unwrap(),
                    Var::from_tensor(&b0).unwrap(),
                );
                let y = if fused {
                    let layer = LoraLinear::with_adapter(
                        FrozenWeight::new(&w, base).unwrap(),
                        None,
                        a.clone(),
                        b.clone(),
                        scale,
                    )
                    .unwrap();
                    layer.forward(x.as_tensor()).unwrap()
                } else {
                    let base_y = x.as_tensor().broadcast_matmul(&wq.t().unwrap()).unwrap();
                    let t = x
                        .as_tensor()
                        .broadcast_matmul(&a.as_tensor().t().unwrap())
                        .unwrap();
                    let u = t.broadcast_matmul(&b.as_tensor().t().unwrap()).unwrap();
                    (base_y + u.affine(scale, 0.0).unwrap()).unwrap()
                };
                let loss = (y.clone() * &r).unwrap().sum_all().unwrap();
                let store = loss.backward().unwrap();
                let g = |v: &Var| store.get(v.as_tensor()).unwrap().clone();
                (y, g(&x), g(&a), g(&b))
            };
            let fused = grads(true);
            let composed = grads(false);
            assert!(max_diff(&fused.0, &composed.0) < 1e-5, "{base}: output");
            assert!(max_diff(&fused.1, &composed.1) < 1e-5, "{base}: dx");
            assert!(max_diff(&fused.2, &composed.2) < 1e-4, "{base}: dA");
            assert!(max_diff(&fused.3, &composed.3) < 1e-4, "{base}: dB");
            // A central difference on one element of A agrees too.
            let loss_at = |delta: f32| {
                let mut a = values(&a0);
                a[5] += delta;
                let a = Tensor::from_vec(a, (4, 10), &dev).unwrap();
                let layer = LoraLinear::with_adapter(
                    FrozenWeight::new(&w, base).unwrap(),
                    None,
                    Var::from_tensor(&a).unwrap(),
                    Var::from_tensor(&b0).unwrap(),
                    scale,
                )
                .unwrap();
                let y = layer.forward(&x0).unwrap();
                (y * &r)
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap() as f64
            };
            let h = 1e-2;
            let numeric = (loss_at(h) - loss_at(-h)) / (2.0 * h as f64);
            let analytic = values(&fused.2)[5] as f64;
            assert!(
                (numeric - analytic).abs() < 1e-2 * analytic.abs().max(1.0),
                "{numeric} {analytic}"
            );
        }
    }

    #[test]
    fn merged_weight_is_w_plus_scaled_ba() {
        let dev = Device::Cpu;
        let w = Tensor::randn(0f32, 0.2, (6, 5), &dev).unwrap();
        let a = Var::randn(0f32, 0.3, (2, 5), &dev).unwrap();
        let b = Var::randn(0f32, 0.3, (6, 2), &dev).unwrap();
        let layer =
            LoraLinear::with_adapter(FrozenWeight::Dense(w.clone()), None, a, b, 2.0).unwrap();
        let x = Tensor::randn(0f32, 1.0, (4, 5), &dev).unwrap();
        let merged = layer.merged(DType::F32).unwrap();
        let y = layer.forward(&x).unwrap();
        assert!(max_diff(&y, &x.matmul(&merged.t().unwrap()).unwrap()) < 1e-5);
    }
}
