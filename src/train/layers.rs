//! Layers shared by the trainable families.
//!
//! Norms and biased projections are single graph nodes with their own backward
//! ([`super::fused`]); softmax and rotary embeddings are composed from
//! differentiable candle ops (candle's fused fast paths have no backward).
//! Every op output on the path to a parameter stays alive in candle's graph
//! until the loss is dropped, so each function's doc lists the tensors it
//! allocates; views (reshape of a contiguous tensor, transpose, narrow,
//! broadcast) allocate nothing.

use super::fused;
use crate::measure::tag::{Op, Scope};
use candle_core::{DType, Device, Result, Tensor, D};
use oomfix_strategies::attention::{flash_attention, AttentionOptions};
use oomfix_strategies::Attention;

/// How a projection's weight is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightLayout {
    /// `[in, out]`: GPT-2's `Conv1D`, `y = x W + b`.
    InOut,
    /// `[out, in]`: `torch.nn.Linear`, `y = x Wᵀ + b`.
    OutIn,
}

/// An affine projection of the last dimension.
#[derive(Debug, Clone)]
pub(crate) struct Linear {
    weight: Tensor,
    bias: Option<Tensor>,
    layout: WeightLayout,
}

impl Linear {
    pub(crate) fn new(weight: Tensor, bias: Option<Tensor>, layout: WeightLayout) -> Self {
        Linear {
            weight,
            bias,
            layout,
        }
    }

    /// `x`: `[b, s, in]`, contiguous → `[b, s, out]`.
    ///
    /// Allocates the output `[b·s, out]`: with a bias, [`fused::linear`] adds it
    /// in place. Without, `x` is flattened to 2-D (a view) so the weight gradient
    /// is one `[in, out]` matmul rather than a per-batch product summed afterwards.
    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let _op = Scope::op(Op::Matmul);
        if let Some(bias) = &self.bias {
            return fused::linear(x, &self.weight, bias, self.layout);
        }
        let (b, s, d_in) = x.dims3()?;
        let w = match self.layout {
            WeightLayout::InOut => self.weight.clone(),
            WeightLayout::OutIn => self.weight.t()?,
        };
        x.reshape((b * s, d_in))?.matmul(&w)?.reshape((b, s, ()))
    }
}

/// The vocabulary of the LM head's products is padded to a multiple of this
/// many rows (zero rows, masked out of the loss): with an odd vocabulary
/// (GPT-2's 50,257, BERT's 30,522 is only 2-aligned) each row of the logits
/// starts at a misaligned address and cuBLAS falls back to slow kernels for
/// the three products around them.
pub const VOCAB_ALIGN: usize = 64;

/// The LM head's logits `x·Wᵀ (+ b)`, `x` `[n, h]`, `W` `[V, h]`, `b` `[V]`,
/// over a vocabulary padded with zero rows to `P`, the next multiple of
/// [`VOCAB_ALIGN`]: `[n, P]`, whose first `V` columns are the logits (pass
/// `V` to [`super::loss::cross_entropy_padded`]). When `V` is a multiple
/// already, nothing is copied; otherwise the padded weight (and bias) is one
/// more `[P, h]` (`[P]`) tensor.
pub(crate) fn lm_logits(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    let _op = Scope::op(Op::Matmul);
    let (v, h) = w.dims2()?;
    let p = v.next_multiple_of(VOCAB_ALIGN);
    let pad = |t: &Tensor, shape: &[usize]| -> Result<Tensor> {
        if p == v {
            return Ok(t.clone());
        }
        let zeros = Tensor::zeros(shape, t.dtype(), t.device())?;
        Tensor::cat(&[t, &zeros], 0)
    };
    let w = pad(w, &[p - v, h])?;
    match b {
        Some(b) => fused::linear(x, &w, &pad(b, &[p - v])?, WeightLayout::OutIn),
        None => x.matmul(&w.t()?),
    }
}

/// Layer normalisation with scale and bias, computed in f32 (as PyTorch autocast
/// does) and returned in the input's dtype: one [`fused::layer_norm`] node.
#[derive(Debug, Clone)]
pub(crate) struct LayerNorm {
    weight: Tensor,
    bias: Tensor,
    eps: f64,
}

impl LayerNorm {
    pub(crate) fn new(weight: Tensor, bias: Tensor, eps: f64) -> Self {
        LayerNorm { weight, bias, eps }
    }

    /// Allocates the output, the size of `x`.
    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let _op = Scope::op(Op::LayerNorm);
        fused::layer_norm(x, &self.weight, &self.bias, self.eps)
    }
}

/// RMS normalisation with a scale, computed in f32 and returned in the input's
/// dtype: one [`fused::rms_norm`] node.
#[derive(Debug, Clone)]
pub(crate) struct RmsNorm {
    weight: Tensor,
    eps: f64,
}

