//! [`MpiComm`]: the collectives between processes on the CPU through MPI.

use std::sync::Mutex;

use candle_core::{DType, Device, Shape, Tensor};
use mpi::collective::SystemOperation;
use mpi::datatype::Equivalence;
use mpi::environment::Universe;
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;
use mpi::Threading;

use super::Comm;
use crate::{Error, Result};

/// A [`Comm`] over MPI's world communicator (Open MPI, MPICH, …, through the
/// `mpi` crate): one process per rank, started by `mpirun` (or another MPI
/// launcher), CPU tensors only.
///
/// Each operation is one MPI collective (`MPI_Allreduce`, `MPI_Reduce`,
/// `MPI_Bcast`, `MPI_Allgather`) on a copy of the tensor's elements. f32,
/// f64, i64, u32 and u8 travel as they are; bf16 and f16 travel as f32 (MPI
/// has no sum for them) and come back in their dtype. MPI's default error
/// handler stays: an MPI error aborts the whole job rather than leaving a
/// rank waiting.
///
/// Creating it initialises MPI (once per process: a second one is an error);
/// dropping it finalises MPI. Calls are serialised by a lock, so it may be
/// shared between threads.
pub struct MpiComm {
    world: SimpleCommunicator,
    rank: usize,
    size: usize,
    lock: Mutex<()>,
    // Last: finalises MPI when dropped, after the communicator.
    _universe: Universe,
}

// SAFETY: MPI is initialised with `MPI_THREAD_SERIALIZED` (checked in `init`)
// and every call through `world` holds `lock`: no two threads call MPI at once.
unsafe impl Send for MpiComm {}
// SAFETY: as for `Send`.
unsafe impl Sync for MpiComm {}

impl std::fmt::Debug for MpiComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpiComm")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .finish()
    }
}

/// A tensor's elements as MPI sends them.
enum Wire {
    F32(Vec<f32>),
    F64(Vec<f64>),
    I64(Vec<i64>),
    U32(Vec<u32>),
    U8(Vec<u8>),
}

/// Applies `$f` (a generic function of `&self` and a slice) to the vector in
/// a [`Wire`], wrapping a `Vec` result in the same variant.
macro_rules! on_wire {
    ($w:expr, $v:ident => $body:expr) => {
        match $w {
            Wire::F32($v) => $body.map(|r| r.map(Wire::F32)),
            Wire::F64($v) => $body.map(|r| r.map(Wire::F64)),
            Wire::I64($v) => $body.map(|r| r.map(Wire::I64)),
            Wire::U32($v) => $body.map(|r| r.map(Wire::U32)),
            Wire::U8($v) => $body.map(|r| r.map(Wire::U8)),
        }
    };
}

fn to_wire(t: &Tensor) -> Result<Wire> {
    if !t.device().is_cpu() {
        return Err(Error::Unsupported(
            "MPI collectives take CPU tensors (use NCCL for GPUs)".into(),
        ));
    }
    let flat = t.flatten_all()?;
    Ok(match t.dtype() {
        DType::F32 | DType::BF16 | DType::F16 => Wire::F32(flat.to_dtype(DType::F32)?.to_vec1()?),
        DType::F64 => Wire::F64(flat.to_vec1()?),
        DType::I64 => Wire::I64(flat.to_vec1()?),
        DType::U32 => Wire::U32(flat.to_vec1()?),
        DType::U8 => Wire::U8(flat.to_vec1()?),
        other => {
            return Err(Error::Unsupported(format!(
                "MPI collectives of {other:?} tensors"
            )))
        }
    })
}

fn from_wire(w: Wire, shape: &Shape, dtype: DType) -> Result<Tensor> {
    let cpu = &Device::Cpu;
    let t = match w {
        Wire::F32(v) => Tensor::from_vec(v, shape, cpu)?,
        Wire::F64(v) => Tensor::from_vec(v, shape, cpu)?,
        Wire::I64(v) => Tensor::from_vec(v, shape, cpu)?,
        Wire::U32(v) => Tensor::from_vec(v, shape, cpu)?,
        Wire::U8(v) => Tensor::from_vec(v, shape, cpu)?,
    };
    Ok(if t.dtype() == dtype {
        t
    } else {
        t.to_dtype(dtype)?
    })
}

