#!/usr/bin/env bash
# CUDA flash_attention vs PyTorch's scaled_dot_product_attention, side by side,
# on the GPU machine: runs examples/gpu_attention (checks, then timings), the
# checks and timings again with the mma.sync kernels instead of the warpgroup
# ones on Hopper (OOMFIX_FLASH_WGMMA=0), the checks on the SIMT kernels
# (OOMFIX_FLASH_SIMT=1) and with grouped-query heads never split over blocks
# (OOMFIX_FLASH_KV_SPLITS=1),
# scripts/sdpa_bench.py with the same shapes (PyTorch's choice of backend, and
# its FlashAttention-2 backend forced), and prints a table.
#
# Usage: scripts/bench-attention-gpu.sh [BIN_DIR] [OUT_DIR]
#   BIN_DIR  holds gpu_attention-cuda.xz from
#            `scripts/build-cuda.sh --features cuda --example gpu_attention`
#            (default: .gpu/cuda)
#   OUT_DIR  logs: oomfix.txt, oomfix-mma.txt, oomfix-simt.txt, oomfix-nosplit.txt, sdpa.txt,
#            table.md
#            (default: $OUT, else attention-gpu-out)
# Environment: SEQS (default 1024,2048,4096,8192; the SDPA side only).
set -uo pipefail

BIN_DIR=${1:-.gpu/cuda}
OUT_DIR=${2:-${OUT:-attention-gpu-out}}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
mkdir -p "$OUT_DIR"
WORK=${TMPDIR:-/tmp}/attention-gpu
mkdir -p "$WORK"
export PYTHONUNBUFFERED=1 CUDA_CACHE_PATH=$WORK/nvcache
unset RUST_BACKTRACE

xz -dc "$BIN_DIR/gpu_attention-cuda.xz" >"$WORK/gpu_attention" && chmod +x "$WORK/gpu_attention" ||
    { echo "cannot unpack $BIN_DIR/gpu_attention-cuda.xz" >&2; exit 1; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT_DIR/device.txt"

status=0
"$WORK/gpu_attention" 2>&1 | tee "$OUT_DIR/oomfix.txt" || status=1
OOMFIX_FLASH_WGMMA=0 "$WORK/gpu_attention" 2>&1 | tee "$OUT_DIR/oomfix-mma.txt" || status=1
OOMFIX_FLASH_SIMT=1 "$WORK/gpu_attention" --check-only 2>&1 | tee "$OUT_DIR/oomfix-simt.txt" || status=1
OOMFIX_FLASH_KV_SPLITS=1 "$WORK/gpu_attention" --check-only 2>&1 | tee "$OUT_DIR/oomfix-nosplit.txt" || status=1
python3 "$HERE/sdpa_bench.py" --backends --seqs "${SEQS:-1024,2048,4096,8192}" 2>&1 | tee "$OUT_DIR/sdpa.txt" || status=1

python3 - "$OUT_DIR/oomfix.txt" "$OUT_DIR/sdpa.txt" "$OUT_DIR/oomfix-mma.txt" <<'PY' | tee "$OUT_DIR/table.md"
import sys
def rows(path, tag):
    out = {}
    for line in open(path):
        f = line.split()
        if len(f) == 6 and f[0] == tag and "-" not in f[3:]:
            out[(f[1], int(f[2]))] = tuple(float(x) for x in f[3:])
    return out
def losses(path, tag):
    out = {}
    for line in open(path):
        f = line.split()
        if len(f) == 4 and f[0] == tag:
            out[(f[1], int(f[2]))] = float(f[3])
    return out
ours, sdpa, fa2 = rows(sys.argv[1], "PERF"), rows(sys.argv[2], "PERF"), rows(sys.argv[2], "PERF-flash")
mma = rows(sys.argv[3], "PERF")
our_loss, sdpa_loss = losses(sys.argv[1], "LOSS"), losses(sys.argv[2], "LOSS")
print("| dtype | b×h×s×d | oomfix fwd ms | SDPA fwd ms | fwd ratio | oomfix fwd+bwd ms | SDPA fwd+bwd ms | fwd+bwd ratio | oomfix fwd+bwd − loss ms | SDPA fwd+bwd − loss ms | ratio without loss | FA2 fwd+bwd ms | ratio to FA2 | oomfix fwd+bwd ms, mma.sync kernels | oomfix peak MiB | SDPA peak MiB |")
print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for key in sorted(set(ours) | set(sdpa), key=lambda k: (k[0] != "bf16", k[1])):
    o, s, f, m = ours.get(key), sdpa.get(key), fa2.get(key), mma.get(key)
    cell = lambda t, i: f"{t[i]:.2f}" if t else "-"
    ratio = lambda a, b, i: f"{a[i] / b[i]:.2f}" if a and b and b[i] > 0 else "-"
    peak = lambda t: f"{t[2]:.0f}" if t else "-"
    # The step less its loss (sum(o * w) and backward, timed alone on each side).
    net_o = (o[1] - our_loss[key],) if o and key in our_loss else None
    net_s = (s[1] - sdpa_loss[key],) if s and key in sdpa_loss else None
    print(f"| {key[0]} | 8×12×{key[1]}×64 | {cell(o, 0)} | {cell(s, 0)} | {ratio(o, s, 0)} | {cell(o, 1)} | {cell(s, 1)} | {ratio(o, s, 1)} | {cell(net_o, 0)} | {cell(net_s, 0)} | {ratio(net_o, net_s, 0)} | {cell(f, 1)} | {ratio(o, f, 1)} | {cell(m, 1)} | {peak(o)} | {peak(s)} |")
print()
print("Loss alone (sum(o · w) and its backward), ms: " + ", ".join(
    f"{k[0]} s={k[1]} oomfix {our_loss[k]:.2f} / PyTorch {sdpa_loss[k]:.2f}"
    for k in sorted(our_loss, key=lambda k: (k[0] != "bf16", k[1])) if k in sdpa_loss))
print()
print("TinyLlama-1.1B attention (4×32/4 heads×2048×64, bf16, causal), fwd / fwd+bwd ms:")
for path, tag, who in [(sys.argv[1], "PERF-gqa", "oomfix"), (sys.argv[3], "PERF-gqa", "oomfix, mma.sync kernels"),
                       (sys.argv[2], "PERF-gqa-repeat", "SDPA, keys repeated"),
                       (sys.argv[2], "PERF-gqa", "SDPA, enable_gqa")]:
    for line in open(path):
        f = line.split()
        if len(f) == 6 and f[0] == tag:
            print(f"- {who}: {f[3]} / {f[4]}")
gqa_loss = [losses(sys.argv[i], "LOSS-gqa").get(("bf16", 2048)) for i in (1, 2)]
if None not in gqa_loss:
    print(f"- loss alone: oomfix {gqa_loss[0]:.3f}, PyTorch {gqa_loss[1]:.3f}")
PY
grep -h "^FAIL\|FAILED" "$OUT_DIR"/oomfix*.txt
exit $status
