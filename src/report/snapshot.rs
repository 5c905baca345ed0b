//! A measured step as a PyTorch memory snapshot (`torch.cuda.memory._dump_snapshot`
//! format, pickle protocol 3), readable by PyTorch's memory_viz.
//!
//! `device_traces[0]` starts with one `alloc` per block alive when the step
//! started (weights, optimizer state, …, at time 0), then lists every
//! allocation (`alloc`) and free (`free_completed`) of the step with its
//! address, size and time, and ends with a `snapshot` entry. Each entry's
//! `frames` read, innermost first (memory_viz prints `filename:line:name`):
//!
//! 1. `{name: "h.3.attn.matmul", filename: "activations"}`: the module path and
//!    op that allocated the block (for a parameter: its name), and its component;
//! 2. `{name: "forward", filename: "phase"}`: the phase it was allocated in
//!    (`setup`, `forward`, `backward`, `optimizer_step`), with `line` the
//!    micro-batch (1-based) for forward and backward;
//! 3. for blocks older than the step: `{name: "allocated before the step", filename: "oomfix"}`.
//!
//! Each entry also has a `category` (the component), which memory_viz uses to
//! colour its "Active Memory Timeline" by component; the closing `snapshot`
//! entry carries the `unknown` category that memory_viz expects to find.
//! `segments` holds the blocks alive when the step ends, one segment per block
//! (host memory has no allocator segments of its own), with the same frames.
//!
//! # CUDA
//!
//! A device timeline ([`Timeline::from_device_events`]) adds the pool. Its
//! blocks are the tensors' storages at their device addresses, plus the
//! block `pool buffers outside tensors` (see [`crate::measure::timeline::POOL_BUFFERS`]), so that the
//! trace's allocated bytes are the pool's used bytes. The pool's reservation
//! is drawn as segments: CUDA does not tell how the pool's memory is laid out,
//! so each growth of the reserved bytes is a `segment_alloc` of the growth,
//! and each shrink `segment_free`s the newest segments (re-allocating the
//! rest of one it cuts), at addresses of their own ([`SEGMENT_BASE`]); the
//! segments alive at any time add up to the pool's reserved bytes (memory_viz's
//! "Active Cached Segment Timeline"). At the end, the pool's cached memory
//! (reserved minus used) is one segment with one `inactive` block, beside
//! the live blocks' segments, so the segments add up to the reserved bytes.
//! `allocator_settings` carries the figures: the pool's high-water marks over
//! the steps and the device memory outside the pool (context, modules,
//! cuBLAS workspaces), which no segment holds.

use crate::measure::timeline::{Block, PoolTrace};
use crate::measure::Timeline;
use crate::track::alloc::Phase;
use serde::Serialize;
use std::collections::BTreeMap;

/// Address of the first segment standing for the pool's reservation
/// (2^51: below 2^52, which memory_viz's JavaScript numbers hold exactly,
/// and far above the addresses CUDA hands out).
pub const SEGMENT_BASE: u64 = 0x0008_0000_0000_0000;

/// Address of the segment of the pool's cached memory at the end.
pub const CACHED_ADDR: u64 = 0x000e_0000_0000_0000;

/// One stack frame as memory_viz reads it.
#[derive(Debug, Clone, Serialize, PartialEq, Eq, Hash)]
pub struct Frame {
    /// Shown after the file and line.
    pub name: String,
    /// Shown first.
    pub filename: &'static str,
    /// Shown between.
    pub line: u64,
}

/// One entry of `device_traces[0]`.
#[derive(Debug, Clone, Serialize)]
pub struct TraceEntry {
    /// `alloc`, `free_completed`, `segment_alloc`, `segment_free` (CUDA) or `snapshot`.
    pub action: &'static str,
    /// Block address.
    pub addr: u64,
    /// Block size in bytes.
    pub size: u64,
    /// Always 0.
    pub stream: u64,
    /// Microseconds since the step started.
    pub time_us: u64,
    /// Module, op, component and phase (see the module docs).
    pub frames: Vec<Frame>,
    /// The component, or `unknown`.
    pub category: &'static str,
}

/// A block of a segment.
#[derive(Debug, Clone, Serialize)]
pub struct SegmentBlock {
    /// Address.
    pub address: u64,
    /// Size in bytes.
    pub size: u64,
    /// Requested size (= size; 0 for cached memory).
    pub requested_size: u64,
    /// `active_allocated`; `inactive` for the pool's cached memory (CUDA).
    pub state: &'static str,
    /// As in the trace.
    pub frames: Vec<Frame>,
}

