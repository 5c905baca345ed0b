#!/usr/bin/env bash
# Build the `oomfix` binary with CUDA on a machine that has no GPU and no
# NVIDIA driver, for running on the GPU machine (DESIGN.md §7).
#
# Steps (each skipped when its cached result is already up to date):
#   1. install a CUDA 13.0 toolkit from PyPI wheels into a venv in the cache;
#   2. assemble a CUDA_HOME of symlinks to it, plus a stub libcuda.so.1 so
#      that `-lcuda` resolves at link time (the real one loads at run time);
#   3. compile the kernel sources that run-time NVRTC compiles (flash.cu,
#      adamw.cu, accumulate.cu, nn's fused.cu and loss.cu) with the toolkit's
#      libnvrtc;
#   4. `cargo build --release` into target-cuda/, with an rpath to the GPU
#      machine's library folders;
#   5. strip the binary and write an xz-compressed copy to carry over.
#
# Usage: scripts/build-cuda.sh [--features LIST] [--example NAME] [--compute-cap N] [--cache DIR]
#   --features LIST    cargo features (default: cuda,nccl; e.g. `cuda`)
#   --example NAME     build the example NAME instead of the `oomfix` binary
#   --compute-cap N    GPU compute capability, 90 = H100/H200 (default: 90)
#   --cache DIR        toolkit cache (default: $OOMFIX_CUDA_CACHE or
#                      ~/.cache/oomfix-cuda)
#
# Outputs: target-cuda/release/oomfix, target-cuda/oomfix-cuda (stripped),
# target-cuda/oomfix-cuda.xz (to copy; `xz -d` it on the GPU machine); for an
# example, target-cuda/release/examples/NAME, target-cuda/NAME-cuda(.xz).
set -euo pipefail

# Toolkit pins: what PyTorch 2.11 (cu130) uses on the GPU machine. nvcc must
# stay at 13.0: a 13.1+ nvcc emits PTX that driver 580 rejects.
PINS=(
    nvidia-cuda-nvcc==13.0.88
    nvidia-nvvm==13.0.88
    nvidia-cuda-crt==13.0.88
    nvidia-cuda-runtime==13.0.96
    nvidia-cuda-cccl==13.0.85
    nvidia-cuda-nvrtc==13.0.88
    nvidia-cublas==13.1.0.3
    nvidia-curand==10.4.0.35
    nvidia-nccl-cu13==2.28.9
)
# Library folders on the GPU machine, baked into the binary as its rpath.
GPU_LIB_DIRS=(
    /opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib
    /opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib
    /usr/local/nvidia/lib64
)
# Newest glibc the GPU machine provides.
GLIBC_LIMIT=2.39
# CUDA_ERROR_STUB_LIBRARY: what every function of the stub libcuda returns.
STUB_ERROR=34

FEATURES=cuda,nccl
EXAMPLE=
COMPUTE_CAP=90
CACHE=${OOMFIX_CUDA_CACHE:-$HOME/.cache/oomfix-cuda}

say() { printf '==> %s\n' "$*" >&2; }
die() { printf 'build-cuda.sh: error: %s\n' "$*" >&2; exit 1; }
usage() { sed -n '/^# Usage:/,/^# example, target-cuda/s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; }

while (($#)); do
    case $1 in
        --features) FEATURES=${2:?--features needs a value}; shift 2 ;;
        --example) EXAMPLE=${2:?--example needs a value}; shift 2 ;;
        --compute-cap) COMPUTE_CAP=${2:?--compute-cap needs a value}; shift 2 ;;
        --cache) CACHE=${2:?--cache needs a value}; shift 2 ;;
        -h | --help) usage; exit 0 ;;
        *) usage >&2; die "unknown argument: $1" ;;
    esac
