//! Token embedding lookup whose backward scatters the output's gradient rows
//! straight into a fresh table-sized gradient.
//!
//! candle differentiates `index_select` with `index_add` into a copy of the
//! gradient so far (zeros for an untied table), and its CUDA kernel gives one
//! thread to each column of the table, which loops over every id: 768
//! threads for GPT-2, about 5 ms per step on the H200 at 8192 tokens. Here the
//! CUDA backward is one thread per gradient element, added atomically (16-bit
//! values by compare-and-swap, so the order of additions, and with it the
//! rounding of a 16-bit sum, varies from run to run, as with any atomic
//! reduction); the CPU backward sums each table row's gradients in f32, rows
//! in parallel, in a fixed order.
//!
//! A padding id ([`embedding_padded`], transformers' `padding_idx`) gets no
//! gradient from the lookup: its positions are left out of the scatter.
//!
//! Memory: the backward makes one `[V, h]` tensor, the gradient itself (candle:
//! the zeros and the copy). A tied table's gradient is then the sum of this
//! one and the output head's, made by candle's gradient store.

use candle_core::backend::BackendStorage;
#[cfg(feature = "cuda")]
use candle_core::CudaStorage;
use candle_core::{CpuStorage, DType, Layout, Result, Shape, Tensor, WithDType};
use rayon::prelude::*;

use super::{cpu_slice, f};
use crate::custom_op::{CustomOp, Input, Kernel};

/// Rows `ids` (1-D, u32 or i64) of `table` `[V, h]`: `[ids.len(), h]`. Its
/// backward gives `table` a gradient and `ids` none.
pub fn embedding(table: &Tensor, ids: &Tensor) -> Result<Tensor> {
    embedding_padded(table, ids, None)
}

/// [`embedding`] whose backward gives row `padding_idx` nothing from the
/// positions holding it, as `torch.nn.Embedding(padding_idx=…)` does (the
/// row still gets what other uses of the table give it, a tied head's).
/// `None`, or an id past the table, is no padding id.
pub fn embedding_padded(table: &Tensor, ids: &Tensor, padding_idx: Option<u32>) -> Result<Tensor> {
    let (vocab, _) = table.dims2()?;
    if ids.rank() != 1 {
        candle_core::bail!("embedding: ids must be 1-D, got {:?}", ids.dims());
    }
    let ids = ids.to_dtype(DType::U32)?.contiguous()?;
    let padding_idx = padding_idx.filter(|&p| (p as usize) < vocab);
    table
        .contiguous()?
        .apply_op2(&ids, CustomOp(Embedding { vocab, padding_idx }))
}

/// Forward: `table`, `ids` → the rows.
struct Embedding {
    vocab: usize,
    /// The id whose positions the backward leaves out.
    padding_idx: Option<u32>,
}

/// Backward: `dy` `[n, h]`, `ids` → `[vocab, h]`, the rows of `dy` summed by id.
struct EmbeddingGrad {
    vocab: usize,
}

/// The rows of `table` `ids` selects on either device, and their shape:
/// one row of `h` per id.
fn rows<S: BackendStorage>(
    (table, tl): Input<'_, S>,
    (ids, il): Input<'_, S>,
) -> Result<(S, Shape)> {
    let (_, h) = tl.shape().dims2()?;
    let shape = Shape::from((il.shape().elem_count(), h));
    Ok((table.index_select(ids, tl, il, 0)?, shape))
}

