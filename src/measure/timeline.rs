//! A measured step's allocations, each with its module, op and component.
//!
//! [`Timeline::from_events`] replays a recording that starts before the
//! trainer is built and runs through a warm-up step into the measured step
//! (which begins at the [`EventKind::StepStart`] event). Blocks still alive
//! when the step starts (weights, optimizer state, caches) are the step's
//! initial blocks; the step's allocations and frees follow.
//!
//! # Components
//!
//! Every block gets exactly one [`Component`], by the first rule that applies:
//!
//! 1. **Marked**: the trainer marks the buffers it knows by address while they
//!    are alive ([`crate::track::alloc::mark_tensors`]): each micro-batch's parameter
//!    gradients, the accumulated, unscaled and widened gradients are
//!    *gradients*. The last mark of a block wins.
//! 2. **Built as state**: blocks allocated under [`Op::InitWeights`] (the
//!    model's parameters and fp32 master weights, built by `Trainer::new`) are
//!    *weights*; under [`Op::InitOptimizer`] (AdamW's moments) *optimizer
//!    state*. Parameters are updated in place, so these blocks live on.
//! 3. **Saved for backward**: blocks allocated during a forward pass, still
//!    alive when that micro-batch's backward pass starts and freed before it
//!    ends are *activations* (with activation checkpointing: the blocks'
//!    inputs that are kept, plus the head's graph; the blocks recomputed
//!    during backward are not). Forward blocks that outlive the backward
//!    (caches of the matmul kernels, say) are not.
//! 4. Everything else is *temporaries*: buffers of the forward pass freed
//!    before backward, of backward (gradients of activations, recomputed
//!    blocks), of the optimizer step, and the small bookkeeping of the process.
//!
//! Live totals here are sums over the tracked blocks (allocated since
//! recording started), so per-component bytes always add up to the total;
//! frees of blocks older than the recording are ignored.
//!
//! # A device's pool
//!
//! [`Timeline::from_device_events`] builds the timeline of a CUDA recording
//! ([`crate::track::device`]): the blocks are the tensors' storages, and the
//! pool's bytes that no live storage holds (op buffers such as strides and
//! indices, storages made and dropped inside an op) are one more block,
//! [`POOL_BUFFERS`] (a temporary), resized at every event but a free to the
//! pool's used bytes minus the storages' — so the timeline's total at each
//! pool allocation is the pool's used counter, and its peak the pool's
//! high-water mark. [`Timeline::pool`] keeps the pool's counters over time
//! (the reserved line) and the device memory outside the pool.

use crate::track::alloc::{Event, EventKind, Phase};
use crate::track::device::DeviceEvent;
use crate::track::tag::{Component, Module, Op, Tag};
use std::collections::HashMap;

/// Name (module path) of the block that stands for the pool's bytes outside
/// live tensor storages in a device timeline.
pub const POOL_BUFFERS: &str = "pool buffers outside tensors";

/// Address of that block (no device allocation has it: below 2^52, which
/// memory_viz's JavaScript numbers hold exactly, and far above the
/// addresses CUDA hands out).
pub const POOL_BUFFERS_ADDR: u64 = 0x000f_0000_0000_0000;

/// The pool's counters over a device timeline's steps.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PoolTrace {
    /// `(ns since the steps started, used, reserved)` at each event, the
    /// first at 0.
    pub samples: Vec<(u64, u64, u64)>,
    /// The pool's own used high-water mark over the steps (its marks are
    /// reset when the steps start).
    pub used_high: u64,
    /// The pool's own reserved high-water mark over the steps.
    pub reserved_high: u64,
    /// Device memory outside the pool when the steps started (the CUDA
    /// context, module images, cuBLAS workspaces: `cuMemGetInfo`'s used
    /// bytes less the pool's reservation), a constant of the run.
    pub outside: u64,
}

/// The pool's state at the moment a timeline's allocated bytes peak.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fragmentation {
    /// When (ns since the steps started).
    pub time_ns: u64,
    /// The pool's used bytes then.
    pub used: u64,
    /// The pool's reserved bytes then.
    pub reserved: u64,
}

impl Fragmentation {
    /// Reserved but not allocated: the pool's cached, free memory.
    pub fn free(&self) -> u64 {
        self.reserved.saturating_sub(self.used)
    }
}

