//! Smaller micro-batches with gradient accumulation, global batch held constant.
//!
//! The planner half is [`Accumulate`]; the mechanism is [`GradAccumulator`]
//! (with [`collect_grads`] to take detached gradients out of a `GradStore`).

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
use rayon::prelude::*;

use crate::float::{
    contiguous_range, is_kernel_dtype, with_cpu_mut, with_cpu_mut_src, with_float_vec, Float, CHUNK,
};
use crate::{Error, ModelFacts, Plan, Result, SearchContext, StateBytes, Strategy};

#[cfg(feature = "cuda")]
mod cuda;

/// Planner half: step the micro-batch down through the divisors of the per-rank
/// batch, raising the accumulation count so the global batch stays the same.
#[derive(Debug, Clone, Copy, Default)]
pub struct Accumulate;

/// Sequences each rank processes per optimizer step.
pub fn per_rank_batch(plan: &Plan) -> usize {
    plan.micro_batch * plan.grad_accum
}

/// Divisors of `n` in ascending order (none for 0).
///
/// Trial division up to √n: a global batch of a million takes a thousand
/// divisions, not a million.
pub fn divisors(n: usize) -> Vec<usize> {
    let mut low = Vec::new();
    let mut high = Vec::new();
    let mut d = 1usize;
    while d <= n / d {
        if n.is_multiple_of(d) {
            low.push(d);
            if d != n / d {
                high.push(n / d);
            }
        }
        d += 1;
    }
    low.extend(high.into_iter().rev());
    low
}

fn with_micro_batch(plan: &Plan, micro: usize) -> Plan {
    let per_rank = per_rank_batch(plan);
    Plan {
        micro_batch: micro,
        grad_accum: per_rank / micro,
        ..*plan
    }
}

impl Strategy for Accumulate {
    fn name(&self) -> &'static str {
        "accumulate"
    }
    fn tighten(&self, plan: &Plan, _ctx: &SearchContext) -> Option<Plan> {
        let next = divisors(per_rank_batch(plan))
            .into_iter()
            .rev()
            .find(|&d| d < plan.micro_batch)?;
        Some(with_micro_batch(plan, next))
    }
    fn relax(&self, plan: &Plan, _ctx: &SearchContext) -> Option<Plan> {
        let next = divisors(per_rank_batch(plan))
            .into_iter()
            .find(|&d| d > plan.micro_batch)?;
        Some(with_micro_batch(plan, next))
    }
    /// With more than one micro-batch, a gradient set in the compute dtype
    /// carries the sums between them ([`GradAccumulator`]).
    fn memory(&self, plan: &Plan, model: &ModelFacts, state: &mut StateBytes) {
        if plan.grad_accum > 1 {
            state.accumulated_gradients = model.parameters * plan.precision.compute_bytes();
        }
    }
}

// ---------------------------------------------------------------------------
// Mechanism: gradient accumulation.

/// The gradients of `vars` from a [`GradStore`], detached (so they do not pin
/// the forward graph once the store and the loss are dropped), in the order of
/// `vars`. A var without a gradient is an error naming its position.
pub fn collect_grads(store: &GradStore, vars: &[Var]) -> Result<Vec<Tensor>> {
    vars.iter()
        .enumerate()
        .map(|(i, v)| {
            store.get(v.as_tensor()).map(Tensor::detach).ok_or_else(|| {
                Error::Config(format!(
                    "var {i} (shape {:?}) received no gradient",
                    v.shape()
                ))
            })
        })
        .collect()
}

/// Sums the gradients of several micro-batches, keeping one gradient set resident.
///
/// The first [`add`](Self::add) keeps the given tensors (no copy); the second
/// replaces each by the sum `acc + g`, a tensor the accumulator owns alone; from
/// then on, tensors of dtype f32/bf16/f16 on the CPU (or on CUDA with the
/// `cuda` feature) are summed in place (the incoming gradient converted while
/// reading); other devices allocate `acc + g` and drop the old sum.
/// [`finish`](Self::finish) scales the sums (in place where it can), hands them
/// out and starts a new round. The sums the accumulator owns stay allocated:
/// the next round's first `add` writes into them, so a training loop that keeps
/// one accumulator allocates its sums once, not every step.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use oomfix_strategies::accumulate::GradAccumulator;
///
/// let mut acc = GradAccumulator::new();
/// for k in 1..=4 {
///     acc.add(vec![Tensor::new(&[k as f32, 2.0 * k as f32], &Device::Cpu)?])?;
/// }
/// let mean = acc.finish(1.0 / 4.0)?; // average over the 4 micro-batches
/// assert_eq!(mean[0].to_vec1::<f32>()?, [2.5, 5.0]);
/// drop(mean); // the next round reuses its storage
/// acc.add(vec![Tensor::new(&[1f32, 1.0], &Device::Cpu)?])?;
/// assert_eq!(acc.finish(1.0)?[0].to_vec1::<f32>()?, [1.0, 1.0]);
/// # Ok::<(), oomfix_strategies::Error>(())
/// ```
#[derive(Debug, Default)]
pub struct GradAccumulator {
    /// The running sums.
    acc: Vec<Tensor>,
    /// Whether `acc[i]`'s storage belongs to the accumulator alone (then it may
    /// be changed in place).
    owned: Vec<bool>,
    /// Dtype to accumulate in; `None` keeps each gradient's dtype.
    dtype: Option<DType>,
    micro_batches: usize,
}

