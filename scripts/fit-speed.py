#!/usr/bin/env python3
"""Fit the CPU throughputs of oomfix's step-time model to a sweep's measured steps.

Usage: scripts/fit-speed.py [--fix NAME=RATE ...] docs/sweep.json

--fix holds a throughput at a rate measured elsewhere (e.g. the bf16 matrix
product rate of a probe, `--fix matmul_half=7.34e14`) and fits the others:
a free fit may trade one term against another to rates no device reaches.

The sweep (`cargo run --release --example sweep`) records, for every
configuration, the work terms of `oomfix::speed::StepWork` and the measured
shortest step time. The model is time = sum(work_i / throughput_i); this fits
the reciprocals 1/throughput_i by non-negative least squares on relative
errors (each row divided by its measured time), so small and large steps
weigh alike, and prints the throughputs to put in `src/speed.rs`'s `CPU`
constant with the fit's median and largest relative error.

Pure Python (no NumPy): the system is a handful of columns.
"""
import json
import sys

# StepWork field -> Throughput field; matrix products split by precision.
COLUMNS = [
    ("matmul_f32", lambda w: 0.0 if w["half"] else w["matmul_flops"]),
    ("matmul_half", lambda w: w["matmul_flops"] if w["half"] else 0.0),
    ("attention", lambda w: w["attention_flops"]),
    ("elementwise", lambda w: w["elementwise_bytes"]),
    ("probabilities", lambda w: w["probabilities_bytes"]),
    ("optimizer", lambda w: w["optimizer_bytes"]),
    ("micro_batch_seconds", lambda w: w["micro_batches"]),
]


def solve(a, b):
    """Solves the square system a x = b by Gaussian elimination with pivoting."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        if abs(m[p][c]) < 1e-300:
            return None
        m[c], m[p] = m[p], m[c]
        for r in range(n):
            if r != c:
                f = m[r][c] / m[c][c]
                for k in range(c, n + 1):
                    m[r][k] -= f * m[c][k]
    return [m[i][n] / m[i][i] for i in range(n)]


def lstsq(x, y, cols):
    """Least squares on the columns `cols` (normal equations)."""
    a = [[sum(r[i] * r[j] for r in x) for j in cols] for i in cols]
    b = [sum(r[i] * yy for r, yy in zip(x, y)) for i in cols]
    return solve(a, b)


def nnls(x, y):
    """Lawson-Hanson non-negative least squares."""
    n = len(x[0])
    passive, coef = [], [0.0] * n
    for _ in range(10 * n):
        resid = [yy - sum(c * v for c, v in zip(coef, r)) for r, yy in zip(x, y)]
        grad = [sum(r[j] * e for r, e in zip(x, resid)) for j in range(n)]
        free = [j for j in range(n) if j not in passive and grad[j] > 1e-12 * max(1.0, max(map(abs, grad)))]
        if not free:
            break
        passive.append(max(free, key=lambda j: grad[j]))
        while True:
            z = lstsq(x, y, passive)
            if z is None:
                passive.pop()
                break
            if all(v > 0 for v in z):
                coef = [0.0] * n
                for j, v in zip(passive, z):
                    coef[j] = v
                break
            alpha = min(
                coef[j] / (coef[j] - v) for j, v in zip(passive, z) if v <= 0 and coef[j] - v > 0
            ) if any(v <= 0 for v in z) else 1.0
            for j, v in zip(passive, z):
                coef[j] += alpha * (v - coef[j])
            passive = [j for j in passive if coef[j] > 1e-18]
    return coef


def main(path, fixed):
    rows = json.load(open(path))["rows"]
    free = [(i, name) for i, (name, _) in enumerate(COLUMNS) if name not in fixed]
    x, y = [], []
    for r in rows:
        t = r["measured_seconds"]
        full = [f(r["work"]) / t for _, f in COLUMNS]
        known = sum(full[i] / fixed[name] for i, (name, _) in enumerate(COLUMNS) if name in fixed)
        x.append([full[i] for i, _ in free])
        y.append(1.0 - known)
    # Scale columns to comparable magnitudes for the solver.
    scale = [max(abs(r[j]) for r in x) or 1.0 for j in range(len(free))]
    xs = [[v / s for v, s in zip(r, scale)] for r in x]
    coef = [c / s for c, s in zip(nnls(xs, y), scale)]
    errors = sorted(abs(sum(c * v for c, v in zip(coef, r)) - yy) for r, yy in zip(x, y))
    print(f"{len(rows)} rows; relative error median {100 * errors[len(errors) // 2]:.1f}%, max {100 * errors[-1]:.1f}%")
    rates = dict(fixed)
    for (_, name), c in zip(free, coef):
        rates[name] = c if name == "micro_batch_seconds" else (float("inf") if c == 0 else 1.0 / c)
    for name, _ in COLUMNS:
        v = rates[name]
        shown = "f64::INFINITY" if v == float("inf") else f"{v:.3e}"
        print(f"    {name}: {shown},{'  (fixed)' if name in fixed else ''}")


if __name__ == "__main__":
    args, fixed = sys.argv[1:], {}
    while args and args[0] == "--fix":
        name, _, rate = args[1].partition("=")
        if name not in dict(COLUMNS) or not rate:
            sys.exit(f"--fix NAME=RATE with NAME one of {', '.join(n for n, _ in COLUMNS)}")
        fixed[name] = float(rate)
        args = args[2:]
    main(args[0] if args else "docs/sweep.json", fixed)
