#!/usr/bin/env python3
"""Several ranks of `oomfix train`, started every way and broken on purpose.

Runs on the CPU (Open MPI, the binary built with `--features mpi`) or on
CUDA (NCCL, `--features nccl`; N ranks on one GPU need NCCL 2.30 or newer
and NCCL_MULTI_RANK_GPU_ENABLE=1), and prints one line per check:

  launcher     `train --gpus N` starts the N ranks itself; K steps
  by hand      the same job started by another launcher (cpu: `mpirun -n N`,
               cuda: `torchrun --nproc-per-node N --no-python`): the same
               losses (relative 1e-5 in fp32, 1e-2 in 16 bits)
  rank killed  SIGKILL to the last rank after the first step: the launcher
               exits 3 within 60 s, naming the rank, and no rank is left
  rank hung    SIGSTOP to the last rank after the first step, with a rank
               timeout of 10 s: the others stop, naming it, and the launcher
               exits 3 within 90 s with no rank left
  verify       `plan --gpus N --verify`: the chosen plan is measured with
               N ranks (its measured bytes against its estimate)

Usage: scripts/ranks-check.py BIN [MODEL] [--device cpu|cuda] [--ranks N]
                              [--stage S] [OPTIONS...]
  (default: the built-in GPT-2 small shape, cpu, 2 ranks, ZeRO 2; planning
  OPTIONS (--seq-len, --precision, ...) replace the device's defaults below
  in every run, the others (--init random, --data FILE) go to `train` only)
Exit status: 0 when every check passed, 1 otherwise.
"""
import json
import os
import signal
import subprocess
import sys
import time

DEFAULTS = {
    "cpu": ["--precision", "fp32", "--attention", "composed", "--micro-batch", "1",
            "--global-batch", "8", "--seq-len", "64", "--budget", "16GiB"],
    "cuda": ["--precision", "bf16", "--attention", "flash", "--micro-batch", "4",
             "--global-batch", "16", "--seq-len", "512", "--budget", "60GiB"],
}
STEPS = 3


PLANNING = {"--precision", "--attention", "--micro-batch", "--grad-accum", "--global-batch",
            "--seq-len", "--budget", "--checkpoint", "--optimizer", "--bucket-size", "--headroom"}


def parse(argv):
    """The script's options, the binary, the planning options (the device's
    defaults, overridden by those given) and the train-only arguments."""
    opts = {"device": "cpu", "ranks": 2, "stage": 2}
    given, train_only = {}, []
    positional = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        key = arg[2:] if arg.startswith("--") else None
        if key in opts and i + 1 < len(argv):
            opts[key] = argv[i + 1] if key == "device" else int(argv[i + 1])
            i += 2
        elif arg in PLANNING and i + 1 < len(argv):
            given[arg] = argv[i + 1]
            i += 2
        elif arg.startswith("--") and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            train_only += [arg, argv[i + 1]]
            i += 2
        elif arg.startswith("--"):
            train_only.append(arg)
            i += 1
        else:
            positional.append(arg)
            i += 1
    if not positional or opts["device"] not in DEFAULTS:
        sys.exit(__doc__)
    defaults = DEFAULTS[opts["device"]]
    planning = dict(zip(defaults[::2], defaults[1::2]), **given)
    planning = positional[1:] + [x for kv in planning.items() for x in kv]
    return opts, positional[0], planning, train_only


def records(stderr):
    out = []
    for line in stderr.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def losses(stderr):
    return [r["fields"]["loss"] for r in records(stderr) if r.get("fields", {}).get("message") == "step"]


def close(a, b, tol):
    return len(a) == len(b) > 0 and all(abs(x - y) <= tol * abs(y) for x, y in zip(a, b))