impl GradAccumulator {
    /// Accumulates each gradient in its own dtype.
    pub fn new() -> Self {
        Self::default()
    }

    /// Accumulates in `dtype`, e.g. f32 sums of bf16 gradients (the first
    /// micro-batch's gradients are converted, 4 bytes per element for f32).
    pub fn with_dtype(dtype: DType) -> Self {
        GradAccumulator {
            dtype: Some(dtype),
            ..Self::default()
        }
    }

    /// Micro-batches added so far.
    pub fn micro_batches(&self) -> usize {
        self.micro_batches
    }

    /// Adds one micro-batch's gradients (detached here; same count and shapes
    /// every time, else an error and nothing changes). Drop the `GradStore` they
    /// came from before the next forward, or it keeps the graph alive.
    pub fn add(&mut self, grads: Vec<Tensor>) -> Result<()> {
        if self.micro_batches == 0 && self.reusable(&grads) {
            for (a, g) in self.acc.iter().zip(&grads) {
                combine_in_place(a, g, Combine::Assign)?;
            }
        } else if self.micro_batches == 0 {
            let dtype = self.dtype;
            (self.acc, self.owned) = grads
                .into_iter()
                .map(|g| take_first(g, dtype))
                .collect::<Result<Vec<_>>>()?
                .into_iter()
                .unzip();
        } else {
            self.check(&grads)?;
            for (i, g) in grads.iter().enumerate() {
                self.add_one(i, g)?;
            }
        }
        self.micro_batches += 1;
        Ok(())
    }

    /// Whether the previous round's sums can take `grads` in place: all owned
    /// by the accumulator, in the accumulation dtype, shapes matching, and a
    /// kernel takes each pair.
    fn reusable(&self, grads: &[Tensor]) -> bool {
        !self.acc.is_empty()
            && self.owned.iter().all(|&o| o)
            && grads.len() == self.acc.len()
            && self.acc.iter().zip(grads).all(|(a, g)| {
                a.dims() == g.dims()
                    && self.dtype.unwrap_or(g.dtype()) == a.dtype()
                    && in_place(a, g)
            })
    }

    fn check(&self, grads: &[Tensor]) -> Result<()> {
        if grads.len() != self.acc.len() {
            return Err(Error::Config(format!(
                "{} gradients added to an accumulator of {}",
                grads.len(),
                self.acc.len()
            )));
        }
        for (i, (a, g)) in self.acc.iter().zip(grads).enumerate() {
            if a.shape() != g.shape() {
                return Err(Error::Config(format!(
                    "gradient {i} has shape {:?}, earlier micro-batches {:?}",
                    g.shape(),
                    a.shape()
                )));
            }
        }
        Ok(())
    }

    fn add_one(&mut self, i: usize, g: &Tensor) -> Result<()> {
        if self.owned[i] && in_place(&self.acc[i], g) {
            combine_in_place(&self.acc[i], g, Combine::Add)?;
        } else {
            let acc = &self.acc[i];
            self.acc[i] = (acc + g.detach().to_dtype(acc.dtype())?)?;
            self.owned[i] = true;
        }
        Ok(())
    }

    /// The sums times `scale` (`1 / micro_batches` gives the mean), in the order
    /// added, and a new round: the next [`add`](Self::add) starts from zero,
    /// writing into the sums this accumulator owns (the returned tensors share
    /// their storage: use them before that). An error if nothing was added.
    pub fn finish(&mut self, scale: f64) -> Result<Vec<Tensor>> {
        if self.micro_batches == 0 {
            return Err(Error::Config("no gradients were accumulated".into()));
        }
        self.micro_batches = 0;
        if scale != 1.0 {
            for (a, owned) in self.acc.iter_mut().zip(&mut self.owned) {
                if *owned && scale_in_place(a, scale as f32)? {
                    continue;
                }
                *a = a.affine(scale, 0.0)?;
                *owned = true;
            }
        }
        let sums = self.acc.clone();
        if !self.owned.iter().all(|&o| o) {
            // Sums that are the caller's gradients are not kept between rounds.
            self.acc.clear();
            self.owned.clear();
        }
        Ok(sums)
    }

    /// Forgets the current round (after a failed step): the next
    /// [`add`](Self::add) starts from zero. Owned sums stay allocated.
    pub fn restart(&mut self) {
        self.micro_batches = 0;
    }
}

/// What [`combine_in_place`] writes into the accumulator.
#[derive(Debug, Clone, Copy)]
enum Combine {
    /// `acc = acc + g`
    Add,
    /// `acc = g`
    Assign,
}

