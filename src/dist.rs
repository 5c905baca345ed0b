//! Several processes: a job's ranks as its launcher describes them, and the
//! control connection between them.
//!
//! * [`Job::from_env`] reads what the launcher set: `mpirun` (Open MPI's
//!   `OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE`, `OMPI_COMM_WORLD_LOCAL_RANK`,
//!   `OMPI_COMM_WORLD_LOCAL_SIZE`) or `torchrun` (`RANK`, `WORLD_SIZE`,
//!   `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`); an
//!   inconsistent environment is a usage error.
//! * [`Control`] is one TCP connection from every rank to rank 0 (at
//!   `MASTER_ADDR:MASTER_PORT` for torchrun's jobs; at a port rank 0 picks and
//!   sends through MPI for mpirun's). The rendezvous over it checks that every
//!   rank agrees on the world size and hands every rank a payload from rank 0
//!   (NCCL's unique id); a rank that does not arrive in time, a world size
//!   that differs, or an address that cannot be used are usage errors. After
//!   the rendezvous it is the job's watchdog: a rank that fails says so before
//!   exiting ([`Control::report_failure`]), rank 0 passes it on, and a rank
//!   whose connection closes without a word (killed, crashed) is reported as
//!   such, so every rank learns of a failure within moments instead of
//!   waiting in a collective for ever. It also carries a heartbeat: every
//!   rank says every few seconds that it is alive and how many collectives
//!   it has entered ([`Watched`] counts them). A rank that says nothing for
//!   the rank timeout ([`Job::rank_timeout`]: stopped, or its machine gone)
//!   is reported as hung, and so is one that stays behind the others, which
//!   wait for it in a collective, for that long: the job stops instead of
//!   hanging, as PyTorch's NCCL watchdog makes it. It carries no tensor:
//!   collectives go through MPI or NCCL.

use crate::strategies::shard::Comm;
use crate::{Error, Result};
use candle_core::Tensor;
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Who started the job's processes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launcher {
    /// `mpirun` (Open MPI): collectives through MPI on the CPU.
    Mpi,
    /// `torchrun` or oomfix's own launcher: collectives through NCCL on GPUs.
    Torchrun,
}

/// This process's place in a job of several ranks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Job {
    /// Who started the job.
    pub launcher: Launcher,
    /// This process's rank, in `0..world_size`.
    pub rank: usize,
    /// The number of ranks.
    pub world_size: usize,
    /// This process's rank among those on its machine (its GPU's index).
    pub local_rank: usize,
    /// The number of ranks on this machine.
    pub local_world_size: usize,
    /// `MASTER_ADDR` (default `127.0.0.1`).
    pub master_addr: String,
    /// The control connection's port: `MASTER_PORT` (default 29500, as
    /// PyTorch's), or the port after it under torchrun's agent, which
    /// serves its own store at `MASTER_PORT` (`TORCHELASTIC_USE_AGENT_STORE`);
    /// `None` under mpirun when not set (rank 0 then picks a free port).
    pub master_port: Option<u16>,
}

/// The default rendezvous timeout: 300 s, as torchrun's.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// The environment variable that sets the rendezvous timeout in seconds.
pub const TIMEOUT_VAR: &str = "OOMFIX_RENDEZVOUS_TIMEOUT";

/// The default rank timeout: 600 s, as PyTorch's NCCL watchdog.
pub const DEFAULT_RANK_TIMEOUT: Duration = Duration::from_secs(600);

/// The environment variable that sets the rank timeout in seconds.
pub const RANK_TIMEOUT_VAR: &str = "OOMFIX_RANK_TIMEOUT";

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

fn number(name: &str, value: &str) -> Result<usize> {
    value
        .trim()
        .parse()
        .map_err(|_| Error::Usage(format!("{name}={value:?} is not a whole number")))
}

fn optional(name: &str) -> Result<Option<usize>> {
    var(name).map(|v| number(name, &v)).transpose()
}