impl PoolTrace {
    /// The highest used bytes sampled.
    pub fn used_peak(&self) -> u64 {
        self.samples.iter().map(|s| s.1).max().unwrap_or(0)
    }

    /// The highest reserved bytes sampled.
    pub fn reserved_peak(&self) -> u64 {
        self.samples.iter().map(|s| s.2).max().unwrap_or(0)
    }

    /// The pool at its highest used bytes (the first such sample).
    pub fn at_used_peak(&self) -> Fragmentation {
        self.first_at(self.used_peak(), |s| s.1)
    }

    /// The pool at the first sample whose `value` is `peak` (all zeros
    /// without samples).
    fn first_at(&self, peak: u64, value: fn(&(u64, u64, u64)) -> u64) -> Fragmentation {
        let s = self.samples.iter().find(|s| value(s) == peak).copied();
        let (time_ns, used, reserved) = s.unwrap_or((0, 0, 0));
        Fragmentation {
            time_ns,
            used,
            reserved,
        }
    }

    /// One line: the pool's peaks (sampled, and its own high-water marks),
    /// the fragmentation at the allocated peak (reserved minus allocated,
    /// the pool's cached free memory: CUDA's pool does not tell its largest
    /// free block) and the memory outside the pool.
    pub fn summary(&self) -> String {
        use crate::units::format_bytes;
        let at = self.at_used_peak();
        let at_reserved = self.at_reserved_peak();
        format!(
            "pool: allocated peak {} (high-water mark {}), reserved then {}: fragmentation {} \
             (largest free block: not reported by the CUDA pool); reserved peak {} (high-water mark {}, \
             {} of it not allocated); outside the pool (context, modules, cuBLAS) {}",
            format_bytes(at.used),
            format_bytes(self.used_high),
            format_bytes(at.reserved),
            format_bytes(at.free()),
            format_bytes(at_reserved.reserved),
            format_bytes(self.reserved_high),
            format_bytes(at_reserved.free()),
            format_bytes(self.outside),
        )
    }

    /// A shorter [`summary`](Self::summary), for a plot's header.
    pub fn short_summary(&self) -> String {
        use crate::units::format_bytes;
        let at = self.at_used_peak();
        format!(
            "pool: reserved {} at the allocated peak, fragmentation {}; reserved peak {}",
            format_bytes(at.reserved),
            format_bytes(at.free()),
            format_bytes(self.reserved_peak()),
        )
    }

    /// The pool at its highest reserved bytes (the first such sample).
    pub fn at_reserved_peak(&self) -> Fragmentation {
        self.first_at(self.reserved_peak(), |s| s.2)
    }
}

/// One heap block alive at some time during the measured step.
#[derive(Debug, Clone, PartialEq)]
pub struct Block {
    /// Its address.
    pub addr: u64,
    /// Its size in bytes.
    pub size: u64,
    /// Module path and op that allocated it.
    pub tag: Tag,
    /// The phase it was allocated in.
    pub phase: Phase,
    /// What it holds.
    pub component: Component,
    /// The parameter it stores (`h.0.attn.c_attn.weight`, `master.…`), where known.
    pub name: Option<String>,
    /// When it was allocated (ns since the step started); `None`: before the step.
    pub alloc_ns: Option<u64>,
    /// When it was freed (ns since the step started); `None`: alive at the end.
    pub free_ns: Option<u64>,
}

/// An allocation or free during the step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Change {
    /// Nanoseconds since the step started.
    pub time_ns: u64,
    /// Index into [`Timeline::blocks`].
    pub block: usize,
    /// `true` for the allocation, `false` for the free.
    pub alloc: bool,
}

/// Bytes per component, indexed by `Component as usize`.
pub type ComponentBytes = [u64; 5];

/// A measured step's allocation timeline.
#[derive(Debug, Clone, Default)]
pub struct Timeline {
    /// Blocks alive when the step started (first), then those allocated during it.
    pub blocks: Vec<Block>,
    /// The step's allocations and frees, in order.
    pub changes: Vec<Change>,
    /// The phases of the step: `(start ns, phase)`, in order, the first at 0.
    pub phases: Vec<(u64, Phase)>,
    /// Duration of the step in nanoseconds (up to the last event).
    pub end_ns: u64,
    /// Live heap bytes of the whole process when the recording started (not in the timeline).
    pub baseline: u64,
    /// Whether events were dropped because the buffer filled up.
    pub truncated: bool,
    /// A device timeline's pool counters ([`Timeline::from_device_events`]);
    /// `None` for the heap.
    pub pool: Option<PoolTrace>,
}

