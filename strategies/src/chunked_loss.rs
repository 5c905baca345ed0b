//! The LM head and the cross-entropy computed chunk by chunk of tokens (a
//! fused linear cross-entropy), so that one chunk's logits exist at a time.
//!
//! A language model's last op multiplies `n` hidden states `[n, h]` by the
//! output embedding `[P, h]` (`P`: the vocabulary, perhaps padded) and
//! takes the cross-entropy of the `[n, P]` logits. At a large vocabulary the
//! logits and their gradient are the largest tensors of the whole step
//! (Llama 3's 128,256 classes at 1024 tokens: 250 MiB each in bf16).
//!
//! The planner half, [`ChunkedLoss`], turns the plan's `chunked_loss` on;
//! its execution hook bounds a chunk's logits at [`CHUNK_BYTES`]. The
//! mechanism, [`linear_cross_entropy`], walks the tokens in chunks of
//! [`chunk_rows`] rows. For each chunk, outside autograd, it computes the
//! logits, each row's loss, the logits' gradient (the gradient of the mean,
//! times the loss scale, is known before the loss is: it does not depend on
//! the logits), and from it at once the chunk's rows of the hidden states'
//! gradient, its share of the head weight's gradient (summed into one
//! `[P, h]` tensor in place, block of rows by block of rows) and of the
//! bias's; then the chunk's logits and their gradient are freed. The loss is
//! the same reduction of the same per-row losses as
//! [`cross_entropy_padded`](crate::nn::loss::cross_entropy_padded)'s. It is
//! returned attached to the graph by one op on the hidden states, the
//! weight and the bias, whose backward hands out the gradients made in the
//! forward (rescaled if the gradient arriving is not the loss scale), and
//! lets go of them.
//!
//! The head's products are those of the unchunked pass, each done once: the
//! logits, the input gradient and, when the weight is trained, its
//! gradient; none is recomputed. What the chunks cost besides is that each
//! chunk's products read the whole `[P, h]` weight again (the step-time
//! model counts those reads). Computing the gradients in the forward costs
//! no lifetime: the head is the last op of the forward, and its backward
//! is the first of the backward. With checkpointing the head runs on the
//! last segment's output as on any hidden states.
//!
//! Arithmetic: the logits and their gradient in the compute dtype, each
//! row's loss and softmax in f32 (as the fused cross-entropy does); the
//! weight's gradient is summed over the chunks in the compute dtype (one
//! rounding per chunk in 16 bits), the bias's in f32. Every op is a candle
//! op (or this crate's cross-entropy op, which has its CUDA kernel), so
//! it runs wherever those run.
//!
//! ```
//! use candle_core::{Device, Tensor, Var};
//! use oomfix_strategies::chunked_loss::{linear_cross_entropy, LmHead};
//! use oomfix_strategies::nn::loss::cross_entropy;
//!
//! let dev = Device::Cpu;
//! let x = Var::randn(0f32, 1.0, (10, 8), &dev)?;
//! let w = Var::randn(0f32, 1.0, (32, 8), &dev)?;
//! let targets = Tensor::new(&[1u32, 0, 31, 3, 4, 5, 6, 7, 8, 9], &dev)?;
//! // Chunks of 3 rows: 3 × 32 f32 logits take 384 bytes.
//! let head = LmHead { weight: w.as_tensor(), bias: None, classes: 32 };
//! let chunked = linear_cross_entropy(x.as_tensor(), &head, &targets, None, 384, 1.0)?;
//! let whole = cross_entropy(&x.matmul(&w.t()?)?, &targets, None)?;
//! assert!((chunked.to_scalar::<f32>()? - whole.to_scalar::<f32>()?).abs() < 1e-6);
//! let (a, b) = (chunked.backward()?, whole.backward()?);
//! let diff = (a.get(&w).unwrap() - b.get(&w).unwrap())?.abs()?.max_all()?;
//! assert!(diff.to_scalar::<f32>()? < 1e-6);
//! # Ok::<(), candle_core::Error>(())
//! ```

