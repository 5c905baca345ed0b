//! What the trainable families share besides the layers of
//! [`oomfix_strategies::nn`]: those layers' memory-timeline tags
//! ([`Tagged`]), a block's residual connections and row-wise part in tiles,
//! the LM head's logits, the packing of documents and the attention as the
//! plan chooses it.
//!
//! Norms, biased projections and the attention probabilities are single graph
//! nodes with their own backward ([`oomfix_strategies::nn::ops`]; candle's
//! fused fast paths have no backward).
//! Every op output on the path to a parameter stays alive in candle's graph
//! until the loss is dropped, so each function's doc lists the tensors it
//! allocates; views (reshape of a contiguous tensor, transpose, narrow,
//! broadcast) allocate nothing.

use crate::spec::VOCAB_ALIGN;
use crate::track::tag::{Module, Op, Scope};
use candle_core::{DType, Device, Result, Tensor};
use oomfix_strategies::attention::{flash_attention, AttentionOptions};
use oomfix_strategies::lora::{FrozenLinear, FrozenWeight};
use oomfix_strategies::model::TokenBatch;
use oomfix_strategies::nn::ops::{self, WeightLayout};
use oomfix_strategies::nn::{LayerNorm, Projection, RmsNorm};
use oomfix_strategies::{tiled_mlp, Attention, Execution};

/// A layer of [`oomfix_strategies::nn`] as the families run it: its
/// forward, with what it allocates tagged with its op in the memory
/// timeline (the layers themselves know nothing of tags). What each
/// allocates: [`Projection`] its output (a frozen one keeps only its input),
/// the norms their output, the size of `x`.
pub(crate) trait Tagged {
    /// The layer's [`candle_core::Module::forward`] under its op's tag.
    fn forward(&self, x: &Tensor) -> Result<Tensor>;

    /// [`forward`](Self::forward) in `module`: what it allocates tagged
    /// with the module too.
    fn forward_in(&self, module: Module, x: &Tensor) -> Result<Tensor> {
        let _m = Scope::module(module);
        self.forward(x)
    }
}

/// [`Tagged`] for each layer type, with its op.
macro_rules! tagged {
    ($($layer:ty => $op:ident),* $(,)?) => {$(
        impl Tagged for $layer {
            fn forward(&self, x: &Tensor) -> Result<Tensor> {
                let _op = Scope::op(Op::$op);
                candle_core::Module::forward(self, x)
            }
        }
    )*};
}

tagged!(Projection => Matmul, LayerNorm => LayerNorm, RmsNorm => RmsNorm);

/// `part(block, x)` for `part` a block's row-wise part (each token's output
/// from its own input only: the MLP and what surrounds it), in tiles of
/// `tile` tokens when given ([`tiled_mlp::tiled_rows`]), on a copy of the
/// block (its tensors are shared handles: a copy is cheap). The output
/// (the tiles' joined outputs and the op's copy) is tagged as `module`'s.
pub(crate) fn tiled<B: Clone + Send + Sync + 'static>(
    block: &B,
    x: &Tensor,
    tile: Option<usize>,
    module: Module,
    part: fn(&B, &Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    let _m = Scope::module(module);
    let block = block.clone();
    tiled_mlp::tiled_rows(x, tile, move |x| part(&block, x))
}

/// `x + tiled(..)`: a block's row-wise part and the residual connection
/// after it, both tagged as `module`'s.
pub(crate) fn tiled_residual<B: Clone + Send + Sync + 'static>(
    block: &B,
    x: &Tensor,
    tile: Option<usize>,
    module: Module,
    part: fn(&B, &Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    let _m = Scope::module(module);
    let out = tiled(block, x, tile, module, part)?;
    residual(x, &out)
}

/// `x + out`: a block's residual connection, tagged as one.
pub(crate) fn residual(x: &Tensor, out: &Tensor) -> Result<Tensor> {
    let _op = Scope::op(Op::Residual);
    x.add(out)
}