struct Building {
    addr: u64,
    size: u64,
    tag: Tag,
    phase: Phase,
    time_ns: u64,
    freed_ns: Option<u64>,
    mark: Option<Component>,
    saved_for_backward: bool,
    outlived_backward: bool,
}

impl Timeline {
    /// Builds the timeline of the step that starts at the first
    /// [`EventKind::StepStart`] of `events` (at the start of `events` if there
    /// is none). `names` gives the parameter name stored at an address.
    pub fn from_events(
        events: &[Event],
        names: &HashMap<u64, String>,
        baseline: u64,
        truncated: bool,
    ) -> Timeline {
        let mut built: Vec<Building> = Vec::new();
        let mut live: HashMap<u64, usize> = HashMap::new();
        let start = events.iter().position(|e| e.kind == EventKind::StepStart);
        let (mut initial, mut start_ns) = (None, 0);
        if start.is_none() {
            initial = Some(Vec::new());
            start_ns = events.first().map_or(0, |e| e.time_ns);
        }
        let mut phase = Phase::Setup;
        let mut phases = Vec::new();
        let mut changes = Vec::new();
        for (i, e) in events.iter().enumerate() {
            let in_step = initial.is_some();
            match e.kind {
                EventKind::Alloc => {
                    built.push(Building {
                        addr: e.addr,
                        size: e.size,
                        tag: e.tag,
                        phase: e.phase,
                        time_ns: e.time_ns,
                        freed_ns: None,
                        mark: None,
                        saved_for_backward: false,
                        outlived_backward: false,
                    });
                    live.insert(e.addr, built.len() - 1);
                    if in_step {
                        changes.push((e.time_ns, built.len() - 1, true));
                    }
                }
                EventKind::Free => {
                    if let Some(b) = live.remove(&e.addr) {
                        built[b].freed_ns = Some(e.time_ns);
                        if in_step {
                            changes.push((e.time_ns, b, false));
                        }
                    }
                }
                EventKind::Mark => {
                    if let (Some(&b), Some(c)) = (live.get(&e.addr), Component::from_index(e.size))
                    {
                        built[b].mark = Some(c);
                    }
                }
                EventKind::Phase => {
                    if phase == Phase::Forward && e.phase == Phase::Backward {
                        for &b in live.values() {
                            if built[b].phase == Phase::Forward {
                                built[b].saved_for_backward = true;
                            }
                        }
                    }
                    if phase == Phase::Backward && e.phase != Phase::Backward {
                        for &b in live.values() {
                            built[b].outlived_backward |= built[b].saved_for_backward;
                        }
                    }
                    phase = e.phase;
                    if in_step {
                        phases.push((e.time_ns, phase));
                    }
                }
                EventKind::StepStart => {
                    if initial.is_none() && Some(i) == start {
                        let mut alive: Vec<usize> = live.values().copied().collect();
                        alive.sort_unstable();
                        initial = Some(alive);
                        start_ns = e.time_ns;
                        phases.push((e.time_ns, e.phase));
                    }
                }
                // A pool allocation counts through the pool's block (see
                // `from_device_events`).
                EventKind::Pool => {}
            }
        }
        let initial = initial.unwrap_or_default();
        let end_ns = events
            .last()
            .map_or(0, |e| e.time_ns)
            .saturating_sub(start_ns);
        let rel = |t: u64| t.saturating_sub(start_ns);
        // Output blocks: the initial ones, then the step's in allocation order.
        let mut index: HashMap<usize, usize> = HashMap::new();
        let mut blocks = Vec::new();
        let mut out = |b: usize, before: bool, blocks: &mut Vec<Block>| {
            let x = &built[b];
            let component = x.mark.or_else(|| x.tag.op().component()).unwrap_or(
                if x.saved_for_backward && !x.outlived_backward && x.phase == Phase::Forward {
                    Component::Activations
                } else {
                    Component::Temporaries
                },
            );
            blocks.push(Block {
                addr: x.addr,
                size: x.size,
                tag: x.tag,
                phase: x.phase,
                component,
                name: names.get(&x.addr).filter(|_| x.freed_ns.is_none()).cloned(),
                alloc_ns: (!before).then(|| rel(x.time_ns)),
                free_ns: x.freed_ns.map(rel),
            });
            index.insert(b, blocks.len() - 1);
        };
        for &b in &initial {
            out(b, true, &mut blocks);
        }
        for &(_, b, alloc) in &changes {
            if alloc {
                out(b, false, &mut blocks);
            }
        }
        let changes = changes
            .into_iter()
            .filter_map(|(t, b, alloc)| {
                Some(Change {
                    time_ns: rel(t),
                    block: *index.get(&b)?,
                    alloc,
                })
            })
            .collect();
        let mut phases: Vec<(u64, Phase)> = phases.into_iter().map(|(t, p)| (rel(t), p)).collect();
        phases.dedup_by(|b, a| a.1 == b.1);
        Timeline {
            blocks,
            changes,
            phases,
            end_ns,
            baseline,
            truncated,
            pool: None,
        }
    }

