#!/usr/bin/env bash
# The longest sequence that fits, planned and then trained, on the GPU
# machine: Llama-3.1-8B's shape (random weights, made here by
# scripts/make-hub-shape.py as a header over a sparse data region), QLoRA r 32
# on every linear projection of the blocks, NF4 base, batch 1, under each
# budget enforced (`--enforce-budget`: the pool refuses to grow past it), with
# `--seq-len longest`. Each run's JSON (the plan, the length, the estimate and
# the measured peak) and its JSON log (one line per step, with its seconds)
# are kept; a table is printed last (scripts/long-context-table.py).
#
# Usage: scripts/long-context-gpu.sh CARRY   (CARRY holds oomfix-cuda.xz from
#   scripts/build-cuda.sh; writes into $OUT, else /tmp/long-context)
# Environment: BUDGETS (default "8GiB 24GiB"), STEPS (optimizer steps per
#   run, the first one a warm-up; default 3), CAP (seconds one run may take;
#   default 240).
set -uo pipefail
carry=${1:?carry folder}
out=${OUT:-/tmp/long-context}
BUDGETS=${BUDGETS:-8GiB 24GiB}
STEPS=${STEPS:-3}
CAP=${CAP:-240}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
mkdir -p "$out"
xz -dc "$carry/oomfix-cuda.xz" >/tmp/oomfix && chmod +x /tmp/oomfix
python3 "$here/make-hub-shape.py" llama-3.1-8b /tmp/l31 || exit 3
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/card.txt"
export NCCL_NVLS_ENABLE=0
for budget in $BUDGETS; do
    echo "== $budget"
    start=$(date +%s)
    timeout "$CAP" /tmp/oomfix train /tmp/l31 --init random --device cuda:0 \
        --budget "$budget" --enforce-budget --lora 32 --base-precision nf4 \
        --global-batch 1 --seq-len longest --steps "$STEPS" --json --log-format json \
        >"$out/$budget.json" 2>"$out/$budget.log"
    rc=$?
    echo "{\"budget\": \"$budget\", \"exit\": $rc, \"wall_seconds\": $(($(date +%s) - start))}" \
        >"$out/$budget.run"
    echo "exit $rc"
    tail -n 3 "$out/$budget.log" | cut -c1-400
done
python3 "$here/long-context-table.py" "$out" $BUDGETS | tee "$out/table.md"
