#!/usr/bin/env python3
"""Markdown tables from scripts/side-by-side.sh's results.

A configuration measured in several rounds (ROUNDS > 1) gets one row: the
median of its rounds' step times, the largest peaks, and the range of the
per-round time ratios.

Where torch.compile rows ran (PHASES=speed), a speed table comes first: each
row on oomfix, PyTorch eager and torch.compile, with time and memory ratios,
MFU and the compilation time; then oomfix's gradient-norm timings.

usage: side-by-side-tables.py TORCH_JSONL OOMFIX_JSONL CLI_TXT
"""
import json, statistics, sys

GIB = 2**30
def load(path):
    rows = []
    for line in open(path):
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass
    return rows

key = lambda r: (r["model"], r["batch"], r["seq"], r["precision"], r["ckpt"], r.get("accum", 1),
                 r.get("optimizer", "fused-adamw"), bool(r.get("compile")))

def merge(rows):
    """One row per configuration and attention; rounds keep their step times in `rounds_ms`."""
    groups = {}
    for r in rows:
        groups.setdefault((key(r), r.get("attn", "composed")), []).append(r)
    out = []
    for g in groups.values():
        ok = [r for r in g if r.get("status") == "ok"]
        if not ok:
            out.append(g[-1])
            continue
        m = dict(ok[0])
        for f in ("peak_alloc_bytes", "peak_reserved_bytes"):
            m[f] = max(r[f] for r in ok)
        m["rounds_ms"] = [r["step_ms"] for r in ok]
        m["failed_rounds"] = len(g) - len(ok)
        m["step_ms"] = statistics.median(m["rounds_ms"])
        out.append(m)
    return out

ORDER = {"gpt2": 0, "gpt2-medium": 1, "tinyllama": 2}
by_model = lambda rows: sorted(rows, key=lambda r: ORDER.get(r["model"], 3))
oomfix_all = load(sys.argv[2])
norm_rows = [r for r in oomfix_all if r.get("side") == "norm"]
torch_all = by_model(merge(load(sys.argv[1])))
oomfix_rows = by_model(merge([r for r in oomfix_all if r.get("side") != "norm"]))
compiled_rows = [r for r in torch_all if r.get("compile")]
torch_rows = [r for r in torch_all if not r.get("compile")]
# oomfix's attention per row: composed (eager-style) or flash. PyTorch's eager
# rows compare with composed; its SDPA rows with flash where it ran, else composed.
ours = {(key(r), r.get("attn", "composed")): r for r in oomfix_rows}
def match(t):
    if t["attn"] == "eager":
        return ours.get((key(t), "composed"))
    return ours.get((key(t), "flash")) or ours.get((key(t), "composed"))
gib = lambda b: f"{b / GIB:.2f}"
def cell(r, field, fmt):
    if r is None:
        return "not run"
    if r.get("status") != "ok":
        return r.get("status", "?").upper() if field == "peak_alloc_bytes" else ""
    return fmt(r[field])
def ratio(a, b, field):
    if a is None or b is None or a.get("status") != "ok" or b.get("status") != "ok":
        return ""
    return f"{a[field] / b[field]:.2f}"
def spread(o, t):
    """min–max of the per-round time ratios, when both sides ran more than one round."""
    if o is None or t is None or len(o.get("rounds_ms", [])) < 2 or len(t.get("rounds_ms", [])) < 2:
        return ""
    rs = [a / b for a, b in zip(o["rounds_ms"], t["rounds_ms"])]
    failed = o.get("failed_rounds", 0) + t.get("failed_rounds", 0)
    return f"{min(rs):.2f}–{max(rs):.2f}" + (f" ({failed} round(s) failed)" if failed else "")
plan = lambda r: (f'{r["model"]} | {r["batch"]}×{r["seq"]} | {r["precision"]}'
                  f'{" offloaded" if r.get("optimizer") == "cpu-adamw" else ""} | {"every block" if r["ckpt"] else "no"}')

# Matrix-product parameters per model (the LM head included, embedding
# lookups not): (layers, hidden, that count).
def _llama(layers, h, kv, inter, vocab):
    return layers, h, layers * (2 * h * h + 2 * h * kv + 3 * h * inter) + vocab * h
