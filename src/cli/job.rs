//! `train` as one rank of a job: joining the others (the communicator and the
//! control connection), the watchdog's reaction to another rank's failure,
//! and the plan rank 0 chooses for all.

use super::{logging, Failure, Outcome};
use candle_core::{Device, Tensor};
use oomfix::dist::{Control, Job, Launcher, PeerFailure, Watched};
use oomfix::strategies::shard::Comm;
use oomfix::{Plan, Target};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

/// The control connection of this process, once it joined its job: a
/// failure reported at exit goes to the other ranks through it.
static CONTROL: OnceLock<Control> = OnceLock::new();

/// This rank's side of a job.
pub struct Joined {
    /// Where the job's ranks are.
    pub job: Job,
    /// The collectives between the ranks.
    pub comm: Arc<dyn Comm>,
    /// The device this rank trains on.
    pub device: Device,
}

/// The rank of this process as its launcher set it (for logs), without
/// checking the rest of the environment.
pub fn rank_from_env() -> Option<usize> {
    ["OMPI_COMM_WORLD_RANK", "RANK"]
        .iter()
        .find_map(|v| std::env::var(v).ok()?.trim().parse().ok())
}

/// Set when another rank's failure stops this one: the watchdog reports it
/// and exits, and what the aborted collectives make fail here is not news.
static STOPPING: AtomicBool = AtomicBool::new(false);

/// Tells the other ranks that this one failed (a no-op outside a job).
pub fn report_failure(failure: &Failure) {
    if let Some(c) = CONTROL.get() {
        c.report_failure(logging::without_backtrace(&failure.to_string()));
    }
}

/// Ends this rank's part of the job with `outcome`: a success tells the
/// others that this rank finished; a failure tells them (they would wait for
/// it in a collective), says why and leaves at once, as the watchdog does:
/// closing the communicator (MPI's finalisation) would wait for ranks that
/// are stopping.
pub fn conclude(outcome: Outcome) -> Outcome {
    match &outcome {
        Ok(_) => {
            if let Some(c) = CONTROL.get() {
                c.finish();
            }
        }
        Err(failure) => {
            if STOPPING.load(Ordering::SeqCst) {
                // The watchdog is reporting the cause and ending the process.
                std::thread::sleep(std::time::Duration::from_secs(10));
                std::process::exit(Failure::Run(String::new()).code().into());
            }
            report_failure(failure);
            std::process::exit(logging::report(failure).into());
        }
    }
    outcome
}

/// Joins the job as rank `job.rank`: the communicator, the control
/// connection and its watchdog, on the device `target` asks for.
pub fn join(job: Job, target: Target) -> Result<Joined, Failure> {
    let (timeout, rank_timeout) = (Job::timeout()?, Job::rank_timeout()?);
    let (comm, device, control): (Arc<dyn Comm>, Device, Control) = match job.launcher {
        Launcher::Mpi => join_mpi(&job, target, timeout)?,
        Launcher::Torchrun => join_nccl(&job, target, timeout)?,
    };
    let watched = Watched::new(comm);
    let progress = watched.progress();
    let comm: Arc<dyn Comm> = Arc::new(watched);
    // Weak: the communicator is dropped (MPI finalised) when training ends.
    let abort = Arc::downgrade(&comm);
    control.watch(progress, rank_timeout, move |f: PeerFailure| {
        STOPPING.store(true, Ordering::SeqCst);
        if let Some(comm) = abort.upgrade() {
            comm.abort();
        }
        let code = logging::report(&Failure::Run(format!(
            "stopping: rank {} failed: {}",
            f.rank, f.cause
        )));
        std::process::exit(code.into());
    });
    let _ = CONTROL.set(control);
    tracing::info!(
        rank = job.rank,
        world_size = job.world_size,
        pid = std::process::id(),
        "rank started"
    );
    Ok(Joined { job, comm, device })
}