impl MpiComm {
    /// Initialises MPI and takes its world communicator: this process's rank
    /// and the number of processes come from the MPI launcher. Fails when MPI
    /// is already initialised in this process or cannot serialise calls from
    /// several threads.
    pub fn init() -> Result<Self> {
        let (universe, threading) = mpi::initialize_with_threading(Threading::Serialized)
            .ok_or_else(|| Error::Comm("MPI is already initialised in this process".into()))?;
        if threading < Threading::Serialized {
            return Err(Error::Comm(format!(
                "the MPI library offers {threading:?} threading; serialised calls from several threads are needed"
            )));
        }
        let world = universe.world();
        let (rank, size) = (world.rank() as usize, world.size() as usize);
        Ok(MpiComm {
            world,
            rank,
            size,
            lock: Mutex::new(()),
            _universe: universe,
        })
    }

    fn locked<R>(&self, f: impl FnOnce(&SimpleCommunicator) -> R) -> Result<R> {
        let _guard = self
            .lock
            .lock()
            .map_err(|_| Error::Comm("a thread panicked inside an MPI call".into()))?;
        Ok(f(&self.world))
    }

    fn check_root(&self, root: usize) -> Result<i32> {
        if root < self.size {
            Ok(root as i32)
        } else {
            Err(Error::Comm(format!(
                "root {root} is not a rank of a group of {}",
                self.size
            )))
        }
    }

    fn all_reduce_vec<T: Equivalence + Copy + Default>(&self, v: &[T]) -> Result<Option<Vec<T>>> {
        let mut out = vec![T::default(); v.len()];
        self.locked(|w| w.all_reduce_into(v, &mut out[..], SystemOperation::sum()))?;
        Ok(Some(out))
    }

    fn reduce_vec<T: Equivalence + Copy + Default>(
        &self,
        v: &[T],
        root: i32,
    ) -> Result<Option<Vec<T>>> {
        self.locked(|w| {
            let p = w.process_at_rank(root);
            if w.rank() == root {
                let mut out = vec![T::default(); v.len()];
                p.reduce_into_root(v, &mut out[..], SystemOperation::sum());
                Some(out)
            } else {
                p.reduce_into(v, SystemOperation::sum());
                None
            }
        })
    }

    fn broadcast_vec<T: Equivalence>(&self, mut v: Vec<T>, root: i32) -> Result<Option<Vec<T>>> {
        self.locked(|w| w.process_at_rank(root).broadcast_into(&mut v[..]))?;
        Ok(Some(v))
    }

    fn all_gather_vec<T: Equivalence + Copy + Default>(&self, v: &[T]) -> Result<Option<Vec<T>>> {
        let mut out = vec![T::default(); v.len() * self.size];
        self.locked(|w| w.all_gather_into(v, &mut out[..]))?;
        Ok(Some(out))
    }
}

impl Comm for MpiComm {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.size
    }
    fn all_reduce_sum(&self, t: &Tensor) -> Result<Tensor> {
        let w = on_wire!(to_wire(t)?, v => self.all_reduce_vec(&v))?.expect("every rank");
        from_wire(w, t.shape(), t.dtype())
    }
    fn reduce_sum(&self, t: &Tensor, root: usize) -> Result<Option<Tensor>> {
        let root = self.check_root(root)?;
        match on_wire!(to_wire(t)?, v => self.reduce_vec(&v, root))? {
            Some(w) => Ok(Some(from_wire(w, t.shape(), t.dtype())?)),
            None => Ok(None),
        }
    }
    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        let root = self.check_root(root)?;
        let w = on_wire!(to_wire(t)?, v => self.broadcast_vec(v, root))?.expect("every rank");
        from_wire(w, t.shape(), t.dtype())
    }
    fn all_gather(&self, t: &Tensor) -> Result<Vec<Tensor>> {
        let w = on_wire!(to_wire(t)?, v => self.all_gather_vec(&v))?.expect("every rank");
        let all = from_wire(w, &Shape::from(t.elem_count() * self.size), t.dtype())?;
        (0..self.size)
            .map(|r| {
                Ok(all
                    .narrow(0, r * t.elem_count(), t.elem_count())?
                    .reshape(t.shape())?)
            })
            .collect()
    }
}