/// A segment: one live block at the end of the step, or (CUDA) the pool's
/// cached memory then.
#[derive(Debug, Clone, Serialize)]
pub struct Segment {
    /// Always 0.
    pub device: u64,
    /// Address.
    pub address: u64,
    /// Size in bytes.
    pub total_size: u64,
    /// = total_size (0 for cached memory).
    pub allocated_size: u64,
    /// = total_size (0 for cached memory).
    pub active_size: u64,
    /// = total_size (0 for cached memory).
    pub requested_size: u64,
    /// Always 0.
    pub stream: u64,
    /// `small` below 1 MiB, else `large`.
    pub segment_type: &'static str,
    /// As in the trace.
    pub frames: Vec<Frame>,
    /// The one block.
    pub blocks: Vec<SegmentBlock>,
}

/// Allocator settings (informational).
#[derive(Debug, Clone, Serialize)]
pub struct AllocatorSettings {
    /// What allocator the snapshot describes.
    pub host: &'static str,
    /// Figures of a device timeline, in bytes: `pool_used_high`,
    /// `pool_reserved_high`, `outside_pool` (empty for the heap).
    #[serde(flatten)]
    pub figures: BTreeMap<&'static str, u64>,
}

/// The whole snapshot, as pickled.
#[derive(Debug, Clone, Serialize)]
pub struct Snapshot {
    /// Blocks alive at the end of the step.
    pub segments: Vec<Segment>,
    /// One trace: the host's, or the CUDA device's.
    pub device_traces: Vec<Vec<TraceEntry>>,
    /// Informational.
    pub allocator_settings: AllocatorSettings,
}

/// Numbers the forward/backward passes of the step (1-based micro-batch) by time.
fn micro_batch(timeline: &Timeline, time_ns: u64) -> u64 {
    timeline
        .phases
        .iter()
        .take_while(|(t, _)| *t <= time_ns)
        .filter(|(_, p)| *p == Phase::Forward)
        .count() as u64
}

fn frames(timeline: &Timeline, b: &Block) -> Vec<Frame> {
    let what = b.name.clone().unwrap_or_else(|| match b.tag.name() {
        n if n.is_empty() => "oomfix".to_string(),
        n => n,
    });
    let line = match (b.alloc_ns, b.phase) {
        (Some(t), Phase::Forward | Phase::Backward) => micro_batch(timeline, t),
        _ => 0,
    };
    let mut f = vec![
        Frame {
            name: what,
            filename: b.component.as_str(),
            line: 0,
        },
        Frame {
            name: b.phase.as_str().to_string(),
            filename: "phase",
            line,
        },
    ];
    if b.alloc_ns.is_none() {
        f.push(Frame {
            name: "allocated before the step".into(),
            filename: "oomfix",
            line: 0,
        });
    }
    f
}

/// The snapshot of a timeline.
pub fn snapshot(timeline: &Timeline) -> Snapshot {
    let frames: Vec<Vec<Frame>> = timeline
        .blocks
        .iter()
        .map(|b| frames(timeline, b))
        .collect();
    let entry = |i: usize, alloc: bool, time_ns: u64| {
        let b = &timeline.blocks[i];
        TraceEntry {
            action: if alloc { "alloc" } else { "free_completed" },
            addr: b.addr,
            size: b.size,
            stream: 0,
            time_us: time_ns / 1000,
            frames: frames[i].clone(),
            category: b.component.as_str(),
        }
    };
    let mut trace: Vec<TraceEntry> = (timeline.blocks.iter().enumerate())
        .filter(|(_, b)| b.alloc_ns.is_none())
        .map(|(i, _)| entry(i, true, 0))
        .collect();
    trace.extend(
        timeline
            .changes
            .iter()
            .map(|c| entry(c.block, c.alloc, c.time_ns)),
    );
    if let Some(pool) = &timeline.pool {
        trace = merge_by_time(trace, segment_entries(pool));
    }
    trace.push(TraceEntry {
        action: "snapshot",
        addr: 0,
        size: 0,
        stream: 0,
        time_us: timeline.end_ns / 1000,
        frames: Vec::new(),
        category: "unknown",
    });
    let mut alive: Vec<usize> = (0..timeline.blocks.len())
        .filter(|&i| timeline.blocks[i].free_ns.is_none())
        .collect();
    alive.sort_by_key(|&i| timeline.blocks[i].addr);
    let mut segments: Vec<Segment> = alive
        .into_iter()
        .map(|i| {
            let b = &timeline.blocks[i];
            Segment {
                device: 0,
                address: b.addr,
                total_size: b.size,
                allocated_size: b.size,
                active_size: b.size,
                requested_size: b.size,
                stream: 0,
                segment_type: if b.size < (1 << 20) { "small" } else { "large" },
                frames: frames[i].clone(),
                blocks: vec![SegmentBlock {
                    address: b.addr,
                    size: b.size,
                    requested_size: b.size,
                    state: "active_allocated",
                    frames: frames[i].clone(),
                }],
            }
        })
        .collect();
    let mut figures = BTreeMap::new();
    let host = match &timeline.pool {
        None => "oomfix counting allocator",
        Some(pool) => {
            figures.insert("pool_used_high", pool.used_high);
            figures.insert("pool_reserved_high", pool.reserved_high);
            figures.insert("outside_pool", pool.outside);
            let (_, used, reserved) = pool.samples.last().copied().unwrap_or_default();
            let cached = reserved.saturating_sub(used);
            if cached > 0 {
                let frames = vec![pool_frame("cached by the pool (reserved, not allocated)")];
                segments.push(Segment {
                    device: 0,
                    address: CACHED_ADDR,
                    total_size: cached,
                    allocated_size: 0,
                    active_size: 0,
                    requested_size: 0,
                    stream: 0,
                    segment_type: "large",
                    frames: frames.clone(),
                    blocks: vec![SegmentBlock {
                        address: CACHED_ADDR,
                        size: cached,
                        requested_size: 0,
                        state: "inactive",
                        frames,
                    }],
                });
            }
            "CUDA stream-ordered memory pool (cuMemAllocAsync), recorded by oomfix"
        }
    };
    Snapshot {
        segments,
        device_traces: vec![trace],
        allocator_settings: AllocatorSettings { host, figures },
    }
}

