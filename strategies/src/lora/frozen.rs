//! Frozen weights: kept as given (16-bit, or the compute dtype), or in NF4
//! on their device ([`Nf4Weight`]), and the frozen projection that uses one
//! without training it ([`FrozenLinear`]).
//!
//! An NF4 weight's codes and absmax values live on the weight's device; it
//! is dequantized there, into a new tensor of the compute dtype, when a
//! product needs it (the CPU: [`nf4`]'s loops; CUDA: one kernel, `nf4.cu`,
//! giving the same bits).

use candle_core::{CpuStorage, CustomOp1, CustomOp3, DType, Device, Layout, Shape, Tensor};
use std::sync::{Arc, Mutex};

use super::{nf4, BasePrecision};
use crate::{Error, Result};

/// A frozen weight `[out, in]`: as given, or in NF4.
#[derive(Debug, Clone)]
pub enum FrozenWeight {
    /// The weight as given, detached.
    Dense(Tensor),
    /// The weight in NF4 on its device.
    Nf4(Nf4Weight),
}

impl FrozenWeight {
    /// `weight` (`[out, in]`) frozen as `base`: kept as given for
    /// [`BasePrecision::Bf16`] (the caller chooses its dtype), quantized
    /// to NF4 (double-quantized absmax for [`BasePrecision::Nf4Double`]) on
    /// the weight's device otherwise.
    pub fn new(weight: &Tensor, base: BasePrecision) -> Result<FrozenWeight> {
        FrozenWeight::on_device(weight, base, weight.dtype(), weight.device())
    }

    /// `weight` (`[out, in]`, on any device) frozen as `base` on `device`:
    /// in `dtype` for [`BasePrecision::Bf16`], else quantized to NF4
    /// (double-quantized absmax for [`BasePrecision::Nf4Double`]) from its
    /// values on the host, the codes stored on `device`.
    pub fn on_device(
        weight: &Tensor,
        base: BasePrecision,
        dtype: DType,
        device: &Device,
    ) -> Result<FrozenWeight> {
        if !base.is_quantized() {
            let weight = weight.to_dtype(dtype)?.to_device(device)?;
            return Ok(FrozenWeight::Dense(weight.detach()));
        }
        let values = weight
            .to_dtype(DType::F32)?
            .to_device(&Device::Cpu)?
            .contiguous()?;
        // The host's f32 values read in place (a copy of an 8B model's
        // weights in f32 is 32 GB).
        let (storage, layout) = values.storage_and_layout();
        let candle_core::Storage::Cpu(storage) = &*storage else {
            unreachable!("a tensor moved to the CPU has CPU storage")
        };
        let range = layout.start_offset()..layout.start_offset() + values.elem_count();
        Ok(FrozenWeight::Nf4(Nf4Weight::quantize(
            &storage.as_slice::<f32>()?[range],
            weight.dims2()?,
            base == BasePrecision::Nf4Double,
            device,
        )?))
    }

    /// The weight in `dtype`, `[out, in]`: a new tensor for NF4 (or another
    /// dtype), the stored one otherwise.
    pub fn weight(&self, dtype: DType) -> Result<Tensor> {
        match self {
            FrozenWeight::Dense(w) => Ok(w.to_dtype(dtype)?),
            FrozenWeight::Nf4(q) => q.dequantize(dtype),
        }
    }

    /// `(out, in)`.
    pub fn dims(&self) -> Result<(usize, usize)> {
        match self {
            FrozenWeight::Dense(w) => Ok(w.dims2()?),
            FrozenWeight::Nf4(q) => Ok(q.shape),
        }
    }

    /// Bytes held on the device.
    pub fn bytes(&self) -> usize {
        match self {
            FrozenWeight::Dense(w) => w.elem_count() * w.dtype().size_in_bytes(),
            FrozenWeight::Nf4(q) => q.bytes(),
        }
    }
}

/// A weight `[out, in]` in NF4 on a device: packed 4-bit codes and the
/// blocks' absmax values, in fp32 or double-quantized.
#[derive(Debug, Clone)]
pub struct Nf4Weight {
    /// u8, `⌈n/2⌉`.
    codes: Tensor,
    absmax: Absmax,
    shape: (usize, usize),
}

