"""The GPU acceptance kit: runs each measurement under its own time limit and writes
OUTDIR/gpu-kit.json (the machine, then one object per step: its figures, or {"skipped": why}
or {"error": text}; every figure as {"value", "goal", "met"}; and a `verdict`) and
OUTDIR/gpu-kit.log (every step's stderr). The JSON is rewritten after each step, so a killed
run keeps what it measured. docs/gpu.md says what each figure means.

    python bench/gpu/run.py OUTDIR [--cpu] [--budget-s 400] [--steps a,b]

This process never creates a CUDA context: the device's properties and a context's cost are
read in subprocesses, and the cost is passed to every daemon the steps start
(`salusd serve --context-bytes`), so no daemon measures it again.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import goals

HERE = Path(__file__).resolve().parent
# (step, its weight: seconds it may take on a GPU machine at a 415 s budget): each step's share
# of `--budget-s` is in proportion
STEPS = {
    "cuda_tests": 110,
    "switch_latency": 45,
    "priority_latency": 70,
    "inference_memory": 50,
    "faults": 60,
    "gang": 30,
    "script_job": 30,
    "mstopk": 20,
    "mps_facts": 40,
}
DEFAULT_BUDGET_S = 400.0
RESERVE_S = 15.0  # kept for each step still to run when one step may take more than its share

_PROPS = """
import json, torch
p = torch.cuda.get_device_properties(0)
print(json.dumps({"device": p.name, "device_memory_bytes": int(p.total_memory),
                  "multiprocessors": p.multi_processor_count,
                  "capability": f"{p.major}.{p.minor}"}))
