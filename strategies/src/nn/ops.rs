//! The fused ops: layers as single graph nodes with their own backward (layer
//! norm, RMS norm, biased linear maps, GELU, SwiGLU, rotary position
//! embedding, the token embedding lookup and the attention probabilities).
//!
//! Composed from candle ops, each of these keeps every intermediate result
//! alive for backward, and its backward is a chain of small kernels, each
//! storing its result in candle's gradient store. As one custom op each, the
//! graph keeps only the op's output (its inputs are kept anyway, by the ops
//! that made them) and the backward is one pass over the saved inputs: norms
//! recompute their row statistics, GELU and SwiGLU their derivative.
//! Arithmetic is in f32 whatever the storage dtype (f32, bf16 or f16). On the
//! CPU rows run in parallel; on CUDA (feature `cuda`) the kernels are
//! `fused.cu`, compiled at run time with NVRTC.
//!
//! Every op but RoPE and the attention probabilities (`[b, heads, s, d]`
//! inputs) works on the last dimension of a contiguous tensor of any rank, so
//! no reshape node sits around it.
//!
//! ```
//! use candle_core::{DType, Device, Tensor, Var};
//! use oomfix_strategies::nn::ops::{gelu, layer_norm, GeluForm};
//!
//! let x = Var::randn(0f32, 1.0, (2, 3, 8), &Device::Cpu)?;
//! let w = Tensor::ones(8, DType::F32, &Device::Cpu)?;
//! let b = Tensor::zeros(8, DType::F32, &Device::Cpu)?;
//! let y = gelu(&layer_norm(x.as_tensor(), &w, &b, 1e-5)?, GeluForm::Tanh)?;
//! let grads = y.sum_all()?.backward()?;
//! assert_eq!(grads.get(&x).unwrap().dims(), &[2, 3, 8]);
//! # Ok::<(), candle_core::Error>(())
//! ```

use candle_core::backend::BackendStorage;
#[cfg(feature = "cuda")]
use candle_core::CudaStorage;
use candle_core::{CpuStorage, DType, Layout, Result, Shape, Tensor, WithDType, D};

use crate::custom_op::{CustomOp, Input, Kernel};
use rayon::prelude::*;

/// How a projection's weight is stored, for [`linear`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightLayout {
    /// `[in, out]`: GPT-2's `Conv1D`, `y = x W + b`.
    InOut,
    /// `[out, in]`: `torch.nn.Linear` and `candle_nn::Linear`, `y = x Wᵀ + b`.
    OutIn,
}

#[cfg(feature = "cuda")]
mod cuda;

/// Which GELU: the tanh approximation (GPT-2's `gelu_new`) or the exact erf form (BERT).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GeluForm {
    /// `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`.
    Tanh,
    /// `0.5·x·(1 + erf(x/√2))`.
    Erf,
}

/// Which normalisation a [`Norm`] op computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NormKind {
    /// `(x − mean)/√(var + eps)·w + b`.
    Layer,
    /// `x/√(mean(x²) + eps)·w`.
    Rms,
}

/// `(x − mean(x))/√(var(x) + eps)·w + b` over the last dimension of `x`; `w`
/// and `b` are `[h]` in `x`'s dtype. Keeps only its output for backward.
pub fn layer_norm(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64) -> Result<Tensor> {
    check_param(x, w, "the scale")?;
    check_param(x, b, "the shift")?;
    let op = Norm {
        kind: NormKind::Layer,
        eps: eps as f32,
        offset: 0.0,
    };
    x.contiguous()?
        .apply_op3(&w.contiguous()?, &b.contiguous()?, CustomOp(op))
}

/// [`layer_norm`] without the shift: `(x − mean(x))/√(var(x) + eps)·w` over
/// the last dimension of `x`; `w` is `[h]` in `x`'s dtype. Keeps only its
/// output for backward.
pub fn layer_norm_no_bias(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    check_param(x, w, "the scale")?;
    let op = Norm {
        kind: NormKind::Layer,
        eps: eps as f32,
        offset: 0.0,
    };
    x.contiguous()?.apply_op2(&w.contiguous()?, CustomOp(op))
}

/// `x/√(mean(x²) + eps)·w` over the last dimension of `x`; `w` is `[h]` in
/// `x`'s dtype. Keeps only its output for backward.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    rms_norm_offset(x, w, eps, 0.0)
}

/// [`rms_norm`] scaled by `w + offset` instead of `w`, the sum taken in f32:
/// `x/√(mean(x²) + eps)·(offset + w)` (Gemma's norms store `w` with
/// `offset` 1). The output is rounded to `x`'s dtype once, after the scale.
/// Keeps only its output for backward.
pub fn rms_norm_offset(x: &Tensor, w: &Tensor, eps: f64, offset: f32) -> Result<Tensor> {
    check_param(x, w, "the scale")?;
    let op = Norm {
        kind: NormKind::Rms,
        eps: eps as f32,
        offset,
    };
    x.contiguous()?.apply_op2(&w.contiguous()?, CustomOp(op))
}