#[derive(Debug, Clone)]
enum Absmax {
    /// f32, one per block of [`nf4::BLOCK`].
    Plain(Tensor),
    /// u8 codes of [`nf4::dynamic_map`], one f32 scale per
    /// [`nf4::DOUBLE_BLOCK`] of them, and the offset.
    Double {
        codes: Tensor,
        scales: Tensor,
        offset: f32,
    },
}

impl Nf4Weight {
    /// `values` (row-major, `shape`) quantized on the CPU and stored on `device`.
    pub fn quantize(
        values: &[f32],
        shape: (usize, usize),
        double: bool,
        device: &Device,
    ) -> Result<Nf4Weight> {
        if values.len() != shape.0 * shape.1 {
            return Err(Error::Config(format!(
                "{} values for a {} x {} weight",
                values.len(),
                shape.0,
                shape.1
            )));
        }
        let q = nf4::quantize(values);
        let tensor = |v: &[u8]| Tensor::from_slice(v, v.len(), device);
        let codes = tensor(q.codes())?;
        let absmax = if double {
            let d = nf4::DoubleAbsmax::quantize(q.absmax());
            Absmax::Double {
                codes: tensor(d.codes())?,
                scales: Tensor::from_slice(d.scales(), d.scales().len(), device)?,
                offset: d.offset(),
            }
        } else {
            Absmax::Plain(Tensor::from_slice(q.absmax(), q.absmax().len(), device)?)
        };
        Ok(Nf4Weight {
            codes,
            absmax,
            shape,
        })
    }

    /// `(out, in)`.
    pub fn shape(&self) -> (usize, usize) {
        self.shape
    }

    /// Bytes held: the codes and the absmax values (with their scales and
    /// offset when double-quantized).
    pub fn bytes(&self) -> usize {
        let codes = self.codes.elem_count();
        codes
            + match &self.absmax {
                Absmax::Plain(a) => 4 * a.elem_count(),
                Absmax::Double { codes, scales, .. } => {
                    codes.elem_count() + 4 * scales.elem_count() + 4
                }
            }
    }

    /// The weight in `dtype` (f32, bf16 or f16), `[out, in]`, on its device:
    /// each level times its block's absmax in f32, rounded to `dtype`.
    pub fn dequantize(&self, dtype: DType) -> Result<Tensor> {
        let n = self.shape.0 * self.shape.1;
        let op = Dequantize { dtype, n };
        let out = match &self.absmax {
            Absmax::Plain(a) => self.codes.apply_op3_no_bwd(a, a, &op)?,
            Absmax::Double {
                codes,
                scales,
                offset,
            } => self.codes.apply_op3_no_bwd(
                codes,
                scales,
                &DequantizeDouble {
                    op,
                    offset: *offset,
                },
            )?,
        };
        Ok(out.reshape(self.shape)?)
    }
}

/// Dequantization with fp32 absmax values: `(codes, absmax, absmax)`.
struct Dequantize {
    dtype: DType,
    n: usize,
}

/// Dequantization with double-quantized absmax values: `(codes, absmax
/// codes, scales)`.
struct DequantizeDouble {
    op: Dequantize,
    offset: f32,
}

fn cpu_slice<'a, T: candle_core::WithDType>(
    s: &'a CpuStorage,
    l: &Layout,
) -> candle_core::Result<&'a [T]> {
    let (a, b) = l
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("nf4: a strided input".into()))?;
    Ok(&T::cpu_storage_as_slice(s)?[a..b])
}

impl Dequantize {
    fn cpu(&self, codes: &[u8], absmax: &[f32]) -> candle_core::Result<(CpuStorage, Shape)> {
        let n = self.n;
        if codes.len() != n.div_ceil(2) || absmax.len() != n.div_ceil(nf4::BLOCK) {
            candle_core::bail!(
                "nf4: {} codes and {} absmax for {n} values",
                codes.len(),
                absmax.len()
            );
        }
        let storage = match self.dtype {
            DType::F32 => {
                let mut out = vec![0f32; n];
                nf4::dequantize_into(codes, absmax, &mut out, |v| v);
                CpuStorage::F32(out)
            }
            DType::BF16 => {
                let mut out = vec![half::bf16::ZERO; n];
                nf4::dequantize_into(codes, absmax, &mut out, half::bf16::from_f32);
                CpuStorage::BF16(out)
            }
            DType::F16 => {
                let mut out = vec![half::f16::ZERO; n];
                nf4::dequantize_into(codes, absmax, &mut out, half::f16::from_f32);
                CpuStorage::F16(out)
            }
            other => candle_core::bail!("nf4: cannot dequantize to {other:?}"),
        };
        Ok((storage, Shape::from(n)))
    }
}

