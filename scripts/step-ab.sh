#!/usr/bin/env bash
# A/B of the training step on the GPU machine: two or more builds of
# `gpu_side_by_side` train the same rows, taking turns (A, B, A, B ...) so
# that clock and thermal drift fall on every side, and a table gives each
# row's median step time and peaks on each side and its time ÷ A's. A change
# to the step is merged when its ratio says it pays (docs/speed.md).
#
# Usage: scripts/step-ab.sh A_DIR B_DIR [C_DIR ...]
#   each DIR holds gpu_side_by_side-cuda.xz (scripts/build-cuda.sh --features
#   cuda --example gpu_side_by_side); the sides are named by their folders
# Output: in $OUT (else /tmp/step-ab), ab.jsonl (one line per run, with its
#   side and round) and ab.md (the table).
# Environment: ROWS (gpu_side_by_side configurations; default the speed
#   guard's four bf16 rows: GPT-2 small 8 x 1024 and TinyLlama-1.1B 4 x 2048,
#   plain and every block checkpointed), ROUNDS (default 2), STEPS (timed
#   steps a run; default 5), CAP (seconds a run may take; default 90).
set -uo pipefail
(($# >= 2)) || { echo "usage: scripts/step-ab.sh A_DIR B_DIR [C_DIR ...]" >&2; exit 2; }
sides=("$@")
out=${OUT:-/tmp/step-ab}
ROWS=${ROWS:-gpt2:8:1024:bf16:0:fused:1:flash tinyllama:4:2048:bf16:0:fused:1:flash gpt2:8:1024:bf16:1:fused:1:flash tinyllama:4:2048:bf16:1:fused:1:flash}
ROUNDS=${ROUNDS:-2}
STEPS=${STEPS:-5}
CAP=${CAP:-90}
mkdir -p "$out" /tmp/step-ab-bin
: >"$out/ab.jsonl"
for i in "${!sides[@]}"; do
    xz -dc "${sides[$i]}/gpu_side_by_side-cuda.xz" >/tmp/step-ab-bin/$i && chmod +x /tmp/step-ab-bin/$i || exit 1
done
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/card.txt"
export NCCL_NVLS_ENABLE=0 CUDA_CACHE_PATH=/tmp/step-ab-jit CUDA_CACHE_MAXSIZE=4294967296
unset RUST_BACKTRACE
# Untimed: the driver's JIT of candle's kernels and NVRTC's, once per build.
for i in "${!sides[@]}"; do
    timeout 150 /tmp/step-ab-bin/$i --steps 1 gpt2:1:128:bf16:1:fused:1:flash >/dev/null 2>&1
done
for ((round = 1; round <= ROUNDS; round++)); do
    for row in $ROWS; do
        for i in "${!sides[@]}"; do
            line=$(timeout "$CAP" /tmp/step-ab-bin/$i --steps "$STEPS" "$row" 2>>"$out/log.txt")
            rc=$?
            [ -n "$line" ] || line="{\"status\": \"exit $rc\"}"
            python3 -c 'import json,sys; r=json.loads(sys.argv[1]); r.update(side=sys.argv[2], round=int(sys.argv[3]), row=sys.argv[4]); print(json.dumps(r))' \
                "$line" "${sides[$i]}" $round "$row" >>"$out/ab.jsonl"
            echo "round $round ${sides[$i]} $row: rc $rc"
        done
    done
done
python3 - "$out/ab.jsonl" "${sides[@]}" <<'PY' | tee "$out/ab.md"
import json, statistics, sys
runs = [json.loads(l) for l in open(sys.argv[1])]
sides = sys.argv[2:]
gib = lambda rs, f: max(r[f] for r in rs) / 2**30
print("| row | side | step ms | ÷ first | GiB used | GiB reserved |")
print("|---|---|---:|---:|---:|---:|")
for row in dict.fromkeys(r["row"] for r in runs):
    first = None
    for side in sides:
        mine = [r for r in runs if r["row"] == row and r["side"] == side]
        ok = [r for r in mine if r.get("status") == "ok"]
        if not ok:
            print(f"| {row} | {side} | " + ", ".join(r.get("status", "?") for r in mine) + " | | | |")
            continue
        ms = statistics.median(r["step_ms"] for r in ok)
        first = first or ms
        print(f"| {row} | {side} | {ms:.1f} | {ms / first:.3f} | "
              f"{gib(ok, 'peak_alloc_bytes'):.2f} | {gib(ok, 'peak_reserved_bytes'):.2f} |")
PY
