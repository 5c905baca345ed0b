#!/usr/bin/env bash
# The `offload-activations` fix on the GPU machine, on Llama-3.1-8B's shape
# (random weights; scripts/make-hub-shape.py) under QLoRA r 32 with an NF4
# base, batch 1, every block checkpointed:
#   1. `--seq-len longest` under BUDGET enforced (the planner's longest,
#      which takes the fix), trained STEPS steps;
#   2. at SEQ tokens, unenforced, the same plan with the blocks' inputs on
#      the device (`--activations device`) and on the host
#      (`--activations host`), STEPS steps each from the same seed: the
#      pool's used peak, the steady step and the losses side by side (the
#      same values are expected: the recompute starts from the same inputs).
# Each run's JSON result and JSON log land in $OUT (else
# /tmp/offload-activations); a table is printed last.
#
# Usage: scripts/offload-activations-gpu.sh CARRY   (CARRY holds
#   oomfix-cuda.xz from scripts/build-cuda.sh)
# Environment: BUDGET (default 24GiB), SEQ (default 25129), STEPS (default
#   3), CAP (seconds one run may take; default 150), LONGEST (0: skip run 1;
#   default 1).
set -uo pipefail
carry=${1:?carry folder}
out=${OUT:-/tmp/offload-activations}
BUDGET=${BUDGET:-24GiB}
SEQ=${SEQ:-25129}
STEPS=${STEPS:-3}
CAP=${CAP:-150}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
mkdir -p "$out"
xz -dc "$carry/oomfix-cuda.xz" >/tmp/oomfix && chmod +x /tmp/oomfix
python3 "$here/make-hub-shape.py" llama-3.1-8b /tmp/l31 >/dev/null || exit 3
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
# One driver JIT cache for the three processes (and for long-context-gpu.sh's
# in the same call): only the first run compiles the kernels, in its first step.
export NCCL_NVLS_ENABLE=0 CUDA_CACHE_PATH=${CUDA_CACHE_PATH:-/tmp/oomfix-jit} CUDA_CACHE_MAXSIZE=4294967296
common=(train /tmp/l31 --init random --device cuda:0 --lora 32 --base-precision nf4
    --global-batch 1 --steps "$STEPS" --json --log-format json)

run() {
    local name=$1
    shift
    timeout "$CAP" /tmp/oomfix "${common[@]}" "$@" >"$out/$name.json" 2>"$out/$name.log"
    echo "$name: exit $?"
}
[ "${LONGEST:-1}" = 0 ] || run longest --budget "$BUDGET" --enforce-budget --seq-len longest
pinned=(--budget "$BUDGET" --seq-len "$SEQ" --precision bf16 --checkpoint every
    --attention flash --loss chunked --optimizer cpu-adamw)
run device "${pinned[@]}" --activations device
run host "${pinned[@]}" --activations host

python3 - "$out" <<'EOF'
import json, statistics, sys
out = sys.argv[1]
print("| run | tokens | plan | estimated tensors GiB | measured used GiB | error | host GiB | steady step s | modelled s | losses |")
print("|---|---:|---|---:|---:|---:|---:|---:|---:|---|")
for name in ("longest", "device", "host"):
    try:
        r = json.load(open(f"{out}/{name}.json"))
    except (OSError, json.JSONDecodeError):
        print(f"| {name} | - | no result | | | | | | | |")
        continue
    steps = []
    for line in open(f"{out}/{name}.log"):
        try:
            f = json.loads(line).get("fields", {})
        except json.JSONDecodeError:
            continue
        if f.get("message") == "step":
            steps.append(f)
    e, p = r["estimate"], r["plan"]
    est = e["peak_bytes"] - e["runtime_bytes"] - e["pool_slack_bytes"]
    meas = max((s["forward_backward_peak_bytes"] for s in steps), default=0)
    err = f"{100 * (est / meas - 1):+.1f}%" if meas else "-"
    steady = statistics.median(s["seconds"] for s in steps[1:]) if len(steps) > 1 else None
    where = "host" if p.get("offload_activations") else "device"
    losses = " ".join(f"{s['loss']:.6f}" for s in steps)
    print(f"| {name} | {p['seq_len']:,} | inputs on the {where}, {p['optimizer']} | {est / 2**30:.2f} | "
          f"{meas / 2**30:.2f} | {err} | {e['host_bytes'] / 2**30:.2f} | "
          f"{steady if steady is None else f'{steady:.2f}'} | {r['estimated_step_seconds']:.2f} | {losses} |")
EOF