impl CustomOp3 for Dequantize {
    fn name(&self) -> &'static str {
        "oomfix-nf4-dequantize"
    }

    fn cpu_fwd(
        &self,
        codes: &CpuStorage,
        cl: &Layout,
        absmax: &CpuStorage,
        al: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        self.cpu(cpu_slice::<u8>(codes, cl)?, cpu_slice::<f32>(absmax, al)?)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        codes: &candle_core::CudaStorage,
        cl: &Layout,
        absmax: &candle_core::CudaStorage,
        al: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let absmax = super::cuda::DeviceAbsmax::Plain(absmax, al);
        let out = super::cuda::dequantize((codes, cl), absmax, self.n, self.dtype)?;
        Ok((out, Shape::from(self.n)))
    }
}

impl CustomOp3 for DequantizeDouble {
    fn name(&self) -> &'static str {
        "oomfix-nf4-dq-dequantize"
    }

    fn cpu_fwd(
        &self,
        codes: &CpuStorage,
        cl: &Layout,
        q: &CpuStorage,
        ql: &Layout,
        scales: &CpuStorage,
        sl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (q, scales) = (cpu_slice::<u8>(q, ql)?, cpu_slice::<f32>(scales, sl)?);
        if scales.len() != q.len().div_ceil(nf4::DOUBLE_BLOCK) {
            candle_core::bail!("nf4: {} scales for {} absmax codes", scales.len(), q.len());
        }
        let absmax =
            nf4::DoubleAbsmax::from_parts(q.to_vec(), scales.to_vec(), self.offset).dequantize();
        self.op.cpu(cpu_slice::<u8>(codes, cl)?, &absmax)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        codes: &candle_core::CudaStorage,
        cl: &Layout,
        q: &candle_core::CudaStorage,
        ql: &Layout,
        scales: &candle_core::CudaStorage,
        sl: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let absmax = super::cuda::DeviceAbsmax::Double {
            codes: (q, ql),
            scales: (scales, sl),
            offset: self.offset,
        };
        let out = super::cuda::dequantize((codes, cl), absmax, self.op.n, self.op.dtype)?;
        Ok((out, Shape::from(self.op.n)))
    }
}

/// A frozen projection `y = x·Wᵀ + b`, `W` `[out, in]` frozen (any
/// [`FrozenWeight`]) and `b` frozen: one op for candle's autograd that keeps
/// its input only. Its forward converts (dequantizes) `W` into the input's
/// dtype, multiplies and frees it; its backward does so again for the
/// input's gradient and computes no gradient of `W` or `b`.
#[derive(Debug, Clone)]
pub struct FrozenLinear {
    frozen: Arc<FrozenWeight>,
    bias: Option<Tensor>,
}

impl FrozenLinear {
    /// The projection of `frozen` and `bias` (`[out]`, detached).
    pub fn new(frozen: FrozenWeight, bias: Option<Tensor>) -> FrozenLinear {
        FrozenLinear {
            frozen: Arc::new(frozen),
            bias: bias.map(|b| b.detach()),
        }
    }

    /// The frozen weight.
    pub fn frozen(&self) -> &FrozenWeight {
        &self.frozen
    }

    /// The frozen bias.
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// `x` `[..., in]` to `[..., out]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        on_rows(x, &self.frozen, |x2| {
            let y = frozen_product(&x2.detach(), &self.frozen, self.bias.as_ref())?;
            let op = Frozen {
                output: Mutex::new(Some(y)),
                frozen: Arc::clone(&self.frozen),
            };
            Ok(x2.apply_op1(op)?)
        })
    }
}