/// `x·W + b` over the last dimension of `x` (`[.., in]` → `[.., out]`), with
/// `W` stored as `layout` says and `b` `[out]`. One matrix product and the
/// bias added in place: the graph keeps only the output.
pub fn linear(x: &Tensor, w: &Tensor, b: &Tensor, layout: WeightLayout) -> Result<Tensor> {
    x.contiguous()?
        .apply_op3(w, &b.contiguous()?, CustomOp(Linear { layout }))
}

/// `x·W` over the last dimension of `x` (`[.., in]` → `[.., out]`), with `W`
/// stored as `layout` says and no bias: one node whose backward makes the
/// weight's gradient in the weight's own layout (`dyᵀ·x` for `[out, in]`),
/// where `x.matmul(&w.t())` makes it transposed and copies it back.
pub fn project(x: &Tensor, w: &Tensor, layout: WeightLayout) -> Result<Tensor> {
    x.contiguous()?.apply_op2(w, CustomOp(Linear { layout }))
}

/// GELU of `x` (any shape), keeping nothing but its input and output.
pub fn gelu(x: &Tensor, form: GeluForm) -> Result<Tensor> {
    x.contiguous()?.apply_op1(CustomOp(Gelu(form)))
}

/// `silu(gate)·up` (Llama's MLP), keeping nothing but its inputs and output.
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    if gate.shape() != up.shape() {
        candle_core::bail!(
            "swiglu: gate {:?} and up {:?} differ",
            gate.dims(),
            up.dims()
        );
    }
    gate.contiguous()?
        .apply_op2(&up.contiguous()?, CustomOp(Swiglu))
}

/// Rotary position embedding of `x` (`[b, s, n·d]` or `[b, s, n, d]`,
/// `n` = `heads`) with the heads moved first: `[b, n, s, d]`, contiguous, ready
/// for attention. Element `i < d/2` of a head becomes `x_i·cos_i + x_{i+d/2}·sin_i`
/// and element `i + d/2` becomes `x_{i+d/2}·cos_{i+d/2} + x_i·sin_{i+d/2}`, with
/// `cos` and `sin` the first `s` rows of `tables` (a [`RopeTables`]), or,
/// with per-token tables ([`RopeTables::at_positions`]), row `bb·s + p`
/// for token `p` of batch row `bb`.
///
/// One graph node that keeps nothing (its backward is the transposed map of
/// the output's gradient), instead of the composed form's half-swapped copy,
/// two products, sum and head transpose, and the table gradients candle's
/// backward computes for each broadcast product.
pub fn rope(x: &Tensor, heads: usize, tables: &RopeTables) -> Result<Tensor> {
    let (b, s) = (x.dim(0)?, x.dim(1)?);
    let d = tables.cos.dim(1)?;
    let rows = tables.cos.dim(0)?;
    let rows_fit = if tables.per_token {
        rows == b * s
    } else {
        rows >= s
    };
    if x.elem_count() != b * s * heads * d || d % 2 != 0 || !rows_fit {
        candle_core::bail!(
            "rope: x {:?} is not [b, s, {heads}·{d}] for tables of {:?} {} (even d)",
            x.dims(),
            tables.cos.dims(),
            if tables.per_token {
                "tokens"
            } else {
                "positions"
            }
        );
    }
    let op = Rope {
        tables: tables.clone(),
        dims: [b, s, heads, d],
        back: false,
    };
    x.contiguous()?.apply_op1(CustomOp(op))
}

/// The `[positions, d]` f32 cosine and signed-sine tables of [`rope`], or
/// their rows at each token's position (`[b·s, d]`,
/// [`RopeTables::at_positions`]).
#[derive(Debug, Clone)]
pub struct RopeTables {
    cos: Tensor,
    sin: Tensor,
    /// Row `bb·s + p` is token `p` of batch row `bb` (else row `p` serves
    /// position `p` of every batch row).
    per_token: bool,
}

impl RopeTables {
    /// Tables for positions `0..s` and heads of `head_dim` (even), with the
    /// frequencies `theta^(-2i/head_dim)` of Llama's `rotate_half` form, every
    /// entry multiplied by `scale` (an attention scale folded into the queries'
    /// tables costs no tensor).
    pub fn new(
        s: usize,
        head_dim: usize,
        theta: f64,
        scale: f64,
        device: &candle_core::Device,
    ) -> Result<Self> {
        let inv_freq: Vec<f64> = (0..head_dim / 2)
            .map(|i| theta.powf(-2.0 * i as f64 / head_dim as f64))
            .collect();
        Self::from_inv_freq(s, &inv_freq, scale, device)
    }

