#!/usr/bin/env bash
# Wall time of `oomfix inspect` and `oomfix --budget 80GiB` on a sparse 70B Llama
# header, as whole processes (target: under 50 ms each). Uses hyperfine when
# installed, else a loop of 20 runs reporting the median.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --quiet
bin=target/release/oomfix
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
python3 scripts/make-sparse-llama.py "$dir/llama-70b.safetensors"
du -h --apparent-size "$dir/llama-70b.safetensors" | sed 's/^/apparent size: /'
du -h "$dir/llama-70b.safetensors" | sed 's/^/on disk:       /'
cmds=("$bin inspect $dir/llama-70b.safetensors" "$bin --budget 80GiB --gpus 8 $dir/llama-70b.safetensors")
if command -v hyperfine >/dev/null; then
    hyperfine -N --warmup 3 -i "${cmds[@]}"
else
    for c in "${cmds[@]}"; do
        times=()
        for _ in $(seq 20); do
            s=$(date +%s%N); $c >/dev/null 2>&1 || true; e=$(date +%s%N)
            times+=($(( (e - s) / 1000 )))
        done
        median=$(printf '%s\n' "${times[@]}" | sort -n | sed -n 10p)
        echo "median ${median} us over 20 runs: $c"
    done
fi