use std::sync::Mutex;

#[cfg(feature = "cuda")]
use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::{bail, CpuStorage, DType, Result, Shape, Tensor};

use crate::custom_op::{CustomOp, Input, Kernel};
use crate::nn::loss;
use crate::nn::ops::{self, WeightLayout};
use crate::{Execution, Plan, SearchContext, Strategy};

/// The most bytes one chunk's logits take in the compute dtype under the
/// `chunked-loss` fix: 32 MiB, 130 rows of Llama 3's 128,256 classes in
/// bf16 (250 MiB for 1024 tokens unchunked), 333 rows of GPT-2's 50,304
/// (padded). Chosen, not tuned by measurement: small beside the logits it
/// replaces at a large vocabulary, and chunks of over a hundred rows, so
/// that each chunk's product does about as many multiply-adds per weight
/// byte read as a GPU's memory can feed (`scripts/chunked-loss-gpu.sh`
/// times the products against the whole logits').
pub const CHUNK_BYTES: u64 = 32 << 20;

/// Planner half: compute the LM head and the loss chunk by chunk of tokens
/// ([`linear_cross_entropy`]).
///
/// ```
/// use oomfix_strategies::chunked_loss::{ChunkedLoss, CHUNK_BYTES};
/// use oomfix_strategies::{Execution, Plan, SearchContext, Strategy};
///
/// let ctx = SearchContext::new(8, 12);
/// let chunked = ChunkedLoss.tighten(&Plan::baseline(8, 1024), &ctx).unwrap();
/// assert!(chunked.chunked_loss);
/// assert!(ChunkedLoss.tighten(&chunked, &ctx).is_none());
/// assert!(!ChunkedLoss.relax(&chunked, &ctx).unwrap().chunked_loss);
/// let exec = Execution::for_plan(&chunked, &oomfix_strategies::builtins());
/// assert_eq!(exec.loss_chunk_bytes, Some(CHUNK_BYTES));
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct ChunkedLoss;

impl Strategy for ChunkedLoss {
    fn name(&self) -> &'static str {
        "chunked-loss"
    }
    fn tighten(&self, plan: &Plan, _ctx: &SearchContext) -> Option<Plan> {
        (!plan.chunked_loss).then_some(Plan {
            chunked_loss: true,
            ..*plan
        })
    }
    fn relax(&self, plan: &Plan, _ctx: &SearchContext) -> Option<Plan> {
        plan.chunked_loss.then_some(Plan {
            chunked_loss: false,
            ..*plan
        })
    }
    /// Chunks of logits of at most [`CHUNK_BYTES`]. Its memory terms are
    /// activations, which the memory model derives from the execution.
    fn execution(&self, plan: &Plan, exec: &mut Execution) {
        if plan.chunked_loss {
            exec.loss_chunk_bytes = Some(CHUNK_BYTES);
        }
    }
    /// Needs a model whose loss is an LM head computed as the execution says.
    fn unusable(&self, ctx: &SearchContext) -> Option<String> {
        (!ctx.model.chunked_loss).then(|| {
            "needs a model whose loss is an LM head's cross-entropy, which the chunks compute \
             (not a soft-capped head, nor a loss of its own)"
                .into()
        })
    }
}

/// Rows per chunk whose logits of `columns` values of `dtype` take at most
/// `bytes` (at least 1).
///
/// ```
/// use candle_core::DType;
/// use oomfix_strategies::chunked_loss::{chunk_rows, CHUNK_BYTES};
/// assert_eq!(chunk_rows(CHUNK_BYTES, 128_256, DType::BF16), 130);
/// assert_eq!(chunk_rows(10, 128_256, DType::F32), 1);
/// ```
pub fn chunk_rows(bytes: u64, columns: usize, dtype: DType) -> usize {
    let row = (columns.max(1) * dtype.size_in_bytes()) as u64;
    (bytes / row).max(1) as usize
}

