#!/usr/bin/env python3
"""Fit the CPU throughputs of oomfix's step-time model to a sweep's measured steps.

Usage: scripts/fit-speed.py docs/sweep.json

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


def main(path):
    rows = json.load(open(path))["rows"]
    x, y = [], []
    for r in rows:
        t = r["measured_seconds"]
        x.append([f(r["work"]) / t for _, f in COLUMNS])
        y.append(1.0)
    # Scale columns to comparable magnitudes for the solver.
    scale = [max(abs(r[j]) for r in x) or 1.0 for j in range(len(COLUMNS))]
    xs = [[v / s for v, s in zip(r, scale)] for r in x]
    coef = [c / s for c, s in zip(nnls(xs, y), scale)]
    errors = sorted(abs(sum(c * v for c, v in zip(coef, r)) - 1.0) for r in x)
    print(f"{len(rows)} rows; relative error median {100 * errors[len(errors) // 2]:.1f}%, max {100 * errors[-1]:.1f}%")
    for (name, _), c in zip(COLUMNS, coef):
        if name == "micro_batch_seconds":
            print(f"    {name}: {c:.3e},")
        else:
            print(f"    {name}: {'f64::INFINITY' if c == 0 else f'{1.0 / c:.3e}'},")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "docs/sweep.json")