impl RmsNorm {
    pub(crate) fn new(weight: Tensor, eps: f64) -> Self {
        RmsNorm { weight, eps }
    }

    /// Allocates the output, the size of `x`.
    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let _op = Scope::op(Op::RmsNorm);
        fused::rms_norm(x, &self.weight, self.eps)
    }
}

/// Softmax over the last dimension.
///
/// The row maximum is subtracted for stability and detached: softmax does not
/// depend on the shift, so the gradient is exact and the backward skips the
/// maximum's mask. Allocates the shifted values, their exponentials and the
/// output (three tensors the size of `x`) plus the row sums.
pub(crate) fn softmax(x: &Tensor) -> Result<Tensor> {
    let _op = Scope::op(Op::Softmax);
    let max = x.max_keepdim(D::Minus1)?.detach();
    let exp = x.broadcast_sub(&max)?.exp()?;
    exp.broadcast_div(&exp.sum_keepdim(D::Minus1)?)
}

/// A large negative score for masked attention positions in `dtype`, finite so that a
/// fully masked row gives uniform weights rather than NaN.
fn masked_score(dtype: DType) -> f64 {
    if dtype == DType::F16 {
        -65504.0
    } else {
        -1e9
    }
}

/// The additive causal mask `[s, s]` in `dtype`: 0 on and below the diagonal,
/// a large negative value above. Built once per forward and broadcast over batch
/// and heads.
fn causal_mask(s: usize, dtype: DType, device: &Device) -> Result<Tensor> {
    let neg = masked_score(dtype) as f32;
    let values: Vec<f32> = (0..s)
        .flat_map(|i| (0..s).map(move |j| if j <= i { 0.0 } else { neg }))
        .collect();
    Tensor::from_vec(values, (s, s), device)?.to_dtype(dtype)
}

/// The additive padding mask `[b, 1, 1, 1, s]` in `dtype` from `keep` (`[b, s]`,
/// nonzero = a real token), shaped to broadcast over [`attention`]'s grouped scores.
fn padding_mask(keep: &Tensor, dtype: DType) -> Result<Tensor> {
    let (b, s) = keep.dims2()?;
    let neg = masked_score(dtype);
    let keep = keep.ne(0u32)?.to_dtype(DType::F32)?;
    keep.affine(-neg, neg)?
        .to_dtype(dtype)?
        .reshape((b, 1, 1, 1, s))
}

/// `[b, s, n·d]` → `[b, n, s, d]` as a view (strided).
pub(crate) fn split_heads(x: &Tensor, heads: usize) -> Result<Tensor> {
    let (b, s, _) = x.dims3()?;
    x.reshape((b, s, heads, ()))?.transpose(1, 2)
}

/// A block's attention as the plan chooses it, with what one forward shares
/// between blocks (the composed form's additive mask, the flash op's options).
#[derive(Debug, Clone)]
pub(crate) enum Attend {
    /// [`attention`], composed from candle ops, adding this mask (if any) to the scores.
    Composed(Option<Tensor>),
    /// [`flash_attention`] with these options (the scale is set per call).
    Flash(AttentionOptions),
}

impl Attend {
    /// Causal attention over `s` positions; the composed form builds its
    /// [`causal_mask`] once here.
    pub(crate) fn causal(kind: Attention, s: usize, dtype: DType, device: &Device) -> Result<Self> {
        Ok(match kind {
            Attention::Composed => Attend::Composed(Some(causal_mask(s, dtype, device)?)),
            Attention::Flash => Attend::Flash(AttentionOptions {
                causal: true,
                ..Default::default()
            }),
        })
    }

    /// Bidirectional attention that ignores the keys where `keep` (`[b, s]`, any
    /// dtype) is zero; `None`: every key counts. The composed form builds its
    /// [`padding_mask`] once here.
    pub(crate) fn padded(kind: Attention, keep: Option<&Tensor>, dtype: DType) -> Result<Self> {
        Ok(match kind {
            Attention::Composed => {
                Attend::Composed(keep.map(|k| padding_mask(k, dtype)).transpose()?)
            }
            Attention::Flash => Attend::Flash(AttentionOptions {
                key_padding: keep.cloned(),
                ..Default::default()
            }),
        })
    }

