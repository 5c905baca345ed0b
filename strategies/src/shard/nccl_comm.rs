//! [`NcclComm`]: the collectives between GPU processes through NCCL.

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::nccl::safe::{Comm as Nccl, Id, ReduceOp};
use candle_core::cuda_backend::{CudaDType, CudaStorage};
use candle_core::{CpuStorage, CustomOp1, DType, Device, Layout, Shape, Tensor};

use super::Comm;
use crate::{Error, Result};

/// A [`Comm`] over NCCL: one process per GPU, the collectives on device memory
/// in the tensor's own dtype (bf16 and f16 gradients travel in 16 bits),
/// enqueued on the device's stream so that they are ordered with candle's
/// kernels. CPU tensors (small messages such as the plan) are copied to the
/// device and back.
///
/// The ranks agree on a [`unique_id`](Self::unique_id) made by rank 0 and
/// handed to the others (oomfix serves it over TCP at `MASTER_ADDR:MASTER_PORT`).
/// [`Comm::abort`] aborts the communicator (`ncclCommAbort`), so that a rank
/// whose peer died does not wait for ever.
pub struct NcclComm {
    comm: Mutex<Option<Nccl>>,
    device: Device,
    rank: usize,
    world: usize,
}

// SAFETY: the NCCL communicator is used by one thread at a time (the mutex);
// NCCL allows a communicator to be used from any thread when calls are not concurrent.
unsafe impl Send for NcclComm {}
// SAFETY: as for `Send`.
unsafe impl Sync for NcclComm {}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclComm")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .finish()
    }
}

fn nccl_error(e: impl std::fmt::Debug) -> Error {
    Error::Comm(format!("NCCL: {e:?}"))
}

#[derive(Clone, Copy)]
enum Kind {
    AllReduce,
    Reduce(usize),
    Broadcast(usize),
    AllGather,
}

struct Op<'a> {
    comm: &'a Nccl,
    kind: Kind,
    world: usize,
}

impl Op<'_> {
    fn run<T>(&self, s: &CudaStorage, l: &Layout) -> candle_core::Result<(CudaStorage, Shape)>
    where
        T: CudaDType
            + candle_core::cuda_backend::cudarc::nccl::safe::NcclType
            + candle_core::cuda_backend::cudarc::driver::DeviceRepr
            + candle_core::cuda_backend::cudarc::driver::ValidAsZeroBits,
    {
        let (start, end) = l
            .contiguous_offsets()
            .ok_or_else(|| candle_core::Error::Msg("NCCL takes contiguous tensors".into()))?;
        let n = end - start;
        let dev = s.device().clone();
        let src = s.as_cuda_slice::<T>()?.slice(start..end);
        let err = |e: candle_core::cuda_backend::cudarc::nccl::result::NcclError| {
            candle_core::Error::Msg(format!("NCCL: {e:?}"))
        };
        let (len, shape) = match self.kind {
            Kind::AllGather => (n * self.world, Shape::from(n * self.world)),
            _ => (n, l.shape().clone()),
        };
        let mut dst = dev.alloc_zeros::<T>(len)?;
        match self.kind {
            Kind::AllReduce => self.comm.all_reduce(&src, &mut dst, &ReduceOp::Sum),
            Kind::Reduce(root) => {
                self.comm
                    .reduce(&src, Some(&mut dst), &ReduceOp::Sum, root as i32)
            }
            Kind::Broadcast(root) => self.comm.broadcast(Some(&src), &mut dst, root as i32),
            Kind::AllGather => self.comm.all_gather(&src, &mut dst),
        }
        .map_err(err)?;
        Ok((CudaStorage::wrap_cuda_slice(dst, dev), shape))
    }
}

