#!/usr/bin/env bash
# The long-context fixes leave training unchanged: SmolLM2-135M's shape
# (random weights, scripts/make-hub-shape.py), fp32, 4 x 1024 tokens a step,
# every block checkpointed, STEPS optimizer steps on the same synthetic data,
# three times: as planned with the blocks' inputs on the device and the MLP
# whole; with the MLP in tiles of 256 tokens (tiled-mlp); and with the inputs
# in host memory as well (offload-activations). Prints each run's losses at a
# few steps and the largest relative difference from the first run's.
#
# Usage: scripts/fix-losses-gpu.sh CARRY   (CARRY holds oomfix-cuda.xz from
#   scripts/build-cuda.sh; writes into $OUT, else /tmp/fix-losses)
# Environment: STEPS (default 300), CAP (seconds a run may take; default 150).
set -uo pipefail
carry=${1:?carry folder}
out=${OUT:-/tmp/fix-losses}
STEPS=${STEPS:-300}
CAP=${CAP:-150}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
mkdir -p "$out"
xz -dc "$carry/oomfix-cuda.xz" >/tmp/oomfix && chmod +x /tmp/oomfix
python3 "$here/make-hub-shape.py" smollm2-135m /tmp/smol >/dev/null || exit 3
export NCCL_NVLS_ENABLE=0 CUDA_CACHE_PATH=${CUDA_CACHE_PATH:-/tmp/oomfix-jit}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/card.txt"
run() {
    local name=$1
    shift
    timeout "$CAP" /tmp/oomfix train /tmp/smol --init random --device cuda:0 --budget 60GiB \
        --precision fp32 --global-batch 4 --micro-batch 4 --seq-len 1024 --checkpoint every \
        --steps "$STEPS" --log-format json "$@" >"$out/$name.json" 2>"$out/$name.log"
    echo "$name: exit $?"
}
run kept --mlp-tile none --activations device
run tiled --mlp-tile 256 --activations device
run tiled-host --mlp-tile 256 --activations host
python3 - "$out" "$STEPS" <<'PY'
import json, os, sys
out, steps = sys.argv[1], int(sys.argv[2])
def losses(name):
    found = []
    for line in open(os.path.join(out, name + ".log")):
        try:
            e = json.loads(line)
        except json.JSONDecodeError:
            continue
        f = e.get("fields", {})
        if f.get("message") == "step" and "loss" in f:
            found.append(float(f["loss"]))
    return found
runs = {n: losses(n) for n in ("kept", "tiled", "tiled-host")}
base = runs["kept"]
marks = sorted({0, 9, 99, steps // 2, steps - 1})
for name, ls in runs.items():
    shown = ", ".join(f"{i + 1}: {ls[i]:.5f}" for i in marks if i < len(ls))
    diff = max((abs(a - b) / abs(b) for a, b in zip(ls, base)), default=float("nan"))
    print(f"{name:>10}: {len(ls)} steps; {shown}; largest relative difference from kept {diff:.2e}")
PY