impl Job {
    /// The job this process is a rank of, from the environment; `None` when
    /// no launcher set one up (neither `OMPI_COMM_WORLD_SIZE` nor `RANK` /
    /// `WORLD_SIZE`). Under mpirun, `RANK` and `WORLD_SIZE` when set must
    /// agree with MPI's.
    pub fn from_env() -> Result<Option<Job>> {
        Self::from_lookup(&|name| var(name))
    }

    /// As [`from_env`](Self::from_env), reading variables through `get`.
    pub fn from_lookup(get: &dyn Fn(&str) -> Option<String>) -> Result<Option<Job>> {
        let num = |name: &str| -> Result<Option<usize>> {
            get(name).map(|v| number(name, &v)).transpose()
        };
        let master_addr = get("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into());
        let master_port = get("MASTER_PORT")
            .map(|p| {
                p.trim()
                    .parse::<u16>()
                    .ok()
                    .filter(|&p| p > 0)
                    .ok_or_else(|| {
                        Error::Usage(format!("MASTER_PORT={p:?} is not a port (1 to 65535)"))
                    })
            })
            .transpose()?;
        let job = if let Some(size) = num("OMPI_COMM_WORLD_SIZE")? {
            let rank = num("OMPI_COMM_WORLD_RANK")?.unwrap_or(0);
            for (name, mpi) in [("WORLD_SIZE", size), ("RANK", rank)] {
                if let Some(v) = num(name)? {
                    if v != mpi {
                        return Err(Error::Usage(format!(
                            "{name}={v}, but mpirun started this process as {} {mpi}",
                            if name == "RANK" { "rank" } else { "one of" }
                        )));
                    }
                }
            }
            Job {
                launcher: Launcher::Mpi,
                rank,
                world_size: size,
                local_rank: num("OMPI_COMM_WORLD_LOCAL_RANK")?.unwrap_or(rank),
                local_world_size: num("OMPI_COMM_WORLD_LOCAL_SIZE")?.unwrap_or(size),
                master_addr,
                master_port,
            }
        } else {
            let (rank, size) = match (num("RANK")?, num("WORLD_SIZE")?) {
                (None, None) => return Ok(None),
                (Some(r), Some(w)) => (r, w),
                (Some(_), None) => {
                    return Err(Error::Usage("RANK is set but WORLD_SIZE is not".into()))
                }
                (None, Some(_)) => {
                    return Err(Error::Usage("WORLD_SIZE is set but RANK is not".into()))
                }
            };
            if rank >= size {
                return Err(Error::Usage(format!(
                    "RANK={rank} is not below WORLD_SIZE={size}"
                )));
            }
            let local_rank = num("LOCAL_RANK")?.unwrap_or(rank);
            let local_world_size = num("LOCAL_WORLD_SIZE")?.unwrap_or(size);
            if local_rank >= local_world_size {
                return Err(Error::Usage(format!(
                    "LOCAL_RANK={local_rank} is not below LOCAL_WORLD_SIZE={local_world_size}"
                )));
            }
            // torchrun's agent serves its own store at MASTER_PORT and says
            // so to its workers: the control connection takes the next port.
            let agent_store = get("TORCHELASTIC_USE_AGENT_STORE")
                .is_some_and(|v| v.trim().eq_ignore_ascii_case("true"));
            let port = master_port.unwrap_or(29500);
            let port = if agent_store {
                port.checked_add(1).ok_or_else(|| {
                    Error::Usage(format!(
                        "MASTER_PORT={port} is torchrun's store, and no port follows it for oomfix's"
                    ))
                })?
            } else {
                port
            };
            Job {
                launcher: Launcher::Torchrun,
                rank,
                world_size: size,
                local_rank,
                local_world_size,
                master_addr,
                master_port: Some(port),
            }
        };
        if job.world_size == 0 {
            return Err(Error::Usage("WORLD_SIZE is 0".into()));
        }
        if job.rank >= job.world_size {
            return Err(Error::Usage(format!(
                "RANK={} is not below WORLD_SIZE={}",
                job.rank, job.world_size
            )));
        }
        Ok(Some(job))
    }

    /// The rendezvous timeout: [`TIMEOUT_VAR`] in seconds, else [`DEFAULT_TIMEOUT`].
    pub fn timeout() -> Result<Duration> {
        seconds(TIMEOUT_VAR, DEFAULT_TIMEOUT)
    }

    /// The rank timeout: how long a rank may say nothing, or stay behind the
    /// others waiting for it in a collective, before the job stops as hung:
    /// [`RANK_TIMEOUT_VAR`] in seconds, else [`DEFAULT_RANK_TIMEOUT`].
    pub fn rank_timeout() -> Result<Duration> {
        seconds(RANK_TIMEOUT_VAR, DEFAULT_RANK_TIMEOUT)
    }
}

fn seconds(name: &str, default: Duration) -> Result<Duration> {
    match optional(name)? {
        Some(0) => Err(Error::Usage(format!("{name} must be at least 1 second"))),
        Some(s) => Ok(Duration::from_secs(s as u64)),
        None => Ok(default),
    }
}

/// A [`Comm`] that counts the collectives this rank entered: the progress
/// its heartbeat reports (see [`Control::watch`]).
pub struct Watched {
    inner: Arc<dyn Comm>,
    entered: Arc<AtomicU64>,
}

impl Watched {
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn Comm>) -> Watched {
        Watched {
            inner,
            entered: Arc::new(AtomicU64::new(0)),
        }
    }