/// The modules `{prefix}.{name}` of `names` (a block's, under its prefix),
/// interned for the memory timeline's tags.
pub(crate) fn module_tags<const N: usize>(prefix: &str, names: [&str; N]) -> [Module; N] {
    names.map(|name| Module::intern(&format!("{prefix}.{name}")))
}

/// The LM head's logits `x·Wᵀ (+ b)`, `x` `[n, h]`, `W` `[V, h]`, `b` `[V]`,
/// over a vocabulary padded with zero rows to `P`, the next multiple of
/// [`VOCAB_ALIGN`]: `[n, P]`, whose first `V` columns are the logits (pass
/// `V` to [`oomfix_strategies::nn::loss::cross_entropy_padded`]). When `V` is a multiple
/// already, nothing is copied; otherwise the padded weight (and bias) is one
/// more `[P, h]` (`[P]`) tensor ([`padded_output`]).
pub(crate) fn lm_logits(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    let _op = Scope::op(Op::Matmul);
    let frozen = !w.track_op();
    let (w, b) = padded_output(w, b)?;
    match b {
        Some(b) => ops::linear(x, &w, &b, WeightLayout::OutIn),
        // A frozen head (LoRA): no gradient of its weight.
        None if frozen => FrozenLinear::new(FrozenWeight::Dense(w), None)
            .forward(x)
            .map_err(candle_core::Error::wrap),
        None => x.matmul(&w.t()?),
    }
}

/// The output embedding `W` `[V, h]` and bias `b` `[V]` padded with zero
/// rows to `P`, the next multiple of [`VOCAB_ALIGN`] (themselves when `V` is
/// one): `[P, h]` and `[P]`, differentiable in `W` and `b`.
pub(crate) fn padded_output(w: &Tensor, b: Option<&Tensor>) -> Result<(Tensor, Option<Tensor>)> {
    let (v, h) = w.dims2()?;
    let p = v.next_multiple_of(VOCAB_ALIGN);
    let pad = |t: &Tensor, shape: &[usize]| -> Result<Tensor> {
        if p == v {
            return Ok(t.clone());
        }
        let zeros = Tensor::zeros(shape, t.dtype(), t.device())?;
        Tensor::cat(&[t, &zeros], 0)
    };
    Ok((
        pad(w, &[p - v, h])?,
        b.map(|b| pad(b, &[p - v])).transpose()?,
    ))
}

/// `[b, s, n·d]` → `[b, n, s, d]` as a view (strided).
pub(crate) fn split_heads(x: &Tensor, heads: usize) -> Result<Tensor> {
    let (b, s, _) = x.dims3()?;
    x.reshape((b, s, heads, ()))?.transpose(1, 2)
}

/// The documents of a packed batch ([`TokenBatch::documents`]), read once
/// per forward on the host: each token's position in its document and the
/// first position of its document, which the causal families give RoPE (or
/// the learned position rows) and attention, so that a row computes what
/// its documents would one by one. A document is a run of equal ids: an id
/// that comes back after another starts a new document.
#[derive(Debug, Clone)]
pub(crate) struct Packing {
    /// Each token's position in its document, `[b, s]` u32 on the blocks'
    /// device.
    pub(crate) positions: Tensor,
    /// The first position of each token's document in its row, `[b, s]` u32
    /// on the blocks' device: the first key the token attends to.
    pub(crate) key_start: Tensor,
    /// [`key_start`](Self::key_start) on the host, row by row.
    pub(crate) starts: Vec<Vec<u32>>,
    /// Tokens of the longest document.
    pub(crate) longest: usize,
}

