#!/usr/bin/env bash
# Where a training step's GPU time goes, oomfix beside PyTorch eager and
# torch.compile on the same rows, in one run on the GPU machine.
#
# Usage: scripts/profile-step.sh BIN_DIR [OUT_DIR]
#   BIN_DIR  holds gpu_side_by_side-cuda.xz (scripts/build-cuda.sh --features
#            cuda --example gpu_side_by_side)
#   OUT_DIR  results (default: $OUT, else profile-out): ncu-ROW.csv,
#            torch-ROW-{eager,compile}.json, oomfix.jsonl, log.txt, profile.md
# Environment: ROWS (default "gpt2 tinyllama": GPT-2 small 8 x 1024 and
#   TinyLlama-1.1B 4 x 2048, bf16, flash attention / SDPA, fused AdamW).
#
# For each row: oomfix's step time without a profiler (median of 10 after a
# warm-up), then Nsight Compute's per-kernel device time of a warm-up and two
# more steps (`ncu --clock-control none --metrics gpu__time_duration.sum`;
# ncu runs kernels one at a time, so each kernel's time is its own), then
# one PyTorch step of each side under torch.profiler (scripts/torch_profile.py).
# scripts/profile-summary.py prints launches per step, the kernels' summed
# time, the wall time and the time between kernels, the time by kind of
# kernel and the ten most expensive kernels, per side (profile.md).
set -uo pipefail
BIN_DIR=${1:?usage: profile-step.sh BIN_DIR [OUT_DIR]}
OUT_DIR=${2:-${OUT:-profile-out}}
ROWS=${ROWS:-gpt2 tinyllama}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
mkdir -p "$OUT_DIR"
export CUDA_CACHE_PATH=/tmp/nvcache CUDA_CACHE_MAXSIZE=4294967296 PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "profile-step.sh: ncu (Nsight Compute) is not installed" >&2; exit 2; }
BIN=/tmp/gpu_side_by_side
xz -dc "$BIN_DIR/gpu_side_by_side-cuda.xz" >"$BIN" && chmod +x "$BIN" || exit 2
LOG=$OUT_DIR/log.txt
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT_DIR/gpu.txt"
: >"$OUT_DIR/profile.md"
for row in $ROWS; do
    case $row in
        gpt2) ours=gpt2:8:1024:bf16:0:fused:1:flash torch=gpt2:8:1024:bf16:0:sdpa ;;
        tinyllama) ours=tinyllama:4:2048:bf16:0:fused:1:flash torch=tinyllama:4:2048:bf16:0:sdpa ;;
        *) echo "profile-step.sh: unknown row $row (gpt2, tinyllama)" >&2; exit 2 ;;
    esac
    echo "[$SECONDS s] $row" | tee -a "$LOG"
    timeout 120 "$BIN" --steps 10 "$ours" >>"$OUT_DIR/oomfix.jsonl" 2>>"$LOG"
    ms=$(tail -1 "$OUT_DIR/oomfix.jsonl" | python3 -c 'import json,sys; print(json.load(sys.stdin)["step_ms"])')
    timeout 300 "$NCU" --clock-control none --metrics gpu__time_duration.sum --csv --page raw \
        --log-file "$OUT_DIR/ncu-$row.csv" "$BIN" --steps 2 "$ours" >>"$LOG" 2>&1
    timeout 120 python3 "$HERE/torch_profile.py" "$OUT_DIR/torch-$row-eager.json" "$torch" >>"$LOG" 2>&1
    timeout 300 python3 "$HERE/torch_profile.py" "$OUT_DIR/torch-$row-compile.json" "$torch:fused:compile" >>"$LOG" 2>&1
    python3 "$HERE/profile-summary.py" "$OUT_DIR/ncu-$row.csv" "$ms" \
        "$OUT_DIR/torch-$row-eager.json" "$OUT_DIR/torch-$row-compile.json" | tee -a "$OUT_DIR/profile.md"
done
