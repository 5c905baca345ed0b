#!/usr/bin/env bash
# Build the `oomfix` binary with CUDA on a machine that has no GPU and no
# NVIDIA driver, for running on the GPU machine (the recipe: scripts/cuda-env.sh).
#
# Steps (each skipped when its cached result is already up to date):
#   1-2. set up the CUDA 13.0 toolkit from PyPI wheels in the cache, with a
#      CUDA_HOME of symlinks and a stub libcuda.so.1, and write the cache's
#      ENV file (scripts/cuda-env.sh);
#   3. compile the kernel sources that run-time NVRTC compiles (every tracked
#      *.cu file) with the toolkit's libnvrtc;
#   4. `cargo build --release` into target-cuda/, with an rpath to the GPU
#      machine's library folders;
#   5. strip the binary and write an xz-compressed copy to carry over.
#
# Usage: scripts/build-cuda.sh [--features LIST] [--example NAME | --test NAME] [--compute-cap N] [--cache DIR]
#   --features LIST    cargo features (default: cuda,nccl; e.g. `cuda`)
#   --example NAME     build the example NAME instead of the `oomfix` binary
#   --test NAME        build the integration test tests/NAME.rs instead (its
#                      CUDA tests run where a device is; run the unpacked
#                      binary with the test names to run, as `cargo test`
#                      would; tests that read the repository's files need
#                      it at the path they were built in)
#   --compute-cap N    GPU compute capability, 90 = H100/H200 (default: 90)
#   --cache DIR        toolkit cache (default: $OOMFIX_CUDA_CACHE or
#                      ~/.cache/oomfix-cuda)
#
# Outputs: target-cuda/release/oomfix, target-cuda/oomfix-cuda (stripped),
# target-cuda/oomfix-cuda.xz (to copy; `xz -d` it on the GPU machine); for an
# example, target-cuda/release/examples/NAME, target-cuda/NAME-cuda(.xz); for a
# test, target-cuda/NAME-test-cuda(.xz).
set -euo pipefail

# shellcheck source=scripts/cuda-env.sh
. "$(dirname "${BASH_SOURCE[0]}")/cuda-env.sh"

# Library folders on the GPU machine, baked into the binary as its rpath.
GPU_LIB_DIRS=(
    /opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib
    /opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib
    /usr/local/nvidia/lib64
)
# Newest glibc the GPU machine provides.
GLIBC_LIMIT=2.39

FEATURES=cuda,nccl
EXAMPLE=
TEST=
COMPUTE_CAP=90
CACHE=${OOMFIX_CUDA_CACHE:-$HOME/.cache/oomfix-cuda}

usage() { sed -n '/^# Usage:/,/^# example, target-cuda/s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; }

while (($#)); do
    case $1 in
        --features) FEATURES=${2:?--features needs a value}; shift 2 ;;
        --example) EXAMPLE=${2:?--example needs a value}; shift 2 ;;
        --test) TEST=${2:?--test needs a value}; shift 2 ;;
        --compute-cap) COMPUTE_CAP=${2:?--compute-cap needs a value}; shift 2 ;;
        --cache) CACHE=${2:?--cache needs a value}; shift 2 ;;
        -h | --help) usage; exit 0 ;;
        *) usage >&2; die "unknown argument: $1" ;;
    esac
done
[[ $COMPUTE_CAP =~ ^[0-9]+$ ]] || die "--compute-cap must be a number such as 90, got '$COMPUTE_CAP'"
[[ -z $EXAMPLE || $EXAMPLE =~ ^[A-Za-z0-9_-]+$ ]] || die "--example must be an example's name, got '$EXAMPLE'"
[[ -z $TEST || $TEST =~ ^[A-Za-z0-9_-]+$ ]] || die "--test must be a test's name, got '$TEST'"
[[ -z $TEST || -z $EXAMPLE ]] || die "--example and --test build one thing each: give one"
# What cargo builds, where it lands, and the name of the packaged copy.
if [[ -n $TEST ]]; then
    TARGET_ARGS=(--test "$TEST") BUILT= PACKAGED=target-cuda/$TEST-test-cuda
