#!/usr/bin/env bash
# oomfix vs PyTorch on one GPU, same plans, same run; then `oomfix --budget 8GiB
# --verify` on GPT-2 medium and TinyLlama-1.1B headers. Run on the GPU machine.
#
# Usage: scripts/side-by-side.sh [BIN_DIR] [OUT_DIR]
#   BIN_DIR  holds gpu_side_by_side-cuda.xz and (for the cli and medium
#            phases) oomfix-cuda.xz from scripts/build-cuda.sh (default: .gpu)
#   OUT_DIR  results, written as they come (default: $OUT, else side-by-side-out):
#            torch.jsonl, oomfix.jsonl (one JSON line per configuration),
#            cli.txt (the two CLI runs), log.txt (progress, stderr), tables.md
# Environment: DEADLINE (seconds from start after which no new run starts; 480),
#   CAP (seconds one configuration may take; 100), COMPILE_CAP (the same for a
#   torch.compile configuration, compilation included; 300), STEPS (measured
#   steps per configuration, both sides; 5), WARMUP (0: no untimed oomfix
#   process first; 1), PHASES (which runs, in this
#   order: default "gpt2 cli medium llama eager offload"; "speed" is the speed
#   guard below), SPEED_ROWS (the speed guard's rows, MODEL:BATCH:SEQ:PRECISION:CKPT[:offload];
#   default all six, in the order below), ROUNDS (how many times the
#   gpt2, llama and offload phases run, the two sides alternating; 1): the tables give
#   the median over rounds and the range of the per-round time ratios;
#   ROWS=flash runs only the memory-efficient attention rows (PyTorch's SDPA,
#   oomfix's flash attention), ROWS=composed only the others (PyTorch's eager
#   attention, oomfix's composed attention).
#
# Runs in order of importance, so a cut-off loses the least: GPT-2 small both
# sides (gpt2), the two 8 GiB CLI runs (cli), GPT-2 medium at the CLI's plan
# (medium), TinyLlama both sides (llama), PyTorch eager rows for TinyLlama
# (eager), the optimizer offloaded to the CPU on both sides (offload: GPT-2
# small, and TinyLlama at the plan `oomfix --budget 8GiB` finds). The tables
# (scripts/side-by-side-tables.py) are printed last from whatever finished.
#
# PHASES=speed is the speed guard: six rows, each run by oomfix, PyTorch eager
# and torch.compile one after the other (GPT-2 small 8 x 1024 bf16 with flash
# attention / SDPA, TinyLlama-1.1B 4 x 2048 bf16, each plain and with every
# block checkpointed, GPT-2 small fp32, GPT-2 small checkpointed with the
# optimizer offloaded to the CPU), after oomfix's gradient-norm timing on both
# models' shapes (`gpu_side_by_side --norm`). Its table gives each row's step
# time, allocated peak and MFU on all three sides, the ratios to eager and to
# torch.compile, and torch.compile's compilation time apart.
set -uo pipefail

BIN_DIR=${1:-.gpu}
OUT_DIR=${2:-${OUT:-side-by-side-out}}
DEADLINE=${DEADLINE:-480}
CAP=${CAP:-100}
COMPILE_CAP=${COMPILE_CAP:-300}
STEPS=${STEPS:-5}
PHASES=${PHASES:-gpt2 cli medium llama eager offload}
ROUNDS=${ROUNDS:-1}
ROWS=${ROWS:-all}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

mkdir -p "$OUT_DIR"
TORCH=$OUT_DIR/torch.jsonl OOMFIX=$OUT_DIR/oomfix.jsonl CLI=$OUT_DIR/cli.txt LOG=$OUT_DIR/log.txt
: >"$TORCH"; : >"$OOMFIX"; : >"$CLI"; : >"$LOG"
WORK=${TMPDIR:-/tmp}/side-by-side
rm -rf "$WORK" && mkdir -p "$WORK"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
# Keep the driver's PTX JIT cache between processes: each oomfix process would
# otherwise JIT candle's kernels again.
export CUDA_CACHE_PATH=$WORK/nvcache CUDA_CACHE_MAXSIZE=4294967296
unset RUST_BACKTRACE   # candle captures a backtrace into every error when set