/// The output layer of an LM head: logits `x·Wᵀ + b` over `P` columns, the
/// first `classes` of them real (the others padding, masked out of the loss).
#[derive(Debug, Clone, Copy)]
pub struct LmHead<'a> {
    /// The output embedding `[P, h]` (tied to the input embedding or not).
    pub weight: &'a Tensor,
    /// The bias `[P]`, if the head has one (BERT's decoder).
    pub bias: Option<&'a Tensor>,
    /// The real classes, at most `P`.
    pub classes: usize,
}

/// The mean cross-entropy of the logits `x·Wᵀ (+ b)` against `targets`, over
/// the rows `mask` selects (all without one), computed in chunks of rows
/// whose logits take at most `chunk_bytes`: the value
/// [`cross_entropy_padded`](crate::nn::loss::cross_entropy_padded) gives
/// the whole logits, and, through the returned scalar, the same gradients
/// of `x`, the weight and the bias.
///
/// * `x`: the hidden states `[n, h]` in the compute dtype; the weight
///   `[P, h]` and the bias `[P]` share it;
/// * `targets`: `[n]` u32 below `head.classes`; `mask`: `[n]` f32 0/1;
/// * `loss_scale`: the factor the caller's backward multiplies the loss by
///   (fp16 loss scaling): the gradients are made already scaled, so that
///   16-bit values keep their precision as the unchunked backward's do.
///   A backward whose incoming gradient is not `loss_scale` gets them
///   rescaled.
///
/// The gradients are made in this call for the inputs that are on a graph
/// (`track_op`), held by the returned loss's op and handed to the first
/// backward through it (a second backward through the same loss is an
/// error). A detached `x` (a forward-only pass) makes none, whatever the
/// weight: use [`loss_only`] for evaluation instead, which never makes them.
pub fn linear_cross_entropy(
    x: &Tensor,
    head: &LmHead<'_>,
    targets: &Tensor,
    mask: Option<&Tensor>,
    chunk_bytes: u64,
    loss_scale: f64,
) -> Result<Tensor> {
    let wanted = [
        x.track_op(),
        head.weight.track_op(),
        head.bias.is_some_and(Tensor::track_op),
    ];
    if !wanted[0] {
        return loss_only(x, head, targets, mask, chunk_bytes);
    }
    let pass = Pass::new(x, head, targets, chunk_bytes)?;
    let grads = pass.run(mask, Some((loss_scale, wanted)))?;
    let op = Attached {
        loss: grads.loss.to_dtype(DType::F32)?.to_scalar::<f32>()?,
        loss_scale,
        grads: Mutex::new(Some(grads.grads)),
    };
    match head.bias {
        None => x.apply_op2(head.weight, CustomOp(op)),
        Some(b) => x.apply_op3(head.weight, b, CustomOp(op)),
    }
}

/// [`linear_cross_entropy`]'s loss without any gradient (nothing attached to
/// a graph): a forward-only pass, chunk by chunk.
pub fn loss_only(
    x: &Tensor,
    head: &LmHead<'_>,
    targets: &Tensor,
    mask: Option<&Tensor>,
    chunk_bytes: u64,
) -> Result<Tensor> {
    Ok(Pass::new(x, head, targets, chunk_bytes)?
        .run(mask, None)?
        .loss)
}

/// The checked, detached inputs of one chunked pass.
struct Pass {
    x: Tensor,
    weight: Tensor,
    bias: Option<Tensor>,
    classes: usize,
    targets: Tensor,
    rows: usize,
    /// Rows of the weight's gradient summed at once.
    weight_rows: usize,
}

/// What a chunked pass made: the loss, and the gradients of x, the weight
/// and the bias that were wanted.
struct Made {
    loss: Tensor,
    grads: [Option<Tensor>; 3],
}