done
[[ $COMPUTE_CAP =~ ^[0-9]+$ ]] || die "--compute-cap must be a number such as 90, got '$COMPUTE_CAP'"
[[ -z $EXAMPLE || $EXAMPLE =~ ^[A-Za-z0-9_-]+$ ]] || die "--example must be an example's name, got '$EXAMPLE'"
# What cargo builds, where it lands, and the name of the packaged copy.
if [[ -n $EXAMPLE ]]; then
    TARGET_ARGS=(--example "$EXAMPLE") BUILT=target-cuda/release/examples/$EXAMPLE PACKAGED=target-cuda/$EXAMPLE-cuda
else
    TARGET_ARGS=(--bin oomfix) BUILT=target-cuda/release/oomfix PACKAGED=target-cuda/oomfix-cuda
fi

check_prerequisites() {
    local tool
    for tool in python3 gcc cargo xz strip readelf objdump cmp; do
        command -v "$tool" >/dev/null ||
            die "missing prerequisite: '$tool' is not on PATH (needed: python3, gcc, cargo, xz, binutils, cmp)"
    done
    python3 -c 'import venv, ensurepip' 2>/dev/null ||
        die "missing prerequisite: python3 cannot create virtual environments (install the python3-venv package)"
}

# Step 1: the toolkit wheels, reinstalled only when the pins change.
install_toolkit() {
    local venv=$CACHE/venv stamp=$CACHE/venv/.oomfix-pins
    if [[ -f $stamp && $(<"$stamp") == "${PINS[*]}" ]]; then
        say "CUDA toolkit wheels already installed in $venv"
        return
    fi
    say "Installing CUDA toolkit wheels into $venv"
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install --disable-pip-version-check --no-input -q "${PINS[@]}"
    printf '%s' "${PINS[*]}" >"$stamp"
}

# Where the wheels put the toolkit: <site-packages>/nvidia.
wheel_root() {
    local purelib
    purelib=$("$CACHE/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    [[ -x $purelib/nvidia/cu13/bin/nvcc ]] || die "nvcc not found under $purelib/nvidia/cu13 after installing the wheels"
    printf '%s/nvidia' "$purelib"
}

# cudarc's driver bindings, whose cu* names the stub libcuda must export.
cudarc_driver_bindings() {
    local version registry_src file
    version=$(awk '/^name = "cudarc"$/ { getline; gsub(/version = |"/, ""); print; exit }' Cargo.lock)
    [[ -n $version ]] || die "cudarc is not in Cargo.lock; is candle-core's cuda feature wired up?"
    registry_src=${CARGO_HOME:-$HOME/.cargo}/registry/src
    file=$(compgen -G "$registry_src/*/cudarc-$version/src/driver/sys/mod.rs" | head -n 1 || true)
    if [[ -z $file ]]; then
        say "Fetching crate sources (cudarc $version is not unpacked yet)"
        cargo fetch >&2
        file=$(compgen -G "$registry_src/*/cudarc-$version/src/driver/sys/mod.rs" | head -n 1 || true)
    fi
    [[ -n $file ]] || die "cudarc $version sources not found under $registry_src"
    printf '%s' "$file"
}

# A libcuda.so.1 whose every function returns CUDA_ERROR_STUB_LIBRARY: enough
# for the linker, never shipped.
build_stub_libcuda() {
    local bindings=$1 dir=$2 names
    names=$(sed -nE 's/^[[:space:]]+fn (cu[A-Za-z0-9_]+)\(.*/\1/p' "$bindings" | sort -u)
    [[ -n $names ]] || die "no cu* functions found in $bindings"
    mkdir -p "$dir"
    {
        printf '/* Generated by scripts/build-cuda.sh from %s */\n' "$bindings"
        sed "s/.*/int &(void) { return $STUB_ERROR; }/" <<<"$names"
    } >"$dir/libcuda-stub.c"
    gcc -shared -fPIC -O1 -Wl,-soname,libcuda.so.1 -o "$dir/libcuda.so.1" "$dir/libcuda-stub.c"
    ln -sfn libcuda.so.1 "$dir/libcuda.so"
    say "Stub libcuda.so.1 exports $(wc -l <<<"$names") functions"
}

# Link every entry of the given folders into dest, refusing name clashes.
link_entries() {
    local dest=$1 src entry
    shift
    mkdir -p "$dest"
    for src in "$@"; do
        for entry in "$src"/*; do
            if [[ -e $dest/${entry##*/} ]]; then
                die "$dest/${entry##*/} provided twice"
            fi
            ln -s "$entry" "$dest/"
        done
    done
}