    /// `softmax(q·kᵀ·scale + mask)·v` with heads merged: `q` `[b, H, s, d]` (any
    /// strides), `k`, `v` `[b, KV, s, d]` contiguous → `[b, s, H·d]`.
    ///
    /// Composed: `q` is multiplied by `scale` into a contiguous copy (none when
    /// `scale` is 1 and `q` is contiguous), then [`attention`]. Flash: the op
    /// makes `q` contiguous (a copy when it is strided) and keeps its output
    /// `[b, H, s, d]` and one f32 log-sum-exp per query row; merging the heads
    /// copies the output to `[b, s, H·d]`.
    pub(crate) fn forward(&self, q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Tensor> {
        let _op = Scope::op(Op::Attention);
        match self {
            Attend::Composed(mask) => {
                let q = if scale == 1.0 {
                    q.contiguous()?
                } else {
                    q.affine(scale, 0.0)?
                };
                attention(&q, k, v, mask.as_ref())
            }
            Attend::Flash(opts) => {
                let opts = AttentionOptions {
                    scale: Some(scale as f32),
                    ..opts.clone()
                };
                let (b, h, s, d) = q.dims4()?;
                flash_attention(q, k, v, &opts)?
                    .transpose(1, 2)?
                    .reshape((b, s, h * d))
            }
        }
    }
}

/// Scaled dot-product attention with grouped-query heads, without repeating keys
/// and values.
///
/// `q`: `[b, H, s, d]` contiguous and already multiplied by the attention scale;
/// `k`, `v`: `[b, KV, s, d]` contiguous with `H` a multiple of `KV` (query head `i`
/// uses key/value head `i / (H/KV)`, as Hugging Face's `repeat_kv`). The queries of
/// one key/value group are viewed as one `[g·s, d]` matrix, so the scores are
/// `[b, KV, g·s, s]` = `[b, H, s, s]` elements with no copy of `k` or `v`.
/// `mask` is added to the scores viewed as `[b, KV, g, s, s]` (a causal `[s, s]`
/// or a padding `[b, 1, 1, 1, s]` mask).
///
/// Allocates the scores, (with a mask) the masked scores, the softmax's three
/// tensors (all `[b, H, s, s]`), the context `[b, H, s, d]` and the merged output
/// `[b, s, H·d]` (a copy, since the heads are transposed back).
fn attention(q: &Tensor, k: &Tensor, v: &Tensor, mask: Option<&Tensor>) -> Result<Tensor> {
    let (b, h, s, d) = q.dims4()?;
    let kv = k.dim(1)?;
    let g = h / kv;
    let matmul = |a: &Tensor, b: &Tensor| {
        let _op = Scope::op(Op::Matmul);
        a.matmul(b)
    };
    let scores = matmul(&q.reshape((b, kv, g * s, d))?, &k.t()?)?;
    let scores = match mask {
        Some(mask) => scores.reshape((b, kv, g, s, s))?.broadcast_add(mask)?,
        None => scores,
    };
    let probs = softmax(&scores)?.reshape((b, kv, g * s, s))?;
    matmul(&probs, v)?
        .reshape((b, h, s, d))?
        .transpose(1, 2)?
        .reshape((b, s, h * d))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Var;

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a - b)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    }

    #[test]
    fn softmax_matches_candle_in_value_and_gradient() {
        let x = Var::randn(0f32, 3.0, (3, 5, 7), &Device::Cpu).unwrap();
        let w = Tensor::randn(0f32, 1.0, (3, 5, 7), &Device::Cpu).unwrap();
        let ours = softmax(x.as_tensor()).unwrap();
        let theirs = candle_nn::ops::softmax(x.as_tensor(), D::Minus1).unwrap();
        assert!(max_diff(&ours, &theirs) < 1e-6);
        let g1 = ours.mul(&w).unwrap().sum_all().unwrap().backward().unwrap();
        let g2 = theirs
            .mul(&w)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        assert!(max_diff(g1.get(&x).unwrap(), g2.get(&x).unwrap()) < 1e-5);
    }

    #[test]
    fn grouped_attention_equals_repeated_kv_heads() {
        let dev = Device::Cpu;
        let (b, h, kv, s, d) = (2, 4, 2, 5, 3);
        let q = Tensor::randn(0f32, 1.0, (b, h, s, d), &dev).unwrap();
        let k = Tensor::randn(0f32, 1.0, (b, kv, s, d), &dev).unwrap();
        let v = Tensor::randn(0f32, 1.0, (b, kv, s, d), &dev).unwrap();
        let mask = causal_mask(s, DType::F32, &dev).unwrap();
        let ours = attention(&q, &k, &v, Some(&mask)).unwrap();
        // Reference: repeat each kv head h/kv times, plain multi-head attention.
        let repeat = |t: &Tensor| {
            t.unsqueeze(2)
                .unwrap()
                .broadcast_as((b, kv, h / kv, s, d))
                .unwrap()
                .reshape((b, h, s, d))
                .unwrap()
        };
        let scores = q
            .matmul(&repeat(&k).t().unwrap())
            .unwrap()
            .broadcast_add(&mask)
            .unwrap();
        let probs = candle_nn::ops::softmax(&scores, D::Minus1).unwrap();
        let reference = probs
            .matmul(&repeat(&v))
            .unwrap()
            .transpose(1, 2)
            .unwrap()
            .reshape((b, s, h * d))
            .unwrap();
        assert!(max_diff(&ours, &reference) < 1e-5);
    }
}
