#!/usr/bin/env bash
# Measured peak memory and step time of each memory fix on the CPU (GPT-2- and
# Llama-shaped models of ~15M parameters, global batch 8), fused vs candle_nn
# AdamW, and checkpointed vs plain forward+backward. Builds in release, runs
# examples/bench_train.rs and writes docs/bench-train.md. Arguments go to the
# example (--seq N, --rounds N, --quick). Takes several minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --quiet --example bench_train
out=docs/bench-train.md
mkdir -p docs
tables=$(mktemp)
trap 'rm -f "$tables"' EXIT
start=$(date +%s)
target/release/examples/bench_train "$@" >"$tables"
secs=$(( $(date +%s) - start ))
{
    echo "# Training benchmark (CPU)"
    echo
    echo "Command: \`scripts/bench-train.sh${*:+ $*}\` (runs \`target/release/examples/bench_train${*:+ $*}\`)."
    echo "Commit $(git rev-parse --short HEAD)$([ -z "$(git status --porcelain -- src strategies examples)" ] || echo ' (with local changes)'), $(date -u +%Y-%m-%d)," \
        "$(nproc) cores ($(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1)), ${secs} s."
    echo
    echo "Peaks are heap bytes from a counting allocator: a plan's peak is the heap its trainer holds between"
    echo "steps (weights, master weights, optimizer state) plus the step's high-water mark above the heap just"
    echo "before the step. MB = 10^6 bytes. Variants run interleaved, one step each per round; round 1 is a"
    echo "warm-up; every figure is the median over the other rounds. Times are from a shared 2-core machine:"
    echo "compare ratios, not absolute times. Estimated peaks come from oomfix's memory model."
    echo
    cat "$tables"
} >"$out"
cat "$out"
