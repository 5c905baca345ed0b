//! A small pickle writer (protocol 3) that memoizes repeated strings and
//! frame lists, as Python's own pickler does for shared objects.
//!
//! A snapshot repeats the same dictionary keys and the same frames in every
//! trace entry; written once and referenced afterwards (`BINPUT`/`BINGET`),
//! the file is several times smaller than a plain serialisation. Only opcodes
//! of protocols 2 and 3 that PyTorch's memory_viz reads are written: `PROTO`,
//! `EMPTY_DICT`, `EMPTY_LIST`, `MARK`, `SETITEMS`, `APPENDS`, `BINUNICODE`,
//! `BININT`, `LONG1`, `BINPUT`/`LONG_BINPUT`, `BINGET`/`LONG_BINGET`, `STOP`.

use super::snapshot::{Frame, Segment, SegmentBlock, Snapshot, TraceEntry};
use crate::measure::Timeline;
use std::collections::HashMap;

/// Writes pickle opcodes into a buffer.
struct Pickler<'a> {
    out: Vec<u8>,
    next_memo: u32,
    strings: HashMap<&'a str, u32>,
    frames: HashMap<&'a [Frame], u32>,
}

impl<'a> Pickler<'a> {
    fn new() -> Self {
        Pickler {
            out: vec![0x80, 3],
            next_memo: 0,
            strings: HashMap::new(),
            frames: HashMap::new(),
        }
    }

    /// Memoizes the object on top of the stack; returns its memo index.
    fn put(&mut self) -> u32 {
        let id = self.next_memo;
        self.next_memo += 1;
        match u8::try_from(id) {
            Ok(small) => self.out.extend([b'q', small]),
            Err(_) => {
                self.out.push(b'r');
                self.out.extend(id.to_le_bytes());
            }
        }
        id
    }

    fn get(&mut self, id: u32) {
        match u8::try_from(id) {
            Ok(small) => self.out.extend([b'h', small]),
            Err(_) => {
                self.out.push(b'j');
                self.out.extend(id.to_le_bytes());
            }
        }
    }

    fn str(&mut self, s: &'a str) {
        if let Some(&id) = self.strings.get(s) {
            return self.get(id);
        }
        self.out.push(b'X');
        self.out.extend((s.len() as u32).to_le_bytes());
        self.out.extend(s.as_bytes());
        let id = self.put();
        self.strings.insert(s, id);
    }

    fn int(&mut self, v: u64) {
        if let Ok(small) = i32::try_from(v) {
            self.out.push(b'J');
            self.out.extend(small.to_le_bytes());
            return;
        }
        // LONG1: little-endian two's complement, with a zero byte on top if
        // the highest bit is set (the value is positive).
        let bytes = v.to_le_bytes();
        let mut n = 8 - v.leading_zeros() as usize / 8;
        let mut payload = bytes[..n].to_vec();
        if payload[n - 1] & 0x80 != 0 {
            payload.push(0);
            n += 1;
        }
        self.out.extend([0x8a, n as u8]);
        self.out.extend(payload);
    }

    /// A dict: `{}`, mark, then key/value pairs, closed by [`end_dict`](Self::end_dict).
    fn begin_dict(&mut self) {
        self.out.extend([b'}', b'(']);
    }

    fn end_dict(&mut self) {
        self.out.push(b'u');
    }

    fn begin_list(&mut self) {
        self.out.extend([b']', b'(']);
    }

    fn end_list(&mut self) {
        self.out.push(b'e');
    }

    fn key_str(&mut self, k: &'a str, v: &'a str) {
        self.str(k);
        self.str(v);
    }

    fn key_int(&mut self, k: &'a str, v: u64) {
        self.str(k);
        self.int(v);
    }

    fn frames(&mut self, frames: &'a [Frame]) {
        if let Some(&id) = self.frames.get(frames) {
            return self.get(id);
        }
        self.begin_list();
        for f in frames {
            self.begin_dict();
            self.key_str("name", &f.name);
            self.key_str("filename", f.filename);
            self.key_int("line", f.line);
            self.end_dict();
        }
        self.end_list();
        let id = self.put();
        self.frames.insert(frames, id);
    }

    fn trace_entry(&mut self, e: &'a TraceEntry) {
        self.begin_dict();
        self.key_str("action", e.action);
        self.key_int("addr", e.addr);
        self.key_int("size", e.size);
        self.key_int("stream", e.stream);
        self.key_int("time_us", e.time_us);
        self.str("frames");
        self.frames(&e.frames);
        self.key_str("category", e.category);
        self.end_dict();
    }

