#!/usr/bin/env python3
"""The table of scripts/long-context-gpu.sh: per budget, the longest length
planned, the estimated tensors (the peak less the runtime and the pool's
slack) and the pool's measured used mark, the start-up (process start to the
end of the first step) and the steady step (the median of the steps after the
first).

Usage: long-context-table.py DIR BUDGET...   (DIR holds BUDGET.json,
BUDGET.log and BUDGET.run for each budget)
"""
import json
import os
import statistics
import sys
from datetime import datetime


def parse_time(stamp):
    return datetime.fromisoformat(stamp.replace("Z", "+00:00"))


def steps(log_path):
    """The step lines of a JSON log, and the time of its first line."""
    first, out = None, []
    with open(log_path) as f:
        for line in f:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            first = first or parse_time(event["timestamp"])
            if event.get("fields", {}).get("message") == "step":
                out.append((parse_time(event["timestamp"]), event["fields"]))
    return first, out


def row(directory, budget):
    run = json.load(open(os.path.join(directory, f"{budget}.run")))
    cells = {"budget": budget, "exit": run["exit"]}
    try:
        result = json.load(open(os.path.join(directory, f"{budget}.json")))
    except (OSError, json.JSONDecodeError):
        return cells
    longest = result.get("longest") or {}
    plan = result.get("plan") or {}
    cells["longest"] = longest.get("seq_len")
    cells["plan"] = ", ".join(
        f"{k} {plan[k]}" for k in ("precision", "checkpoint", "attention", "optimizer") if k in plan
    )
    if plan.get("offload_activations"):
        cells["plan"] += ", activations on the host"
    if plan.get("mlp_tile"):
        cells["plan"] += f", MLP tile {plan['mlp_tile']:,}"
    # The estimate's tensors: its peak less what the pool's used mark does
    # not count (the runtime outside the pool, the pool's reserve).
    estimate = result.get("estimate") or {}
    if estimate.get("peak_bytes"):
        cells["estimated"] = (estimate["peak_bytes"] - estimate.get("runtime_bytes", 0)
                              - estimate.get("pool_slack_bytes", 0))
    cells["modelled_s"] = result.get("estimated_step_seconds")
    first, step_lines = steps(os.path.join(directory, f"{budget}.log"))
    if step_lines:
        cells["measured"] = max(s["forward_backward_peak_bytes"] for _, s in step_lines)
        # The log's first line comes after the process started and before
        # the model is read; the wall time of the run bounds it from above.
        cells["startup_s"] = (step_lines[0][0] - first).total_seconds()
        later = [s["seconds"] for _, s in step_lines[1:]]
        cells["steady_s"] = statistics.median(later) if later else None
    return cells


def gib(n):
    return f"{n / 2**30:.2f}" if n else "-"


def main():
    directory, budgets = sys.argv[1], sys.argv[2:]
    print("| budget | longest | plan | estimated tensors GiB | measured used GiB | error | "
          "first step from the log's start, s | steady step, s | modelled, s | tokens/s | exit |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for budget in budgets:
        c = row(directory, budget)
        est, meas = c.get("estimated"), c.get("measured")
        error = f"{100 * (est / meas - 1):+.1f}%" if est and meas else "-"
        steady = c.get("steady_s")
        rate = f"{c['longest'] / steady:,.0f}" if steady and c.get("longest") else "-"
        fmt = lambda v: f"{v:.2f}" if isinstance(v, float) else "-"
        longest = f"{c['longest']:,}" if c.get("longest") else "-"
        print(f"| {budget} | {longest} | {c.get('plan', '-')} | {gib(est)} | {gib(meas)} | "
              f"{error} | {fmt(c.get('startup_s'))} | {fmt(steady)} | {fmt(c.get('modelled_s'))} | "
              f"{rate} | {c['exit']} |")


if __name__ == "__main__":
    main()