"""


def machine(cpu: bool) -> dict[str, Any]:
    """The host, the device, driver, CUDA and torch versions: torch's build here (importing
    torch starts no CUDA), NVML's view, and the device's properties from a subprocess."""
    import torch

    out: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "torch_cuda": torch.version.cuda, "hostname": platform.node(),
                           "kernel": platform.release(), "cpu_count": os.cpu_count(),
                           "mode": "cpu" if cpu else "cuda",
                           "mps_control": shutil.which("nvidia-cuda-mps-control"),
                           "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        out["nvml"] = {
            "driver": pynvml.nvmlSystemGetDriverVersion(),
            "cuda_driver": pynvml.nvmlSystemGetCudaDriverVersion_v2(),
            "devices": pynvml.nvmlDeviceGetCount(),
            "device": pynvml.nvmlDeviceGetName(handle),
            "uuid": pynvml.nvmlDeviceGetUUID(handle),
            "memory_total_bytes": int(pynvml.nvmlDeviceGetMemoryInfo(handle).total),
            "memory_used_bytes": int(pynvml.nvmlDeviceGetMemoryInfo(handle).used),
        }
        pynvml.nvmlShutdown()
    except Exception as exc:  # noqa: BLE001 - no NVML or no driver: say which
        out["nvml"] = {"skipped": f"{type(exc).__name__}: {exc}"[:300]}
    out["device"] = "cpu"
    if not cpu and torch.cuda.is_available():  # NVML-based: no context here
        done = subprocess.run([sys.executable, "-c", _PROPS], capture_output=True, text=True,
                              timeout=120)
        lines = done.stdout.strip().splitlines()
        out.update(json.loads(lines[-1]) if done.returncode == 0 and lines else
                   {"device": "unknown", "device_error": done.stderr[-500:]})
    return out


def context_cost(cpu: bool, log: Any) -> dict[str, Any]:
    """What one CUDA context costs GPU 0, measured once as the daemon would (a subprocess that
    sees only that GPU), for every daemon the steps start."""
    if cpu:
        return {"skipped": "CPU run: executors cost no CUDA context"}
    from salus.daemon.devices.context_cost import executor_cost
    from salus.daemon.devices.discovery import cuda_devices

    try:
        gpu = cuda_devices()[0]
        cost = executor_cost(gpu)
    except Exception as exc:  # noqa: BLE001 - then each daemon measures its own
        log.write(f"context cost: {type(exc).__name__}: {exc}\n")
        return {"error": f"{type(exc).__name__}: {exc}"[:500]}
    return {"bytes": cost.bytes - cost.workspace_bytes, "workspace_bytes": cost.workspace_bytes,
            "measured": cost.measured, "how": cost.how}


def run_step(name: str, limit_s: float, flags: list[str], log: Any,
             env: dict[str, str]) -> dict[str, Any]:
    """One step's JSON object, or {"error": ...} when it failed or ran past `limit_s`."""
    log.write(f"\n==== {name} (limit {limit_s:.0f} s) ====\n")
    log.flush()
    proc = subprocess.Popen([sys.executable, str(HERE / f"{name}.py"), *flags],
                            stdout=subprocess.PIPE, stderr=log, text=True, env=env,
                            start_new_session=True)  # its daemons and clients die with it
    try:
        out, _ = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        return {"error": f"timed out after {limit_s:.0f} s"}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    with_json = [line for line in out.splitlines() if line.startswith("{")]
    log.write(out)
    if proc.returncode != 0 or not with_json:
        return {"error": f"exit {proc.returncode}; see gpu-kit.log"}
    result: dict[str, Any] = json.loads(with_json[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--cpu", action="store_true",
                        help="CPU devices only, smallest sizes (also chosen without CUDA)")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                        help=f"seconds for the whole run (default {DEFAULT_BUDGET_S:.0f}); each "
                        "step's limit is its share of it")
    parser.add_argument("--steps", default=",".join(STEPS),
                        help=f"comma-separated steps to run (default all: {','.join(STEPS)})")
    args = parser.parse_args()
    # Inherited by every step before it imports torch: no CUDA initialised by the check, and
    # one intra-op thread per process, as the daemon's executors and the baselines use.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    cpu = args.cpu or not torch.cuda.is_available()
    chosen = args.steps.split(",")
    unknown = set(chosen) - set(STEPS)
    if unknown:
        parser.error(f"unknown steps {sorted(unknown)}; known: {list(STEPS)}")
    flags = ["--cpu", "--small"] if cpu else []
    args.outdir.mkdir(parents=True, exist_ok=True)
    path = args.outdir / "gpu-kit.json"
    started = time.monotonic()
    deadline = started + args.budget_s
    with open(args.outdir / "gpu-kit.log", "a") as log:
        report: dict[str, Any] = {"kit": "salusd gpu acceptance kit", "machine": machine(cpu),
                                  "budget_s": args.budget_s, "steps": {}}
        report["machine"]["context_cost"] = context_cost(cpu, log)
        # the steps share what the machine's description and the context's cost left
        share = (deadline - time.monotonic()) / sum(STEPS[n] for n in chosen)
        env = dict(os.environ)
        if isinstance(report["machine"]["context_cost"].get("bytes"), int):
            env["SALUS_KIT_CONTEXT_BYTES"] = str(report["machine"]["context_cost"]["bytes"])
        for name, weight in STEPS.items():
            left = deadline - time.monotonic()
            if name not in chosen:
                result: dict[str, Any] = {"skipped": "not among --steps"}
            elif left < 10:
                result = {"skipped": f"the kit's {args.budget_s:.0f} s budget was spent"}
            else:
                # Its share of the budget, or up to twice that where earlier steps left time,
                # keeping RESERVE_S for each step still to come.
                later = [n for n in list(STEPS)[list(STEPS).index(name) + 1:] if n in chosen]
                limit = min(2 * weight * share, left - RESERVE_S * len(later))
                began = time.monotonic()
                limit = max(limit, 10.0)
                env["SALUS_KIT_STEP_LIMIT_S"] = f"{limit:.0f}"
                result = run_step(name, limit, flags, log, env)
                result["step_seconds"] = time.monotonic() - began
            report["steps"][name] = goals.judge(name, result, cuda=not cpu)
            report["verdict"] = goals.verdict(report["steps"])
            report["kit_seconds"] = time.monotonic() - started
            path.write_text(json.dumps(report, indent=2) + "\n")
            status = next((k for k in ("error", "skipped") if k in result), "ok")
            print(f"{name}: {status}", file=sys.stderr, flush=True)
    print(path)


if __name__ == "__main__":
    main()
