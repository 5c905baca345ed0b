#!/usr/bin/env bash
# Compile the GPU code on a machine that cannot run it (CI has no GPU): sets up
# the CUDA toolkit (scripts/cuda-env.sh), compiles every run-time kernel
# source with NVRTC, and type-checks the workspace, tests and examples
# included, with `--features cuda` and with `--features nccl`.
#
# Usage: scripts/check-cuda.sh [--compute-cap N] [--cache DIR]
#   --compute-cap N    GPU compute capability, 90 = H100/H200 (default: 90)
#   --cache DIR        toolkit cache (default: $OOMFIX_CUDA_CACHE or
#                      ~/.cache/oomfix-cuda)
#
# candle-kernels' build script runs nvcc for compute capability N, also under
# `cargo check`; its PTX is compiled for real, its static MoE/GGUF library
# (only linked, and most of its nvcc time) from empty objects
# (scripts/nvcc-no-objects.sh). Hence a target folder of its own,
# $CARGO_TARGET_DIR/cuda-check (target/cuda-check), that no build links from.
set -euo pipefail
# shellcheck source=scripts/cuda-env.sh
. "$(dirname "${BASH_SOURCE[0]}")/cuda-env.sh"

cuda_args "$@"

start=$SECONDS
cuda_env_setup "$cache" "$cap"
say "toolkit ready after $((SECONDS - start)) s"
cuda_check_kernels "$cache" "$cap"
say "kernels checked after $((SECONDS - start)) s"
# shellcheck source=/dev/null
. "$cache/ENV"
export NVCC=$PWD/scripts/nvcc-no-objects.sh
target_dir=${CARGO_TARGET_DIR:-target}/cuda-check
for features in cuda nccl; do
    say "cargo check --workspace --all-targets --features $features (CUDA_COMPUTE_CAP=$cap, into $target_dir)"
    cargo check --workspace --all-targets --features "$features" --target-dir "$target_dir"
    say "--features $features checked after $((SECONDS - start)) s"
done