impl Kernel<2> for Embedding {
    fn name(&self) -> &'static str {
        "oomfix-embedding"
    }

    fn cpu_fwd(&self, [table, ids]: [Input<'_, CpuStorage>; 2]) -> Result<(CpuStorage, Shape)> {
        check_ids(cpu_slice::<u32>(ids.0, ids.1)?, self.vocab)?;
        rows(table, ids)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, [table, ids]: [Input<'_, CudaStorage>; 2]) -> Result<(CudaStorage, Shape)> {
        rows(table, ids)
    }

    fn bwd(&self, [_, ids]: [&Tensor; 2], _: &Tensor, dy: &Tensor) -> Result<[Option<Tensor>; 2]> {
        // The padding id's positions scatter to `vocab`, past the table: both
        // backward kernels skip such ids.
        let ids = match self.padding_idx {
            Some(p) => {
                let past = Tensor::full(self.vocab as u32, ids.shape(), ids.device())?;
                ids.eq(p as f64)?.where_cond(&past, ids)?
            }
            None => ids.clone(),
        };
        let grad = CustomOp(EmbeddingGrad { vocab: self.vocab });
        Ok([Some(dy.contiguous()?.apply_op2_no_bwd(&ids, &grad)?), None])
    }
}

/// Every id below `vocab`.
fn check_ids(ids: &[u32], vocab: usize) -> Result<()> {
    match ids.iter().find(|&&id| id as usize >= vocab) {
        Some(id) => {
            candle_core::bail!("embedding: index {id} is out of range for a table of {vocab} rows")
        }
        None => Ok(()),
    }
}

/// The rows of `dy` `[ids.len(), h]` summed into a `[vocab, h]` table by id, in f32, one table
/// row per task (the ids sorted by a counting sort); ids at or past `vocab`
/// (a padding id's positions) are left out.
fn scatter_cpu<T: WithDType>(dy: &[T], ids: &[u32], vocab: usize, h: usize) -> CpuStorage {
    // One more bucket, last, for the ids left out.
    let bucket = |id: u32| (id as usize).min(vocab);
    let mut start = vec![0usize; vocab + 2];
    for &id in ids {
        start[bucket(id) + 1] += 1;
    }
    for v in 0..=vocab {
        start[v + 1] += start[v];
    }
    let mut order = vec![0usize; ids.len()];
    let mut next = start.clone();
    for (row, &id) in ids.iter().enumerate() {
        order[next[bucket(id)]] = row;
        next[bucket(id)] += 1;
    }
    let mut out = vec![T::zero(); vocab * h];
    out.par_chunks_mut(h.max(1)).enumerate().for_each_init(
        || vec![0f32; h],
        |acc, (v, out_row)| {
            let rows = &order[start[v]..start[v + 1]];
            if rows.is_empty() {
                return;
            }
            acc.fill(0.0);
            for &r in rows {
                for (a, &g) in acc.iter_mut().zip(&dy[r * h..(r + 1) * h]) {
                    *a += f(g);
                }
            }
            for (o, &a) in out_row.iter_mut().zip(acc.iter()) {
                *o = T::from_f64(a as f64);
            }
        },
    );
    T::to_cpu_storage_owned(out)
}

impl Kernel<2> for EmbeddingGrad {
    fn name(&self) -> &'static str {
        "oomfix-embedding-backward"
    }

    fn cpu_fwd(
        &self,
        [(dy, dl), (ids, il)]: [Input<'_, CpuStorage>; 2],
    ) -> Result<(CpuStorage, Shape)> {
        // The forward checked the ids; `vocab` marks a padding position.
        let ids = cpu_slice::<u32>(ids, il)?;
        let (_, h) = dl.shape().dims2()?;
        let out = by_dtype!(dy.dtype(), scatter_slices(dy, dl, ids, self.vocab, h))?;
        Ok((out, Shape::from((self.vocab, h))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, [dy, ids]: [Input<'_, CudaStorage>; 2]) -> Result<(CudaStorage, Shape)> {
        let (_, h) = dy.1.shape().dims2()?;
        let out = super::cuda::embedding_grad(dy, ids, self.vocab)?;
        Ok((out, Shape::from((self.vocab, h))))
    }
}

fn scatter_slices<T: WithDType>(
    dy: &CpuStorage,
    dl: &Layout,
    ids: &[u32],
    vocab: usize,
    h: usize,
) -> Result<CpuStorage> {
    Ok(scatter_cpu(cpu_slice::<T>(dy, dl)?, ids, vocab, h))
}
