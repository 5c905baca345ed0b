//! A measured step as a PyTorch memory snapshot (`torch.cuda.memory._dump_snapshot`
//! format, pickle protocol 3), readable by PyTorch's memory_viz.
//!
//! `device_traces[0]` lists every allocation (`alloc`) and free
//! (`free_completed`) of the step with its address, size and time; each entry's
//! frame names the phase of the step (`forward_backward`, `optimizer_step`).
//! `segments` holds the blocks still allocated when the step ends, one segment
//! per block (host memory has no allocator segments of its own).

use crate::measure::Timeline;
use serde_json::{json, Value};
use std::collections::HashMap;

fn frames(phase: &str) -> Value {
    json!([{ "filename": "oomfix", "line": 0, "name": phase }])
}

/// The snapshot as a JSON-like value (what is pickled).
pub fn snapshot_value(timeline: &Timeline) -> Value {
    let mut live: HashMap<u64, (u64, &'static str)> = HashMap::new();
    let trace: Vec<Value> = timeline
        .events
        .iter()
        .map(|e| {
            let phase = e.phase.as_str();
            if e.alloc {
                live.insert(e.addr, (e.size, phase));
            } else {
                live.remove(&e.addr);
            }
            json!({
                "action": if e.alloc { "alloc" } else { "free_completed" },
                "addr": e.addr,
                "size": e.size,
                "stream": 0,
                "time_us": e.time_ns / 1000,
                "frames": frames(phase),
            })
        })
        .collect();
    let mut blocks: Vec<_> = live.into_iter().collect();
    blocks.sort();
    let segments: Vec<Value> = blocks
        .iter()
        .map(|(addr, (size, phase))| {
            json!({
                "device": 0,
                "address": addr,
                "total_size": size,
                "allocated_size": size,
                "active_size": size,
                "requested_size": size,
                "stream": 0,
                "segment_type": if *size < (1 << 20) { "small" } else { "large" },
                "frames": frames(phase),
                "blocks": [{
                    "address": addr,
                    "size": size,
                    "requested_size": size,
                    "state": "active_allocated",
                    "frames": frames(phase),
                }],
            })
        })
        .collect();
    json!({
        "segments": segments,
        "device_traces": [trace],
        "allocator_settings": { "host": "oomfix counting allocator" },
    })
}

/// The snapshot as pickle bytes (protocol 3).
pub fn snapshot_pickle(timeline: &Timeline) -> Vec<u8> {
    serde_pickle::to_vec(&snapshot_value(timeline), serde_pickle::SerOptions::new())
        .expect("JSON values always pickle")
}
