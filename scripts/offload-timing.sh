#!/usr/bin/env bash
# Step time of the offloaded optimizer (cpu-adamw) against the fused AdamW on
# the same plan, in fp32 and bf16, for GPT-2 small and a TinyLlama-1.1B shape:
# what the step-time model's host-bus and host-AdamW rates are fitted to
# (src/speed.rs). Per run: the median step time of steps 2-6 (step 1 loads and
# compiles the kernels) beside the modelled one. The offloaded step moves
# 2 x P x (compute bytes) over the bus and steps P parameters on the host, so
# the difference between the two precisions' offloaded-minus-fused times
# separates the bus (4 more bytes per parameter in fp32) from the host's rate.
#
# Usage: scripts/offload-timing.sh [OOMFIX_BINARY]   (on a GPU machine;
#   default target-cuda/release/oomfix, built by scripts/build-cuda.sh)
set -euo pipefail
bin=${1:-target-cuda/release/oomfix}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
python3 "$(dirname "$0")/make-sparse-llama.py" "$dir/tinyllama.safetensors" 22 2048 32 4 5632 32000 >/dev/null
printf '%-10s %-5s %-12s %10s %12s %12s\n' model prec optimizer parameters "step ms" "modelled ms"
for model in gpt2 tinyllama; do
    [ "$model" = gpt2 ] && src=() || src=("$dir/tinyllama.safetensors" --init random)
    for prec in bf16 fp32; do
        for opt in fused-adamw cpu-adamw; do
            if ! timeout 300 "$bin" train "${src[@]}" --device cuda:0 --budget 70GiB \
                --precision "$prec" --attention flash --checkpoint every --micro-batch 4 \
                --global-batch 4 --seq-len 1024 --optimizer "$opt" --steps 6 \
                --json --log-format json >"$dir/out.json" 2>"$dir/log"; then
                echo "$model $prec $opt failed:" >&2; tail -3 "$dir/log" >&2; continue
            fi
            python3 - "$model" "$prec" "$opt" "$dir/out.json" "$dir/log" <<'PY'
import json, statistics, sys
model, prec, opt, out, log = sys.argv[1:]
run = json.load(open(out))
steps = [json.loads(l)["fields"]["seconds"] for l in open(log)
         if l.startswith("{") and json.loads(l)["fields"].get("message") == "step"]
print(f"{model:<10} {prec:<5} {opt:<12} {run['model']['parameters']:>10} "
      f"{1e3 * statistics.median(steps[1:]):>12.1f} {1e3 * run['estimated_step_seconds']:>12.1f}")
PY
        done
    done
done