def main():
    opts, binary, planning, train_only = parse(sys.argv[1:])
    device, n, stage = opts["device"], opts["ranks"], str(opts["stage"])
    planning += ["--device", device, "--zero-stage", stage]
    train = [binary, "train", *planning, *train_only, "--log-format", "json"]
    tol = 1e-5 if "fp32" in planning else 1e-2
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    results = []

    def check(name, ok, detail):
        results.append(ok)
        print(f"{name:<12} {'ok' if ok else 'FAILED':<7} {detail}", flush=True)

    # 1. The launcher.
    t = time.time()
    run = subprocess.run(train + ["--gpus", str(n), "--steps", str(STEPS)], env=env,
                         capture_output=True, text=True, timeout=900)
    want = losses(run.stderr)
    check("launcher", run.returncode == 0 and len(want) == STEPS,
          f"exit {run.returncode}, losses {want}, {time.time() - t:.0f} s"
          + ("" if run.returncode == 0 else f": {run.stderr[-500:]}"))

    # 2. Another launcher.
    if device == "cpu":
        by_hand = ["mpirun", "-n", str(n), "--oversubscribe", "--bind-to", "none"]
        env_hand = dict(env, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    else:
        by_hand = ["torchrun", "--nproc-per-node", str(n), "--no-python"]
        env_hand = env
    run = subprocess.run(by_hand + train + ["--steps", str(STEPS)], env=env_hand,
                         capture_output=True, text=True, timeout=900)
    got = losses(run.stderr)
    check("by hand", run.returncode == 0 and close(got, want, tol),
          f"exit {run.returncode}, losses {got}" + ("" if run.returncode == 0 else f": {run.stderr[-500:]}"))

    # 3. A rank killed after the first step, and one stopped (hung) there.
    def broken(name, sig, extra_env, limit):
        job = subprocess.Popen(train + ["--gpus", str(n), "--steps", "1000000"],
                               env=dict(env, **extra_env), stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
        pids, stepped, lines = {}, False, []
        deadline = time.time() + 600
        while not (stepped and len(pids) == n) and time.time() < deadline:
            line = job.stderr.readline()
            if not line:
                break
            lines.append(line)
            for r in records(line):
                f = r.get("fields", {})
                if f.get("message") == "rank started":
                    pids[f["rank"]] = f["pid"]
                stepped |= f.get("message") == "step"
        if not (len(pids) == n and stepped):
            job.kill()
            check(name, False, f"the job did not start: {''.join(lines)[-500:]}")
            return
        os.kill(pids[n - 1], sig)
        broke = time.time()
        try:
            _, rest = job.communicate(timeout=limit)
            code, waited = job.returncode, time.time() - broke
        except subprocess.TimeoutExpired:
            job.kill()
            _, rest = job.communicate()
            code, waited = None, None
        alive = [r for r, p in pids.items() if os.path.exists(f"/proc/{p}")
                 and open(f"/proc/{p}/stat").read().rsplit(") ", 1)[-1][:1] not in "ZX"]
        said = [r["fields"]["message"] for r in records(rest) if r.get("level") == "ERROR"]
        named = any(f"rank {n - 1}" in m for m in said)
        check(name, code == 3 and not alive and named,
              f"exit {code} after {waited and round(waited, 1)} s, ranks still running {alive}, "
              f"errors {said[:2]}")

    broken("rank killed", signal.SIGKILL, {}, 60)
    # Stopped: silent for the rank timeout (10 s), then the others stop; the
    # launcher kills what is left after its grace period (30 s).
    broken("rank hung", signal.SIGSTOP, {"OOMFIX_RANK_TIMEOUT": "10"}, 90)

    # 4. --verify with ranks.
    plan = [binary, "plan", *planning, "--gpus", str(n), "--verify", "--json"]
    run = subprocess.run(plan, env=env, capture_output=True, text=True, timeout=900)
    try:
        attempts = json.loads(run.stdout)["attempts"]
        measured = [a for a in attempts if isinstance(a.get("measured_bytes"), int)]
        a = measured[-1]
        ratio = a["measured_bytes"] / a["estimated_bytes"]
        check("verify", run.returncode == 0 and a["world_size"] == n,
              f"{len(measured)} measured; the last: {a['measured_bytes']} B measured, "
              f"{a['estimated_bytes']} B estimated ({ratio:.3f})")
    except (ValueError, KeyError, IndexError) as e:
        check("verify", False, f"exit {run.returncode}, {e}: {run.stderr[-500:]}")
    sys.exit(0 if all(results) else 1)


if __name__ == "__main__":
    main()
