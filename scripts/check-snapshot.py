#!/usr/bin/env python3
"""Loads an oomfix memory snapshot (`--snapshot`) as memory_viz reads it and
checks its figures.

Replays `device_traces[0]`: allocated bytes (`alloc` / `free_completed`)
and, for a CUDA snapshot, reserved bytes (`segment_alloc` / `segment_free`)
over time. Checks that every entry has the fields memory_viz reads, that
frees match allocations, and that the segments alive at the end add up to
the reserved bytes at the end. With `--pool` (a CUDA snapshot), also that
the trace's allocated peak equals the pool's used high-water mark and its
reserved peak the pool's reserved high-water mark (`allocator_settings`).
Where PyTorch is installed, it also runs its own readers of the format
(`torch.cuda._memory_viz`: segsum, segments, memory, and trace on small
traces, and the HTML of trace_plot / segment_plot).

Prints one JSON object: entries, phases seen, the peaks, the pool's marks,
the fragmentation at the allocated peak (reserved minus allocated then),
the memory outside the pool.

Usage: scripts/check-snapshot.py SNAPSHOT [--pool] [--steps N]
  --steps N   the trace holds N optimizer steps
Exit status: 0 when every check passed, 1 otherwise.
"""
import json
import pickle
import sys


def fail(why):
    print(f"check-snapshot: {why}", file=sys.stderr)
    sys.exit(1)


def main():
    args = sys.argv[1:]
    if not args or args[0].startswith("-"):
        fail("usage: check-snapshot.py SNAPSHOT [--pool] [--steps N]")
    path, pool, steps = args[0], "--pool" in args, None
    if "--steps" in args:
        steps = int(args[args.index("--steps") + 1])
    with open(path, "rb") as f:
        d = pickle.load(f)
    if not {"segments", "device_traces", "allocator_settings"} <= set(d):
        fail(f"top-level keys {sorted(d)}")
    t = d["device_traces"][0]
    need = {"action", "addr", "size", "stream", "time_us", "frames"}
    actions = {"alloc", "free_completed", "segment_alloc", "segment_free", "snapshot"}
    live, segs = {}, {}
    allocated = reserved = 0
    peak_alloc = peak_reserved = 0
    reserved_at_peak = 0
    last_time = 0
    phases = set()
    opt_steps, prev = 0, None
    for i, e in enumerate(t):
        if not need <= set(e):
            fail(f"entry {i} lacks {sorted(need - set(e))}")
        if e["action"] not in actions:
            fail(f"entry {i}: action {e['action']}")
        if e["time_us"] < last_time:
            fail(f"entry {i}: time goes back ({e['time_us']} < {last_time})")
        last_time = e["time_us"]
        for fr in e["frames"]:
            if not {"name", "filename", "line"} <= set(fr):
                fail(f"entry {i}: frame {fr}")
        a, addr, size = e["action"], e["addr"], e["size"]
        if a == "alloc":
            if addr in live:
                fail(f"entry {i}: {addr:#x} allocated twice")
            live[addr] = size
            allocated += size
            if allocated > peak_alloc:
                peak_alloc, reserved_at_peak = allocated, reserved
            ph = next((f["name"] for f in e["frames"] if f["filename"] == "phase"), None)
            if ph:
                phases.add(ph)
                if ph == "optimizer_step" and prev != ph:
                    opt_steps += 1
                prev = ph
        elif a == "free_completed":
            if live.get(addr) != size:
                fail(f"entry {i}: free of {addr:#x} ({size} B) that is not live")
            allocated -= live.pop(addr)
        elif a == "segment_alloc":
            if addr in segs:
                fail(f"entry {i}: segment {addr:#x} allocated twice")
            segs[addr] = size
            reserved += size
            peak_reserved = max(peak_reserved, reserved)
        elif a == "segment_free":
            if segs.get(addr) != size:
                fail(f"entry {i}: free of segment {addr:#x} that is not live")
            reserved -= segs.pop(addr)
    settings = d["allocator_settings"]
    out = {
        "entries": len(t),
        "phases": sorted(phases),
        "optimizer_steps": opt_steps,
        "peak_allocated": peak_alloc,
        "peak_reserved": peak_reserved,
        "reserved_at_allocated_peak": reserved_at_peak,
        "fragmentation_at_allocated_peak": reserved_at_peak - peak_alloc if pool else None,
        "segments_at_end": len(d["segments"]),
        "allocator": settings.get("host"),
    }
    for k in ("pool_used_high", "pool_reserved_high", "outside_pool"):
        if k in settings:
            out[k] = settings[k]
    if steps is not None and opt_steps != steps:
        fail(f"{opt_steps} optimizer steps in the trace, expected {steps}")
    if pool:
        if "pool_used_high" not in settings:
            fail("--pool: the snapshot has no pool figures (a CPU snapshot?)")
        seg_total = sum(s["total_size"] for s in d["segments"])
        if seg_total != reserved:
            fail(f"segments at the end hold {seg_total} B, the trace's reserve is {reserved} B")
        if peak_alloc != settings["pool_used_high"]:
            fail(f"allocated peak {peak_alloc} B != the pool's used high-water mark {settings['pool_used_high']} B")
        if peak_reserved != settings["pool_reserved_high"]:
            fail(f"reserved peak {peak_reserved} B != the pool's reserved high-water mark {settings['pool_reserved_high']} B")
    try:
        from torch.cuda import _memory_viz as mv
    except Exception:  # no PyTorch here: the checks above stand alone
        out["torch_memory_viz"] = "not installed"
    else:
        mv.segsum(d)
        # The flame-graph text itself (not drawn: that needs flamegraph.pl).
        lines = mv.segments(d, format_flamegraph=lambda s: s) + mv.memory(d, format_flamegraph=lambda s: s)
        if not lines.strip():
            fail("memory_viz's segments and memory views are empty")
        if len(t) < 20000:
            mv.trace(d)
        html = mv.trace_plot(d) + mv.segment_plot(d)
        out["torch_memory_viz"] = f"segsum, segments, memory{', trace' if len(t) < 20000 else ''}, plots ({len(html)} B of HTML)"
    print(json.dumps(out))


if __name__ == "__main__":
    main()
