#!/usr/bin/env bash
# The GPU rows of docs/accuracy-families.md: `--verify` on header-only
# checkpoints of Hub models (scripts/make-hub-shape.py: transformers' own
# tensor lists, random weights, synthetic tokens), one plan each, the
# estimate beside the measured peak and the modelled step time beside the
# measured one.
#
# Usage: scripts/gpu-families.sh BIN OUT_DIR [MODEL...]
#   BIN      the oomfix binary built by scripts/build-cuda.sh
#   OUT_DIR  each model's table and log, and summary.txt
#   MODEL    shapes of make-hub-shape.py (default: qwen3-0.6b llama-3.2-1b
#            gemma-3-1b gemma-2-2b)
# Environment: SECONDS_EACH (the time limit of each run; 150).
#
# Plan: 1024 tokens, global batch 8 in micro-batches of 2 (1 for Gemma 2
# 2B, whose 2 do not fit 70 GiB), bf16, fused AdamW, no checkpointing;
# flash attention pinned where the family has it (Gemma has not: composed).
set -uo pipefail
BIN=$1 OUT_DIR=$2
shift 2
MODELS=${*:-qwen3-0.6b llama-3.2-1b gemma-3-1b gemma-2-2b}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
WORK=${TMPDIR:-/tmp}/gpu-families
mkdir -p "$OUT_DIR" "$WORK"
SUM=$OUT_DIR/summary.txt
export NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$SUM"
for m in $MODELS; do
    python3 "$HERE/make-hub-shape.py" "$m" "$WORK/$m" | tee -a "$SUM"
    case $m in
    gemma-2-*) plan=(--micro-batch 1) ;;
    *) plan=(--micro-batch 2) ;;
    esac
    case $m in
    gemma-*) ;;
    *) plan+=(--attention flash) ;;
    esac
    start=$SECONDS
    timeout "${SECONDS_EACH:-150}" "$BIN" --device cuda:0 --budget 70GiB --seq-len 1024 \
        --global-batch 8 --precision bf16 --optimizer fused-adamw --checkpoint none \
        "${plan[@]}" --verify "$WORK/$m" >"$OUT_DIR/$m.txt" 2>"$OUT_DIR/$m.log"
    echo "== $m: exit $? after $((SECONDS - start)) s" | tee -a "$SUM"
    grep -E "^ +[0-9]+ |^plan|^estimated|^measured" "$OUT_DIR/$m.txt" | tee -a "$SUM"
done
