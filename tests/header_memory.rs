//! Peak memory of the real binary on large safetensors headers: a length field
//! over the reference library's limit (100,000,000 bytes) is refused without
//! allocating it, and a large valid header is parsed within twice the file's
//! size.
//!
//! The peak is the child's resident-set high-water mark (`ru_maxrss` from
//! `wait4`). Linux carries a parent's high-water mark into a child it spawns,
//! so these tests live in their own test binary, which stays small, and check
//! that it was small when it spawned the child.
#![cfg(target_os = "linux")]

mod common;

use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::write_raw;
use tempfile::TempDir;

/// What one run of `oomfix` did.
struct Run {
    code: Option<i32>,
    stderr: String,
    /// Peak resident set, bytes: the child's, or this process's when it spawned
    /// the child if that was higher.
    peak: u64,
    /// This process's peak resident set when it spawned the child, bytes.
    parent_peak: u64,
    elapsed: Duration,
}

/// This process's resident-set high-water mark, bytes (`VmHWM`).
fn own_peak() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .expect("VmHWM in /proc/self/status");
    let kib: u64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap();
    kib * 1024
}

/// Runs `oomfix args…` and measures its peak resident set.
fn run(dir: &Path, args: &[&str]) -> Run {
    let stderr_path = dir.join("stderr");
    let parent_peak = own_peak();
    let start = Instant::now();
    // Reaped by `wait4` below, which `Child::wait` cannot replace: it drops the usage.
    #[allow(clippy::zombie_processes)]
    let child = Command::new(env!("CARGO_BIN_EXE_oomfix"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(File::create(&stderr_path).unwrap())
        .spawn()
        .unwrap();
    let mut status = 0;
    // SAFETY: `rusage` is plain data that `wait4` fills in.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    loop {
        // SAFETY: `child` is ours and not yet waited for; both pointers are valid.
        let pid = unsafe { libc::wait4(child.id() as libc::pid_t, &mut status, 0, &mut usage) };
        if pid >= 0 {
            break;
        }
        let err = std::io::Error::last_os_error();
        assert_eq!(err.kind(), std::io::ErrorKind::Interrupted, "wait4: {err}");
    }
    let elapsed = start.elapsed();
    // At most 64 KiB of it, so that a runaway message cannot swell this process.
    let mut stderr = Vec::new();
    File::open(&stderr_path)
        .unwrap()
        .take(64 << 10)
        .read_to_end(&mut stderr)
        .unwrap();
    Run {
        code: libc::WIFEXITED(status).then(|| libc::WEXITSTATUS(status)),
        stderr: String::from_utf8_lossy(&stderr).into_owned(),
        peak: usage.ru_maxrss as u64 * 1024,
        parent_peak,
        elapsed,
    }
}

#[test]
fn a_length_over_the_limit_is_refused_without_allocating_it() {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("m.safetensors");
    // One byte over the limit, in a (sparse) file long enough to hold it.
    write_raw(&path, 100_000_001, b"{}", 100_000_000);
    let run = run(dir.path(), &["inspect", path.to_str().unwrap()]);
    assert_eq!(run.code, Some(2), "{}", run.stderr);
    assert_eq!(run.stderr.lines().count(), 1, "{}", run.stderr);
    assert!(
        run.stderr.contains(path.to_str().unwrap()),
        "{}",
        run.stderr
    );
    assert!(
        run.stderr.contains(
            "header length field says 100000001 bytes, over the safetensors limit of 100000000 bytes"
        ),
        "{}",
        run.stderr
    );
    let limit = 50_000_000;
    assert!(
        run.parent_peak < limit,
        "the test itself had peaked at {} bytes",
        run.parent_peak
    );
    assert!(run.peak < limit, "peak {} bytes", run.peak);
    assert!(
        run.elapsed < Duration::from_secs(10),
        "took {:?}",
        run.elapsed
    );
}

#[test]
fn a_large_valid_header_is_parsed_within_twice_the_file_size() {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("m.safetensors");
    // 60 MB of header, nearly all one `__metadata__` string, written in pieces
    // so that this process stays small.
    let head = r#"{"__metadata__":{"format":"pt","blob":""#;
    let tail = r#""},"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#;
    let header_len = 60_000_000;
    let blob_len = header_len - head.len() - tail.len();
    let mut out = BufWriter::new(File::create(&path).unwrap());
    out.write_all(&(header_len as u64).to_le_bytes()).unwrap();
    out.write_all(head.as_bytes()).unwrap();
    let piece = vec![b'x'; 1 << 20];
    let mut left = blob_len;
    while left > 0 {
        let n = left.min(piece.len());
        out.write_all(&piece[..n]).unwrap();
        left -= n;
    }
    out.write_all(tail.as_bytes()).unwrap();
    out.write_all(&[0; 4]).unwrap();
    out.into_inner().unwrap().sync_all().unwrap();
    let file_len = std::fs::metadata(&path).unwrap().len();
    assert_eq!(file_len, 8 + header_len as u64 + 4);

    let run = run(dir.path(), &["inspect", path.to_str().unwrap()]);
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    let limit = 2 * file_len;
    assert!(
        run.parent_peak < limit / 2,
        "the test itself had peaked at {} bytes",
        run.parent_peak
    );
    assert!(
        run.peak <= limit,
        "peak {} bytes for a {file_len}-byte file, over twice its size",
        run.peak
    );
}