# Step 2: CUDA_HOME, rebuilt only when the pins, the wheels' place or cudarc's
# bindings change.
assemble_cuda_home() {
    local nv=$1 bindings=$2 home=$CACHE/cuda-home stamp lib base
    stamp="${PINS[*]} $nv $bindings"
    if [[ -f $home/.oomfix-stamp && $(<"$home/.oomfix-stamp") == "$stamp" ]]; then
        say "CUDA_HOME already assembled at $home"
        return
    fi
    say "Assembling CUDA_HOME at $home"
    rm -rf "$home"
    mkdir -p "$home/lib64"
    # nvcc finds cicc and its headers through its own real path.
    ln -s "$nv/cu13/bin" "$home/bin"
    ln -s "$nv/cu13/nvvm" "$home/nvvm"
    link_entries "$home/include" "$nv/cu13/include" "$nv/nccl/include"
    for lib in "$nv"/cu13/lib/lib*.so* "$nv"/nccl/lib/lib*.so* "$nv"/cu13/lib/lib*.a; do
        base=${lib##*/}
        ln -s "$lib" "$home/lib64/$base"
        if [[ $base == *.so.* ]]; then
            ln -s "$lib" "$home/lib64/${base%%.so.*}.so"
        fi
    done
    build_stub_libcuda "$bindings" "$home/lib64/stubs"
    printf '%s' "$stamp" >"$home/.oomfix-stamp"
}

# Step 3: the kernels compiled at run time with NVRTC, compiled once here with
# the toolkit's libnvrtc so that a source error fails the build, not the GPU run.
check_kernels() {
    local lib=$CACHE/cuda-home/lib64 flash_arch=compute_$COMPUTE_CAP
    # flash.cu's warpgroup kernels compile for the architecture-specific 9.0
    # target, as the run-time compile does on such a device.
    if [[ $COMPUTE_CAP == 90 ]]; then flash_arch=compute_90a; fi
    say "NVRTC check of the run-time kernel sources"
    LD_LIBRARY_PATH=$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} python3 scripts/nvrtc-check.py \
        "$lib/libnvrtc.so" strategies/src/half.cuh "strategies/src/attention/flash.cu@$flash_arch" \
        strategies/src/adamw/adamw.cu strategies/src/accumulate/accumulate.cu \
        strategies/src/nn/ops/fused.cu strategies/src/nn/loss/loss.cu >&2 ||
        die "a run-time kernel source does not compile with NVRTC (log above)"
}

# Step 4: the release build, with the environment cudarc and cudaforge read.
cargo_build() {
    local home=$CACHE/cuda-home rpath start
    rpath=$(IFS=:; printf '%s' "${GPU_LIB_DIRS[*]}")
    export CUDA_HOME=$home CUDA_PATH=$home PATH=$home/bin:$PATH
    export CUDA_COMPUTE_CAP=$COMPUTE_CAP CUDARC_CUDA_VERSION=13000 CUDAFORGE_THREADS=2
    export RUSTFLAGS="${RUSTFLAGS:+$RUSTFLAGS }-C link-arg=-Wl,-rpath,$rpath"
    say "nvcc: $(nvcc --version | sed -n 's/^Cuda compilation tools, //p')"
    say "cargo build --release --features $FEATURES --target-dir target-cuda ${TARGET_ARGS[*]} (CUDA_COMPUTE_CAP=$COMPUTE_CAP)"
    start=$SECONDS
    cargo build --release --features "$FEATURES" --target-dir target-cuda "${TARGET_ARGS[@]}"
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
install_toolkit
nv=$(wheel_root)
bindings=$(cudarc_driver_bindings)
assemble_cuda_home "$nv" "$bindings"
check_kernels
cargo_build
package_binary
say "Done: copy $PACKAGED.xz to the GPU machine and unpack it with xz -d"