say() { printf '[%4ds] %s\n' "$SECONDS" "$*" | tee -a "$LOG" >&2; }
# Seconds the next run may take: CAP, less near the deadline; 0 means skip.
budget() {
    local left=$((DEADLINE - SECONDS))
    ((left < 15)) && { echo 0; return; }
    echo $((left < ${1:-$CAP} ? left : ${1:-$CAP}))
}

# Whether PHASES names phase $1.
want() { [[ " $PHASES " == *" $1 "* ]]; }

binaries=gpu_side_by_side
{ want cli || want medium; } && binaries+=" oomfix"
for name in $binaries; do
    xz -dc "$BIN_DIR/$name-cuda.xz" >"$WORK/$name" && chmod +x "$WORK/$name" ||
        { say "cannot unpack $BIN_DIR/$name-cuda.xz"; exit 1; }
done
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm,clocks.mem --format=csv >>"$LOG" 2>&1

# One untimed oomfix process first, on small shapes: it JIT-compiles candle's
# kernels into the driver's cache (CUDA_CACHE_PATH) and the run-time kernels
# once, so the first timed configuration does not pay for that (on a fresh
# machine the first row, GPT-2 fp32 with flash attention, ran past a 60 s CAP).
if ((${WARMUP:-1})); then
say "warm-up: one untimed oomfix process"
timeout 150 "$WORK/gpu_side_by_side" --steps 1 gpt2:1:128:fp32:0:fused:1:flash \
    gpt2:1:128:bf16:1:fused:1:flash gpt2:1:128:bf16:0:fused >/dev/null 2>>"$LOG" ||
    say "warm-up exited with $? (timeout is 124)"
fi

# The configurations among "$@" that ROWS selects, one per line.
rows() {
    local c
    for c in "$@"; do
        case $ROWS in
            flash) [[ $c == *:sdpa* || $c == *:flash ]] ;;
            composed) [[ $c != *:sdpa* && $c != *:flash ]] ;;
        esac && printf '%s\n' "$c"
    done
}

