#!/usr/bin/env bash
# Device memory NCCL's communicator takes per rank: what lies outside the
# CUDA pool for one process against each rank of a 2-rank job, on the same
# plan's steps (`plan --verify`, whose measurements log "device memory outside
# the pool"), for each number of NCCL channels asked for (NCCL_MIN_CTAS =
# NCCL_MAX_CTAS). Prints one row per run; the difference from one process is
# NCCL's part (its channels' buffers, work queues, proxy state).
#
# Usage: scripts/comm-memory.sh [OOMFIX_BINARY] [CHANNELS...]
#   (default binary target-cuda/release/oomfix, channels 2 4 8). Two ranks on
#   one GPU need NCCL 2.30 or newer and NCCL_MULTI_RANK_GPU_ENABLE=1.
set -euo pipefail
bin=${1:-target-cuda/release/oomfix}
shift $(($# > 0 ? 1 : 0))
[ $# -gt 0 ] && channels=("$@") || channels=(2 4 8)
plan=(plan --device cuda --budget 60GiB --precision bf16 --attention flash --checkpoint none
      --optimizer fused-adamw --micro-batch 8 --global-batch 16 --seq-len 1024 --verify)
dir=$(mktemp -d)
run() { # label, then the arguments; prints "label pool-used outside"
    local label=$1 log=$dir/$1.log
    shift
    # RUST_LOG=info: the measuring ranks log their records at info level.
    if ! RUST_LOG=info timeout 300 "$bin" "${plan[@]}" "$@" >/dev/null 2>"$log"; then
        echo "$label failed:" >&2; tail -5 "$log" >&2; return
    fi
    python3 - "$label" "$log" <<'PY'
import re, sys
label, log = sys.argv[1:]
rows = [(int(u), int(o)) for u, o in re.findall(
    r'pool_used_peak\W+(\d+).*?outside_pool_bytes\W+(\d+)', open(log).read())]
used, outside = max(rows) if rows else (0, 0)
print(f"{label:<24} {used / 2**20:>12.0f} {outside / 2**20:>14.0f}")
PY
}
printf '%-24s %12s %14s\n' run "pool used MiB" "outside MiB"
run "1 process" --gpus 1 --zero-stage 0 --grad-accum 2
for c in "${channels[@]}"; do
    NCCL_MIN_CTAS=$c NCCL_MAX_CTAS=$c run "2 ranks, $c channels" --gpus 2 --zero-stage 2 --grad-accum 1
done
rm -rf "$dir"