    fn block(&mut self, b: &'a SegmentBlock) {
        self.begin_dict();
        self.key_int("address", b.address);
        self.key_int("size", b.size);
        self.key_int("requested_size", b.requested_size);
        self.key_str("state", b.state);
        self.str("frames");
        self.frames(&b.frames);
        self.end_dict();
    }

    fn segment(&mut self, s: &'a Segment) {
        self.begin_dict();
        self.key_int("device", s.device);
        self.key_int("address", s.address);
        self.key_int("total_size", s.total_size);
        self.key_int("allocated_size", s.allocated_size);
        self.key_int("active_size", s.active_size);
        self.key_int("requested_size", s.requested_size);
        self.key_int("stream", s.stream);
        self.key_str("segment_type", s.segment_type);
        self.str("frames");
        self.frames(&s.frames);
        self.str("blocks");
        self.begin_list();
        for b in &s.blocks {
            self.block(b);
        }
        self.end_list();
        self.end_dict();
    }

    fn snapshot(&mut self, s: &'a Snapshot) {
        self.begin_dict();
        self.str("segments");
        self.begin_list();
        for seg in &s.segments {
            self.segment(seg);
        }
        self.end_list();
        self.str("device_traces");
        self.begin_list();
        for trace in &s.device_traces {
            self.begin_list();
            for e in trace {
                self.trace_entry(e);
            }
            self.end_list();
        }
        self.end_list();
        self.str("allocator_settings");
        self.begin_dict();
        self.key_str("host", s.allocator_settings.host);
        for (k, v) in &s.allocator_settings.figures {
            self.key_int(k, *v);
        }
        self.end_dict();
        self.end_dict();
    }
}

/// `snapshot` as pickle bytes (protocol 3, memoized).
pub(crate) fn pickle_snapshot(snapshot: &Snapshot) -> Vec<u8> {
    let mut p = Pickler::new();
    p.snapshot(snapshot);
    p.out.push(b'.');
    p.out
}

/// The snapshot as pickle bytes (protocol 3; repeated strings and frame
/// lists are written once and referenced, see the `pickle` module).
pub fn snapshot_pickle(timeline: &Timeline) -> Vec<u8> {
    pickle_snapshot(&super::snapshot::snapshot(timeline))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A snapshot's memoized pickle holds the same value as its plain pickle
    /// (serde-pickle's), as Python's pickle reads both; a device snapshot's
    /// passes scripts/check-snapshot.py (with PyTorch's own readers where
    /// installed).
    #[test]
    fn a_snapshots_pickle_is_its_plain_pickle() {
        use super::super::snapshot::{snapshot, tests};
        let python = std::env::var("OOMFIX_PYTHON").unwrap_or_else(|_| "python3".into());
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/check-snapshot.py");
        let same = "import pickle, sys; a, b = (pickle.load(open(p, 'rb')) for p in sys.argv[1:]); assert a == b";
        for (timeline, device) in [(tests::timeline(), false), (tests::device_timeline(), true)] {
            let bytes = snapshot_pickle(&timeline);
            assert_eq!(&bytes[..2], b"\x80\x03", "pickle protocol 3");
            let plain = serde_pickle::to_vec(&snapshot(&timeline), serde_pickle::SerOptions::new())
                .unwrap();
            let dir = tempfile::tempdir().unwrap();
            let (a, b) = (dir.path().join("a.pickle"), dir.path().join("b.pickle"));
            std::fs::write(&a, &bytes).unwrap();
            std::fs::write(&b, &plain).unwrap();
            let mut checks = vec![vec!["-c", same, a.to_str().unwrap(), b.to_str().unwrap()]];
            if device {
                checks.push(vec![script, a.to_str().unwrap(), "--pool"]);
            }
            for args in checks {
                match std::process::Command::new(&python).args(&args).output() {
                    Ok(out) => assert!(
                        out.status.success(),
                        "{}{}",
                        String::from_utf8_lossy(&out.stdout),
                        String::from_utf8_lossy(&out.stderr)
                    ),
                    Err(e) => eprintln!("{python} not run ({e}): not checked"),
                }
            }
        }
    }

    #[test]
    fn ints_round_trip_through_serde_pickle() {
        for v in [
            0u64,
            1,
            255,
            0x7fff_ffff,
            0x8000_0000,
            0xffff_ffff,
            1 << 40,
            0x7fff_ffff_ffff_ffff,
            u64::MAX,
        ] {
            let mut p = Pickler::new();
            p.int(v);
            p.out.push(b'.');
            let back: serde_pickle::Value =
                serde_pickle::value_from_slice(&p.out, Default::default()).unwrap();
            let want: serde_pickle::Value = serde_pickle::value_from_slice(
                &serde_pickle::to_vec(&v, Default::default()).unwrap(),
                Default::default(),
            )
            .unwrap();
            assert_eq!(back, want, "{v}");
        }
    }
}
