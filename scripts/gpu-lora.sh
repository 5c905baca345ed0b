#!/usr/bin/env bash
# QLoRA on a Llama-3-8B-shaped model (random weights) inside an enforced
# 8 GiB budget on the GPU machine, beside PyTorch + PEFT bf16 LoRA on the
# same shape (scripts/peft-step.py), with a bf16 base and with bitsandbytes'
# NF4 base (QLoRA), in one run: the oomfix binary built by
# scripts/build-cuda.sh in CARRY, the model made here by
# scripts/make-hub-shape.py (a header over a sparse data region:
# --init random reads none of it), and PEFT's package (pure Python) and
# bitsandbytes' (the PyPI wheel unpacked, its libbitsandbytes_cuda130.so the
# only library kept) in CARRY/py.
#
# Usage: scripts/gpu-lora.sh CARRY SEQ STEPS   (writes into $OUT)
set -uo pipefail
carry=${1:?carry folder} seq=${2:-512} steps=${3:-4}
out=${OUT:-/tmp/gpu-lora}
mkdir -p "$out"
xz -dc "$carry/oomfix-cuda.xz" >/tmp/oomfix && chmod +x /tmp/oomfix
python3 "$(dirname "$0")/make-hub-shape.py" llama-3-8b /tmp/l3
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/card.txt"
export NCCL_NVLS_ENABLE=0
echo "== oomfix"
timeout 300 /tmp/oomfix train /tmp/l3 --init random --device cuda:0 --budget 8GiB \
    --enforce-budget --lora 16 --base-precision nf4 --seq-len "$seq" --steps "$steps" \
    >"$out/oomfix.txt" 2>"$out/oomfix.log"
echo "oomfix exit $?"
tail -n 30 "$out/oomfix.txt" "$out/oomfix.log"
for base in nf4 bf16; do
    echo "== PyTorch + PEFT, $base base"
    PYTHONPATH="$carry/py" timeout 200 python3 "$(dirname "$0")/peft-step.py" /tmp/l3/config.json \
        --rank 16 --seq "$seq" --micro 1 --accum 8 --steps "$steps" --base "$base" \
        >"$out/peft-$base.json" 2>"$out/peft-$base.log"
    echo "peft $base exit $?"
    cat "$out/peft-$base.json"
    tail -n 5 "$out/peft-$base.log"
done