    /// The count of collectives entered, shared with the heartbeat.
    pub fn progress(&self) -> Arc<AtomicU64> {
        self.entered.clone()
    }

    fn enter(&self) -> &dyn Comm {
        self.entered.fetch_add(1, Ordering::SeqCst);
        self.inner.as_ref()
    }
}

impl Comm for Watched {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn all_reduce_sum(&self, t: &Tensor) -> crate::strategies::Result<Tensor> {
        self.enter().all_reduce_sum(t)
    }
    fn reduce_sum(&self, t: &Tensor, root: usize) -> crate::strategies::Result<Option<Tensor>> {
        self.enter().reduce_sum(t, root)
    }
    fn broadcast(&self, t: &Tensor, root: usize) -> crate::strategies::Result<Tensor> {
        self.enter().broadcast(t, root)
    }
    fn all_gather(&self, t: &Tensor) -> crate::strategies::Result<Vec<Tensor>> {
        self.enter().all_gather(t)
    }
    fn abort(&self) {
        self.inner.abort()
    }
}

/// A failure of one rank, as the watchdog learns of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerFailure {
    /// The rank that failed.
    pub rank: usize,
    /// Why, in one line.
    pub cause: String,
}

/// The control connection of one rank (see the [module](self) documentation).
pub struct Control {
    rank: usize,
    /// Rank 0: one stream per other rank (index = rank; `None` for rank 0).
    /// Other ranks: the stream to rank 0 only.
    streams: Arc<Mutex<Vec<Option<TcpStream>>>>,
}

const HELLO: &str = "oomfix-rendezvous/1";

fn io(context: String) -> impl FnOnce(std::io::Error) -> Error {
    move |e| Error::Usage(format!("{context}: {e}"))
}

fn resolve(addr: &str, port: u16) -> Result<SocketAddr> {
    (addr, port)
        .to_socket_addrs()
        .map_err(io(format!("MASTER_ADDR {addr}")))?
        .next()
        .ok_or_else(|| Error::Usage(format!("MASTER_ADDR {addr} has no address")))
}

fn read_line(stream: &TcpStream, deadline: Instant) -> std::io::Result<String> {
    let left = deadline.saturating_duration_since(Instant::now());
    stream.set_read_timeout(Some(left.max(Duration::from_millis(1))))?;
    let mut line = String::new();
    BufReader::new(stream).read_line(&mut line)?;
    stream.set_read_timeout(None)?;
    Ok(line.trim_end().to_string())
}

/// Rank 0's listening socket, bound before the other ranks connect.
pub struct Listener {
    listener: TcpListener,
}

