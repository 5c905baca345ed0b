#!/usr/bin/env bash
# Per-rank memory of ZeRO stages 1-3 on the CPU, as run: 2 ranks over Open MPI
# (the binary built with `--features mpi`), the built-in GPT-2 small shape, fp32,
# fused AdamW, micro-batch 1 x 4 accumulated, sequence 64, 2 steps; and the
# same global batch on one process (stage 0). Prints, per stage, each rank's
# measured peak (the training summary's rank_peak_bytes) beside the plan's
# estimate. Needs jq.
#
# Usage: scripts/zero-stages.sh [OOMFIX_BINARY]   (default target/release/oomfix)
set -euo pipefail
bin=${1:-target/release/oomfix}
common=(train --device cpu --precision fp32 --optimizer fused-adamw --checkpoint none
        --attention composed --micro-batch 1 --global-batch 8 --seq-len 64 --steps 2
        --budget 16GiB --json)
printf '%-6s %-26s %-12s %s\n' stage "measured peak by rank (MB)" "estimate (MB)" "measured / estimate"
for stage in 0 1 2 3; do
    if [ "$stage" = 0 ]; then
        args=(--grad-accum 8 --zero-stage 0)
    else
        args=(--grad-accum 4 --zero-stage "$stage" --gpus 2)
    fi
    "$bin" "${common[@]}" "${args[@]}" 2>/dev/null | jq -r --arg s "$stage" '.training
        | (.rank_peak_bytes // [.peak_bytes]) as $r
        | [$s, ($r | map(. / 1e6 | floor) | map(tostring) | join(" ")),
           (.estimated_peak_bytes / 1e6 | floor | tostring),
           (($r | max) / .estimated_peak_bytes * 1000 | floor / 1000 | tostring)]
        | "\(.[0])      \(.[1])\t\t   \(.[2])\t\(.[3])"'
done