impl Pass {
    fn new(x: &Tensor, head: &LmHead<'_>, targets: &Tensor, chunk_bytes: u64) -> Result<Self> {
        let (n, h) = x.dims2()?;
        let (p, hw) = head.weight.dims2()?;
        if hw != h || head.weight.dtype() != x.dtype() {
            bail!(
                "linear_cross_entropy: weight {:?} {:?} does not fit hidden states {:?} {:?}",
                head.weight.dims(),
                head.weight.dtype(),
                x.dims(),
                x.dtype()
            );
        }
        if head.classes == 0 || head.classes > p {
            bail!(
                "linear_cross_entropy: {} classes in a head of {p} rows",
                head.classes
            );
        }
        if let Some(b) = head.bias {
            if b.dims() != [p] || b.dtype() != x.dtype() {
                bail!(
                    "linear_cross_entropy: bias {:?} {:?} does not fit a head of {p} rows",
                    b.dims(),
                    b.dtype()
                );
            }
        }
        if targets.dims() != [n] || targets.dtype() != DType::U32 {
            bail!(
                "linear_cross_entropy: targets must be [{n}] u32, got {:?} {:?}",
                targets.dims(),
                targets.dtype()
            );
        }
        let c = x.dtype().size_in_bytes() as u64;
        Ok(Pass {
            x: x.detach().contiguous()?,
            weight: head.weight.detach().contiguous()?,
            bias: head.bias.map(|b| b.detach().contiguous()).transpose()?,
            classes: head.classes,
            targets: targets.contiguous()?,
            rows: chunk_rows(chunk_bytes, p, x.dtype()).min(n.max(1)),
            weight_rows: ((chunk_bytes / (h.max(1) as u64 * c)).max(1) as usize).min(p),
        })
    }

    /// The loss over `mask`'s rows and, with `grads`' loss scale and which
    /// of x, the weight and the bias to differentiate, their gradients of
    /// `loss × loss_scale`.
    fn run(&self, mask: Option<&Tensor>, grads: Option<(f64, [bool; 3])>) -> Result<Made> {
        let (n, h) = self.x.dims2()?;
        let (p, _) = self.weight.dims2()?;
        let (dtype, dev) = (self.x.dtype(), self.x.device());
        let mask = mask.map(|m| m.to_dtype(DType::F32)).transpose()?;
        // The gradient each row's loss gets from the mean (times the loss
        // scale): the reduction's own backward, at zeros (it does not depend
        // on the losses).
        let (row_grad, want) = match grads {
            Some((scale, want)) => (Some(row_gradients(n, mask.as_ref(), scale, dev)?), want),
            None => (None, [false; 3]),
        };
        let gx = want[0]
            .then(|| Tensor::zeros((n, h), dtype, dev))
            .transpose()?;
        let gw = want[1]
            .then(|| Tensor::zeros((p, h), dtype, dev))
            .transpose()?;
        let mut gb: Option<Tensor> = None;
        let mut nll = Vec::with_capacity(n.div_ceil(self.rows));
        for start in (0..n).step_by(self.rows) {
            let len = self.rows.min(n - start);
            let x = self.x.narrow(0, start, len)?;
            let logits = match &self.bias {
                Some(b) => ops::linear(&x, &self.weight, b, WeightLayout::OutIn)?,
                None => x.matmul(&self.weight.t()?)?,
            };
            let targets = self.targets.narrow(0, start, len)?;
            nll.push(loss::row_nll(&logits, self.classes, &targets)?);
            let Some(row_grad) = &row_grad else {
                continue;
            };
            let grad = loss::row_nll_grad(
                &logits,
                self.classes,
                &targets,
                &row_grad.narrow(0, start, len)?,
            )?;
            drop(logits);
            if let Some(gx) = &gx {
                gx.slice_set(&grad.matmul(&self.weight)?, 0, start)?;
            }
            if let Some(gw) = &gw {
                self.add_weight_gradient(gw, &grad, &x)?;
            }
            if want[2] {
                let sum = grad.to_dtype(DType::F32)?.sum(0)?;
                gb = Some(match gb {
                    Some(acc) => acc.add(&sum)?,
                    None => sum,
                });
            }
        }
        let loss = loss::mean_over_rows(&Tensor::cat(&nll, 0)?, mask.as_ref())?;
        let gb = match (gb, want[2]) {
            (Some(gb), _) => Some(gb.to_dtype(dtype)?),
            (None, true) => Some(Tensor::zeros(p, dtype, dev)?),
            (None, false) => None,
        };
        Ok(Made {
            loss,
            grads: [gx, gw, gb],
        })
    }

