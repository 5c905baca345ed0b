#!/usr/bin/env bash
# Where the CUDA attention's time goes, on the GPU machine, with Nsight
# Compute (ncu, clocks left alone):
#   kernels.txt   every kernel of the bf16 timings of examples/gpu_attention
#                 (forward, forward+backward and the loss alone) with its
#                 duration (ncu --print-summary per-kernel), so that the
#                 attention kernels can be told from the loss and candle's own
#                 ops in a forward+backward step;
#   KERNEL.txt    for each warpgroup kernel (flash_fwd_wgmma, flash_bwd_wgmma),
#                 one launch at s = SEQ: speed of light, occupancy, scheduler
#                 and warp-state (stall reason) sections;
#   KERNEL-sass.csv  the same launch's per-instruction stall samples
#                 (ncu --page source, SASS).
#
# Usage: scripts/profile-attention-gpu.sh BIN_DIR OUT_DIR
#   BIN_DIR  holds gpu_attention-cuda.xz from
#            `scripts/build-cuda.sh --features cuda --example gpu_attention`
# Environment: SEQ (4096), OOMFIX_FLASH_SOURCE (a kernel variant, as in
# flash-variants.sh).
set -uo pipefail

BIN_DIR=$1 OUT_DIR=$2
mkdir -p "$OUT_DIR"
WORK=${TMPDIR:-/tmp}/attention-profile
mkdir -p "$WORK"
export CUDA_CACHE_PATH=$WORK/nvcache PERF_DTYPES=bf16
unset RUST_BACKTRACE
xz -dc "$BIN_DIR/gpu_attention-cuda.xz" >"$WORK/gpu_attention" && chmod +x "$WORK/gpu_attention" ||
    { echo "cannot unpack $BIN_DIR/gpu_attention-cuda.xz" >&2; exit 1; }
SEQ=${SEQ:-4096}
# Launches of each kernel before the first one at s = SEQ: 14 per length for
# the backward (3 warm-up, 10 timed, 1 for the peak), 27 for the forward
# (13 forward-only steps besides).
index=$(( $(tr ',' '\n' <<<"1024,2048,4096,8192" | grep -n "^$SEQ$" | cut -d: -f1) - 1 ))
[ "$index" -ge 0 ] || { echo "SEQ must be one of 1024 2048 4096 8192" >&2; exit 2; }

status=0
ncu --clock-control none --metrics gpu__time_duration.sum --print-summary per-kernel \
    "$WORK/gpu_attention" --perf-only >"$OUT_DIR/kernels.txt" 2>&1 || status=1
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
exit $status