MODELS = {
    "gpt2": (12, 768, 12 * 12 * 768 * 768 + 50257 * 768),
    "gpt2-medium": (24, 1024, 24 * 12 * 1024 * 1024 + 50257 * 1024),
    "tinyllama": _llama(22, 2048, 256, 5632, 32000),
}
# Dense datasheet peaks of the SXM parts (the same for H100 and H200), FLOP/s.
PEAK = {"bf16": 989.4e12, "fp32": 66.9e12}

def step_flops(r):
    """Model FLOPs of one step: tokens × (6 N + 12 L h s) (PaLM's count; a
    checkpointed block's recomputation is not counted)."""
    layers, h, n = MODELS[r["model"]]
    tokens = r["batch"] * r["seq"] * r.get("accum", 1)
    return tokens * (6 * n + 12 * layers * h * r["seq"])

def mfu(r, card):
    if r is None or r.get("status") != "ok" or r["model"] not in MODELS:
        return ""
    if not any(c in card for c in ("H100", "H200")):
        return ""
    peak = PEAK["fp32" if r["precision"] == "fp32" else "bf16"]
    return f'{100 * step_flops(r) / (r["step_ms"] / 1e3) / peak:.1f}%'

def ms(r):
    return cell(r, "step_ms", "{:.1f}".format)

def modelled(r):
    """oomfix's step-time model for the row's plan, and its ratio to the
    measured step."""
    if r is None or "modelled_ms" not in r:
        return "", ""
    got = f'{r["modelled_ms"]:.1f}'
    if r.get("status") != "ok":
        return got, ""
    return got, f'{r["modelled_ms"] / r["step_ms"]:.2f}'

