#!/usr/bin/env bash
# `oomfix --budget 8GiB --verify --enforce-budget` on the GPU machine: four
# real training steps of the plan found and measured (`train --verify`) for
# TinyLlama-1.1B (sparse headers written here; its optimizer step's time is
# logged), then plans for GPT-2 medium, GPT-2 medium at sequence length 512 and
# the built-in GPT-2 small, and four training steps of the plans for GPT-2 small
# and GPT-2 medium at 1024 and 512, all with only 8 GiB of the device usable.
#
# Usage: scripts/gpu-8gib.sh [BIN_DIR] [OUT_DIR]
#   BIN_DIR  holds oomfix-cuda.xz from scripts/build-cuda.sh (default: .gpu/cuda)
#   OUT_DIR  cli.txt with every command and its output (default: $OUT, else gpu-8gib-out)
# Environment: CAP (seconds per command; 120), DEADLINE (seconds after which no
#   command starts; 400).
set -uo pipefail

BIN_DIR=${1:-.gpu/cuda}
OUT_DIR=${2:-${OUT:-gpu-8gib-out}}
CAP=${CAP:-120}
DEADLINE=${DEADLINE:-400}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
WORK=${TMPDIR:-/tmp}/gpu-8gib
mkdir -p "$OUT_DIR" "$WORK/gpt2-medium" "$WORK/tinyllama"
LOG=$OUT_DIR/cli.txt
: >"$LOG"
export CUDA_CACHE_PATH=$WORK/nvcache CUDA_CACHE_MAXSIZE=4294967296
unset RUST_BACKTRACE
# shellcheck source=scripts/gpu-log.sh
. "$HERE/gpu-log.sh"
unpack "$BIN_DIR" oomfix
python3 "$HERE/make-sparse-gpt2.py" "$WORK/gpt2-medium/model.safetensors" 24 1024 >&2
python3 "$HERE/make-sparse-llama.py" "$WORK/tinyllama/model.safetensors" 22 2048 32 4 5632 32000 >&2
echo '{"num_attention_heads": 32, "num_key_value_heads": 4, "max_position_embeddings": 2048}' >"$WORK/tinyllama/config.json"

# Runs `oomfix ARGS...` into cli.txt.
run() { logged "$WORK/oomfix" "$@"; }

V=(--budget 8GiB --verify --enforce-budget --device cuda:0)
# `train --verify`: the plan trained is one whose measured step fitted.
T=(train --init random --budget 8GiB --verify --enforce-budget --device cuda:0 --steps 4)
RUST_LOG=oomfix::train::trainer=debug run "${T[@]}" "$WORK/tinyllama/model.safetensors"
run "${V[@]}" "$WORK/gpt2-medium/model.safetensors"
run "${V[@]}" --seq-len 512 "$WORK/gpt2-medium/model.safetensors"
run "${V[@]}"
run "${T[@]}"
run "${T[@]}" "$WORK/gpt2-medium/model.safetensors"
run "${T[@]}" --seq-len 512 "$WORK/gpt2-medium/model.safetensors"