elif [[ -n $EXAMPLE ]]; then
    TARGET_ARGS=(--example "$EXAMPLE") BUILT=target-cuda/release/examples/$EXAMPLE PACKAGED=target-cuda/$EXAMPLE-cuda
else
    TARGET_ARGS=(--bin oomfix) BUILT=target-cuda/release/oomfix PACKAGED=target-cuda/oomfix-cuda
fi

check_prerequisites() {
    local tool
    for tool in xz strip readelf objdump cmp; do
        command -v "$tool" >/dev/null ||
            die "missing prerequisite: '$tool' is not on PATH (needed: xz, binutils, cmp)"
    done
}

# Step 4: the release build, with the environment cudarc and cudaforge read.
cargo_build() {
    local rpath start
    rpath=$(IFS=:; printf '%s' "${GPU_LIB_DIRS[*]}")
    # shellcheck source=/dev/null
    . "$CACHE/ENV"
    export RUSTFLAGS="${RUSTFLAGS:+$RUSTFLAGS }-C link-arg=-Wl,-rpath,$rpath"
    say "nvcc: $(nvcc --version | sed -n 's/^Cuda compilation tools, //p')"
    say "cargo build --release --features $FEATURES --target-dir target-cuda ${TARGET_ARGS[*]} (CUDA_COMPUTE_CAP=$COMPUTE_CAP)"
    start=$SECONDS
    if [[ -n $TEST ]]; then
        # The test binary's path is in cargo's report of what it built.
        BUILT=$(cargo test --release --no-run --features "$FEATURES" --target-dir target-cuda \
            "${TARGET_ARGS[@]}" --message-format=json |
            python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        print(m["executable"])')
        [[ -n $BUILT ]] || die "cargo built no test binary for --test $TEST"
    else
        cargo build --release --features "$FEATURES" --target-dir target-cuda "${TARGET_ARGS[@]}"
    fi
    say "cargo build took $((SECONDS - start)) s"
}

# Step 5: strip and compress; then check what the binary needs at run time.
package_binary() {
    local bin=$BUILT out=$PACKAGED glibc
    say "Stripping $bin to $out"
    strip -o "$out.tmp" "$bin"
    if [[ -f $out.xz ]] && cmp -s "$out.tmp" "$out"; then
        rm "$out.tmp"
        say "$out is unchanged; keeping $out.xz"
    else
        mv "$out.tmp" "$out"
        say "Compressing to $out.xz"
        xz -9 -T0 -c "$out" >"$out.xz.tmp"
        mv "$out.xz.tmp" "$out.xz"
    fi
    stat -c '%n: %s bytes' "$bin" "$out" "$out.xz" | sed 's/^/==> /' >&2
    say "NEEDED: $(readelf -d "$out" | sed -nE 's/.*\(NEEDED\).*\[(.*)\]/\1/p' | tr '\n' ' ')"
    say "RUNPATH: $(readelf -d "$out" | sed -nE 's/.*\((RUN)?PATH\).*\[(.*)\]/\2/p')"
    glibc=$(objdump -T "$out" | grep -o 'GLIBC_[0-9.]*' | sed 's/GLIBC_//' | sort -uV | tail -n 1)
    say "Newest glibc symbol version: $glibc (limit $GLIBC_LIMIT)"
    [[ $(printf '%s\n' "$glibc" "$GLIBC_LIMIT" | sort -V | tail -n 1) == "$GLIBC_LIMIT" ]] ||
        die "the binary needs glibc $glibc, newer than the GPU machine's $GLIBC_LIMIT"
}

check_prerequisites
mkdir -p "$CACHE"
CACHE=$(cd "$CACHE" && pwd)
cd "$(dirname "${BASH_SOURCE[0]}")/.."
cuda_env_setup "$CACHE" "$COMPUTE_CAP"
cuda_check_kernels "$CACHE" "$COMPUTE_CAP"
cargo_build
package_binary
say "Done: copy $PACKAGED.xz to the GPU machine and unpack it with xz -d"
