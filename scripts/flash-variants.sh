#!/usr/bin/env bash
# Variants of the CUDA attention kernels side by side in one run, on the GPU
# machine, without rebuilding: each variant is a copy of
# strategies/src/attention/flash.cu (same entry points and parameters) that
# examples/gpu_attention compiles instead of the built-in source
# (OOMFIX_FLASH_SOURCE). Runs the checks of every variant, then the timings
# round-robin (ROUNDS times, so that the machine's drift falls on all of them),
# and prints the median forward / forward+backward ms per variant.
#
# Usage: scripts/flash-variants.sh BIN_DIR OUT_DIR VARIANT.cu...
#   BIN_DIR  holds gpu_attention-cuda.xz from
#            `scripts/build-cuda.sh --features cuda --example gpu_attention`
#   VARIANT  a kernel source; `builtin` runs the binary's own
# Environment: ROUNDS (timing rounds; 2).
set -uo pipefail

BIN_DIR=$1 OUT_DIR=$2
shift 2
[ $# -gt 0 ] || { echo "usage: $0 BIN_DIR OUT_DIR VARIANT.cu..." >&2; exit 2; }
mkdir -p "$OUT_DIR"
WORK=${TMPDIR:-/tmp}/flash-variants
mkdir -p "$WORK"
export CUDA_CACHE_PATH=$WORK/nvcache
unset RUST_BACKTRACE
xz -dc "$BIN_DIR/gpu_attention-cuda.xz" >"$WORK/gpu_attention" && chmod +x "$WORK/gpu_attention" ||
    { echo "cannot unpack $BIN_DIR/gpu_attention-cuda.xz" >&2; exit 1; }

run() {  # run VARIANT ARGS...: gpu_attention on one variant's source
    local variant=$1
    shift
    if [ "$variant" = builtin ]; then
        env -u OOMFIX_FLASH_SOURCE "$WORK/gpu_attention" "$@"
    else
        OOMFIX_FLASH_SOURCE=$variant "$WORK/gpu_attention" "$@"
    fi
}
name() { basename "$1" .cu; }

status=0
for v in "$@"; do
    run "$v" --check-only >"$OUT_DIR/$(name "$v")-checks.txt" 2>&1 || status=1
    echo "$(name "$v"): $(grep -c '^PASS' "$OUT_DIR/$(name "$v")-checks.txt") checks pass," \
        "$(grep -c '^FAIL' "$OUT_DIR/$(name "$v")-checks.txt") fail"
done
for round in $(seq "${ROUNDS:-2}"); do
    for v in "$@"; do
        run "$v" --perf-only >"$OUT_DIR/$(name "$v")-perf-$round.txt" 2>&1 || status=1
    done
done

python3 - "$OUT_DIR" "$@" <<'PY' | tee "$OUT_DIR/table.md"
import glob, os, statistics, sys
out, variants = sys.argv[1], sys.argv[2:]
def times(v):
    name = os.path.basename(v)[:-3] if v.endswith(".cu") else v
    runs = {}
    for path in sorted(glob.glob(f"{out}/{name}-perf-*.txt")):
        for line in open(path):
            f = line.split()
            if len(f) == 6 and f[0] in ("PERF", "PERF-gqa"):
                runs.setdefault((f[0], f[1], int(f[2])), []).append((float(f[3]), float(f[4])))
    return name, {k: tuple(statistics.median(x[i] for x in r) for i in (0, 1)) for k, r in runs.items()}
cols = [times(v) for v in variants]
keys = sorted({k for _, t in cols for k in t}, key=lambda k: (k[0], k[1] != "bf16", k[2]))
print("| case | " + " | ".join(f"{n} fwd / fwd+bwd ms" for n, _ in cols) + " |")
print("|---|" + "---:|" * len(cols))
for k in keys:
    case = f"{k[1]} s={k[2]}" + (" (TinyLlama GQA)" if k[0] == "PERF-gqa" else "")
    cells = [f"{t[k][0]:.3f} / {t[k][1]:.3f}" if k in t else "-" for _, t in cols]
    print(f"| {case} | " + " | ".join(cells) + " |")
PY
exit $status