fn pool_frame(name: &str) -> Frame {
    Frame {
        name: name.to_string(),
        filename: "pool",
        line: 0,
    }
}

/// The pool's reservation over time as `segment_alloc` / `segment_free`
/// entries (see the module docs), each with whether it shrinks the reserve
/// (the free of a cut segment and the allocation of its rest both do).
fn segment_entries(pool: &PoolTrace) -> Vec<(bool, TraceEntry)> {
    let frames = vec![pool_frame("reserved by the CUDA pool")];
    let entry = |action, addr, size, time_ns: u64| TraceEntry {
        action,
        addr,
        size,
        stream: 0,
        time_us: time_ns / 1000,
        frames: frames.clone(),
        category: "unknown",
    };
    let mut out = Vec::new();
    let (mut stack, mut total, mut next): (Vec<(u64, u64)>, u64, u64) =
        (Vec::new(), 0, SEGMENT_BASE);
    for &(t, _, reserved) in &pool.samples {
        if reserved > total {
            let grow = reserved - total;
            stack.push((next, grow));
            out.push((false, entry("segment_alloc", next, grow, t)));
            next += grow;
        }
        let mut excess = total.saturating_sub(reserved);
        while excess > 0 {
            let Some((addr, size)) = stack.pop() else {
                break;
            };
            out.push((true, entry("segment_free", addr, size, t)));
            if size > excess {
                stack.push((addr, size - excess));
                out.push((true, entry("segment_alloc", addr, size - excess, t)));
                excess = 0;
            } else {
                excess -= size;
            }
        }
        total = reserved;
    }
    out
}

/// The block entries and the segment entries in one trace by time: at the
/// same microsecond the reserve grows before blocks are allocated and
/// shrinks after they are freed; each list keeps its own order.
fn merge_by_time(blocks: Vec<TraceEntry>, segments: Vec<(bool, TraceEntry)>) -> Vec<TraceEntry> {
    let mut all: Vec<(u64, u8, TraceEntry)> = blocks
        .into_iter()
        .map(|e| (e.time_us, 1, e))
        .chain(
            segments
                .into_iter()
                .map(|(shrinks, e)| (e.time_us, if shrinks { 2 } else { 0 }, e)),
        )
        .collect();
    // A stable sort: entries of one list and rank keep their order.
    all.sort_by_key(|(t, rank, _)| (*t, *rank));
    all.into_iter().map(|(_, _, e)| e).collect()
}

