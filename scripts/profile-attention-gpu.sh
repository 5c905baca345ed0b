#!/usr/bin/env bash
# Where the CUDA attention's time goes, on the GPU machine, with Nsight
# Compute (ncu, clocks left alone). Parts (PARTS, default all three):
#   kernels   kernels.txt: every kernel of the bf16 timings of
#             examples/gpu_attention (forward, forward+backward and the loss
#             alone) with its duration (ncu --print-summary per-kernel);
#   launches  KERNEL.txt: for each warpgroup kernel (flash_fwd_wgmma,
#             flash_bwd_wgmma), one launch at s = SEQ: speed of light,
#             occupancy, scheduler and warp-state (stall reason) sections;
#             KERNEL-sass.csv: the same launch's per-instruction stall samples
#             (ncu --page source, SASS);
#   compare   compare.md: the attention kernels' time per forward+backward
#             step, oomfix against PyTorch's SDPA (scripts/sdpa_bench.py), at
#             each length of SEQS, bf16: the sum over the kernels of each side
#             that are not the loss's or setup's (every kernel is listed with
#             its share in compare-kernels.txt), from per-kernel summaries of
#             the same timing protocol on both sides.
#
# Usage: scripts/profile-attention-gpu.sh BIN_DIR OUT_DIR
#   BIN_DIR  holds gpu_attention-cuda.xz from
#            `scripts/build-cuda.sh --features cuda --example gpu_attention`
# Environment: PARTS (kernels,launches,compare), SEQ (4096), SEQS
# (1024,2048,4096,8192), OOMFIX_FLASH_SOURCE (a kernel variant, as in
# flash-variants.sh).
set -uo pipefail

BIN_DIR=$1 OUT_DIR=$2
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
mkdir -p "$OUT_DIR"
WORK=${TMPDIR:-/tmp}/attention-profile
mkdir -p "$WORK"
export CUDA_CACHE_PATH=$WORK/nvcache PERF_DTYPES=bf16
unset RUST_BACKTRACE
xz -dc "$BIN_DIR/gpu_attention-cuda.xz" >"$WORK/gpu_attention" && chmod +x "$WORK/gpu_attention" ||
    { echo "cannot unpack $BIN_DIR/gpu_attention-cuda.xz" >&2; exit 1; }
PARTS=${PARTS:-kernels,launches,compare}
SEQ=${SEQ:-4096}
SEQS=${SEQS:-1024,2048,4096,8192}
part() { [[ ",$PARTS," == *",$1,"* ]]; }
summary() { ncu --clock-control none --metrics gpu__time_duration.sum --print-summary per-kernel "$@"; }

status=0
if part kernels; then
    summary "$WORK/gpu_attention" --perf-only >"$OUT_DIR/kernels.txt" 2>&1 || status=1
fi

if part launches; then
    # Launches of each kernel before the first one at s = SEQ: 14 per length
    # for the backward (3 warm-up, 10 timed, 1 for the peak), 27 for the
    # forward (13 forward-only steps besides).
    index=$(( $(tr ',' '\n' <<<"1024,2048,4096,8192" | grep -n "^$SEQ$" | cut -d: -f1) - 1 ))
    [ "$index" -ge 0 ] || { echo "SEQ must be one of 1024 2048 4096 8192" >&2; exit 2; }
    for kernel in flash_fwd_wgmma flash_bwd_wgmma; do
        per=14
        [ $kernel = flash_fwd_wgmma ] && per=27
        ncu --clock-control none -k "regex:$kernel" --launch-skip $((index * per + 3)) --launch-count 1 \
            --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats \
            --section WarpStateStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
            --section SourceCounters --import-source no -f -o "$WORK/$kernel" \
            "$WORK/gpu_attention" --perf-only >"$WORK/$kernel.log" 2>&1 || { status=1; tail -5 "$WORK/$kernel.log"; }
        ncu --import "$WORK/$kernel.ncu-rep" --page details >"$OUT_DIR/$kernel.txt" 2>&1 || status=1
        ncu --import "$WORK/$kernel.ncu-rep" --page source --csv --print-source sass \
            >"$OUT_DIR/$kernel-sass.csv" 2>&1 || status=1
    done
fi

if part compare; then
    for s in ${SEQS//,/ }; do
        PERF_SEQS=$s summary "$WORK/gpu_attention" --perf-only >"$OUT_DIR/oomfix-$s.txt" 2>&1 || status=1
        summary python3 "$HERE/sdpa_bench.py" --seqs "$s" --dtypes bf16 --no-gqa >"$OUT_DIR/sdpa-$s.txt" 2>&1 ||
            status=1
    done
    # Both programs time 13 forwards, 13 + 1 forward+backward steps and 13
    # losses alone: a forward kernel runs 27 times (or a multiple), a backward
    # one 14; setup kernels (random inputs, casts) fewer. The loss's kernels
    # (products, sums, fills, copies: 14 + 13 runs) are left out by name.
    python3 - "$OUT_DIR" "$SEQS" <<'PY' >"$OUT_DIR/compare.md" 2>"$OUT_DIR/compare-kernels.txt"
import re, sys
out, seqs = sys.argv[1], sys.argv[2].split(",")
def kernels(path):
    found, name = [], None
    for line in open(path):
        m = re.match(r"  (.+?) \(([\d, ]+)\)x\(([\d, ]+)\), .*Invocations (\d+)", line)
        if m:
            name = (m.group(1), m.group(2), int(m.group(4)))
        elif name and "gpu__time_duration.sum" in line:
            f = line.split()
            avg = float(f[-1].replace(",", "")) * {"ns": 1e-6, "us": 1e-3, "ms": 1.0}[f[1]]
            found.append((*name, avg))
            name = None
    return found
def per_step(found, is_attention, side, s):
    total = 0.0
    for name, grid, inv, avg in found:
        runs = inv // 27 if inv % 27 == 0 else inv // 14 if inv % 14 == 0 else 0
        counted = runs if is_attention(name) else 0
        total += counted * avg
        print(f"{side} s={s}: {name[:90]} ({grid}) x{inv}, {avg:.4f} ms, counted {counted} per step", file=sys.stderr)
    return total
loss_or_setup = re.compile(r"elementwise|reduce_kernel|distribution|fill|copy|Fill|Copy")
print("| s | oomfix attention kernels ms/step | SDPA attention kernels ms/step | ratio |")
print("|---:|---:|---:|---:|")
for s in seqs:
    ours = per_step(kernels(f"{out}/oomfix-{s}.txt"), lambda n: n.startswith("flash_"), "oomfix", s)
    sdpa = per_step(kernels(f"{out}/sdpa-{s}.txt"), lambda n: not loss_or_setup.search(n), "sdpa", s)
    ratio = f"{ours / sdpa:.2f}" if sdpa > 0 else "-"
    print(f"| {s} | {ours:.3f} | {sdpa:.3f} | {ratio} |")
PY
    cat "$OUT_DIR/compare.md"
fi
exit $status