#[cfg(feature = "mpi")]
fn join_mpi(
    job: &Job,
    target: Target,
    timeout: std::time::Duration,
) -> Result<(Arc<dyn Comm>, Device, Control), Failure> {
    use oomfix::dist::Listener;
    use oomfix::strategies::shard::MpiComm;
    if target != Target::Cpu {
        return Err(Failure::Usage(
            "ranks started by mpirun train on the CPU (--device cpu); GPU ranks use NCCL with torchrun's \
             environment (or `oomfix train --gpus N`)"
                .into(),
        ));
    }
    let comm = MpiComm::init().map_err(|e| Failure::Run(format!("MPI: {e}")))?;
    if comm.world_size() != job.world_size || comm.rank() != job.rank {
        return Err(Failure::Usage(format!(
            "MPI says rank {} of {}, the environment rank {} of {}",
            comm.rank(),
            comm.world_size(),
            job.rank,
            job.world_size
        )));
    }
    // Rank 0 listens at a port of its choosing and sends it through MPI (0: it could not).
    let listener = (job.rank == 0)
        .then(|| Listener::bind(&job.master_addr, job.master_port.unwrap_or(0)))
        .transpose();
    let port = match &listener {
        Ok(Some(l)) => l.port(),
        _ => 0,
    };
    let port = comm
        .broadcast(
            &Tensor::new(&[u32::from(port)], &Device::Cpu).map_err(lib)?,
            0,
        )
        .and_then(|t| Ok(t.to_vec1::<u32>()?[0]))
        .map_err(|e| Failure::Run(format!("MPI: {e}")))?;
    let control = match listener? {
        Some(l) => l.accept(job.world_size, &[], timeout)?,
        None if port == 0 => {
            return Err(Failure::Usage(
                "rank 0 could not open the control connection (MASTER_ADDR, MASTER_PORT)".into(),
            ))
        }
        None => {
            Control::connect(
                &job.master_addr,
                port as u16,
                job.rank,
                job.world_size,
                timeout,
            )?
            .0
        }
    };
    Ok((Arc::new(comm), Device::Cpu, control))
}

#[cfg(not(feature = "mpi"))]
fn join_mpi(
    _: &Job,
    _: Target,
    _: std::time::Duration,
) -> Result<(Arc<dyn Comm>, Device, Control), Failure> {
    Err(Failure::Usage(
        "started by mpirun, but this build has no MPI (build with --features mpi)".into(),
    ))
}

/// Joins a torchrun job (NCCL between GPU ranks).
fn join_nccl(
    job: &Job,
    target: Target,
    timeout: std::time::Duration,
) -> Result<(Arc<dyn Comm>, Device, Control), Failure> {
    if target == Target::Cpu {
        return Err(cpu_under_torchrun());
    }
    #[cfg(not(feature = "nccl"))]
    {
        let _ = (job, timeout);
        Err(Failure::Usage(
            "RANK and WORLD_SIZE are set (a torchrun job), but this build has no NCCL (build with --features nccl)"
                .into(),
        ))
    }
    #[cfg(feature = "nccl")]
    {
        use oomfix::dist::Listener;
        use oomfix::strategies::shard::NcclComm;
        let ordinal = gpu_of(job.local_rank)?;
        let device = candle_core::Device::new_cuda(ordinal)
            .map_err(|e| Failure::Usage(format!("cannot use cuda:{ordinal}: {e}")))?;
        let port = job.master_port.unwrap_or(29500);
        let (control, id) = if job.rank == 0 {
            let listener = Listener::bind(&job.master_addr, port)?;
            let id = NcclComm::unique_id().map_err(|e| Failure::Run(format!("NCCL: {e}")))?;
            (listener.accept(job.world_size, &id, timeout)?, id)
        } else {
            Control::connect(&job.master_addr, port, job.rank, job.world_size, timeout)?
        };
        let comm = NcclComm::new(&device, job.rank, job.world_size, &id)
            .map_err(|e| Failure::Run(format!("NCCL: {e}")))?;
        Ok((Arc::new(comm), device, control))
    }
}