impl CustomOp1 for Op<'_> {
    fn name(&self) -> &'static str {
        "nccl"
    }
    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        Err(candle_core::Error::Msg(
            "NCCL collectives run on CUDA tensors".into(),
        ))
    }
    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        match s.dtype() {
            DType::F32 => self.run::<f32>(s, l),
            DType::F64 => self.run::<f64>(s, l),
            DType::BF16 => self.run::<half::bf16>(s, l),
            DType::F16 => self.run::<half::f16>(s, l),
            DType::I64 => self.run::<i64>(s, l),
            DType::U32 => self.run::<u32>(s, l),
            DType::U8 => self.run::<u8>(s, l),
            other => Err(candle_core::Error::Msg(format!(
                "NCCL collectives of {other:?} tensors"
            ))),
        }
    }
}

impl NcclComm {
    /// A new NCCL unique id (on rank 0), as the 128 bytes to hand the other ranks.
    pub fn unique_id() -> Result<Vec<u8>> {
        let id = Id::new().map_err(nccl_error)?;
        Ok(id.internal().iter().map(|&c| c as u8).collect())
    }

    /// Joins the communicator of `world` ranks named by `id` (rank 0's
    /// [`unique_id`](Self::unique_id)) as `rank`, on `device` (a CUDA device);
    /// blocks until every rank has joined.
    pub fn new(device: &Device, rank: usize, world: usize, id: &[u8]) -> Result<Self> {
        let cuda = device.as_cuda_device()?;
        let mut internal = [0 as std::ffi::c_char; 128];
        if id.len() != internal.len() {
            return Err(Error::Comm(format!(
                "an NCCL unique id has 128 bytes, not {}",
                id.len()
            )));
        }
        for (d, &b) in internal.iter_mut().zip(id) {
            *d = b as std::ffi::c_char;
        }
        let comm = Nccl::from_rank(cuda.cuda_stream(), rank, world, Id::uninit(internal))
            .map_err(nccl_error)?;
        Ok(NcclComm {
            comm: Mutex::new(Some(comm)),
            device: device.clone(),
            rank,
            world,
        })
    }

    fn apply(&self, t: &Tensor, kind: Kind) -> Result<Tensor> {
        let guard = self
            .comm
            .lock()
            .map_err(|_| Error::Comm("a thread panicked inside an NCCL call".into()))?;
        let comm = guard
            .as_ref()
            .ok_or_else(|| Error::Comm("the NCCL communicator was aborted".into()))?;
        let on_cpu = t.device().is_cpu();
        let input = if on_cpu {
            t.to_device(&self.device)?
        } else {
            t.contiguous()?
        };
        let out = input.apply_op1_no_bwd(&Op {
            comm,
            kind,
            world: self.world,
        })?;
        Ok(if on_cpu {
            out.to_device(&Device::Cpu)?
        } else {
            out
        })
    }

    fn check_root(&self, root: usize) -> Result<()> {
        if root < self.world {
            Ok(())
        } else {
            Err(Error::Comm(format!(
                "root {root} is not a rank of a group of {}",
                self.world
            )))
        }
    }
}

impl Comm for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.world
    }
    fn all_reduce_sum(&self, t: &Tensor) -> Result<Tensor> {
        self.apply(t, Kind::AllReduce)
    }
    fn reduce_sum(&self, t: &Tensor, root: usize) -> Result<Option<Tensor>> {
        self.check_root(root)?;
        let out = self.apply(t, Kind::Reduce(root))?;
        Ok((self.rank == root).then_some(out))
    }
    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        self.check_root(root)?;
        self.apply(t, Kind::Broadcast(root))
    }
    fn all_gather(&self, t: &Tensor) -> Result<Vec<Tensor>> {
        let all = self.apply(t, Kind::AllGather)?;
        let n = t.elem_count();
        (0..self.world)
            .map(|r| Ok(all.narrow(0, r * n, n)?.reshape(t.shape())?))
            .collect()
    }
    fn abort(&self) {
        // A call in flight holds the lock: then the process is ending anyway.
        if let Ok(mut guard) = self.comm.try_lock() {
            drop(guard.take());
        }
    }
}