/// Whether an in-place kernel takes the pair: CPU tensors, or CUDA tensors
/// (with the `cuda` feature), of dtype f32/bf16/f16 and equal element count.
fn in_place(acc: &Tensor, g: &Tensor) -> bool {
    if acc.elem_count() != g.elem_count() {
        return false;
    }
    #[cfg(feature = "cuda")]
    if cuda_in_place_ok(acc) && cuda_in_place_ok(g) {
        return true;
    }
    in_place_ok(acc) && in_place_ok(g)
}

/// Writes `g` into `acc` by `op`, in place; the pair passed [`in_place`].
fn combine_in_place(acc: &Tensor, g: &Tensor, op: Combine) -> Result<()> {
    #[cfg(feature = "cuda")]
    if acc.device().is_cuda() {
        let g = g.contiguous()?;
        match op {
            Combine::Add => cuda::add(acc, &g)?,
            Combine::Assign => cuda::assign(acc, &g)?,
        }
        return Ok(());
    }
    let g = g.contiguous()?;
    with_cpu_mut_src(acc, &g, |a, al, g, gl| {
        let (ar, gr) = (contiguous_range(al)?, contiguous_range(gl)?);
        with_float_vec!(a, a => with_float_vec!(g, g => {
            let (a, g) = (&mut a[ar.clone()], &g[gr.clone()]);
            match op {
                Combine::Add => zip_in_place(a, g, |a, g| a + g),
                Combine::Assign => zip_in_place(a, g, |_, g| g),
            }
            Ok(())
        }))
    })?;
    Ok(())
}

/// `acc *= s` in place when a kernel takes `acc`; `false` when none does.
fn scale_in_place(acc: &Tensor, s: f32) -> Result<bool> {
    if in_place_ok(acc) {
        with_cpu_mut(acc, |st, l| {
            let r = contiguous_range(l)?;
            with_float_vec!(st, v => {
                map_in_place(&mut v[r], |x| x * s);
                Ok(())
            })
        })?;
        return Ok(true);
    }
    #[cfg(feature = "cuda")]
    if cuda_in_place_ok(acc) {
        cuda::scale(acc, s)?;
        return Ok(true);
    }
    Ok(false)
}

/// Whether the CUDA in-place kernels can take `t`: a contiguous f32, bf16 or
/// f16 tensor on a CUDA device.
#[cfg(feature = "cuda")]
fn cuda_in_place_ok(t: &Tensor) -> bool {
    t.device().is_cuda() && is_kernel_dtype(t.dtype()) && t.is_contiguous()
}

/// Whether the CPU in-place kernels can take `t`.
fn in_place_ok(t: &Tensor) -> bool {
    t.device().is_cpu() && is_kernel_dtype(t.dtype())
}

/// The first micro-batch's gradient, detached and converted to `dtype` if one is
/// given; `true` when that made a new tensor (owned by the accumulator).
fn take_first(g: Tensor, dtype: Option<DType>) -> Result<(Tensor, bool)> {
    let g = g.detach();
    match dtype {
        Some(d) if d != g.dtype() => Ok((g.to_dtype(d)?, true)),
        _ => Ok((g, false)),
    }
}

/// `a[i] = f(a[i], b[i])` computed in f32, chunked across rayon for large slices.
pub(crate) fn zip_in_place<A: Float, B: Float>(
    a: &mut [A],
    b: &[B],
    f: impl Fn(f32, f32) -> f32 + Sync,
) {
    let serial = |a: &mut [A], b: &[B]| {
        for (a, b) in a.iter_mut().zip(b) {
            *a = A::from_f32(f(a.to_f32(), b.to_f32()));
        }
    };
    if a.len() <= CHUNK {
        serial(a, b);
    } else {
        a.par_chunks_mut(CHUNK)
            .zip(b.par_chunks(CHUNK))
            .for_each(|(a, b)| serial(a, b));
    }
}

/// `a[i] = f(a[i])` computed in f32, chunked across rayon for large slices.
fn map_in_place<A: Float>(a: &mut [A], f: impl Fn(f32) -> f32 + Sync) {
    let serial = |a: &mut [A]| a.iter_mut().for_each(|x| *x = A::from_f32(f(x.to_f32())));
    if a.len() <= CHUNK {
        serial(a);
    } else {
        a.par_chunks_mut(CHUNK).for_each(serial);
    }
}

#[cfg(test)]
mod divisor_tests {
    use super::divisors;

    #[test]
    fn divisors_match_trial_division_of_every_number() {
        for n in 0..=1000usize {
            let slow: Vec<usize> = (1..=n).filter(|d| n % d == 0).collect();
            assert_eq!(divisors(n), slow, "n = {n}");
        }
    }

    #[test]
    fn divisors_of_large_numbers_are_immediate() {
        assert_eq!(divisors(1 << 40).len(), 41);
        let d = divisors(720_720);
        assert_eq!(d.len(), 240);
        assert!(d.windows(2).all(|w| w[0] < w[1]));
    }
}