/// A projection by `frozen` (`[out, in]`) of `x` `[..., in]`: `project`
/// of its rows `[n, in]`, `[n, out]` reshaped to `[..., out]`.
pub(super) fn on_rows(
    x: &Tensor,
    frozen: &FrozenWeight,
    project: impl FnOnce(&Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    let (out, d_in) = frozen.dims()?;
    let y = project(&x.reshape(((), d_in))?)?;
    let mut dims = x.dims().to_vec();
    if let Some(last) = dims.last_mut() {
        *last = out;
    }
    Ok(y.reshape(dims)?)
}

/// `x·Wᵀ (+ b)` off the graph, `W` converted for the product and freed.
pub(super) fn frozen_product(
    x: &Tensor,
    frozen: &FrozenWeight,
    bias: Option<&Tensor>,
) -> Result<Tensor> {
    let w = frozen.weight(x.dtype())?;
    let mut y = x.matmul(&w.t()?)?;
    drop(w);
    if let Some(b) = bias {
        y = y.broadcast_add(&b.to_dtype(y.dtype())?)?;
    }
    Ok(y)
}

/// Hands over an output computed beforehand (once).
pub(super) fn take(output: &Mutex<Option<Tensor>>) -> candle_core::Result<Tensor> {
    output
        .lock()
        .map_err(|_| candle_core::Error::Msg("lora: poisoned lock".into()))?
        .take()
        .ok_or_else(|| candle_core::Error::Msg("lora: the output was taken already".into()))
}

/// The storage of a tensor computed beforehand, for a custom op's forward.
pub(super) fn cpu_output(y: Tensor) -> candle_core::Result<(CpuStorage, Shape)> {
    let (storage, _) = y.storage_and_layout();
    match &*storage {
        candle_core::Storage::Cpu(s) => Ok((s.clone(), y.shape().clone())),
        _ => candle_core::bail!("lora: the output is not on the CPU"),
    }
}

/// As [`cpu_output`] on CUDA.
#[cfg(feature = "cuda")]
pub(super) fn cuda_output(y: Tensor) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
    use candle_core::backend::BackendStorage;
    let (storage, layout) = y.storage_and_layout();
    match &*storage {
        candle_core::Storage::Cuda(s) => Ok((s.try_clone(layout)?, y.shape().clone())),
        _ => candle_core::bail!("lora: the output is not on a CUDA device"),
    }
}

/// `cpu_fwd` and `cuda_fwd` of a custom op that hands over the output
/// computed beforehand (its field `output`, taken once), for an op of the
/// inputs named (`_x` for `CustomOp1`, `_x, _a, _b` for `CustomOp3`).
macro_rules! hand_over_output {
    ($($input:ident),+) => {
        fn cpu_fwd(
            &self,
            $($input: &candle_core::CpuStorage, _: &candle_core::Layout),+
        ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
            $crate::lora::frozen::cpu_output($crate::lora::frozen::take(&self.output)?)
        }

        #[cfg(feature = "cuda")]
        fn cuda_fwd(
            &self,
            $($input: &candle_core::CudaStorage, _: &candle_core::Layout),+
        ) -> candle_core::Result<(candle_core::CudaStorage, candle_core::Shape)> {
            $crate::lora::frozen::cuda_output($crate::lora::frozen::take(&self.output)?)
        }
    };
}
pub(super) use hand_over_output;

/// The frozen projection as one op of `x` `[n, in]`.
struct Frozen {
    output: Mutex<Option<Tensor>>,
    frozen: Arc<FrozenWeight>,
}

