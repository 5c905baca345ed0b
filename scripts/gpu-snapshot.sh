#!/usr/bin/env bash
# CUDA memory snapshots on the GPU machine: a GPT-2 small step (8 x 1024,
# bf16, flash attention) and a TinyLlama-1.1B step (4 x 2048, bf16, flash
# attention, from a header-only checkpoint), each recorded by `oomfix
# --snapshot --plot` and loaded by scripts/check-snapshot.py (with PyTorch's
# memory_viz readers); then `oomfix train` on GPT-2 small with and without
# --trim-between-phases: its first 2 steps recorded (reserved peaks), the
# step times of the unrecorded steps after them from the JSON log.
#
# Usage: scripts/gpu-snapshot.sh BIN OUT_DIR
#   BIN      the oomfix binary built by scripts/build-cuda.sh
#   OUT_DIR  pickles, plots, logs and summary.txt
# Environment: STEPS (train steps per trim run; 12).
set -uo pipefail
BIN=$1 OUT_DIR=$2 STEPS=${STEPS:-12}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
mkdir -p "$OUT_DIR"
SUM=$OUT_DIR/summary.txt
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >"$SUM"
WORK=${TMPDIR:-/tmp}/gpu-snapshot
rm -rf "$WORK" && mkdir -p "$WORK/tinyllama"
python3 "$HERE/make-sparse-llama.py" "$WORK/tinyllama/model.safetensors" 22 2048 32 4 5632 32000 >/dev/null
echo '{"num_attention_heads": 32, "num_key_value_heads": 4, "max_position_embeddings": 2048}' >"$WORK/tinyllama/config.json"

record() { # NAME PLOT_EXT OPTIONS...
    local name=$1 ext=$2
    shift 2
    echo "== $name: oomfix $*" >>"$SUM"
    "$BIN" --budget 70GiB --device cuda:0 --precision bf16 --attention flash --checkpoint none \
        --snapshot "$OUT_DIR/$name.pickle" --plot "$OUT_DIR/$name.$ext" "$@" \
        >"$WORK/$name.out" 2>"$OUT_DIR/$name.log"
    echo "exit $?" >>"$SUM"
    grep -h "oomfix: pool:" "$OUT_DIR/$name.log" >>"$SUM"
    python3 "$HERE/check-snapshot.py" "$OUT_DIR/$name.pickle" --pool >>"$SUM" 2>&1
    echo "check exit $?" >>"$SUM"
}
record gpt2 svg --seq-len 1024 --global-batch 8 --micro-batch 8
record tinyllama png --seq-len 2048 --global-batch 4 --micro-batch 4 "$WORK/tinyllama/model.safetensors"

trim() { # NAME [--trim-between-phases]
    local name=$1
    shift
    echo "== $name: oomfix train --steps $STEPS $*" >>"$SUM"
    "$BIN" train --budget 70GiB --device cuda:0 --precision bf16 --attention flash --checkpoint none \
        --seq-len 1024 --global-batch 8 --micro-batch 8 --steps "$STEPS" --log-format json \
        --snapshot "$OUT_DIR/$name.pickle" --snapshot-steps 2 "$@" \
        >"$WORK/$name.out" 2>"$OUT_DIR/$name.log"
    echo "exit $?" >>"$SUM"
    python3 "$HERE/check-snapshot.py" "$OUT_DIR/$name.pickle" --pool --steps 2 >>"$SUM" 2>&1
    python3 - "$OUT_DIR/$name.log" >>"$SUM" <<'PY'
import json, statistics, sys
steps = []
for line in open(sys.argv[1]):
    try:
        r = json.loads(line)
    except ValueError:
        continue
    f = r.get("fields", r)
    if "seconds" in f and "step" in f and "loss" in f:
        steps.append((int(f["step"]), float(f["seconds"])))
later = [s for n, s in steps if n > 3]
print(json.dumps({"steps": len(steps), "median_step_s_after_3": statistics.median(later) if later else None,
                  "step_s": [round(s, 4) for _, s in steps]}))
PY
}
trim train-plain
trim train-trim --trim-between-phases