# PyTorch configurations MODEL:BATCH:SEQ:PRECISION:CKPT:ATTN[:OPT[:compile]], one
# process; a configuration may take CAP seconds, COMPILE_CAP under compile.
torch_side() {
    local t cap=$CAP
    set -- $(rows "$@")
    (($# > 0)) || return 0
    [[ " $* " == *:compile\ * ]] && cap=$COMPILE_CAP
    t=$(budget $((cap * $#)))
    ((t > 0)) || { say "skipped (deadline): pytorch $*"; return; }
    say "pytorch: $*"
    timeout "$t" python3 "$HERE/torch_step.py" --steps "$STEPS" --cap "$cap" "$@" >>"$TORCH" 2>>"$LOG" ||
        say "torch_step.py exited with $? (timeout is 124)"
}

# oomfix configurations MODEL:BATCH:SEQ:PRECISION:CKPT:OPTIMIZER[:ACCUM[:ATTN]], one process each.
oomfix_side() {
    local c t rc line
    for c in $(rows "$@"); do
        t=$(budget)
        if ((t == 0)); then
            say "skipped (deadline): oomfix $c"
            continue
        fi
        say "oomfix: $c"
        line=$(timeout "$t" "$WORK/gpu_side_by_side" --steps "$STEPS" "$c" 2>>"$LOG")
        rc=$?
        if [[ -n $line ]]; then
            printf '%s\n' "$line" >>"$OOMFIX"
        else
            IFS=: read -r m b s p k o a t <<<"$c"
            printf '{"side":"oomfix","model":"%s","batch":%s,"seq":%s,"precision":"%s","ckpt":%s,"accum":%s,"attn":"%s","status":"%s"}\n' \
                "$m" "$b" "$s" "$p" "$k" "${a:-1}" "${t:-composed}" "$([[ $rc == 124 ]] && echo timeout || echo "exit $rc")" >>"$OOMFIX"
        fi
    done
}

# `oomfix --budget 8GiB --verify --device cuda:0 [OPTION...] MODEL`, output appended to cli.txt.
cli() {
    local t
    t=$(budget 150)
    ((t > 0)) || { say "skipped (deadline): oomfix CLI $*"; return; }
    say "oomfix CLI: $*"
    { printf '$ oomfix --budget 8GiB --verify --device cuda:0 %s\n' "$*"
      timeout "$t" "$WORK/oomfix" --budget 8GiB --verify --device cuda:0 "$@" 2>&1
      printf '(exit status %s)\n\n' "$?"; } >>"$CLI"
}

G=gpt2:8:1024 L=tinyllama:4:2048 M=gpt2-medium
if want speed; then
    for model in gpt2 tinyllama; do
        say "oomfix gradient norm: $model"
        timeout "$(budget 60)" "$WORK/gpu_side_by_side" --norm $model >>"$OOMFIX" 2>>"$LOG" ||
            say "gpu_side_by_side --norm exited with $?"
    done
    # Most telling rows first, so that a cut-off loses the least.
    for row in ${SPEED_ROWS:-$G:bf16:0 $L:bf16:0 $G:bf16:1 $L:bf16:1 $G:fp32:0 $G:bf16:1:offload}; do
        case $row in
            *:offload)
                oomfix_side ${row%:offload}:cpu:1:flash
                torch_side ${row%:offload}:sdpa:offload ${row%:offload}:sdpa:offload:compile ;;
            *)
                oomfix_side $row:fused:1:flash
                torch_side $row:sdpa $row:sdpa:fused:compile ;;
        esac
    done
fi
if want gpt2; then
    for ((round = 1; round <= ROUNDS; round++)); do
        torch_side $G:fp32:0:sdpa $G:bf16:0:sdpa $G:bf16:1:sdpa $G:fp32:0:eager $G:bf16:0:eager $G:bf16:1:eager
        oomfix_side $G:fp32:0:fused:1:flash $G:bf16:0:fused:1:flash $G:bf16:1:fused:1:flash \
            $G:fp32:0:fused $G:bf16:0:fused $G:bf16:1:fused
    done
fi

if want cli || want medium; then
    mkdir -p "$WORK/gpt2-medium" "$WORK/tinyllama"
    python3 "$HERE/make-sparse-gpt2.py" "$WORK/gpt2-medium/model.safetensors" 24 1024 >>"$LOG"
    python3 "$HERE/make-sparse-llama.py" "$WORK/tinyllama/model.safetensors" 22 2048 32 4 5632 32000 >>"$LOG"
    echo '{"num_attention_heads": 32, "num_key_value_heads": 4, "max_position_embeddings": 2048}' >"$WORK/tinyllama/config.json"
fi
if want cli; then
    cli "$WORK/gpt2-medium/model.safetensors"
    cli "$WORK/tinyllama/model.safetensors"
fi

# GPT-2 medium: the CLI's closest 8 GiB plan (1 x 8 accumulation, seq 1024)
# measured, PyTorch at the same micro-batch, b=8 side by side, and the CLI at
# seq 512 (its hint).
if want medium; then
    oomfix_side $M:1:1024:bf16:1:fused:8:flash $M:1:1024:bf16:1:fused:1:flash $M:8:1024:bf16:1:fused:1:flash \
        $M:1:1024:bf16:1:fused $M:8:1024:bf16:1:fused
    torch_side $M:1:1024:bf16:1:sdpa $M:1:1024:bf16:1:eager $M:8:1024:bf16:1:sdpa
    cli --seq-len 512 "$WORK/gpt2-medium/model.safetensors"
fi

if want llama; then
    for ((round = 1; round <= ROUNDS; round++)); do
        torch_side $L:bf16:1:sdpa $L:bf16:0:sdpa $L:fp32:0:sdpa
        # Last: the CLI's closest TinyLlama plan at 8 GiB (1 x 8 accumulation, seq 1024).
        oomfix_side $L:bf16:1:fused:1:flash $L:bf16:0:fused:1:flash $L:bf16:1:fused $L:bf16:0:fused \
            $L:fp32:0:fused tinyllama:1:1024:bf16:1:fused:8:flash
    done
fi
want eager && torch_side $L:bf16:1:eager $L:bf16:0:eager $L:fp32:0:eager
if want offload; then
    for ((round = 1; round <= ROUNDS; round++)); do
        torch_side $G:bf16:1:sdpa:offload tinyllama:8:1024:bf16:1:sdpa:offload
        oomfix_side $G:bf16:1:cpu:1:flash tinyllama:8:1024:bf16:1:cpu:1:flash
    done
fi
say "runs done"

python3 "$HERE/side-by-side-tables.py" "$TORCH" "$OOMFIX" "$CLI" | tee "$OUT_DIR/tables.md"
say "tables written"
