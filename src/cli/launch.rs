//! `oomfix train --gpus N` outside a job: start the N ranks and wait for them.
//!
//! On GPUs it starts N copies of itself with torchrun's environment (`RANK`,
//! `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR=127.0.0.1`,
//! `MASTER_PORT`: the environment's, else a free port); on the CPU (`--device
//! cpu`) it runs `mpirun -n N` on itself. Each rank plans (rank 0 chooses and
//! prints the plan) and trains. When a rank fails, the others stop (the
//! watchdog, see `oomfix::dist`); the launcher names the first rank that
//! failed and exits with its code when that is 1 or 2, else 3. After a first
//! failure it gives the others [`GRACE`] to stop, then kills them. SIGINT and
//! SIGTERM are passed on to the ranks, which stop together at a step boundary
//! (the ranks have a process group of their own: a Ctrl-C at the terminal
//! reaches them once, through the launcher).

use super::signals::StopSignals;
use super::{logging, Exit, Failure, Outcome};
use oomfix::Target;
use std::process::{Child, Command, ExitStatus};
use std::time::{Duration, Instant};

/// How long the other ranks have to stop by themselves after a failure.
pub const GRACE: Duration = Duration::from_secs(30);

/// Starts `n` ranks of this command line on `target` and waits for them.
pub fn run(n: usize, target: Target) -> Outcome {
    run_with(n, target, &[])
}

/// Whether this build can start ranks on `target`: on the CPU it needs MPI,
/// on GPUs NCCL (a usage error otherwise).
pub fn can_start(target: Target) -> Result<(), Failure> {
    let (needs, feature, present) = match target {
        Target::Cpu => (
            "MPI (--device cpu runs them under mpirun)",
            "mpi",
            cfg!(feature = "mpi"),
        ),
        Target::Cuda(_) => ("NCCL", "nccl", cfg!(feature = "nccl")),
    };
    if present {
        return Ok(());
    }
    Err(Failure::Usage(format!(
        "--gpus N runs N processes over {needs}: this build has none (build with --features {feature})"
    )))
}

/// [`run`], with `env` added to the ranks' environment.
pub fn run_with(n: usize, target: Target, env: &[(&str, String)]) -> Outcome {
    can_start(target)?;
    let exe = std::env::current_exe()
        .map_err(|e| Failure::Run(format!("cannot find this program: {}", super::io_text(&e))))?;
    let args: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
    let signals = StopSignals::install()?;
    let children = match target {
        Target::Cpu => vec![(None, spawn_mpirun(n, &exe, &args, env)?)],
        Target::Cuda(_) => spawn_torchrun(n, &exe, &args, env)?,
    };
    logging::notice(format_args!("started {n} ranks"));
    wait(children, &signals)
}

/// Puts a rank (or mpirun) in a process group of its own, so that a Ctrl-C
/// at the terminal reaches the launcher alone, which passes it on once (a
/// second SIGINT stops a rank at once, without its checkpoint), and has it
/// receive SIGTERM should the launcher die.
fn own_group(cmd: &mut Command) -> &mut Command {
    use std::os::unix::process::CommandExt;
    cmd.process_group(0);
    // SAFETY: prctl is async-signal-safe and reads no memory of the parent.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
            Ok(())
        })
    }
}

fn spawn_error(what: &str) -> impl FnOnce(std::io::Error) -> Failure + '_ {
    move |e| Failure::Run(format!("cannot start {what}: {}", super::io_text(&e)))
}