impl Listener {
    /// Listens at `addr:port` (port 0: any free port).
    pub fn bind(addr: &str, port: u16) -> Result<Listener> {
        let at = resolve(addr, port)?;
        let listener = TcpListener::bind(at).map_err(io(format!(
            "rank 0 cannot listen at {at} (MASTER_ADDR, MASTER_PORT)"
        )))?;
        Ok(Listener { listener })
    }

    /// The port listened at.
    pub fn port(&self) -> u16 {
        self.listener.local_addr().map_or(0, |a| a.port())
    }

    /// Waits up to `timeout` for the other `world_size - 1` ranks, checks
    /// that they agree on the world size, and sends each `payload`.
    pub fn accept(self, world_size: usize, payload: &[u8], timeout: Duration) -> Result<Control> {
        let deadline = Instant::now() + timeout;
        let mut streams: Vec<Option<TcpStream>> = (0..world_size).map(|_| None).collect();
        let mut arrived = 0;
        self.listener
            .set_nonblocking(true)
            .map_err(io("rendezvous".into()))?;
        while arrived + 1 < world_size {
            let stream = match self.listener.accept() {
                Ok((s, _)) => s,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        let missing: Vec<String> = (1..world_size)
                            .filter(|&r| streams[r].is_none())
                            .map(|r| r.to_string())
                            .collect();
                        return Err(Error::Usage(format!(
                            "rendezvous: {arrived} of the {} other ranks arrived within {} s (missing: rank {}); \
                             check WORLD_SIZE, MASTER_ADDR and MASTER_PORT",
                            world_size - 1,
                            timeout.as_secs(),
                            missing.join(", ")
                        )));
                    }
                    std::thread::sleep(Duration::from_millis(20));
                    continue;
                }
                Err(e) => return Err(io("rendezvous".into())(e)),
            };
            stream
                .set_nonblocking(false)
                .map_err(io("rendezvous".into()))?;
            let _ = stream.set_nodelay(true);
            let hello = match read_line(&stream, deadline) {
                Ok(l) => l,
                Err(_) => continue, // not one of ours, or too slow: ignore it
            };
            let mut words = hello.split_whitespace();
            if words.next() != Some(HELLO) {
                continue;
            }
            let field = |w: Option<&str>, key: &str| {
                w.and_then(|w| w.strip_prefix(key))
                    .and_then(|v| v.parse::<usize>().ok())
            };
            let (Some(rank), Some(world)) =
                (field(words.next(), "rank="), field(words.next(), "world="))
            else {
                continue;
            };
            let refuse = |mut s: &TcpStream, msg: String| {
                let _ = writeln!(s, "error {msg}");
                Err(Error::Usage(msg))
            };
            if world != world_size {
                return refuse(
                    &stream,
                    format!(
                        "rank {rank} has WORLD_SIZE={world}, rank 0 has WORLD_SIZE={world_size}"
                    ),
                );
            }
            if rank == 0 || rank >= world_size || streams[rank].is_some() {
                return refuse(&stream, format!("two processes say they are rank {rank}"));
            }
            streams[rank] = Some(stream);
            arrived += 1;
        }
        let hex: String = payload.iter().map(|b| format!("{b:02x}")).collect();
        for s in streams.iter_mut().flatten() {
            writeln!(s, "ok {hex}").map_err(io("rendezvous".into()))?;
        }
        Ok(Control {
            rank: 0,
            streams: Arc::new(Mutex::new(streams)),
        })
    }
}