    /// The timeline of a device recording's steps (see the module docs):
    /// the storages' blocks, the [`POOL_BUFFERS`] block for the pool's other
    /// used bytes, and the pool's counters from the step start on. `outside`
    /// is the device memory outside the pool.
    pub fn from_device_events(
        events: &[DeviceEvent],
        names: &HashMap<u64, String>,
        outside: u64,
        truncated: bool,
    ) -> Timeline {
        let pool_tag = Tag::new(Module::intern(POOL_BUFFERS), Op::None);
        let mut out: Vec<Event> = Vec::with_capacity(events.len() * 2);
        let mut storages: HashMap<u64, u64> = HashMap::new();
        let (mut tracked, mut buffers) = (0u64, 0u64);
        for d in events {
            let e = d.event;
            if e.kind == EventKind::Free {
                if let Some(size) = storages.remove(&e.addr) {
                    tracked -= size;
                }
                out.push(e);
                continue;
            }
            let after = tracked
                + if e.kind == EventKind::Alloc {
                    e.size
                } else {
                    0
                };
            let wanted = d.pool.used.saturating_sub(after);
            if wanted != buffers {
                let at = |kind, size| Event {
                    kind,
                    addr: POOL_BUFFERS_ADDR,
                    size,
                    tag: pool_tag,
                    ..e
                };
                if buffers > 0 {
                    out.push(at(EventKind::Free, buffers));
                }
                if wanted > 0 {
                    out.push(at(EventKind::Alloc, wanted));
                }
                buffers = wanted;
            }
            if e.kind == EventKind::Alloc {
                storages.insert(e.addr, e.size);
                tracked = after;
            }
            out.push(e);
        }
        let mut timeline = Timeline::from_events(&out, names, 0, truncated);
        let start = events
            .iter()
            .find(|d| d.event.kind == EventKind::StepStart)
            .or(events.first());
        let start_ns = start.map_or(0, |d| d.event.time_ns);
        let steps = events.iter().filter(|d| d.event.time_ns >= start_ns);
        let mut pool = PoolTrace {
            outside,
            ..PoolTrace::default()
        };
        for d in steps {
            let t = d.event.time_ns - start_ns;
            pool.samples.push((t, d.pool.used, d.pool.reserved));
            pool.used_high = pool.used_high.max(d.pool.used_high);
            pool.reserved_high = pool.reserved_high.max(d.pool.reserved_high);
        }
        timeline.pool = Some(pool);
        timeline
    }

    /// Bytes per component of the blocks alive when the step started.
    pub fn initial_bytes(&self) -> ComponentBytes {
        let mut bytes = [0; 5];
        for b in self.blocks.iter().filter(|b| b.alloc_ns.is_none()) {
            bytes[b.component as usize] += b.size;
        }
        bytes
    }

