#!/usr/bin/env bash
# A/B of the training step on the GPU machine: two builds of
# `gpu_side_by_side` train the same rows, alternating A, B, A, B ... so that
# clock and thermal drift fall on both sides, and a table gives each row's
# median step time and peaks on both sides and B ÷ A. A change to the step is
# merged when B ÷ A says it pays (docs/speed.md).
#
# Usage: scripts/step-ab.sh A_DIR B_DIR [OUT_DIR]
#   A_DIR, B_DIR  each holds gpu_side_by_side-cuda.xz (scripts/build-cuda.sh
#                 --features cuda --example gpu_side_by_side)
#   OUT_DIR       ab.jsonl (one line per run, with its side and round) and
#                 ab.md (the table); default $OUT, else /tmp/step-ab
# Environment: ROWS (gpu_side_by_side configurations; default the speed
#   guard's four bf16 rows: GPT-2 small 8 x 1024 and TinyLlama-1.1B 4 x 2048,
#   plain and every block checkpointed), ROUNDS (default 2), STEPS (timed
#   steps a run; default 5), CAP (seconds a run may take; default 90).
set -uo pipefail
a_dir=${1:?A folder}
b_dir=${2:?B folder}
out=${3:-${OUT:-/tmp/step-ab}}
ROWS=${ROWS:-gpt2:8:1024:bf16:0:fused:1:flash tinyllama:4:2048:bf16:0:fused:1:flash gpt2:8:1024:bf16:1:fused:1:flash tinyllama:4:2048:bf16:1:fused:1:flash}
ROUNDS=${ROUNDS:-2}
STEPS=${STEPS:-5}
CAP=${CAP:-90}
mkdir -p "$out" /tmp/step-ab-bin
: >"$out/ab.jsonl"
for side in a b; do
    dir=$a_dir
    [ $side = b ] && dir=$b_dir
    xz -dc "$dir/gpu_side_by_side-cuda.xz" >/tmp/step-ab-bin/$side && chmod +x /tmp/step-ab-bin/$side || exit 1
done
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/card.txt"
export NCCL_NVLS_ENABLE=0 CUDA_CACHE_PATH=/tmp/step-ab-jit CUDA_CACHE_MAXSIZE=4294967296
unset RUST_BACKTRACE
# Untimed: the driver's JIT of candle's kernels and NVRTC's, once per build.
for side in a b; do
    timeout 150 /tmp/step-ab-bin/$side --steps 1 gpt2:1:128:bf16:1:fused:1:flash >/dev/null 2>&1
done
for ((round = 1; round <= ROUNDS; round++)); do
    for row in $ROWS; do
        for side in a b; do
            line=$(timeout "$CAP" /tmp/step-ab-bin/$side --steps "$STEPS" "$row" 2>>"$out/log.txt")
            rc=$?
            [ -n "$line" ] || line="{\"status\": \"exit $rc\"}"
            python3 -c 'import json,sys; r=json.loads(sys.argv[1]); r.update(side=sys.argv[2], round=int(sys.argv[3]), row=sys.argv[4]); print(json.dumps(r))' \
                "$line" $side $round "$row" >>"$out/ab.jsonl"
            echo "round $round $side $row: rc $rc"
        done
    done
done
python3 - "$out/ab.jsonl" <<'PY' | tee "$out/ab.md"
import json, statistics, sys
runs = [json.loads(l) for l in open(sys.argv[1])]
rows = list(dict.fromkeys(r["row"] for r in runs))
print("| row | A ms | B ms | B ÷ A | A GiB used | B GiB used | A GiB reserved | B GiB reserved |")
print("|---|---:|---:|---:|---:|---:|---:|---:|")
for row in rows:
    cells = {}
    for side in "ab":
        ok = [r for r in runs if r["row"] == row and r["side"] == side and r.get("status") == "ok"]
        cells[side] = ok
    if not cells["a"] or not cells["b"]:
        print(f"| {row} | failed: " + ", ".join(r.get("status", "?") for r in runs if r["row"] == row) + " |")
        continue
    ms = {s: statistics.median(r["step_ms"] for r in cells[s]) for s in "ab"}
    gib = lambda s, f: max(r[f] for r in cells[s]) / 2**30
    print(f"| {row} | {ms['a']:.1f} | {ms['b']:.1f} | {ms['b'] / ms['a']:.3f} | "
          f"{gib('a', 'peak_alloc_bytes'):.2f} | {gib('b', 'peak_alloc_bytes'):.2f} | "
          f"{gib('a', 'peak_reserved_bytes'):.2f} | {gib('b', 'peak_reserved_bytes'):.2f} |")
PY