impl Packing {
    /// The packing of `batch` on `device`, or `None` when it has no
    /// documents (each row is one).
    pub(crate) fn of(batch: &TokenBatch, device: &Device) -> Result<Option<Self>> {
        let Some(documents) = &batch.documents else {
            return Ok(None);
        };
        if !documents.dtype().is_int() || documents.rank() != 2 {
            candle_core::bail!(
                "documents must be [b, s] ids of an integer dtype, got {:?} {:?}",
                documents.dims(),
                documents.dtype()
            );
        }
        let ids = documents.to_dtype(DType::U32)?.to_vec2::<u32>()?;
        let starts: Vec<Vec<u32>> = ids
            .iter()
            .map(|row| {
                let mut first = 0;
                (0..row.len())
                    .map(|i| {
                        if i > 0 && row[i] != row[i - 1] {
                            first = i;
                        }
                        first as u32
                    })
                    .collect()
            })
            .collect();
        let positions: Vec<Vec<u32>> = starts
            .iter()
            .map(|row| (0..row.len() as u32).zip(row).map(|(i, f)| i - f).collect())
            .collect();
        let longest = positions
            .iter()
            .flatten()
            .max()
            .map_or(0, |&p| p as usize + 1);
        let dims = documents.dims2()?;
        let tensor = |rows: &[Vec<u32>]| Tensor::from_vec(rows.concat(), dims, device);
        Ok(Some(Packing {
            positions: tensor(&positions)?,
            key_start: tensor(&starts)?,
            starts,
            longest,
        }))
    }
}

/// A block's attention as the plan chooses it: the form and the masking
/// (the scale is set per call).
#[derive(Debug, Clone)]
pub(crate) struct Attend {
    kind: Attention,
    opts: AttentionOptions,
}

impl Attend {
    /// Causal attention; with a packing, each token attends to the tokens
    /// of its own document only.
    pub(crate) fn causal(exec: &Execution, packing: Option<&Packing>) -> Self {
        Attend {
            kind: exec.attention,
            opts: AttentionOptions {
                causal: true,
                key_start: packing.map(|p| p.key_start.clone()),
                ..Default::default()
            },
        }
    }

    /// Bidirectional attention that ignores the keys where `keep` (`[b, s]`, any
    /// dtype) is zero; `None`: every key counts. The flags are converted to
    /// bytes once here.
    pub(crate) fn padded(exec: &Execution, keep: Option<&Tensor>) -> Result<Self> {
        Ok(Attend {
            kind: exec.attention,
            opts: AttentionOptions {
                key_padding: keep.map(|k| k.ne(0u32)).transpose()?,
                ..Default::default()
            },
        })
    }