if compiled_rows:
    card = next((r["device"] for r in compiled_rows if r.get("device")), "unknown GPU")
    eager = {(key(r)[:-1], r["attn"]): r for r in torch_rows}
    print(f"## Speed: oomfix vs PyTorch eager vs torch.compile, same plan, on one {card}\n")
    print("Step ms: median of the measured steady-state steps (after the warm-up: one step, two under "
          "torch.compile); GiB: allocated peak over those steps (oomfix: the CUDA pool's used high-water "
          "mark; PyTorch: max_memory_allocated). Ratios are oomfix / the other side. MFU: model FLOPs "
          "(6 N + 12 L h s per token, N the matrix-product parameters; a checkpointed block's recomputation "
          "not counted) per second over the dense datasheet peak (bf16 989.4 TFLOP/s, fp32 66.9 TFLOP/s "
          "for the fp32 row; the offloaded row's weights are bf16). compile s: torch.compile's first step "
          "less a steady-state step. modelled: oomfix's step-time model for the plan (one set of CUDA rates, fitted on an H200) "
          "(model ÷ oomfix: the goal is within 10%).\n")
    print("| model | b×s | precision | ckpt | oomfix ms | modelled ms | eager ms | compile ms | oomfix GiB "
          "| eager GiB | compile GiB | time ÷ eager | time ÷ compile | memory ÷ compile | model ÷ oomfix "
          "| MFU oomfix | MFU eager | MFU compile | compile s |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for c in compiled_rows:
        e = eager.get((key(c)[:-1], c["attn"]))
        o = match({**c, "compile": False})
        comp_s = f'{c["compile_s"]:.0f}' if c.get("status") == "ok" and "compile_s" in c else ""
        model_ms, model_ratio = modelled(o)
        print(f'| {plan(c)} | {ms(o)} | {model_ms} | {ms(e)} | {ms(c)} | {cell(o, "peak_alloc_bytes", gib)} '
              f'| {cell(e, "peak_alloc_bytes", gib)} | {cell(c, "peak_alloc_bytes", gib)} '
              f'| {ratio(o, e, "step_ms")} | {ratio(o, c, "step_ms")} | {ratio(o, c, "peak_alloc_bytes")} '
              f'| {model_ratio} | {mfu(o, card)} | {mfu(e, card)} | {mfu(c, card)} | {comp_s} |')
    print()
if norm_rows:
    print("## oomfix: the global gradient norm of one step (bf16 gradients of the model's shapes)\n")
    print("| model | tensors | elements | per-tensor slices through candle ops, ms | one pass, ms | relative difference |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in norm_rows:
        print(f'| {r["model"]} | {r["tensors"]} | {r["elements"]:,} | {r["sliced_ms"]:.2f} '
              f'| {r["one_pass_ms"]:.2f} | {r["relative_difference"]:.1e} |')
    print()

print("## oomfix vs PyTorch 2.11, same plan, fused AdamW (offloaded: AdamW on the CPU, both sides)\n")
print("Peaks in GiB (oomfix: CUDA pool used/reserved high-water; PyTorch: max_memory_allocated/reserved); "
      "step ms: median of the steady-state steps measured (5 unless STEPS said otherwise; over several rounds: the median of the rounds, the two sides "
      "alternating; the last column gives the range of the per-round time ratios). Ratios are oomfix / PyTorch.\n")
print("| model | b×s | precision | ckpt | PyTorch attn | oomfix attn | PyTorch alloc | PyTorch reserved | PyTorch ms "
      "| oomfix alloc | oomfix reserved | oomfix ms | alloc ratio | reserved ratio | time ratio | per-round time ratios |")
print("|---|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
seen = set()
for t in torch_rows:
    o = match(t)
    if o is not None:
        seen.add((key(o), o.get("attn", "composed")))
    print(f'| {plan(t)} | {t["attn"]} | {o.get("attn", "composed") if o else ""} | {cell(t, "peak_alloc_bytes", gib)} | {cell(t, "peak_reserved_bytes", gib)} '
          f'| {cell(t, "step_ms", "{:.0f}".format)} | {cell(o, "peak_alloc_bytes", gib)} '
          f'| {cell(o, "peak_reserved_bytes", gib)} | {cell(o, "step_ms", "{:.0f}".format)} '
          f'| {ratio(o, t, "peak_alloc_bytes")} | {ratio(o, t, "peak_reserved_bytes")} | {ratio(o, t, "step_ms")} | {spread(o, t)} |')
for o in oomfix_rows:
    if (key(o), o.get("attn", "composed")) not in seen:
        print(f'| {plan(o)}{" ×" + str(o.get("accum")) + " accum" if o.get("accum", 1) > 1 else ""} | not run | {o.get("attn", "composed")} | | | '
              f'| {cell(o, "peak_alloc_bytes", gib)} | {cell(o, "peak_reserved_bytes", gib)} '
              f'| {cell(o, "step_ms", "{:.0f}".format)} | | | | |')

print("\n## Memory model vs measured GPU peak (oomfix)\n")
print("estimate − runtime (context and cuBLAS workspace, outside the pool) against the pool's used high-water mark.\n")
print("| model | b×s | precision | ckpt | attn | accum | estimate GiB | estimate − runtime GiB | measured GiB | error |")
print("|---|---|---|---|---|---:|---:|---:|---:|---:|")
errs = []
for o in oomfix_rows:
    if "estimate_bytes" not in o:
        continue
    if o.get("status") == "ok":
        e = o["estimate_pool_bytes"] / o["peak_alloc_bytes"] - 1
        errs.append(e)
        meas, err = gib(o["peak_alloc_bytes"]), f"{100 * e:+.1f}%"
    else:
        meas, err = o.get("status", "?").upper(), ""
    print(f'| {plan(o)} | {o.get("attn", "composed")} | {o.get("accum", 1)} | {gib(o["estimate_bytes"])} | {gib(o["estimate_pool_bytes"])} | {meas} | {err} |')
if errs:
    a = [abs(e) for e in errs]
    print(f"\n{len(errs)} measured: median |error| {100 * statistics.median(a):.1f}%, max |error| {100 * max(a):.1f}%")
outside = [o["outside_pool_bytes"] for o in oomfix_rows if "outside_pool_bytes" in o]
if outside:
    print(f"Device memory outside the pool (context, modules, cuBLAS), after each run: "
          f"{gib(min(outside))}–{gib(max(outside))} GiB")

cli_text = open(sys.argv[3]).read().rstrip()
if cli_text:
    print("\n## `oomfix --budget 8GiB --verify --device cuda:0`\n")
    print("```text")
    print(cli_text)
    print("```")