impl CustomOp1 for Frozen {
    fn name(&self) -> &'static str {
        "oomfix-frozen-linear"
    }

    hand_over_output!(_x);

    /// `dx = g·W`, `W` converted again and freed.
    fn bwd(&self, _x: &Tensor, _y: &Tensor, g: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let g = g.detach();
        let w = self
            .frozen
            .weight(g.dtype())
            .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        Ok(Some(g.matmul(&w)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lora::testing::{max_diff, values};

    /// Deterministic values of changing scale by block.
    fn varied(n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 7919 % 1013) as f32 / 1013.0 - 0.5) * (1 + i / 64 % 5) as f32)
            .collect()
    }

    /// An NF4 weight dequantizes to its codes' levels times the block
    /// absmax (double-quantized: the restored absmax), in every dtype.
    #[test]
    fn dequantized_weights_are_the_codebook_values() {
        let (out, d_in) = (24, 40); // 960 values: 15 blocks, the last pair split
        let v = varied(out * d_in);
        let q = nf4::quantize(&v);
        for double in [false, true] {
            let w = Nf4Weight::quantize(&v, (out, d_in), double, &Device::Cpu).unwrap();
            let absmax = if double {
                nf4::DoubleAbsmax::quantize(q.absmax()).dequantize()
            } else {
                q.absmax().to_vec()
            };
            let want = nf4::Nf4::from_parts(q.codes().to_vec(), absmax, v.len())
                .unwrap()
                .dequantize();
            let got = values(&w.dequantize(DType::F32).unwrap());
            assert!(got
                .iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits()));
            let bf: Vec<half::bf16> = w
                .dequantize(DType::BF16)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            assert!(bf
                .iter()
                .zip(&want)
                .all(|(a, b)| *a == half::bf16::from_f32(*b)));
            let bytes = if double {
                480 + 15 + 4 + 4
            } else {
                480 + 15 * 4
            };
            assert_eq!(w.bytes(), bytes);
        }
    }

    /// The frozen projection's input gradient is `g·W` and it gives its
    /// weight none.
    #[test]
    fn a_frozen_projection_gives_its_input_the_gradient_only() {
        let dev = Device::Cpu;
        let w = Tensor::randn(0f32, 0.3, (6, 5), &dev).unwrap();
        let b = Tensor::randn(0f32, 0.3, 6, &dev).unwrap();
        let x = candle_core::Var::randn(0f32, 1.0, (2, 3, 5), &dev).unwrap();
        let layer = FrozenLinear::new(FrozenWeight::Dense(w.clone()), Some(b.clone()));
        let y = layer.forward(x.as_tensor()).unwrap();
        let want = x
            .as_tensor()
            .broadcast_matmul(&w.t().unwrap())
            .unwrap()
            .broadcast_add(&b)
            .unwrap();
        assert!(max_diff(&y, &want) < 1e-6);
        let grads = y.sum_all().unwrap().backward().unwrap();
        let dx = grads.get(x.as_tensor()).unwrap();
        let want = Tensor::ones((2, 3, 6), DType::F32, &dev)
            .unwrap()
            .broadcast_matmul(&w)
            .unwrap();
        assert!(max_diff(dx, &want) < 1e-6);
        assert!(grads.get(&w).is_none());
    }

    /// On a CUDA device the kernel gives the CPU's bits (f32, bf16, f16;
    /// plain and double-quantized absmax). Skipped where no device is.
    #[cfg(feature = "cuda")]
    #[test]
    fn the_cuda_kernel_gives_the_cpus_bits() {
        let Ok(gpu) = Device::new_cuda(0) else {
            eprintln!("no CUDA device: skipped");
            return;
        };
        let (out, d_in) = (300, 1000); // blocks over several DOUBLE_BLOCKs, odd pairs none
        let v = varied(out * d_in);
        for double in [false, true] {
            let cpu = Nf4Weight::quantize(&v, (out, d_in), double, &Device::Cpu).unwrap();
            let cuda = Nf4Weight::quantize(&v, (out, d_in), double, &gpu).unwrap();
            for dtype in [DType::F32, DType::BF16, DType::F16] {
                let a = cpu.dequantize(dtype).unwrap();
                let b = cuda
                    .dequantize(dtype)
                    .unwrap()
                    .to_device(&Device::Cpu)
                    .unwrap();
                // Every dtype here widens to f32 exactly.
                let bits = |t: &Tensor| -> Vec<u32> {
                    t.to_dtype(DType::F32)
                        .unwrap()
                        .flatten_all()
                        .unwrap()
                        .to_vec1::<f32>()
                        .unwrap()
                        .iter()
                        .map(|v| v.to_bits())
                        .collect()
                };
                assert_eq!(bits(&a), bits(&b), "double {double}, {dtype:?}");
            }
        }
    }
}
