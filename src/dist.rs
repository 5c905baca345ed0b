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
//!   waiting in a collective for ever. It carries no tensor: collectives go
//!   through MPI or NCCL.

use crate::{Error, Result};
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
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
        Ok(optional(TIMEOUT_VAR)?
            .map(|s| Duration::from_secs(s as u64))
            .unwrap_or(DEFAULT_TIMEOUT))
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
    /// (once) when another rank reports a failure or its connection closes
    /// before it said it was done. `on_failure` is expected to end the
    /// process. Rank 0 first passes the failure on to every other rank.
    pub fn watch(&self, on_failure: impl Fn(PeerFailure) + Send + Sync + 'static) {
        let on_failure = Arc::new(on_failure);
        let fired = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let readers: Vec<(usize, TcpStream)> = {
            let streams = self.streams.lock().unwrap_or_else(|e| e.into_inner());
            streams
                .iter()
                .enumerate()
                .filter_map(|(i, s)| Some((i, s.as_ref()?.try_clone().ok()?)))
                .collect()
        };
        for (index, stream) in readers {
            // Rank 0 reads rank `index`; the others read rank 0.
            let peer = if self.rank == 0 { index } else { 0 };
            let (streams, on_failure, fired) =
                (self.streams.clone(), on_failure.clone(), fired.clone());
            let rank = self.rank;
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
                    if l == "done" {
                        return;
                    }
                    if let Some(rest) = l.strip_prefix("failed ") {
                        let (r, cause) = rest.split_once(' ').unwrap_or((rest, "failed"));
                        break PeerFailure {
                            rank: r.parse().unwrap_or(peer),
                            cause: cause.to_string(),
                        };
                    }
                };
                if fired.swap(true, std::sync::atomic::Ordering::SeqCst) {
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
            });
        }
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
        let l = Listener::bind("127.0.0.1", 0).unwrap();
        let port = l.port();
        let peers: Vec<_> = (1..3)
            .map(|r| {
                std::thread::spawn(move || {
                    Control::connect("127.0.0.1", port, r, 3, Duration::from_secs(10))
                })
            })
            .collect();
        let c = l.accept(3, &[1, 2, 255], Duration::from_secs(10)).unwrap();
        for p in peers {
            assert_eq!(p.join().unwrap().unwrap().1, [1, 2, 255]);
        }
        drop(c);

        let l = Listener::bind("127.0.0.1", 0).unwrap();
        let port = l.port();
        let peer = std::thread::spawn(move || {
            Control::connect("127.0.0.1", port, 1, 3, Duration::from_secs(10))
        });
        let e = l.accept(2, &[], Duration::from_secs(10)).err().unwrap();
        assert!(
            e.is_input() && e.to_string().contains("WORLD_SIZE=3"),
            "{e}"
        );
        let e = peer.join().unwrap().err().unwrap();
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
    fn the_watchdog_names_a_rank_that_dies_or_fails() {
        let l = Listener::bind("127.0.0.1", 0).unwrap();
        let port = l.port();
        let peers: Vec<_> = (1..3)
            .map(|r| {
                std::thread::spawn(move || {
                    Control::connect("127.0.0.1", port, r, 3, Duration::from_secs(10))
                        .unwrap()
                        .0
                })
            })
            .collect();
        let zero = l.accept(3, &[], Duration::from_secs(10)).unwrap();
        let mut peers: Vec<Control> = peers.into_iter().map(|p| p.join().unwrap()).collect();
        let (tx, rx) = std::sync::mpsc::channel();
        let tx0 = Mutex::new(tx.clone());
        zero.watch(move |f| tx0.lock().unwrap().send((0, f)).unwrap());
        let tx2 = Mutex::new(tx);
        peers[1].watch(move |f| tx2.lock().unwrap().send((2, f)).unwrap());
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
