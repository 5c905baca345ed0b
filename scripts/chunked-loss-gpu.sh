#!/usr/bin/env bash
# The LM loss in chunks of tokens (`chunked-loss`) on the GPU machine:
#   1. gpu_bench §5: the chunked loss on CUDA against the same op on the CPU
#      (loss and the gradients of the hidden states and the head's weight,
#      f32, bf16, f16) and its forward+backward time against the whole
#      logits, at GPT-2's vocabulary;
#   2. GPT-2 medium (sparse header, random weights) at 8 GiB and 1024
#      tokens, the plan the search finds with the loss in chunks
#      (micro-batch 8 × 1 where the whole logits need 2 × 4), then the same
#      search with `--loss whole` and `--loss chunked` pinned: estimated
#      against measured peaks (`--verify --enforce-budget`), and four real
#      training steps of the chunked plan (`train --verify`).
#
# Build (on the build machine):
#   scripts/build-cuda.sh --features cuda                         # oomfix-cuda.xz
#   scripts/build-cuda.sh --features cuda --example gpu_bench     # gpu_bench-cuda.xz
#   copy both into BIN_DIR (carried to the GPU machine).
# Usage: scripts/chunked-loss-gpu.sh [BIN_DIR] [OUT_DIR]
#   BIN_DIR  holds oomfix-cuda.xz and gpu_bench-cuda.xz (default: .gpu/cuda)
#   OUT_DIR  chunked-loss.txt with every command and its output (default: $OUT)
# Environment: CAP (seconds per command; 150), DEADLINE (seconds after which
#   no command starts; 480).
set -uo pipefail

BIN_DIR=${1:-.gpu/cuda}
OUT_DIR=${2:-${OUT:-chunked-loss-out}}
CAP=${CAP:-150}
DEADLINE=${DEADLINE:-480}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
WORK=${TMPDIR:-/tmp}/chunked-loss
mkdir -p "$OUT_DIR" "$WORK/gpt2-medium"
LOG=$OUT_DIR/chunked-loss.txt
: >"$LOG"
export CUDA_CACHE_PATH=$WORK/nvcache CUDA_CACHE_MAXSIZE=4294967296
unset RUST_BACKTRACE
# shellcheck source=scripts/gpu-log.sh
. "$HERE/gpu-log.sh"
unpack "$BIN_DIR" oomfix gpu_bench
python3 "$HERE/make-sparse-gpt2.py" "$WORK/gpt2-medium/model.safetensors" 24 1024 >&2
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv | tee -a "$LOG"

M=$WORK/gpt2-medium/model.safetensors
V=(--budget 8GiB --verify --enforce-budget --device cuda:0)
logged env SECTIONS=5 "$WORK/gpu_bench"
logged "$WORK/oomfix" "${V[@]}" "$M"
logged "$WORK/oomfix" "${V[@]}" --loss whole "$M"
logged "$WORK/oomfix" "${V[@]}" --loss chunked --micro-batch 8 "$M"
logged "$WORK/oomfix" train --init random "${V[@]}" --steps 4 "$M"
