#!/usr/bin/env bash
# Repeated trials of GPT-2 medium inside an enforced 8 GiB on the GPU machine:
# `oomfix train --budget 8GiB --verify --enforce-budget --steps 3`, alternating
# sequence lengths 1024 and 512, one line per trial (what the search found,
# how many steps trained, the out-of-memory message if any).
#
# Usage: scripts/gpu-8gib-trials.sh [BIN_DIR] [TRIALS]
#   BIN_DIR  holds oomfix-cuda.xz from scripts/build-cuda.sh (default: .gpu/cuda)
#   TRIALS   rounds of the two lengths (default 4)
# Environment: DEADLINE (seconds after which no trial starts; 100).
set -uo pipefail

BIN_DIR=${1:-.gpu/cuda}
TRIALS=${2:-4}
DEADLINE=${DEADLINE:-100}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
WORK=${TMPDIR:-/tmp}/gpu-8gib-trials
mkdir -p "$WORK/gpt2-medium"
export CUDA_CACHE_PATH=$WORK/nvcache
unset RUST_BACKTRACE
xz -dc "$BIN_DIR/oomfix-cuda.xz" >"$WORK/oomfix" && chmod +x "$WORK/oomfix" ||
    { echo "cannot unpack $BIN_DIR/oomfix-cuda.xz" >&2; exit 1; }
python3 "$HERE/make-sparse-gpt2.py" "$WORK/gpt2-medium/model.safetensors" 24 1024 >/dev/null

for ((i = 1; i <= TRIALS; i++)); do
    for seq in 1024 512; do
        ((SECONDS > DEADLINE)) && exit 0
        out=$(timeout 60 "$WORK/oomfix" train --init random --budget 8GiB --verify --enforce-budget --device cuda:0 \
            --steps 3 --seq-len "$seq" "$WORK/gpt2-medium/model.safetensors" 2>&1)
        rc=$?
        found=$(grep -E 'fits:|nothing fits' <<<"$out" | head -1 | sed 's/^ *//')
        steps=$(grep -cE '^step ' <<<"$out")
        oom=$(grep -iE 'oomfix: .*out of memory' <<<"$out" | head -1 | cut -c1-80)
        echo "trial $i seq $seq rc=$rc $found | $steps steps | $oom"
    done
done