    /// Live bytes per component after each change: `(time ns, bytes)`, starting
    /// with the initial state at time 0.
    pub fn series(&self) -> Vec<(u64, ComponentBytes)> {
        let mut bytes = self.initial_bytes();
        let mut out = Vec::with_capacity(self.changes.len() + 1);
        out.push((0, bytes));
        for c in &self.changes {
            let b = &self.blocks[c.block];
            let slot = &mut bytes[b.component as usize];
            *slot = if c.alloc {
                *slot + b.size
            } else {
                slot.saturating_sub(b.size)
            };
            out.push((c.time_ns, bytes));
        }
        out
    }

    /// The moment of the highest total live bytes: `(time ns, bytes per component)`.
    pub fn peak(&self) -> (u64, ComponentBytes) {
        self.series()
            .into_iter()
            .max_by_key(|(t, b)| (b.iter().sum::<u64>(), std::cmp::Reverse(*t)))
            .unwrap_or((0, [0; 5]))
    }

    /// The phase at `time_ns`.
    pub fn phase_at(&self, time_ns: u64) -> Phase {
        self.phases
            .iter()
            .take_while(|(t, _)| *t <= time_ns)
            .last()
            .map_or(Phase::Setup, |p| p.1)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::track::tag::{Module, Op};

    /// An event of `kind` at `t` ns: `size` bytes at `addr`, in `phase`, by `op`.
    pub(crate) fn ev(kind: EventKind, t: u64, addr: u64, size: u64, phase: Phase, op: Op) -> Event {
        Event {
            time_ns: t,
            addr,
            size,
            live: 0,
            tag: Tag::new(Module::ROOT, op),
            kind,
            phase,
        }
    }

    #[test]
    fn components_follow_the_rules() {
        use EventKind::{Alloc, Free, Mark, StepStart};
        use Phase::{Backward, Forward, Setup};
        let events = [
            ev(Alloc, 0, 0x10, 100, Setup, Op::InitWeights),
            ev(Alloc, 1, 0x20, 200, Setup, Op::InitOptimizer),
            ev(Alloc, 2, 0x30, 7, Setup, Op::None),
            ev(StepStart, 3, 0, 0, Setup, Op::None),
            ev(EventKind::Phase, 4, 0, 0, Forward, Op::None),
            ev(Alloc, 5, 0x40, 50, Forward, Op::Matmul), // saved for backward
            ev(Alloc, 6, 0x50, 60, Forward, Op::Softmax), // freed in forward
            ev(Alloc, 6, 0x80, 8, Forward, Op::Matmul),  // a cache: outlives backward
            ev(Free, 7, 0x50, 60, Forward, Op::Softmax),
            ev(EventKind::Phase, 8, 0, 0, Backward, Op::None),
            ev(Alloc, 9, 0x60, 100, Backward, Op::Backward), // a gradient
            ev(Alloc, 10, 0x70, 30, Backward, Op::Backward), // temporary
            ev(
                Mark,
                11,
                0x60,
                Component::Gradients as u64,
                Backward,
                Op::None,
            ),
            ev(Free, 12, 0x40, 50, Backward, Op::None),
            ev(Free, 13, 0x70, 30, Backward, Op::None),
            ev(Free, 14, 0x999, 1000, Backward, Op::None), // older than the recording
            ev(EventKind::Phase, 15, 0, 0, Setup, Op::None),
        ];
        let names = HashMap::from([(0x10, "w".to_string())]);
        let t = Timeline::from_events(&events, &names, 0, false);
        let comp: Vec<(u64, Component)> = t.blocks.iter().map(|b| (b.addr, b.component)).collect();
        assert_eq!(
            comp,
            [
                (0x10, Component::Weights),
                (0x20, Component::OptimizerState),
                (0x30, Component::Temporaries),
                (0x40, Component::Activations),
                (0x50, Component::Temporaries),
                (0x80, Component::Temporaries),
                (0x60, Component::Gradients),
                (0x70, Component::Temporaries),
            ]
        );
        assert_eq!(t.blocks[0].name.as_deref(), Some("w"));
        assert_eq!(t.changes.len(), 8);
        assert_eq!(t.initial_bytes(), [100, 0, 200, 0, 7]);
        let (time, bytes) = t.peak();
        assert_eq!(time, 10 - 3);
        assert_eq!(bytes, [100, 100, 200, 50, 45]);
        assert_eq!(
            t.phases,
            [(0, Setup), (1, Forward), (5, Backward), (12, Setup)]
        );
        assert_eq!(t.phase_at(6), Backward);
        assert_eq!(t.end_ns, 12);
    }

    /// A fake CUDA recording: the pool's counters with each event, as the
    /// memory hook delivers them (the pool's used bytes include an op's
    /// buffers that never become a storage).
    pub(crate) fn device_events() -> Vec<DeviceEvent> {
        use crate::track::device::PoolCounters;
        use EventKind::{Alloc, Free, Pool, StepStart};
        use Phase::{Backward, Forward, Setup};
        let mut high = 0;
        let rows = [
            // kind, t, addr, size, phase, op, used, reserved
            (Pool, 0, 0, 100, Setup, Op::InitWeights, 100, 100),
            (Alloc, 1, 0xa0, 100, Setup, Op::InitWeights, 100, 100),
            (StepStart, 2, 0, 0, Setup, Op::None, 100, 100),
            (EventKind::Phase, 3, 0, 0, Forward, Op::None, 100, 100),
            (Pool, 4, 0, 50, Forward, Op::Matmul, 150, 160),
            (Pool, 5, 0, 8, Forward, Op::Matmul, 158, 170), // an op's own buffer
            (Alloc, 6, 0xb0, 50, Forward, Op::Matmul, 150, 170), // the buffer freed
            (EventKind::Phase, 7, 0, 0, Backward, Op::None, 150, 170),
            (Free, 8, 0xb0, 50, Backward, Op::None, 150, 170), // before the pool sees it
            (Pool, 9, 0, 30, Backward, Op::Backward, 130, 170),
            (Alloc, 10, 0xc0, 30, Backward, Op::Backward, 130, 170),
            (EventKind::Phase, 11, 0, 0, Setup, Op::None, 130, 140),
        ];
        rows.into_iter()
            .map(|(kind, t, addr, size, phase, op, used, reserved)| {
                if kind == StepStart {
                    high = used; // the marks are reset when the steps start
                }
                high = high.max(used);
                DeviceEvent {
                    event: Event {
                        live: used,
                        ..ev(kind, t, addr, size, phase, op)
                    },
                    pool: PoolCounters {
                        used,
                        reserved,
                        used_high: high,
                        reserved_high: reserved.max(170 * u64::from(t >= 5)),
                    },
                }
            })
            .collect()
    }

    #[test]
    fn a_device_timeline_peaks_at_the_pools_high_water_mark() {
        let events = device_events();
        let t = Timeline::from_device_events(&events, &HashMap::new(), 7, false);
        let pool = t.pool.as_ref().unwrap();
        let (at, bytes) = t.peak();
        // The op's own buffer counts: the peak is the pool's, not the storages' 150.
        assert_eq!(bytes.iter().sum::<u64>(), 158);
        assert_eq!(pool.used_high, 158);
        assert_eq!(pool.used_peak(), 158);
        assert_eq!(at, 5 - 2);
        // The storages keep their components; the pool's buffer is a temporary.
        let buffers: Vec<&Block> = t
            .blocks
            .iter()
            .filter(|b| b.addr == POOL_BUFFERS_ADDR)
            .collect();
        assert!(buffers
            .iter()
            .all(|b| b.component == Component::Temporaries && b.tag.name() == POOL_BUFFERS));
        // At the peak the matmul's output is not a storage yet: the pool's block holds it.
        assert_eq!(bytes, [100, 0, 0, 0, 58]);
        let output = t.blocks.iter().find(|b| b.addr == 0xb0).unwrap();
        assert_eq!(output.component, Component::Activations);
        // Reserved over the steps, and fragmentation at the allocated peak.
        assert_eq!(pool.samples.first(), Some(&(0, 100, 100)));
        assert_eq!(pool.reserved_peak(), 170);
        assert_eq!(pool.reserved_high, 170);
        let f = pool.at_used_peak();
        assert_eq!((f.used, f.reserved, f.free()), (158, 170, 12));
        assert_eq!(pool.outside, 7);
        // After the backward's allocation, the storages alone are the pool's used bytes.
        let (_, last) = *t.series().last().unwrap();
        assert_eq!(last.iter().sum::<u64>(), 130);
    }
}