/// Starts `mpirun -n N` on this command line (`can_start` said MPI is there).
fn spawn_mpirun(
    n: usize,
    exe: &std::path::Path,
    args: &[std::ffi::OsString],
    env: &[(&str, String)],
) -> Result<Child, Failure> {
    let mut cmd = Command::new("mpirun");
    cmd.args(["-n", &n.to_string(), "--oversubscribe", "--bind-to", "none"]);
    // mpirun passes its own environment on to the ranks.
    cmd.envs(env.iter().map(|(k, v)| (k, v)));
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        cmd.arg("--allow-run-as-root");
    }
    cmd.arg(exe).args(args);
    own_group(&mut cmd).spawn().map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            Failure::Usage(
                "--gpus N with --device cpu runs the ranks under mpirun, which is not installed (Open MPI's openmpi-bin)"
                    .into(),
            )
        } else {
            spawn_error("mpirun")(e)
        }
    })
}

fn spawn_torchrun(
    n: usize,
    exe: &std::path::Path,
    args: &[std::ffi::OsString],
    env: &[(&str, String)],
) -> Result<Vec<(Option<usize>, Child)>, Failure> {
    let port = match std::env::var("MASTER_PORT") {
        Ok(p) => p,
        Err(_) => std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port().to_string())
            .map_err(|e| {
                Failure::Run(format!(
                    "no free port for the rendezvous: {}",
                    super::io_text(&e)
                ))
            })?,
    };
    let mut children = Vec::with_capacity(n);
    for rank in 0..n {
        let child = own_group(&mut Command::new(exe))
            .args(args)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("WORLD_SIZE", n.to_string())
            .env("LOCAL_WORLD_SIZE", n.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", &port)
            .spawn();
        match child {
            Ok(c) => children.push((Some(rank), c)),
            Err(e) => {
                for (_, c) in &mut children {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                return Err(spawn_error("a rank")(e));
            }
        }
    }
    Ok(children)
}

/// How a child ended, in words.
fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exit code {c}"),
        (None, Some(s)) => format!("killed by signal {s}"),
        _ => "an unknown status".into(),
    }
}

fn signal(child: &Child, sig: i32) {
    // SAFETY: kill has no memory preconditions; the pid is our child's (not yet reaped).
    unsafe {
        libc::kill(child.id() as i32, sig);
    }
}

fn wait(mut children: Vec<(Option<usize>, Child)>, signals: &StopSignals) -> Outcome {
    let mut first_failure: Option<(Option<usize>, ExitStatus)> = None;
    let mut failed_at: Option<Instant> = None;
    let mut forwarded = false;
    let mut running: Vec<bool> = vec![true; children.len()];
    while running.iter().any(|&r| r) {
        if let (Some(sig), false) = (signals.received(), forwarded) {
            for (i, (_, c)) in children.iter().enumerate() {
                if running[i] {
                    signal(c, sig);
                }
            }
            forwarded = true;
        }
        for (i, (rank, c)) in children.iter_mut().enumerate() {
            if !running[i] {
                continue;
            }
            if let Ok(Some(status)) = c.try_wait() {
                running[i] = false;
                if !status.success() && first_failure.is_none() {
                    first_failure = Some((*rank, status));
                    failed_at = Some(Instant::now());
                }
            }
        }
        if failed_at.is_some_and(|t| t.elapsed() > GRACE) {
            for (i, (_, c)) in children.iter_mut().enumerate() {
                if running[i] {
                    let _ = c.kill();
                    let _ = c.wait();
                    running[i] = false;
                }
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let Some((rank, status)) = first_failure else {
        return Ok(Exit::Done);
    };
    // Stopped as asked: the ranks exit with 128 + the signal, mpirun with 1.
    if let Some(sig) = signals.received() {
        if matches!(status.code(), Some(1)) || status.code() == Some(128 + sig) {
            return Ok(Exit::Signal(sig));
        }
    }
    let who = rank.map_or_else(
        || "a rank (under mpirun)".to_string(),
        |r| format!("rank {r}"),
    );
    match status.code() {
        Some(1) => Ok(Exit::NothingFits),
        Some(2) => Err(Failure::Usage(format!(
            "{who} stopped on a usage or input error ({})",
            describe(status)
        ))),
        _ => Err(Failure::Run(format!("{who} failed: {}", describe(status)))),
    }
}
