#!/usr/bin/env bash
# Per-rank memory and step time of ZeRO stages 1-3, as run: 2 ranks beside one
# process (stage 0) with the same global batch. Prints, per stage, each rank's
# measured peak (the training summary's rank_peak_bytes) beside the plan's
# estimate, the last loss, the median step time after the first step, and
# rank 0's collectives in that step (megabytes handed over, milliseconds).
#
#   cpu  (default): the built-in GPT-2 small shape, fp32, composed attention,
#        micro-batch 1 x 4 accumulated on 2 ranks over Open MPI (the binary
#        built with `--features mpi`), sequence 64, 2 steps.
#   cuda: the built-in GPT-2 small shape, bf16, flash attention, micro-batch 8
#        on 2 ranks over NCCL (`--features nccl`), sequence 1024, 6 steps. Two
#        ranks on one GPU need NCCL 2.30 or newer and
#        NCCL_MULTI_RANK_GPU_ENABLE=1 in the environment.
#
# Usage: scripts/zero-stages.sh [--device cpu|cuda] [--checkpoint POLICY] [--optimizer NAME] [--logs DIR] [OOMFIX_BINARY [TRAIN_ARGS...]]
#   (--checkpoint none by default; `every` makes stage 3 gather one block at a time;
#   --optimizer fused-adamw by default; cpu-adamw offloads each rank's share, and on
#   the CPU, whose host memory is the same, the estimate then counts the host's bytes)
#   (default binary target/release/oomfix; --logs keeps each run's JSON log
#   lines; TRAIN_ARGS go to every `oomfix train`, e.g. a model file and
#   `--init random`; a planning option among them, e.g. `--micro-batch 1`,
#   replaces the device's default)
set -euo pipefail
device=cpu logs= checkpoint=none optimizer=fused-adamw
while (($#)); do
    case $1 in
        --checkpoint) checkpoint=${2:?--checkpoint needs a policy}; shift 2 ;;
        --device) device=${2:?--device needs cpu or cuda}; shift 2 ;;
        --optimizer) optimizer=${2:?--optimizer needs a name}; shift 2 ;;
        --logs) logs=${2:?--logs needs a directory}; shift 2 ;;
        *) break ;;
    esac
done
bin=${1:-target/release/oomfix}
shift $(($# > 0 ? 1 : 0))
extra=("$@")
case $device in
    cpu)
        common=(--device cpu --precision fp32 --attention composed --micro-batch 1 --global-batch 8
                --seq-len 64 --steps 2 --budget 16GiB)
        one=(--grad-accum 8) two=(--grad-accum 4) ;;
    cuda)
        common=(--device cuda --precision bf16 --attention flash --micro-batch 8 --global-batch 16
                --seq-len 1024 --steps 6 --budget 60GiB)
        one=(--grad-accum 2) two=(--grad-accum 1) ;;
    *) echo "--device must be cpu or cuda, not '$device'" >&2; exit 2 ;;
esac
# A planning option TRAIN_ARGS give replaces the device's default (a given
# micro-batch or accumulation also the accumulation each stage pins).
[[ " ${extra[*]} " == *" --micro-batch "* || " ${extra[*]} " == *" --grad-accum "* ]] && one=() two=()
defaults=()
for ((i = 0; i < ${#common[@]}; i += 2)); do
    [[ " ${extra[*]} " == *" ${common[i]} "* ]] || defaults+=("${common[i]}" "${common[i + 1]}")
done
common=(train "${extra[@]}" "${defaults[@]}" --optimizer "$optimizer" --checkpoint "$checkpoint" --json --log-format json)
[ -n "$logs" ] && mkdir -p "$logs"
printf '%-6s %-22s %-14s %-8s %-10s %-8s %-22s %s\n' stage "peak by rank (MB)" "estimate (MB)" "max/est" "last loss" "step ms" "collectives (MB, ms)" "device MiB by process (nvidia-smi)"
for stage in 0 1 2 3; do
    if [ "$stage" = 0 ]; then
        args=("${one[@]}" --zero-stage 0)
    else
        args=("${two[@]}" --zero-stage "$stage" --gpus 2)
    fi
    log=${logs:-/tmp}/zero-stage-$stage-$device-$checkpoint.log
    : >"$log.smi"
    if [ "$device" = cuda ]; then
        nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits -lms 200 >"$log.smi" &
        smi=$!
    fi
    status=0
    timeout 300 "$bin" "${common[@]}" "${args[@]}" 2>"$log" >"$log.json" || status=$?
    [ "$device" = cuda ] && kill "$smi"
    if [ "$status" != 0 ]; then
        echo "stage $stage failed (exit $status):" >&2; tail -5 "$log" >&2; continue
    fi
    python3 - "$stage" "$log" "$log.json" "$log.smi" "$device" <<'PY'
import json, sys
stage, log, report, smi, device = sys.argv[1:]
doc = json.load(open(report))
t, est = doc["training"], doc["estimate"]
ranks = t.get("rank_peak_bytes") or [t["peak_bytes"]]
# The measured peak is live tensor bytes (on CUDA the pool's used high-water
# mark): compare the estimate without the runtime and the pool's slack.
live = est["peak_bytes"] - est["runtime_bytes"] - est["pool_slack_bytes"] - est.get("communicator_bytes", 0)
if device == "cpu":
    live += est.get("host_bytes", 0)  # an offloaded optimizer's state: the same memory
steps = []
for line in open(log):
    try:
        f = json.loads(line)["fields"]
    except (ValueError, KeyError):
        continue
    if f.get("message") == "step" and f.get("step", 0) > 1:
        steps.append((f["seconds"], f.get("collective_bytes", 0), f.get("collective_seconds", 0)))
steps.sort()
# The median step after the first (which loads and compiles the kernels), and its collectives.
mid = steps[len(steps) // 2] if steps else None
ms = f"{mid[0] * 1e3:.1f}" if mid else "-"
coll = f"{mid[1] / 1e6:.1f}, {mid[2] * 1e3:.1f}" if mid else "-"
procs = {}
for line in open(smi):
    pid, _, mib = line.partition(",")
    if mib.strip().isdigit():
        procs[pid] = max(procs.get(pid, 0), int(mib))
print(f"{stage:<6} {', '.join(str(r // 10**6) for r in ranks):<22} {live // 10**6:<14} "
      f"{max(ranks) / live:<8.3f} {t['last_loss']:<10.4f} {ms:<8} {coll:<22} "
      f"{', '.join(map(str, sorted(procs.values()))) or '-'}")
PY
done
