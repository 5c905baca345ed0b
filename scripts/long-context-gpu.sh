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
# With PEFT_SEQS set, PyTorch + PEFT + bitsandbytes NF4 (scripts/peft-step.py:
# r 32 on every linear projection, gradient checkpointing, SDPA) then trains
# the same shape at each of those lengths (shortest first, 2 steps each, one
# process), its peak allocated and reserved bytes kept per length
# (peft.jsonl) and printed beside the table.
#
# With FULL set to a budget, Llama-3.2-1B's shape is then trained in full
# (no LoRA) at its longest under that budget, enforced (full-1b.json/.log).
#
# Usage: scripts/long-context-gpu.sh CARRY   (CARRY holds oomfix-cuda.xz from
#   scripts/build-cuda.sh, and py/ with peft and bitsandbytes for PEFT_SEQS;
#   writes into $OUT, else /tmp/long-context)
# Environment: BUDGETS (default "8GiB 24GiB"; empty: none), STEPS (optimizer steps per
#   run, the first one a warm-up; default 3), CAP (seconds one run may take;
#   default 240), PEFT_SEQS (default: none), PEFT_CAP (seconds; default 240),
#   FULL (a budget; default: none), SNAPSHOT (1: each budget's run also
#   writes a memory snapshot of its first step, $budget.pickle, for
#   pytorch.org/memory_viz, and logs the CUDA pool's used and reserved bytes
#   after each phase of a step, which an enforced budget limits).
set -uo pipefail
carry=${1:?carry folder}
out=${OUT:-/tmp/long-context}
BUDGETS=${BUDGETS-8GiB 24GiB}
STEPS=${STEPS:-3}
CAP=${CAP:-240}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
mkdir -p "$out"
xz -dc "$carry/oomfix-cuda.xz" >/tmp/oomfix && chmod +x /tmp/oomfix
python3 "$here/make-hub-shape.py" llama-3.1-8b /tmp/l31 || exit 3
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/card.txt"
export NCCL_NVLS_ENABLE=0
# One JIT cache for the runs: the kernels are compiled by the first one only.
export CUDA_CACHE_PATH=${CUDA_CACHE_PATH:-/tmp/oomfix-jit}
for budget in $BUDGETS; do
    echo "== $budget"
    start=$(date +%s)
    snapshot=()
    [ "${SNAPSHOT:-0}" = 1 ] && snapshot=(--snapshot "$out/$budget.pickle" --snapshot-steps 1) &&
        export RUST_LOG=info,oomfix::track::cuda=debug
    timeout "$CAP" /tmp/oomfix train /tmp/l31 --init random --device cuda:0 \
        --budget "$budget" --enforce-budget --lora 32 --base-precision nf4 \
        --global-batch 1 --seq-len longest --steps "$STEPS" --json --log-format json "${snapshot[@]}" \
        >"$out/$budget.json" 2>"$out/$budget.log"
    rc=$?
    echo "{\"budget\": \"$budget\", \"exit\": $rc, \"wall_seconds\": $(($(date +%s) - start))}" \
        >"$out/$budget.run"
    echo "exit $rc"
    tail -n 3 "$out/$budget.log" | cut -c1-400
done
python3 "$here/long-context-table.py" "$out" $BUDGETS | tee "$out/table.md"
if [ -n "${FULL:-}" ]; then
    echo "== Llama-3.2-1B in full at $FULL"
    python3 "$here/make-hub-shape.py" llama-3.2-1b /tmp/l32 >/dev/null || exit 3
    timeout "$CAP" /tmp/oomfix train /tmp/l32 --init random --device cuda:0 \
        --budget "$FULL" --enforce-budget --global-batch 1 --seq-len longest --steps "$STEPS" \
        --json --log-format json >"$out/full-1b.json" 2>"$out/full-1b.log"
    echo "exit $?"
    python3 - "$out" <<'PY'
import json, os, sys
out = sys.argv[1]
r = json.load(open(os.path.join(out, "full-1b.json")))
plan, est = r.get("plan", {}), r.get("estimate", {})
steps = [json.loads(l)["fields"] for l in open(os.path.join(out, "full-1b.log"))
         if '"message":"step"' in l]
print(f"longest {plan.get('seq_len')}, plan {plan}, estimated peak {est.get('peak_bytes', 0) / 2**30:.2f} GiB")
for s in steps:
    print(f"step {s['step']}: {s['seconds']:.2f} s, loss {s['loss']:.4f}, "
          f"used {s['forward_backward_peak_bytes'] / 2**30:.2f} GiB")
PY
fi
if [ -n "${PEFT_SEQS:-}" ]; then
    echo "== PyTorch + PEFT + bitsandbytes NF4 at $PEFT_SEQS"
    PYTHONPATH="$carry/py" timeout "${PEFT_CAP:-240}" python3 "$here/peft-step.py" /tmp/l31/config.json \
        --rank 32 --base nf4 --micro 1 --accum 1 --steps 2 --seq $PEFT_SEQS >"$out/peft.jsonl" 2>"$out/peft.log"
    echo "exit $?"
    python3 - "$out/peft.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r.get("oom"):
        print(f"{r['seq']:>7,} tokens: out of the card's memory ({r['card']})")
        continue
    gib = lambda n: n / 2**30
    print(f"{r['seq']:>7,} tokens: peak allocated {gib(r['peak_allocated']):.2f} GiB, "
          f"reserved {gib(r['peak_reserved']):.2f} GiB, steps {', '.join(f'{t:.2f}' for t in r['step_seconds'])} s "
          f"({r['card']}, torch {r['torch']}, peft {r['peft']})")
PY
fi