    /// Tables for positions `0..s` and heads of `2·inv_freq.len()`, with the
    /// given frequencies (a scaled RoPE's), every entry multiplied by `scale`.
    pub fn from_inv_freq(
        s: usize,
        inv_freq: &[f64],
        scale: f64,
        device: &candle_core::Device,
    ) -> Result<Self> {
        let head_dim = 2 * inv_freq.len();
        let mut cos = Vec::with_capacity(s * head_dim);
        let mut sin = Vec::with_capacity(s * head_dim);
        for p in 0..s {
            let angles: Vec<f64> = inv_freq.iter().map(|f| p as f64 * f).collect();
            cos.extend(
                angles
                    .iter()
                    .chain(&angles)
                    .map(|a| (a.cos() * scale) as f32),
            );
            // rotate_half(x) = [-x2, x1]: the first half's sines carry the minus sign.
            sin.extend(angles.iter().map(|a| (-a.sin() * scale) as f32));
            sin.extend(angles.iter().map(|a| (a.sin() * scale) as f32));
        }
        Ok(RopeTables {
            cos: Tensor::from_vec(cos, (s, head_dim), device)?,
            sin: Tensor::from_vec(sin, (s, head_dim), device)?,
            per_token: false,
        })
    }

    /// Per-token tables: the rows of these (per-position) tables at
    /// `positions` (`[b, s]` u32, on the tables' device, each below the
    /// tables' number of positions), as `[b·s, d]` tables that [`rope`]
    /// reads row `bb·s + p` of for token `p` of batch row `bb`. Packed
    /// documents each count their positions from 0 so.
    pub fn at_positions(&self, positions: &Tensor) -> Result<Self> {
        let rows = self.cos.dim(0)?;
        if self.per_token || positions.rank() != 2 || positions.dtype() != DType::U32 {
            candle_core::bail!(
                "rope tables at positions: need per-position tables and [b, s] u32 positions, \
                 got {} tables and {:?} {:?}",
                if self.per_token {
                    "per-token"
                } else {
                    "per-position"
                },
                positions.dims(),
                positions.dtype()
            );
        }
        let ids = positions.flatten_all()?;
        // The CPU lookup checks the ids; a CUDA one would not.
        if ids.elem_count() > 0 {
            let last = ids.max(0)?.to_scalar::<u32>()? as usize;
            if last >= rows {
                candle_core::bail!("rope tables at positions: position {last} of {rows}");
            }
        }
        Ok(RopeTables {
            cos: self.cos.index_select(&ids, 0)?,
            sin: self.sin.index_select(&ids, 0)?,
            per_token: true,
        })
    }
}

/// The contiguous elements of a CPU storage as a slice of `T`.
fn cpu_slice<'a, T: WithDType>(s: &'a CpuStorage, l: &Layout) -> Result<&'a [T]> {
    let (a, b) = l
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("fused op: inputs must be contiguous".into()))?;
    Ok(&T::cpu_storage_as_slice(s)?[a..b])
}

/// Calls the generic `$f::<T>($args)` for the element type of `$dtype`
/// (f32, bf16 or f16); any other dtype is an error.
macro_rules! by_dtype {
    ($dtype:expr, $f:ident($($arg:expr),*)) => {
        match $dtype {
            DType::F32 => $f::<f32>($($arg),*),
            DType::BF16 => $f::<half::bf16>($($arg),*),
            DType::F16 => $f::<half::f16>($($arg),*),
            other => candle_core::bail!("fused op: unsupported dtype {other:?}"),
        }
    };
}

/// Checks that a norm's `[h]` parameter matches `x`'s rows and dtype.
fn check_param(x: &Tensor, p: &Tensor, what: &str) -> Result<()> {
    let h = x.dims().last().copied().unwrap_or(1);
    if p.dims() != [h] || p.dtype() != x.dtype() {
        candle_core::bail!(
            "norm: {what} must be [{h}] {:?}, got {:?} {:?}",
            x.dtype(),
            p.dims(),
            p.dtype()
        );
    }
    Ok(())
}

/// The sum of the rows of a `[n, c]` tensor, `[c]` in its dtype.
///
/// On CUDA as the product `1ᵀ·t` (cuBLAS, f32 accumulation): candle's
/// reduction over the first dimension gives each block one column, read with
/// a stride (on the H200, 80 µs a call on average over GPT-2 small's bias
/// and norm gradients at n = 8192, fp32: 3% of a step's kernel time); on the
/// CPU, `sum(0)`.
fn column_sum(t: &Tensor) -> Result<Tensor> {
    let (n, c) = t.dims2()?;
    if !t.device().is_cuda() || n == 0 {
        return t.sum(0);
    }
    Tensor::ones((1, n), t.dtype(), t.device())?
        .matmul(t)?
        .reshape(c)
}

#[inline]
fn f(x: impl WithDType) -> f32 {
    x.to_f64() as f32
}

/// A row's mean (0 for RMS norm) and `1/√(var + eps)` (RMS: of the mean square).
fn row_stats<T: WithDType>(row: &[T], kind: NormKind, eps: f32) -> (f32, f32) {
    let h = row.len().max(1) as f32;
    let mean = match kind {
        NormKind::Layer => row.iter().map(|&v| f(v)).sum::<f32>() / h,
        NormKind::Rms => 0.0,
    };
    let var = row.iter().map(|&v| (f(v) - mean).powi(2)).sum::<f32>() / h;
    (mean, 1.0 / (var + eps).sqrt())
}