/// `--enforce-budget` in a job: holds this rank's GPU to `budget` bytes,
/// each rank its own. Refused (exit 2) where the machine's ranks share its
/// GPUs: a rank's hold on free memory would take the others' share.
pub fn enforce_budget(joined: &Joined, budget: u64) -> Result<(), Failure> {
    let gpus = gpu_count()?;
    let ranks = joined.job.local_world_size;
    if ranks > gpus {
        return Err(Failure::Usage(format!(
            "--enforce-budget holds each rank's GPU to the budget, but {ranks} ranks share {gpus} GPU(s) \
             on this machine"
        )));
    }
    super::plan::enforce_on(&joined.device, budget)
}

/// The GPUs of this machine.
#[cfg(feature = "nccl")]
fn gpu_count() -> Result<usize, Failure> {
    use candle_core::cuda_backend::cudarc::driver::CudaContext;
    let gpus = CudaContext::device_count()
        .map_err(|e| Failure::Run(format!("cannot count the GPUs: {e}")))?;
    Ok(gpus.max(0) as usize)
}

/// Without NCCL a job's ranks are on the CPU, which has no GPU to hold.
#[cfg(not(feature = "nccl"))]
fn gpu_count() -> Result<usize, Failure> {
    Err(Failure::Usage(
        "--enforce-budget limits a CUDA device's memory; ranks on the CPU have none".into(),
    ))
}

/// The GPU of the rank with this `LOCAL_RANK`: `cuda:LOCAL_RANK`, as torchrun
/// places ranks. Where NCCL may put several ranks on one GPU
/// (`NCCL_MULTI_RANK_GPU_ENABLE=1`, NCCL 2.30 or newer; for testing), local
/// ranks beyond the machine's GPUs wrap around them.
#[cfg(feature = "nccl")]
fn gpu_of(local_rank: usize) -> Result<usize, Failure> {
    let gpus = gpu_count()?;
    let shared = std::env::var("NCCL_MULTI_RANK_GPU_ENABLE").is_ok_and(|v| v.trim() == "1");
    match (local_rank < gpus, shared && gpus > 0) {
        (true, _) => Ok(local_rank),
        (false, true) => Ok(local_rank % gpus),
        (false, false) => Err(Failure::Usage(format!(
            "LOCAL_RANK {local_rank} has no GPU: this machine has {gpus} (several ranks share a GPU \
             only with NCCL_MULTI_RANK_GPU_ENABLE=1 and NCCL 2.30 or newer)"
        ))),
    }
}

fn cpu_under_torchrun() -> Failure {
    Failure::Usage(
        "RANK and WORLD_SIZE are set (a torchrun job), but ranks on the CPU run under mpirun: \
         `mpirun -n N oomfix train --device cpu …` or `oomfix train --gpus N --device cpu` (build with --features mpi)"
            .into(),
    )
}

fn lib(e: candle_core::Error) -> Failure {
    Failure::Lib(e.into())
}

/// Rank 0's `plan` (`None`: nothing fits) on every rank (collective).
pub fn share_plan(comm: &dyn Comm, plan: Option<&Plan>) -> Result<Option<Plan>, Failure> {
    let json = plan.map(|p| serde_json::to_vec(p).expect("a plan serialises"));
    let len = json.as_ref().map_or(0, |j| j.len() as u32);
    let run = |e: oomfix::strategies::Error| Failure::Run(format!("sharing the plan: {e}"));
    let len = comm
        .broadcast(&Tensor::new(&[len], &Device::Cpu).map_err(lib)?, 0)
        .map_err(run)?
        .to_vec1::<u32>()
        .map_err(lib)?[0] as usize;
    if len == 0 {
        return Ok(None);
    }
    let bytes = json.unwrap_or_else(|| vec![0; len]);
    let bytes = comm
        .broadcast(
            &Tensor::new(bytes.as_slice(), &Device::Cpu).map_err(lib)?,
            0,
        )
        .map_err(run)?
        .to_vec1::<u8>()
        .map_err(lib)?;
    serde_json::from_slice(&bytes)
        .map(Some)
        .map_err(|e| Failure::Run(format!("rank 0's plan: {e}")))
}