/// The snapshot as a JSON value (the same structure that is pickled).
pub fn snapshot_value(timeline: &Timeline) -> serde_json::Value {
    serde_json::to_value(snapshot(timeline)).expect("the snapshot serialises")
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::track::alloc::{Event, EventKind};
    use crate::track::tag::{Component, Module, Op, Tag};
    use std::collections::HashMap;

    /// A heap step: a weight before it, an activation made and freed.
    pub(crate) fn timeline() -> Timeline {
        let m = Module::intern("h.0.attn");
        let ev = |kind, t, addr, size, phase, op| Event {
            time_ns: t,
            addr,
            size,
            live: 0,
            tag: Tag::new(m, op),
            kind,
            phase,
        };
        use EventKind::{Alloc, Free, StepStart};
        let events = [
            ev(Alloc, 0, 0x10, 100, Phase::Setup, Op::InitWeights),
            ev(StepStart, 1000, 0, 0, Phase::Setup, Op::None),
            ev(EventKind::Phase, 2000, 0, 0, Phase::Forward, Op::None),
            ev(Alloc, 3000, 0x20, 50, Phase::Forward, Op::Matmul),
            ev(EventKind::Phase, 4000, 0, 0, Phase::Backward, Op::None),
            ev(Free, 5000, 0x20, 50, Phase::Backward, Op::None),
        ];
        Timeline::from_events(
            &events,
            &HashMap::from([(0x10, "h.0.attn.c_attn.weight".into())]),
            0,
            false,
        )
    }

    #[test]
    fn trace_and_segments_carry_module_op_component_and_phase() {
        let s = snapshot(&timeline());
        let t = &s.device_traces[0];
        assert_eq!(
            t.iter().map(|e| e.action).collect::<Vec<_>>(),
            ["alloc", "alloc", "free_completed", "snapshot"]
        );
        assert_eq!(t[0].frames[0].name, "h.0.attn.c_attn.weight");
        assert_eq!(t[0].category, Component::Weights.as_str());
        assert_eq!(
            t[0].frames.last().unwrap().name,
            "allocated before the step"
        );
        assert_eq!(
            t[1].frames[0],
            Frame {
                name: "h.0.attn.matmul".into(),
                filename: "activations",
                line: 0
            }
        );
        assert_eq!(
            t[1].frames[1],
            Frame {
                name: "forward".into(),
                filename: "phase",
                line: 1
            }
        );
        assert_eq!(t[2].time_us, 4);
        assert_eq!(s.segments.len(), 1);
        assert_eq!(s.segments[0].address, 0x10);
    }

    /// A device step with the pool's reserve, 7 bytes outside the pool.
    pub(crate) fn device_timeline() -> Timeline {
        use crate::measure::timeline::tests::device_events;
        Timeline::from_device_events(&device_events(), &HashMap::new(), 7, false)
    }

    #[test]
    fn a_device_snapshot_has_the_pools_segments_and_figures() {
        use crate::measure::timeline::POOL_BUFFERS_ADDR;
        let t = device_timeline();
        let s = snapshot(&t);
        let trace = &s.device_traces[0];
        // Replayed, the trace's allocated and reserved bytes peak at the pool's marks.
        let (mut alloc, mut reserved, mut peak_alloc, mut peak_reserved) = (0i64, 0i64, 0, 0);
        let mut segments: HashMap<u64, u64> = HashMap::new();
        for e in trace {
            match e.action {
                "alloc" => alloc += e.size as i64,
                "free_completed" => alloc -= e.size as i64,
                "segment_alloc" => {
                    assert!(segments.insert(e.addr, e.size).is_none());
                    reserved += e.size as i64;
                }
                "segment_free" => {
                    assert_eq!(segments.remove(&e.addr), Some(e.size));
                    reserved -= e.size as i64;
                }
                "snapshot" => {}
                other => panic!("{other}"),
            }
            peak_alloc = peak_alloc.max(alloc);
            peak_reserved = peak_reserved.max(reserved);
        }
        let pool = t.pool.as_ref().unwrap();
        assert_eq!(peak_alloc as u64, pool.used_high);
        assert_eq!(peak_reserved as u64, pool.reserved_high);
        assert_eq!(reserved, 140, "the reserve at the end");
        // The reserve shrank: segments were freed (and one cut).
        assert!(trace.iter().any(|e| e.action == "segment_free"));
        assert!(trace.windows(2).all(|w| w[0].time_us <= w[1].time_us));
        // The segments at the end add up to the reserve: live blocks, then the cache.
        let total: u64 = s.segments.iter().map(|g| g.total_size).sum();
        assert_eq!(total, 140);
        let cached = s.segments.last().unwrap();
        assert_eq!((cached.address, cached.total_size), (CACHED_ADDR, 10));
        assert_eq!(cached.blocks[0].state, "inactive");
        assert!(trace.iter().any(|e| e.addr == POOL_BUFFERS_ADDR
            && e.frames[0].name == crate::measure::timeline::POOL_BUFFERS));
        assert_eq!(s.allocator_settings.figures["outside_pool"], 7);
        assert_eq!(s.allocator_settings.figures["pool_used_high"], 158);
    }
}
