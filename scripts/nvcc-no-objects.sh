#!/usr/bin/env bash
# nvcc for `cargo check` only (scripts/check-cuda.sh sets NVCC to it): runs
# $CUDA_HOME/bin/nvcc for everything but compiles to object files (`-c`), for
# which it writes an empty object instead. candle-kernels' build script
# compiles its PTX (read by `include_str!`, so compiled for real here) and a
# static library of MoE/GGUF kernels that only the linker reads: machine code
# for all of it would be most of the check's time, and `cargo check` links
# nothing. Never use it for a build that links.
set -euo pipefail
real=${CUDA_HOME:?CUDA_HOME must be set}/bin/nvcc
out= compile=0 lib=0 args=("$@")
while (($#)); do
    case $1 in
        -c | --compile) compile=1 ;;
        -lib | --lib) lib=1 ;;
        -o | --output-file) out=${2:-}; shift ;;
    esac
    shift
done
if ((compile)) && [[ -n $out ]]; then
    # An empty ELF object for the host.
    exec "${CC:-cc}" -x c -c -o "$out" /dev/null
fi
if ((lib)) && [[ -n $out ]]; then
    # cudaforge's record of up-to-date objects would let a later real build
    # of the same output folder reuse these empty ones: forget it.
    rm -f "$(dirname "$out")/.cudaforge_cache.json"
fi
exec "$real" "${args[@]}"