impl Control {
    /// Rank `rank` (not 0) of `world_size`: connects to rank 0 at
    /// `addr:port` (retrying until it listens), says who it is and waits for
    /// the payload, all within `timeout`.
    pub fn connect(
        addr: &str,
        port: u16,
        rank: usize,
        world_size: usize,
        timeout: Duration,
    ) -> Result<(Control, Vec<u8>)> {
        let at = resolve(addr, port)?;
        let deadline = Instant::now() + timeout;
        let too_late = || {
            Error::Usage(format!(
                "rendezvous: rank 0 did not answer at {at} within {} s; check MASTER_ADDR, MASTER_PORT and WORLD_SIZE",
                timeout.as_secs()
            ))
        };
        let mut stream = loop {
            match TcpStream::connect_timeout(&at, Duration::from_secs(1)) {
                Ok(s) => break s,
                Err(_) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(100))
                }
                Err(_) => return Err(too_late()),
            }
        };
        let _ = stream.set_nodelay(true);
        writeln!(stream, "{HELLO} rank={rank} world={world_size}")
            .map_err(io("rendezvous".into()))?;
        let reply = read_line(&stream, deadline).map_err(|_| too_late())?;
        let payload = match reply.split_once(' ') {
            Some(("ok", hex)) => (0..hex.len() / 2)
                .map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16))
                .collect::<std::result::Result<Vec<u8>, _>>()
                .map_err(|_| Error::Usage(format!("rendezvous: a bad answer from {at}")))?,
            Some(("error", msg)) => return Err(Error::Usage(format!("rendezvous: {msg}"))),
            _ if reply == "ok" => Vec::new(),
            _ => return Err(too_late()),
        };
        Ok((
            Control {
                rank,
                streams: Arc::new(Mutex::new(vec![Some(stream)])),
            },
            payload,
        ))
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Starts the watchdog: a thread per connection that calls `on_failure`
    /// (once) when another rank reports a failure, its connection closes
    /// before it said it was done, or it is hung; `on_failure` is expected to
    /// end the process. Rank 0 first passes the failure on to every other
    /// rank.
    ///
    /// Every rank sends a heartbeat with `progress` (the collectives it
    /// entered, [`Watched::progress`]) every `timeout / 5` (0.1 to 5 s). A
    /// peer is hung when it sends nothing for `timeout` (rank 0 watches
    /// every rank, the others rank 0), or, as rank 0 sees it, when the least
    /// progress of any rank stays the same for `timeout` while some rank is
    /// further: the ranks that stay behind are the ones the others wait for
    /// (all ranks equal for that long: the job is stuck in one collective,
    /// reported against the lowest rank).
    pub fn watch(
        &self,
        progress: Arc<AtomicU64>,
        timeout: Duration,
        on_failure: impl Fn(PeerFailure) + Send + Sync + 'static,
    ) {
        let on_failure = Arc::new(on_failure);
        let fired = Arc::new(AtomicBool::new(false));
        let fail = {
            let (streams, on_failure, fired) = (self.streams.clone(), on_failure, fired.clone());
            let rank = self.rank;
            Arc::new(move |failure: PeerFailure| {
                if fired.swap(true, Ordering::SeqCst) {
                    return;
                }
                if rank == 0 {
                    send_all(
                        &streams,
                        &format!("failed {} {}", failure.rank, failure.cause),
                        Some(failure.rank),
                    );
                }
                on_failure(failure);
            })
        };
        let readers: Vec<(usize, TcpStream)> = {
            let streams = self.streams.lock().unwrap_or_else(|e| e.into_inner());
            streams
                .iter()
                .enumerate()
                .filter_map(|(i, s)| Some((i, s.as_ref()?.try_clone().ok()?)))
                .collect()
        };
        // Rank 0 reads every other rank; the others read rank 0.
        let peer_of = |index: usize| if self.rank == 0 { index } else { 0 };
        let now = Instant::now();
        // What this rank heard of each peer it reads: when, its progress, done.
        let heard: Arc<Mutex<Vec<Heard>>> = Arc::new(Mutex::new(
            readers
                .iter()
                .map(|&(index, _)| Heard {
                    rank: peer_of(index),
                    at: now,
                    progress: 0,
                    done: false,
                })
                .collect(),
        ));
        for (slot, (index, stream)) in readers.into_iter().enumerate() {
            let (heard, fail, peer) = (heard.clone(), fail.clone(), peer_of(index));
            std::thread::spawn(move || {
                let mut reader = BufReader::new(stream);
                let mut line = String::new();
                let failure = loop {
                    line.clear();
                    match reader.read_line(&mut line) {
                        Ok(0) | Err(_) => {
                            break PeerFailure {
                                rank: peer,
                                cause: "its process ended without a word (killed, or crashed)"
                                    .into(),
                            }
                        }
                        Ok(_) => {}
                    }
                    let l = line.trim_end();
                    let mut heard = heard.lock().unwrap_or_else(|e| e.into_inner());
                    heard[slot].at = Instant::now();
                    if let Some(n) = l.strip_prefix("alive ") {
                        heard[slot].progress = n.parse().unwrap_or(heard[slot].progress);
                    } else if l == "done" {
                        heard[slot].done = true;
                        return;
                    } else if let Some(rest) = l.strip_prefix("failed ") {
                        let (r, cause) = rest.split_once(' ').unwrap_or((rest, "failed"));
                        break PeerFailure {
                            rank: r.parse().unwrap_or(peer),
                            cause: cause.to_string(),
                        };
                    }
                };
                fail(failure);
            });
        }
        let beat = (timeout / 5).clamp(Duration::from_millis(100), Duration::from_secs(5));
        let (streams, rank) = (self.streams.clone(), self.rank);
        std::thread::spawn(move || {
            let mut least = (0, Instant::now());
            loop {
                std::thread::sleep(beat);
                let mine = progress.load(Ordering::SeqCst);
                send_all(&streams, &format!("alive {mine}"), None);
                let heard = heard.lock().unwrap_or_else(|e| e.into_inner()).clone();
                if let Some(f) = hung(rank, mine, &heard, &mut least, timeout) {
                    fail(f);
                    return;
                }
            }
        });
    }

    /// Tells the other ranks that this rank failed and why (one line).
    pub fn report_failure(&self, cause: &str) {
        let cause = cause.replace('\n', " ");
        send_all(
            &self.streams,
            &format!("failed {} {cause}", self.rank),
            None,
        );
    }

    /// Tells the other ranks that this rank finished: its connection closing
    /// afterwards is no failure.
    pub fn finish(&self) {
        send_all(&self.streams, "done", None);
    }
}

