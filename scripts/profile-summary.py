#!/usr/bin/env python3
"""Where a training step's GPU time goes, oomfix beside PyTorch
(scripts/profile-step.sh writes the inputs).

usage: profile-summary.py NCU_CSV OOMFIX_STEP_MS TORCH_JSON...

NCU_CSV is `ncu --csv --page raw --metrics gpu__time_duration.sum` over an
oomfix process that ran a warm-up step and two measured steps; the last step
is the longest tail of the launch sequence that repeats just before itself
(the two measured steps launch the same kernels in the same order). OOMFIX_STEP_MS is the step's
wall time measured without the profiler. TORCH_JSON files come from
scripts/torch_profile.py.

Prints, per side: kernel launches per step, the kernels' summed device time,
the wall time, the time between kernels (wall less kernels: launch overhead,
host work, synchronisations), then the device time by kind of kernel and the
ten most expensive kernels.
"""
import csv
import json
import re
import sys

KINDS = [
    ("attention", r"flash|fmha|attention|attn|sdpa"),
    ("matmul", r"gemm|nvjet|xmma|cutlass|cublas|sm90_|sm80_|Kernel2|splitK|gemv"),
    ("optimizer", r"adam|multi_tensor|foreach"),
    ("norm/softmax/loss", r"norm|softmax|nll|cross_entropy|log_softmax|rms"),
    ("reduction", r"reduce|sum|max|min|argmax|mean"),
    ("copy/cast", r"copy|cast|memcpy|memset|ucopy|to_dtype|convert|cat|fill|zero"),
    ("fused (triton)", r"^triton"),
]


def kind(name):
    for k, pat in KINDS:
        if re.search(pat, name, re.I):
            return k
    return "elementwise"


def last_step(names):
    """The first launch of the last step: the longest tail of the launch
    sequence that repeats just before itself (the two measured steps launch
    the same kernels in the same order; the warm-up step has one-off ones)."""
    n = len(names)
    for k in range(n // 2, 0, -1):
        if names[n - 2 * k:n - k] == names[n - k:]:
            return n - k
    return None


def ncu(path):
    rows = []
    with open(path) as f:
        lines = [l for l in f if l.startswith('"')]
    r = csv.DictReader(lines)
    for row in r:
        t = row.get("gpu__time_duration.sum", "")
        try:
            rows.append((row["Kernel Name"], float(t.replace(",", ""))))
        except ValueError:
            continue  # the units row
    start = last_step([n for n, _ in rows])
    if start is None:
        raise SystemExit(f"{path}: no two identical steps at the end of {len(rows)} launches")
    unit = 1e-3  # ncu reports nanoseconds by default: to microseconds
    kernels = {}
    for name, t in rows[start:]:
        k = kernels.setdefault(name, {"name": name, "count": 0, "us": 0.0})
        k["count"] += 1
        k["us"] += t * unit
    return kernels


def report(label, step_ms, kernels):
    launches = sum(k["count"] for k in kernels)
    busy = sum(k["us"] for k in kernels) / 1e3
    print(f"## {label}\n")
    print(f"launches {launches}, kernels {busy:.1f} ms, wall {step_ms:.1f} ms, "
          f"between kernels {step_ms - busy:.1f} ms ({(step_ms - busy) / step_ms:.0%})\n")
    by = {}
    for k in kernels:
        b = by.setdefault(kind(k["name"]), [0, 0.0])
        b[0] += k["count"]
        b[1] += k["us"]
    print("| kind | launches | ms | share of kernel time |\n|---|---:|---:|---:|")
    for name, (n, us) in sorted(by.items(), key=lambda x: -x[1][1]):
        print(f"| {name} | {n} | {us / 1e3:.1f} | {us / 1e3 / busy:.0%} |")
    print("\n| kernel | launches | ms |\n|---|---:|---:|")
    for k in sorted(kernels, key=lambda k: -k["us"])[:10]:
        print(f"| `{k['name'][:90]}` | {k['count']} | {k['us'] / 1e3:.2f} |")
    print()


def main(argv):
    path, step_ms, torch_files = argv[0], float(argv[1]), argv[2:]
    report(f"oomfix ({path})", step_ms, list(ncu(path).values()))
    for p in torch_files:
        try:
            d = json.load(open(p))
        except (OSError, ValueError) as e:
            print(f"## {p}: not read ({e})\n")
            continue
        report(f"{d['side']} {d['config']} ({d['device']})", d["step_ms"], d["kernels"])


if __name__ == "__main__":
    main(sys.argv[1:])