    /// Adds `grad`ᵀ·`x` (`[len, P]`ᵀ · `[len, h]`) to `gw` `[P, h]` in place,
    /// `weight_rows` rows at a time, so that no second `[P, h]` tensor exists.
    fn add_weight_gradient(&self, gw: &Tensor, grad: &Tensor, x: &Tensor) -> Result<()> {
        let (p, _) = gw.dims2()?;
        for start in (0..p).step_by(self.weight_rows) {
            let len = self.weight_rows.min(p - start);
            let part = grad.narrow(1, start, len)?.contiguous()?.t()?.matmul(x)?;
            let sum = gw.narrow(0, start, len)?.add(&part)?;
            drop(part);
            gw.slice_set(&sum, 0, start)?;
        }
        Ok(())
    }
}

/// The gradient of `mean_over_rows(nll, mask) × scale` for each of `n` rows.
fn row_gradients(
    n: usize,
    mask: Option<&Tensor>,
    scale: f64,
    dev: &candle_core::Device,
) -> Result<Tensor> {
    let zeros = candle_core::Var::zeros(n, DType::F32, dev)?;
    let mean = loss::mean_over_rows(zeros.as_tensor(), mask)?;
    let scaled = if scale == 1.0 {
        mean
    } else {
        mean.affine(scale, 0.0)?
    };
    let mut store = scaled.backward()?;
    match store.remove(zeros.as_tensor()) {
        Some(g) => g.detach().contiguous(),
        None => bail!("linear_cross_entropy: the mean has no gradient"),
    }
}

/// The loss as one graph node over the hidden states, the weight and the
/// bias, holding their gradients until its backward takes them.
struct Attached {
    loss: f32,
    loss_scale: f64,
    grads: Mutex<Option<[Option<Tensor>; 3]>>,
}

impl Attached {
    fn cpu(&self) -> (CpuStorage, Shape) {
        (CpuStorage::F32(vec![self.loss]), Shape::from(()))
    }

    #[cfg(feature = "cuda")]
    fn cuda(&self, s: &candle_core::CudaStorage) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((
            s.device().storage_from_slice(&[self.loss])?,
            Shape::from(()),
        ))
    }

    /// The gradients made in the forward, times `grad / loss_scale`.
    fn take(&self, grad: &Tensor) -> Result<[Option<Tensor>; 3]> {
        let grads = self
            .grads
            .lock()
            .map_err(|_| candle_core::Error::Msg("linear_cross_entropy: poisoned".into()))?
            .take();
        let Some(grads) = grads else {
            bail!("linear_cross_entropy: its loss was differentiated twice (the gradients are made once, in the forward)")
        };
        let g = grad.to_dtype(DType::F32)?.to_scalar::<f32>()? as f64;
        let factor = g / self.loss_scale;
        if factor == 1.0 {
            return Ok(grads);
        }
        let [a, b, c] = grads;
        let rescale = |t: Option<Tensor>| t.map(|t| t.affine(factor, 0.0)).transpose();
        Ok([rescale(a)?, rescale(b)?, rescale(c)?])
    }
}