/// What a rank heard of one peer over the control connection.
#[derive(Debug, Clone)]
struct Heard {
    rank: usize,
    at: Instant,
    progress: u64,
    done: bool,
}

/// The hung rank, if any, as rank `rank` sees its peers (see
/// [`Control::watch`]): `least` is the least progress and since when.
fn hung(
    rank: usize,
    mine: u64,
    heard: &[Heard],
    least: &mut (u64, Instant),
    timeout: Duration,
) -> Option<PeerFailure> {
    let now = Instant::now();
    let live: Vec<&Heard> = heard.iter().filter(|h| !h.done).collect();
    if let Some(h) = live.iter().find(|h| now - h.at > timeout) {
        return Some(PeerFailure {
            rank: h.rank,
            cause: format!(
                "it sent nothing for {} s (stopped, hung, or its machine unreachable)",
                timeout.as_secs()
            ),
        });
    }
    if rank != 0 || live.is_empty() {
        return None;
    }
    let all = || std::iter::once((rank, mine)).chain(live.iter().map(|h| (h.rank, h.progress)));
    let min = all().map(|(_, p)| p).min().unwrap_or(mine);
    if min != least.0 {
        *least = (min, now);
        return None;
    }
    if now - least.1 <= timeout {
        return None;
    }
    let behind = all().filter(|&(_, p)| p == min).map(|(r, _)| r).min()?;
    let ahead = all().any(|(_, p)| p > min);
    let secs = timeout.as_secs();
    Some(PeerFailure {
        rank: behind,
        cause: if ahead {
            format!(
                "it made no progress for {secs} s while other ranks waited for it in a collective (hung)"
            )
        } else {
            format!(
                "no rank made progress for {secs} s: every rank waits in collective {min} (hung)"
            )
        },
    })
}

