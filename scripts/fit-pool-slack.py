#!/usr/bin/env python3
"""The CUDA pool's slack term (src/target.rs, CUDA_POOL_SLACK_*), fitted and checked.

The slack is what the stream-ordered pool reserves beyond its live bytes at a
step's peak. It is modelled as

    slack = a * blocks + b * [checkpointed] + c * [checkpointed or accumulating]

(rounded up to the pool's 2 MiB pages). This script fits a, b, c by least
squares to `reserved - live estimate` over the accuracy matrix's rows that
carry the pool's reserved peak (docs/pool-reserve-gpu.json), then prints,
for every file given, the error of `live + slack` against the reserved peak
with the coefficients src/target.rs ships and with the former constant
512 MiB, and the under-estimates past a headroom.

Usage: scripts/fit-pool-slack.py [--headroom MIB PCT] FIT.json [CHECK.json ...]
  FIT.json / CHECK.json: `accuracy --device cuda:0` outputs (rows with
  `measured_reserved_bytes`), or `sweep --device cuda:0` outputs (rows whose
  `measured_peak_bytes` is the reserved peak and `estimated_peak_bytes`
  includes the shipped slack).
  e.g. scripts/fit-pool-slack.py docs/pool-reserve-gpu.json \
       docs/pool-reserve-gpu-rerun.json docs/sweep-cuda.json docs/sweep-cuda-llama.json
"""
import json
import statistics
import sys

MIB = 1 << 20
SHIPPED = (12, 176, 120)  # MiB: per block, recomputation, a pass repeated
BLOCKS = {"gpt2-6l": 6, "gpt2-small": 12, "gpt2-medium": 24,
          "llama-160m": 12, "llama-400m": 24, "tinyllama-1.1b": 22}


def slack(c, blocks, ck, acc):
    s = (c[0] * blocks + c[1] * ck + c[2] * max(ck, acc)) * MIB
    return -(-int(s) // (2 * MIB)) * 2 * MIB


def rows_of(path):
    """(live estimate, reserved peak, blocks, checkpointed, accumulating, name) per row."""
    out = []
    for r in json.load(open(path))["rows"]:
        blocks = BLOCKS[r["model"]]
        if isinstance(r["plan"], str):  # accuracy: plan text, live estimate
            if not r.get("measured_reserved_bytes"):
                continue
            ck = int("checkpoint every" in r["plan"])
            acc = int("x 1 accumulation" not in r["plan"])
            live, reserved = r["estimated_bytes"], r["measured_reserved_bytes"]
            name = r["plan"]
        else:  # sweep: plan object, estimate with the shipped slack
            if not r.get("measured_peak_bytes"):
                continue
            ck = int(r["plan"]["checkpoint"] != "none")
            acc = int(r["plan"]["grad_accum"] > 1)
            live = r["estimated_peak_bytes"] - slack(SHIPPED, blocks, ck, acc)
            reserved = r["measured_peak_bytes"]
            name = json.dumps(r["plan"], sort_keys=True)
        out.append((live, reserved, blocks, ck, acc, f"{r['model']} {name}"))
    return out


def fit(rows):
    """Least squares of reserved - live on (blocks, ck, ck|acc), in MiB."""
    xs = [(b, ck, max(ck, acc)) for _, _, b, ck, acc, _ in rows]
    ys = [(res - live) / MIB for live, res, *_ in rows]
    # normal equations, 3 x 3
    a = [[sum(x[i] * x[j] for x in xs) for j in range(3)] for i in range(3)]
    v = [sum(x[i] * y for x, y in zip(xs, ys)) for i in range(3)]
    for i in range(3):  # Gauss-Jordan
        p = a[i][i]
        a[i] = [e / p for e in a[i]]
        v[i] /= p
        for k in range(3):
            if k != i:
                f = a[k][i]
                a[k] = [e - f * g for e, g in zip(a[k], a[i])]
                v[k] -= f * v[i]
    return v


def report(label, rows, term, headroom):
    errs = [(live + term(b, ck, acc)) / res - 1 for live, res, b, ck, acc, _ in rows]
    mags = sorted(abs(e) for e in errs)
    fixed, pct = headroom
    past = [r for r, e in zip(rows, errs)
            if (r[0] + term(*r[2:5])) * (1 + pct / 100) + fixed * MIB < r[1]]
    print(f"  {label:<22} median {100 * statistics.median(mags):.1f}%, max {100 * mags[-1]:.1f}%, "
          f"within 3%: {sum(m <= 0.03 for m in mags)}/{len(mags)}; under: {sum(e < 0 for e in errs)}, "
          f"worst {100 * min(errs):+.1f}%; past {fixed}MiB+{pct}%: {len(past)}")
    for r in past:
        print(f"      {r[5]}: {(r[1] - r[0] - term(*r[2:5])) / MIB:.0f} MiB over")


def main(argv):
    headroom = (192, 3)
    if argv[:1] == ["--headroom"]:
        headroom, argv = (int(argv[1]), float(argv[2])), argv[3:]
    if not argv:
        sys.exit(__doc__)
    fitted = fit(rows_of(argv[0]))
    print(f"fitted on {argv[0]}: " + ", ".join(f"{c:.1f}" for c in fitted)
          + f" MiB (shipped: {', '.join(map(str, SHIPPED))})")
    for path in argv:
        rows = rows_of(path)
        print(f"{path} ({len(rows)} rows): estimate = live + slack, against the reserved peak")
        report("shipped term", rows, lambda b, ck, acc: slack(SHIPPED, b, ck, acc), headroom)
        report("constant 512 MiB", rows, lambda b, ck, acc: 512 * MIB, headroom)


if __name__ == "__main__":
    main(sys.argv[1:])