/// Over `x` and the weight (`N` = 2), and the bias (3).
impl<const N: usize> Kernel<N> for Attached {
    fn name(&self) -> &'static str {
        "oomfix-chunked-linear-cross-entropy"
    }

    fn cpu_fwd(&self, _: [Input<'_, CpuStorage>; N]) -> Result<(CpuStorage, Shape)> {
        Ok(self.cpu())
    }

    /// On the device of `x`.
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        inputs: [Input<'_, candle_core::CudaStorage>; N],
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.cuda(inputs[0].0)
    }

    fn bwd(&self, _: [&Tensor; N], _: &Tensor, grad: &Tensor) -> Result<[Option<Tensor>; N]> {
        let mut grads = self.take(grad)?.into_iter();
        Ok(std::array::from_fn(|_| grads.next().flatten()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compare::rel_diff;
    use crate::nn::loss::cross_entropy_padded;
    use candle_core::{Device, Var};

    struct Case {
        x: Var,
        w: Var,
        b: Option<Var>,
        classes: usize,
        targets: Tensor,
        mask: Option<Tensor>,
    }

    /// `n` rows of `h` over `p` columns, `classes` real; a bias and a mask
    /// if asked; in `dtype`.
    fn case(
        n: usize,
        h: usize,
        p: usize,
        classes: usize,
        bias: bool,
        mask: bool,
        dtype: DType,
    ) -> Case {
        let dev = Device::Cpu;
        let var = |shape: &[usize]| {
            Var::from_tensor(
                &Tensor::randn(0f32, 1.0, shape, &dev)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap(),
            )
            .unwrap()
        };
        let targets: Vec<u32> = (0..n).map(|i| ((i * 7 + 3) % classes) as u32).collect();
        let mask = mask.then(|| {
            let m: Vec<f32> = (0..n).map(|i| f32::from(u8::from(i % 3 != 1))).collect();
            Tensor::from_vec(m, n, &dev).unwrap()
        });
        Case {
            x: var(&[n, h]),
            w: var(&[p, h]),
            b: bias.then(|| var(&[p])),
            classes,
            targets: Tensor::from_vec(targets, n, &dev).unwrap(),
            mask,
        }
    }

    /// The unchunked loss and gradients (x, w, b) of `loss × scale`.
    fn whole(c: &Case, scale: f64) -> (f32, Vec<Tensor>) {
        let logits = match &c.b {
            Some(b) => ops::linear(&c.x, &c.w, b, WeightLayout::OutIn).unwrap(),
            None => c.x.matmul(&c.w.t().unwrap()).unwrap(),
        };
        let loss = cross_entropy_padded(&logits, c.classes, &c.targets, c.mask.as_ref()).unwrap();
        grads_of(c, &loss, scale)
    }

    impl Case {
        /// The LM head of the case's weight, bias and classes.
        fn head(&self) -> LmHead<'_> {
            LmHead {
                weight: self.w.as_tensor(),
                bias: self.b.as_ref().map(Var::as_tensor),
                classes: self.classes,
            }
        }
    }

    fn chunked(c: &Case, bytes: u64, scale: f64) -> (f32, Vec<Tensor>) {
        let loss = linear_cross_entropy(&c.x, &c.head(), &c.targets, c.mask.as_ref(), bytes, scale)
            .unwrap();
        grads_of(c, &loss, scale)
    }

    fn grads_of(c: &Case, loss: &Tensor, scale: f64) -> (f32, Vec<Tensor>) {
        let value = loss.to_scalar::<f32>().unwrap();
        let scaled = if scale == 1.0 {
            loss.clone()
        } else {
            loss.affine(scale, 0.0).unwrap()
        };
        let store = scaled.backward().unwrap();
        let mut grads = vec![
            store.get(&c.x).unwrap().clone(),
            store.get(&c.w).unwrap().clone(),
        ];
        if let Some(b) = &c.b {
            grads.push(store.get(b).unwrap().clone());
        }
        (value, grads)
    }

    /// Ragged chunks (7 rows in chunks of 3), the weight's gradient summed
    /// in blocks of rows, padding columns, a bias, a mask and a loss scale:
    /// the loss is the unchunked one and so are the gradients of x, the
    /// weight and the bias.
    #[test]
    fn gradients_equal_the_unchunked_loss() {
        for (bias, mask, scale) in [
            (false, false, 1.0),
            (true, false, 1.0),
            (false, true, 1.0),
            (true, true, 256.0),
            (false, false, 1024.0),
        ] {
            let c = case(7, 8, 24, 21, bias, mask, DType::F32);
            let (want_loss, want) = whole(&c, scale);
            // 3 rows of 24 f32: 288 bytes; the weight's gradient in blocks
            // of 288 / (8 · 4) = 9 rows (24 = 9 + 9 + 6).
            for bytes in [288, 1 << 20] {
                let (loss, got) = chunked(&c, bytes, scale);
                let label = format!("bias {bias}, mask {mask}, scale {scale}, {bytes} bytes");
                assert!(
                    (loss - want_loss).abs() <= 1e-6 * want_loss.abs(),
                    "{label}: loss {loss} vs {want_loss}"
                );
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    let rel = rel_diff(g, w).unwrap();
                    assert!(rel < 1e-5, "{label}: gradient {i} off by {rel:e}");
                }
                // The padding columns' rows of the weight get nothing.
                let pad = got[1]
                    .narrow(0, 21, 3)
                    .unwrap()
                    .abs()
                    .unwrap()
                    .max_all()
                    .unwrap();
                assert_eq!(pad.to_scalar::<f32>().unwrap(), 0.0);
            }
        }
    }

    /// In bf16 and f16 the chunked gradients stay within a few 16-bit steps
    /// of the unchunked ones (each chunk's share of the weight's gradient is
    /// rounded once more when summed); with f16 and a loss scale nothing
    /// underflows that the unchunked backward keeps.
    #[test]
    fn sixteen_bit_gradients_are_close_to_the_unchunked_ones() {
        for dtype in [DType::BF16, DType::F16] {
            let c = case(16, 16, 64, 64, false, false, dtype);
            let (want_loss, want) = whole(&c, 1024.0);
            let (loss, got) = chunked(&c, 4 * 64 * 2, 1024.0);
            assert!((loss - want_loss).abs() <= 1e-3 * want_loss, "{dtype:?}");
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(g.dtype(), dtype);
                let rel = rel_diff(g, w).unwrap();
                assert!(rel < 0.02, "{dtype:?}: gradient {i} off by {rel:e}");
            }
        }
    }

    /// A backward whose incoming gradient is not the loss scale the
    /// gradients were made with gets them rescaled; a second backward
    /// through the same loss is an error.
    #[test]
    fn an_other_incoming_gradient_rescales_and_a_second_backward_fails() {
        let c = case(5, 4, 8, 8, false, false, DType::F32);
        let (_, want) = whole(&c, 3.0);
        let loss = linear_cross_entropy(&c.x, &c.head(), &c.targets, None, 64, 1.0).unwrap();
        let store = loss.affine(3.0, 0.0).unwrap().backward().unwrap();
        assert!(rel_diff(store.get(&c.w).unwrap(), &want[1]).unwrap() < 1e-5);
        assert!(rel_diff(store.get(&c.x).unwrap(), &want[0]).unwrap() < 1e-5);
        let again = loss.backward().unwrap_err().to_string();
        assert!(again.contains("twice"), "{again}");
    }

    /// Detached hidden states (a forward-only pass): the loss, no gradient
    /// made; bad shapes are errors.
    #[test]
    fn detached_inputs_give_the_loss_only_and_bad_shapes_are_errors() {
        let c = case(6, 4, 8, 8, false, true, DType::F32);
        let (want, _) = whole(&c, 1.0);
        let head = c.head();
        let x = c.x.as_tensor().detach();
        let loss = linear_cross_entropy(&x, &head, &c.targets, c.mask.as_ref(), 64, 1.0).unwrap();
        assert!(!loss.track_op());
        assert!((loss.to_scalar::<f32>().unwrap() - want).abs() <= 1e-6 * want);
        let bad = LmHead { classes: 9, ..head };
        assert!(linear_cross_entropy(&c.x, &bad, &c.targets, None, 64, 1.0).is_err());
        let short = c.targets.narrow(0, 0, 5).unwrap();
        assert!(linear_cross_entropy(&c.x, &head, &short, None, 64, 1.0).is_err());
    }
}