    /// `softmax(q·kᵀ·scale + mask)·v` with heads merged: `q` `[b, H, s, d]` (any
    /// strides), `k`, `v` `[b, KV, s, d]` contiguous → `[b, s, H·d]`.
    ///
    /// Both forms make `q` contiguous (a copy when it is strided). Composed:
    /// [`ops::attention_probs`] keeps the probabilities `[b, H, s, s]`, then
    /// `P·v` (grouped-query heads share `v` with no copy). Flash: the op keeps
    /// its output `[b, H, s, d]` and one f32 log-sum-exp per query row. Merging
    /// the heads copies the output to `[b, s, H·d]`.
    pub(crate) fn forward(&self, q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Tensor> {
        let _op = Scope::op(Op::Attention);
        let (b, h, s, d) = q.dims4()?;
        let out = match self.kind {
            Attention::Composed => {
                let opts = ops::ProbsOptions {
                    scale: scale as f32,
                    causal: self.opts.causal,
                };
                let probs = {
                    let _op = Scope::op(Op::Softmax);
                    let (keep, start) = (&self.opts.key_padding, &self.opts.key_start);
                    ops::attention_probs(q, k, keep.as_ref(), start.as_ref(), opts)?
                };
                let kv = k.dim(1)?;
                let _op = Scope::op(Op::Matmul);
                probs
                    .reshape((b, kv, h / kv * s, s))?
                    .matmul(v)?
                    .reshape((b, h, s, d))?
            }
            Attention::Flash => {
                let opts = AttentionOptions {
                    scale: Some(scale as f32),
                    ..self.opts.clone()
                };
                flash_attention(q, k, v, &opts)?
            }
        };
        out.transpose(1, 2)?.reshape((b, s, h * d))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var, D};
    use oomfix_strategies::compare::max_diff;

    /// softmax(q·kᵀ·scale + mask)·v with each kv head repeated for its query
    /// heads, from candle ops; `mask` is additive, `[b, 1, s, s]`.
    fn reference(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor, scale: f64) -> Tensor {
        let (b, h, s, d) = q.dims4().unwrap();
        let kv = k.dim(1).unwrap();
        let repeat = |t: &Tensor| {
            t.unsqueeze(2)
                .unwrap()
                .broadcast_as((b, kv, h / kv, s, d))
                .unwrap()
                .reshape((b, h, s, d))
                .unwrap()
        };
        let scores = (q
            .contiguous()
            .unwrap()
            .matmul(&repeat(k).t().unwrap())
            .unwrap()
            * scale)
            .unwrap()
            .broadcast_add(mask)
            .unwrap();
        candle_nn::ops::softmax(&scores, D::Minus1)
            .unwrap()
            .matmul(&repeat(v))
            .unwrap()
            .transpose(1, 2)
            .unwrap()
            .reshape((b, s, h * d))
            .unwrap()
    }

    /// The composed and flash forms against [`reference`], in value and in the
    /// gradients of q, k and v, with grouped-query heads, a strided q, an odd
    /// length, a causal mask and key padding.
    #[test]
    fn composed_and_flash_attention_match_repeated_kv_heads() {
        let dev = Device::Cpu;
        let (b, h, kv, s, d) = (2, 4, 2, 7, 3);
        let scale = 0.6;
        // q strided as split_heads makes it.
        let q = Var::randn(0f32, 1.0, (b, s, h, d), &dev).unwrap();
        let k = Var::randn(0f32, 1.0, (b, kv, s, d), &dev).unwrap();
        let v = Var::randn(0f32, 1.0, (b, kv, s, d), &dev).unwrap();
        let w = Tensor::randn(0f32, 1.0, (b, s, h * d), &dev).unwrap();
        let keep = Tensor::new(&[[1u32, 1, 1, 1, 1, 0, 0], [1, 0, 1, 1, 1, 1, 1]], &dev).unwrap();
        let neg = |allowed: Vec<bool>| -> Vec<f32> {
            allowed
                .into_iter()
                .map(|a| if a { 0.0 } else { -1e9 })
                .collect()
        };
        let causal = neg((0..s).flat_map(|i| (0..s).map(move |j| j <= i)).collect());
        let causal = Tensor::from_vec(causal, (1, 1, s, s), &dev).unwrap();
        let keep_flags = keep.to_vec2::<u32>().unwrap();
        let padding = neg(keep_flags
            .iter()
            .flat_map(|row| (0..s).flat_map(move |_| row.iter().map(|&f| f != 0)))
            .collect());
        let padding = Tensor::from_vec(padding, (b, 1, s, s), &dev).unwrap();
        let cases = [("causal", causal, None), ("padded", padding, Some(&keep))];
        for (name, mask, keep) in cases {
            let qh = q.transpose(1, 2).unwrap();
            let expected = reference(&qh, &k, &v, &mask, scale);
            let want = expected
                .mul(&w)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            for kind in [Attention::Composed, Attention::Flash] {
                let attend = match keep {
                    None => Attend::causal(&Execution::default().attention(kind), None),
                    Some(keep) => {
                        Attend::padded(&Execution::default().attention(kind), Some(keep)).unwrap()
                    }
                };
                let out = attend.forward(&qh, &k, &v, scale).unwrap();
                let got = out.mul(&w).unwrap().sum_all().unwrap().backward().unwrap();
                assert!(
                    max_diff(&out, &expected).unwrap() < 1e-5,
                    "{name} {kind:?}: output"
                );
                for (var, what) in [(&q, "q"), (&k, "k"), (&v, "v")] {
                    let diff = max_diff(got.get(var).unwrap(), want.get(var).unwrap()).unwrap();
                    assert!(
                        diff < 1e-5,
                        "{name} {kind:?}: gradient of {what} off by {diff}"
                    );
                }
            }
        }
    }
}