/// Forward: `x`, `w`, (with a shift) `b` → `y` in `x`'s dtype.
#[derive(Debug, Clone, Copy)]
struct Norm {
    kind: NormKind,
    eps: f32,
    /// Added to the scale `w` (in f32) before it multiplies.
    offset: f32,
}

fn norm_cpu<T: WithDType>(
    op: Norm,
    x: (&CpuStorage, &Layout),
    w: (&CpuStorage, &Layout),
    b: Option<(&CpuStorage, &Layout)>,
    h: usize,
) -> Result<CpuStorage> {
    let (x, w) = (cpu_slice::<T>(x.0, x.1)?, cpu_slice::<T>(w.0, w.1)?);
    let b = b.map(|(s, l)| cpu_slice::<T>(s, l)).transpose()?;
    let mut y = vec![T::zero(); x.len()];
    y.par_chunks_mut(h.max(1))
        .zip(x.par_chunks(h.max(1)))
        .for_each(|(y, x)| {
            let (mean, rstd) = row_stats(x, op.kind, op.eps);
            for (j, (y, &v)) in y.iter_mut().zip(x).enumerate() {
                let shift = b.map_or(0.0, |b| f(b[j]));
                *y = T::from_f64(((f(v) - mean) * rstd * (f(w[j]) + op.offset) + shift) as f64);
            }
        });
    Ok(T::to_cpu_storage_owned(y))
}

impl Norm {
    fn cpu(
        &self,
        x: (&CpuStorage, &Layout),
        w: (&CpuStorage, &Layout),
        b: Option<(&CpuStorage, &Layout)>,
    ) -> Result<(CpuStorage, Shape)> {
        let h = w.1.shape().elem_count();
        let y = by_dtype!(x.0.dtype(), norm_cpu(*self, x, w, b, h))?;
        Ok((y, x.1.shape().clone()))
    }

    /// Gradients of `x` and `w` from the output's gradient, and of `b` when
    /// the norm has one (`shift`).
    ///
    /// With `x̂ = (x − mean)·rstd` and `g = dy·w`:
    /// `dx = rstd·(g − mean(g) − x̂·mean(g·x̂))` (RMS: without `mean(g)`),
    /// `dw = Σ_rows dy·x̂`, `db = Σ_rows dy`; sums in f32.
    fn grads(
        &self,
        x: &Tensor,
        w: &Tensor,
        dy: &Tensor,
        shift: bool,
    ) -> Result<(Tensor, Tensor, Option<Tensor>)> {
        let (x, w, dy) = (x.detach(), w.detach(), dy.contiguous()?);
        let grad = |part| CustomOp(NormGrad(*self, part));
        let dx = x.apply_op3_no_bwd(&w, &dy, &grad(NormGradPart::Input))?;
        let rows = |t: Tensor| t.reshape(((), w.dim(0)?));
        let scaled = x.apply_op3_no_bwd(&w, &dy, &grad(NormGradPart::Scale))?;
        let dw = column_sum(&rows(scaled)?)?.to_dtype(w.dtype())?;
        let db = shift
            .then(|| column_sum(&rows(dy.to_dtype(DType::F32)?)?)?.to_dtype(w.dtype()))
            .transpose()?;
        Ok((dx, dw, db))
    }
}