fn send_all(streams: &Mutex<Vec<Option<TcpStream>>>, line: &str, except: Option<usize>) {
    let mut streams = streams.lock().unwrap_or_else(|e| e.into_inner());
    for (i, s) in streams.iter_mut().enumerate() {
        if Some(i) == except {
            continue;
        }
        if let Some(s) = s {
            let _ = writeln!(s, "{line}");
            let _ = s.flush();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn job(vars: &[(&str, &str)]) -> Result<Option<Job>> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Job::from_lookup(&|name| map.get(name).cloned())
    }

    /// What a rank's thread gets back from [`Control::connect`].
    type Joining = std::thread::JoinHandle<Result<(Control, Vec<u8>)>>;

    /// Rank 0's listener on a free local port, and threads of `ranks` of a
    /// world of `world_size` connecting to it (for 10 s at most).
    fn world(ranks: std::ops::Range<usize>, world_size: usize) -> (Listener, Vec<Joining>) {
        let l = Listener::bind("127.0.0.1", 0).unwrap();
        let port = l.port();
        let peers = ranks
            .map(|r| {
                std::thread::spawn(move || {
                    Control::connect("127.0.0.1", port, r, world_size, Duration::from_secs(10))
                })
            })
            .collect();
        (l, peers)
    }

    #[test]
    fn torchrun_and_mpirun_environments() {
        assert_eq!(job(&[]).unwrap(), None);
        let j = job(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
            ("MASTER_PORT", "1234"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(
            (j.launcher, j.rank, j.world_size, j.local_rank),
            (Launcher::Torchrun, 1, 4, 1)
        );
        assert_eq!(
            (j.master_addr.as_str(), j.master_port),
            ("127.0.0.1", Some(1234))
        );
        // Under torchrun's agent, whose store holds MASTER_PORT: the next port.
        let j = job(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(j.master_port, Some(29501));
        let j = job(&[("OMPI_COMM_WORLD_RANK", "2"), ("OMPI_COMM_WORLD_SIZE", "3")])
            .unwrap()
            .unwrap();
        assert_eq!(
            (j.launcher, j.rank, j.world_size, j.master_port),
            (Launcher::Mpi, 2, 3, None)
        );
        for (vars, says) in [
            (
                &[("RANK", "2"), ("WORLD_SIZE", "2")][..],
                "not below WORLD_SIZE",
            ),
            (&[("RANK", "0")], "WORLD_SIZE is not"),
            (&[("RANK", "x"), ("WORLD_SIZE", "2")], "not a whole number"),
            (
                &[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "70000")],
                "not a port",
            ),
            (
                &[
                    ("OMPI_COMM_WORLD_RANK", "0"),
                    ("OMPI_COMM_WORLD_SIZE", "2"),
                    ("WORLD_SIZE", "3"),
                ],
                "WORLD_SIZE=3",
            ),
        ] {
            let e = job(vars).unwrap_err();
            assert!(
                e.is_input() && e.to_string().contains(says),
                "{vars:?}: {e}"
            );
        }
    }

    #[test]
    fn rendezvous_hands_out_the_payload_and_refuses_another_world_size() {
        let (l, peers) = world(1..3, 3);
        let c = l.accept(3, &[1, 2, 255], Duration::from_secs(10)).unwrap();
        for p in peers {
            assert_eq!(p.join().unwrap().unwrap().1, [1, 2, 255]);
        }
        drop(c);

        let (l, mut peers) = world(1..2, 3);
        let e = l.accept(2, &[], Duration::from_secs(10)).err().unwrap();
        assert!(
            e.is_input() && e.to_string().contains("WORLD_SIZE=3"),
            "{e}"
        );
        let e = peers.remove(0).join().unwrap().err().unwrap();
        assert!(e.to_string().contains("WORLD_SIZE=3"), "{e}");

        // A rank that never comes: a usage error once the timeout has passed.
        let l = Listener::bind("127.0.0.1", 0).unwrap();
        let start = Instant::now();
        let e = l.accept(2, &[], Duration::from_millis(300)).err().unwrap();
        assert!(start.elapsed() < Duration::from_secs(5));
        assert!(
            e.is_input() && e.to_string().contains("missing: rank 1"),
            "{e}"
        );
    }

    #[test]
    fn timeouts_are_whole_seconds_above_zero() {
        std::env::set_var("OOMFIX_TEST_TIMEOUT_A", "7");
        std::env::set_var("OOMFIX_TEST_TIMEOUT_B", "0");
        std::env::set_var("OOMFIX_TEST_TIMEOUT_C", "soon");
        let d = Duration::from_secs(600);
        assert_eq!(
            seconds("OOMFIX_TEST_TIMEOUT_A", d).unwrap(),
            Duration::from_secs(7)
        );
        assert_eq!(seconds("OOMFIX_TEST_TIMEOUT_UNSET", d).unwrap(), d);
        for bad in ["OOMFIX_TEST_TIMEOUT_B", "OOMFIX_TEST_TIMEOUT_C"] {
            let e = seconds(bad, d).unwrap_err();
            assert!(e.is_input() && e.to_string().contains(bad), "{e}");
        }
    }

    #[test]
    fn a_rank_silent_or_behind_for_the_timeout_is_hung() {
        let t = Duration::from_secs(10);
        let long_ago = Instant::now() - Duration::from_secs(11);
        let peer = |rank, at, progress| Heard {
            rank,
            at,
            progress,
            done: false,
        };
        let now = Instant::now();
        // Silent for longer than the timeout: named, on any rank.
        let f = hung(3, 5, &[peer(0, long_ago, 5)], &mut (5, now), t).unwrap();
        assert_eq!(f.rank, 0);
        assert!(f.cause.contains("sent nothing for 10 s"), "{}", f.cause);
        // A finished peer is not watched.
        let mut done = peer(0, long_ago, 5);
        done.done = true;
        assert!(hung(3, 5, &[done], &mut (5, now), t).is_none());
        // Rank 2 stays behind while the others wait: not yet, then named.
        let heard = [peer(1, now, 8), peer(2, now, 7)];
        let mut least = (0, now);
        assert!(hung(0, 8, &heard, &mut least, t).is_none());
        assert_eq!(least.0, 7, "the least progress is tracked");
        least.1 = long_ago;
        let f = hung(0, 8, &heard, &mut least, t).unwrap();
        assert_eq!(f.rank, 2);
        assert!(f.cause.contains("other ranks waited for it"), "{}", f.cause);
        // Everyone equal for that long: stuck in one collective, lowest rank.
        let heard = [peer(1, now, 7), peer(2, now, 7)];
        let f = hung(0, 7, &heard, &mut (7, long_ago), t).unwrap();
        assert_eq!(f.rank, 0);
        assert!(
            f.cause.contains("every rank waits in collective 7"),
            "{}",
            f.cause
        );
        // Only rank 0 judges progress.
        assert!(hung(1, 7, &[peer(0, now, 9)], &mut (7, long_ago), t).is_none());
    }

    #[test]
    fn the_watchdog_names_a_rank_that_dies_or_fails() {
        let (l, peers) = world(1..3, 3);
        let zero = l.accept(3, &[], Duration::from_secs(10)).unwrap();
        let mut peers: Vec<Control> = peers
            .into_iter()
            .map(|p| p.join().unwrap().unwrap().0)
            .collect();
        let (tx, rx) = std::sync::mpsc::channel();
        let tx0 = Mutex::new(tx.clone());
        let (progress, long) = (Arc::new(AtomicU64::new(0)), Duration::from_secs(60));
        zero.watch(progress.clone(), long, move |f| {
            tx0.lock().unwrap().send((0, f)).unwrap()
        });
        let tx2 = Mutex::new(tx);
        peers[1].watch(progress, long, move |f| {
            tx2.lock().unwrap().send((2, f)).unwrap()
        });
        // rank 1's connection closes without a word: rank 0 and, through it, rank 2 learn of it
        drop(peers.remove(0));
        let mut heard: Vec<(usize, PeerFailure)> = (0..2)
            .map(|_| rx.recv_timeout(Duration::from_secs(10)).unwrap())
            .collect();
        heard.sort_by_key(|h| h.0);
        for (who, f) in heard {
            assert_eq!(f.rank, 1, "heard by {who}");
            assert!(f.cause.contains("without a word"), "{}", f.cause);
        }
    }
}
