#!/usr/bin/env bash
# Composed attention vs flash_attention on the CPU (b=1, heads=12, d=64, f32,
# causal; s = 256..2048): forward+backward time, median of REPS runs (default 5),
# and the bytes the forward keeps alive for backward.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo run --release --quiet -p oomfix-strategies --example bench_attention -- "$@"