impl Kernel<3> for Norm {
    fn name(&self) -> &'static str {
        "oomfix-layer-norm"
    }

    fn cpu_fwd(&self, [x, w, b]: [Input<'_, CpuStorage>; 3]) -> Result<(CpuStorage, Shape)> {
        self.cpu(x, w, Some(b))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, [x, w, b]: [Input<'_, CudaStorage>; 3]) -> Result<(CudaStorage, Shape)> {
        cuda::norm(*self, x, w, Some(b))
    }

    fn bwd(&self, [x, w, _]: [&Tensor; 3], _: &Tensor, dy: &Tensor) -> Result<[Option<Tensor>; 3]> {
        let (dx, dw, db) = self.grads(x, w, dy, true)?;
        Ok([Some(dx), Some(dw), db])
    }
}

/// A norm without a shift: RMS norm, or layer norm without its bias.
impl Kernel<2> for Norm {
    fn name(&self) -> &'static str {
        match self.kind {
            NormKind::Layer => "oomfix-layer-norm-no-bias",
            NormKind::Rms => "oomfix-rms-norm",
        }
    }

    fn cpu_fwd(&self, [x, w]: [Input<'_, CpuStorage>; 2]) -> Result<(CpuStorage, Shape)> {
        self.cpu(x, w, None)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, [x, w]: [Input<'_, CudaStorage>; 2]) -> Result<(CudaStorage, Shape)> {
        cuda::norm(*self, x, w, None)
    }

    fn bwd(&self, [x, w]: [&Tensor; 2], _: &Tensor, dy: &Tensor) -> Result<[Option<Tensor>; 2]> {
        let (dx, dw, _) = self.grads(x, w, dy, false)?;
        Ok([Some(dx), Some(dw)])
    }
}

/// Which of a norm's backward results [`NormGrad`] computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NormGradPart {
    /// `dx` in `x`'s dtype.
    Input,
    /// `dy·x̂` in f32, `x`'s shape (summed over rows into the scale's gradient).
    Scale,
}

/// Backward of [`Norm`]: `x`, `w`, `dy` → one [`NormGradPart`].
struct NormGrad(Norm, NormGradPart);

fn norm_grad_cpu<T: WithDType>(
    op: &NormGrad,
    x: (&CpuStorage, &Layout),
    w: (&CpuStorage, &Layout),
    dy: (&CpuStorage, &Layout),
) -> Result<CpuStorage> {
    let NormGrad(Norm { kind, eps, offset }, part) = *op;
    let (x, w, dy) = (
        cpu_slice::<T>(x.0, x.1)?,
        cpu_slice::<T>(w.0, w.1)?,
        cpu_slice::<T>(dy.0, dy.1)?,
    );
    let h = w.len().max(1);
    let rows = x.par_chunks(h).zip(dy.par_chunks(h));
    Ok(match part {
        NormGradPart::Input => {
            let mut dx = vec![T::zero(); x.len()];
            dx.par_chunks_mut(h).zip(rows).for_each(|(dx, (x, dy))| {
                let (mean, rstd) = row_stats(x, kind, eps);
                let xhat = |j: usize| (f(x[j]) - mean) * rstd;
                let g = |j: usize| f(dy[j]) * (f(w[j]) + offset);
                let mean_g = match kind {
                    NormKind::Layer => (0..h).map(g).sum::<f32>() / h as f32,
                    NormKind::Rms => 0.0,
                };
                let mean_gx = (0..h).map(|j| g(j) * xhat(j)).sum::<f32>() / h as f32;
                for (j, dx) in dx.iter_mut().enumerate() {
                    *dx = T::from_f64((rstd * (g(j) - mean_g - xhat(j) * mean_gx)) as f64);
                }
            });
            T::to_cpu_storage_owned(dx)
        }
        NormGradPart::Scale => {
            let mut out = vec![0f32; x.len()];
            out.par_chunks_mut(h).zip(rows).for_each(|(out, (x, dy))| {
                let (mean, rstd) = row_stats(x, kind, eps);
                for ((o, &x), &dy) in out.iter_mut().zip(x).zip(dy) {
                    *o = f(dy) * (f(x) - mean) * rstd;
                }
            });
            CpuStorage::F32(out)
        }
    })
}

impl Kernel<3> for NormGrad {
    fn name(&self) -> &'static str {
        "oomfix-norm-backward"
    }

    fn cpu_fwd(&self, [x, w, dy]: [Input<'_, CpuStorage>; 3]) -> Result<(CpuStorage, Shape)> {
        let out = by_dtype!(x.0.dtype(), norm_grad_cpu(self, x, w, dy))?;
        Ok((out, x.1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, [x, w, dy]: [Input<'_, CudaStorage>; 3]) -> Result<(CudaStorage, Shape)> {
        cuda::norm_grad(self.0, self.1, x, w, dy)
    }
}

/// `x·W + b`: one matrix product, then the bias added in place (three
/// inputs: [`linear`]); without a bias, the product alone (two: [`project`]).
struct Linear {
    layout: WeightLayout,
}

impl Linear {
    /// `(n, in, out)` of the product and the weight's layout as the `[in, out]`
    /// right-hand side.
    fn dims(&self, x: &Layout, w: &Layout) -> Result<(usize, usize, usize, Layout)> {
        let d_in = x.shape().dims().last().copied().unwrap_or(1);
        let (rhs, (k, out)) = match self.layout {
            WeightLayout::InOut => (w.clone(), w.shape().dims2()?),
            WeightLayout::OutIn => {
                let t = w.transpose(0, 1)?;
                let dims = t.shape().dims2()?;
                (t, dims)
            }
        };
        if k != d_in {
            candle_core::bail!("linear: input has {d_in} features, the weight {k}");
        }
        Ok((x.shape().elem_count() / d_in.max(1), d_in, out, rhs))
    }

    /// The matrix product `x·W` on either device, after checking the bias's
    /// layout `b` (if any): the `[n, out]` storage, `n`, and the output's
    /// shape (`x`'s with the last dimension `out`).
    fn product<S: BackendStorage>(
        &self,
        (x, xl): (&S, &Layout),
        (w, wl): (&S, &Layout),
        b: Option<&Layout>,
    ) -> Result<(S, usize, Shape)> {
        let (n, d_in, out, rhs) = self.dims(xl, wl)?;
        if let Some(b) = b.filter(|b| b.shape().dims() != [out]) {
            candle_core::bail!("linear: the bias must be [{out}], got {:?}", b.dims());
        }
        let lhs = Layout::contiguous_with_offset((n, d_in), xl.start_offset());
        let y = x.matmul(w, (1, n, out, d_in), &lhs, &rhs)?;
        let mut dims = xl.shape().dims().to_vec();
        if let Some(last) = dims.last_mut() {
            *last = out;
        }
        Ok((y, n, Shape::from(dims)))
    }

    /// `x`'s gradient, `W`'s in its own layout (`dx = dy·Wᵀ`, `dW = xᵀ·dy`;
    /// `[out, in]` weights: `dyᵀ·x`), and `dy` as `[n, out]`, all from
    /// detached tensors so that no gradient carries a graph.
    fn grads(&self, x: &Tensor, w: &Tensor, dy: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let (x, w) = (x.detach(), w.detach());
        let d_in = x.dim(D::Minus1)?;
        let x2 = x.reshape(((), d_in))?;
        let dy2 = dy.reshape(((), dy.dim(D::Minus1)?))?;
        let (dx, dw) = match self.layout {
            WeightLayout::InOut => (dy2.matmul(&w.t()?)?, x2.t()?.matmul(&dy2)?),
            WeightLayout::OutIn => (dy2.matmul(&w)?, dy2.t()?.matmul(&x2)?),
        };
        Ok((dx.reshape(x.shape())?, dw, dy2))
    }
}

fn add_bias_cpu<T: WithDType>(y: CpuStorage, b: &[T]) -> Result<CpuStorage> {
    let mut y = T::cpu_storage_data(y)?;
    y.par_chunks_mut(b.len().max(1)).for_each(|row| {
        for (y, &b) in row.iter_mut().zip(b) {
            *y = T::from_f64((f(*y) + f(b)) as f64);
        }
    });
    Ok(T::to_cpu_storage_owned(y))
}

impl Kernel<3> for Linear {
    fn name(&self) -> &'static str {
        "oomfix-linear"
    }

    fn cpu_fwd(&self, [x, w, b]: [Input<'_, CpuStorage>; 3]) -> Result<(CpuStorage, Shape)> {
        let (y, _, shape) = self.product(x, w, Some(b.1))?;
        let y = by_dtype!(x.0.dtype(), add_bias_cpu(y, cpu_slice(b.0, b.1)?))?;
        Ok((y, shape))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, [x, w, b]: [Input<'_, CudaStorage>; 3]) -> Result<(CudaStorage, Shape)> {
        let (mut y, n, shape) = self.product(x, w, Some(b.1))?;
        cuda::add_bias(&mut y, n, b)?;
        Ok((y, shape))
    }

    /// `dx`, `dW` ([`Linear::grads`]) and `db = Σ_rows dy`.
    fn bwd(&self, [x, w, _]: [&Tensor; 3], _: &Tensor, dy: &Tensor) -> Result<[Option<Tensor>; 3]> {
        let (dx, dw, dy2) = self.grads(x, w, dy)?;
        Ok([Some(dx), Some(dw), Some(column_sum(&dy2)?)])
    }
}

/// `x·W` without a bias ([`project`]).
impl Kernel<2> for Linear {
    fn name(&self) -> &'static str {
        "oomfix-project"
    }

    fn cpu_fwd(&self, [x, w]: [Input<'_, CpuStorage>; 2]) -> Result<(CpuStorage, Shape)> {
        let (y, _, shape) = self.product(x, w, None)?;
        Ok((y, shape))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, [x, w]: [Input<'_, CudaStorage>; 2]) -> Result<(CudaStorage, Shape)> {
        let (y, _, shape) = self.product(x, w, None)?;
        Ok((y, shape))
    }

    fn bwd(&self, [x, w]: [&Tensor; 2], _: &Tensor, dy: &Tensor) -> Result<[Option<Tensor>; 2]> {
        let (dx, dw, _) = self.grads(x, w, dy)?;
        Ok([Some(dx), Some(dw)])
    }
}

/// GELU: `x` → `gelu(x)`.
struct Gelu(GeluForm);

/// Backward of [`Gelu`]: `x`, `dy` → `dy·gelu'(x)`.
struct GeluGrad(GeluForm);

/// `gelu(x)` and `gelu'(x)`.
fn gelu_and_slope(x: f32, form: GeluForm) -> (f32, f32) {
    match form {
        GeluForm::Tanh => {
            const K: f32 = 0.797_884_6; // √(2/π)
            const C: f32 = 0.044_715;
            let t = (K * (x + C * x * x * x)).tanh();
            let slope = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * K * (1.0 + 3.0 * C * x * x);
            (0.5 * x * (1.0 + t), slope)
        }
        GeluForm::Erf => {
            let cdf =
                0.5 * (1.0 + candle_core::cpu::erf::erf_f32(x * std::f32::consts::FRAC_1_SQRT_2));
            let pdf = (-0.5 * x * x).exp() * 0.398_942_3; // 1/√(2π)
            (x * cdf, cdf + x * pdf)
        }
    }
}

fn gelu_cpu<T: WithDType>(x: &[T], dy: Option<&[T]>, form: GeluForm) -> CpuStorage {
    let out: Vec<T> = match dy {
        None => x
            .par_iter()
            .map(|&x| T::from_f64(gelu_and_slope(f(x), form).0 as f64))
            .collect(),
        Some(dy) => x
            .par_iter()
            .zip(dy)
            .map(|(&x, &dy)| T::from_f64((f(dy) * gelu_and_slope(f(x), form).1) as f64))
            .collect(),
    };
    T::to_cpu_storage_owned(out)
}

impl Kernel<1> for Gelu {
    fn name(&self) -> &'static str {
        "oomfix-gelu"
    }

    fn cpu_fwd(&self, [x]: [Input<'_, CpuStorage>; 1]) -> Result<(CpuStorage, Shape)> {
        let y = by_dtype!(x.0.dtype(), gelu_slices(x, None, self.0))?;
        Ok((y, x.1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, [x]: [Input<'_, CudaStorage>; 1]) -> Result<(CudaStorage, Shape)> {
        cuda::gelu(self.0, x, None)
    }

    fn bwd(&self, [x]: [&Tensor; 1], _: &Tensor, dy: &Tensor) -> Result<[Option<Tensor>; 1]> {
        let grad = CustomOp(GeluGrad(self.0));
        Ok([Some(x.detach().apply_op2_no_bwd(&dy.contiguous()?, &grad)?)])
    }
}

fn gelu_slices<T: WithDType>(
    x: Input<'_, CpuStorage>,
    dy: Option<Input<'_, CpuStorage>>,
    form: GeluForm,
) -> Result<CpuStorage> {
    let dy = dy.map(|(s, l)| cpu_slice::<T>(s, l)).transpose()?;
    Ok(gelu_cpu(cpu_slice::<T>(x.0, x.1)?, dy, form))
}

impl Kernel<2> for GeluGrad {
    fn name(&self) -> &'static str {
        "oomfix-gelu-backward"
    }

    fn cpu_fwd(&self, [x, dy]: [Input<'_, CpuStorage>; 2]) -> Result<(CpuStorage, Shape)> {
        let dx = by_dtype!(x.0.dtype(), gelu_slices(x, Some(dy), self.0))?;
        Ok((dx, x.1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, [x, dy]: [Input<'_, CudaStorage>; 2]) -> Result<(CudaStorage, Shape)> {
        cuda::gelu(self.0, x, Some(dy))
    }
}

/// SwiGLU: `gate`, `up` → `silu(gate)·up`.
struct Swiglu;

/// Backward of [`Swiglu`]: `gate`, `up`, `dy` → `[2, ..]`: the gradients of
/// `gate` and of `up`, stacked.
struct SwigluGrad;

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

fn swiglu_cpu<T: WithDType>(
    g: (&CpuStorage, &Layout),
    u: (&CpuStorage, &Layout),
    dy: Option<(&CpuStorage, &Layout)>,
) -> Result<CpuStorage> {
    let (g, u) = (cpu_slice::<T>(g.0, g.1)?, cpu_slice::<T>(u.0, u.1)?);
    let values = g.par_iter().zip(u);
    let out: Vec<T> = match dy {
        None => values
            .map(|(&g, &u)| T::from_f64((f(g) * sigmoid(f(g)) * f(u)) as f64))
            .collect(),
        Some((s, l)) => {
            let dy = cpu_slice::<T>(s, l)?;
            let (mut dg, du): (Vec<T>, Vec<T>) = values
                .zip(dy)
                .map(|((&g, &u), &dy)| {
                    let (g, u, dy) = (f(g), f(u), f(dy));
                    let sg = sigmoid(g);
                    let dg = dy * u * sg * (1.0 + g * (1.0 - sg));
                    (T::from_f64(dg as f64), T::from_f64((dy * g * sg) as f64))
                })
                .unzip();
            dg.extend(du);
            dg
        }
    };
    Ok(T::to_cpu_storage_owned(out))
}

impl Kernel<2> for Swiglu {
    fn name(&self) -> &'static str {
        "oomfix-swiglu"
    }

    fn cpu_fwd(&self, [g, u]: [Input<'_, CpuStorage>; 2]) -> Result<(CpuStorage, Shape)> {
        let y = by_dtype!(g.0.dtype(), swiglu_cpu(g, u, None))?;
        Ok((y, g.1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, [g, u]: [Input<'_, CudaStorage>; 2]) -> Result<(CudaStorage, Shape)> {
        cuda::swiglu(g, u, None)
    }

    fn bwd(&self, [g, u]: [&Tensor; 2], _: &Tensor, dy: &Tensor) -> Result<[Option<Tensor>; 2]> {
        let both =
            g.detach()
                .apply_op3_no_bwd(&u.detach(), &dy.contiguous()?, &CustomOp(SwigluGrad))?;
        Ok([Some(both.get(0)?), Some(both.get(1)?)])
    }
}

impl Kernel<3> for SwigluGrad {
    fn name(&self) -> &'static str {
        "oomfix-swiglu-backward"
    }

    fn cpu_fwd(&self, [g, u, dy]: [Input<'_, CpuStorage>; 3]) -> Result<(CpuStorage, Shape)> {
        let out = by_dtype!(g.0.dtype(), swiglu_cpu(g, u, Some(dy)))?;
        Ok((out, stacked(g.1)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, [g, u, dy]: [Input<'_, CudaStorage>; 3]) -> Result<(CudaStorage, Shape)> {
        let out = cuda::swiglu(g, u, Some(dy))?.0;
        Ok((out, stacked(g.1)))
    }
}

/// `[2, ..]`: two tensors of `l`'s shape stacked.
fn stacked(l: &Layout) -> Shape {
    let mut dims = vec![2];
    dims.extend_from_slice(l.shape().dims());
    Shape::from(dims)
}

/// [`rope`]'s map (`back`: its transpose, `[b, n, s, d]` → `[b, s, n, d]`).
struct Rope {
    tables: RopeTables,
    /// `[b, s, n, d]`.
    dims: [usize; 4],
    back: bool,
}

/// `per_token`: the tables' row of token `p` of batch row `bb` is `bb·s + p`
/// (else `p`).
fn rope_cpu<T: WithDType>(
    x: &[T],
    (cos, sin): (&[f32], &[f32]),
    [_, s, n, d]: [usize; 4],
    back: bool,
    per_token: bool,
) -> CpuStorage {
    let half = d / 2;
    let mut y = vec![T::zero(); x.len()];
    // One output row (batch, head, position) per chunk, in the output's order.
    y.par_chunks_mut(d.max(1)).enumerate().for_each(|(row, y)| {
        let (bb, rest) = (row / (s * n), row % (s * n));
        // The position and the input row's offset; output rows are [b, s, n]
        // backward, [b, n, s] forward.
        let (p, input) = if back {
            let (p, hh) = (rest / n, rest % n);
            (p, ((bb * n + hh) * s + p) * d)
        } else {
            let (hh, p) = (rest / s, rest % s);
            (p, ((bb * s + p) * n + hh) * d)
        };
        let t = if per_token { bb * s + p } else { p };
        let (x, c, sn) = (&x[input..input + d], &cos[t * d..], &sin[t * d..]);
        for i in 0..half {
            let (lo, hi) = (f(x[i]), f(x[i + half]));
            let (s_lo, s_hi) = if back {
                (sn[i + half], sn[i])
            } else {
                (sn[i], sn[i + half])
            };
            y[i] = T::from_f64((lo * c[i] + hi * s_lo) as f64);
            y[i + half] = T::from_f64((hi * c[i + half] + lo * s_hi) as f64);
        }
    });
    T::to_cpu_storage_owned(y)
}

impl Kernel<1> for Rope {
    fn name(&self) -> &'static str {
        "oomfix-rope"
    }

    fn cpu_fwd(&self, [(st, l)]: [Input<'_, CpuStorage>; 1]) -> Result<(CpuStorage, Shape)> {
        let (cos, sin) = (
            self.tables.cos.storage_and_layout(),
            self.tables.sin.storage_and_layout(),
        );
        let (candle_core::Storage::Cpu(cs), candle_core::Storage::Cpu(ss)) = (&*cos.0, &*sin.0)
        else {
            candle_core::bail!("rope: the tables are not on the CPU");
        };
        let (cos, sin) = (cpu_slice::<f32>(cs, cos.1)?, cpu_slice::<f32>(ss, sin.1)?);
        let per_token = self.tables.per_token;
        let y = by_dtype!(
            st.dtype(),
            rope_slices(st, l, (cos, sin), self.dims, self.back, per_token)
        )?;
        Ok((y, self.out_shape()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, [x]: [Input<'_, CudaStorage>; 1]) -> Result<(CudaStorage, Shape)> {
        let y = cuda::rope(
            x,
            (&self.tables.cos, &self.tables.sin),
            self.dims,
            self.back,
            self.tables.per_token,
        )?;
        Ok((y, self.out_shape()))
    }

    fn bwd(&self, [x]: [&Tensor; 1], _: &Tensor, dy: &Tensor) -> Result<[Option<Tensor>; 1]> {
        let back = Rope {
            tables: self.tables.clone(),
            dims: self.dims,
            back: true,
        };
        let dx = dy.contiguous()?.apply_op1_no_bwd(&CustomOp(back))?;
        Ok([Some(dx.reshape(x.shape())?)])
    }
}

impl Rope {
    /// `[b, n, s, d]` forward, `[b, s, n, d]` backward.
    fn out_shape(&self) -> Shape {
        let [b, s, n, d] = self.dims;
        if self.back {
            Shape::from((b, s, n, d))
        } else {
            Shape::from((b, n, s, d))
        }
    }
}

fn rope_slices<T: WithDType>(
    st: &CpuStorage,
    l: &Layout,
    tables: (&[f32], &[f32]),
    dims: [usize; 4],
    back: bool,
    per_token: bool,
) -> Result<CpuStorage> {
    Ok(rope_cpu(
        cpu_slice::<T>(st, l)?,
        tables,
        dims,
        back,
        per_token,
    ))
}

mod embedding;
pub use embedding::{embedding, embedding_padded};

mod attention_probs;
pub use attention_probs::{attention_probs, PROBS_BACKWARD_CHUNKS};

/// The masking and scale of [`attention_probs`] (the CPU's and CUDA's kernels read it).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ProbsOptions {
    /// Factor applied to `q·kᵀ` before the softmax.
    pub scale: f32,
    /// Query `i` sees key `j` only when `j <= i + s_k − s_q` (the lower
    /// triangle when `s_q == s_k`).
    pub causal: bool,
}

#[cfg(test)]
pub(crate) mod tests;
