"""The GPU acceptance kit: runs each measurement under its own time limit and writes
OUTDIR/gpu-kit.json (the machine, then one object per step: its figures, or {"skipped": why}
or {"error": text}) and OUTDIR/gpu-kit.log (every step's stderr). The JSON is rewritten after
each step, so a killed run keeps what it measured. docs/gpu.md says what each figure means.

    python bench/gpu/run.py OUTDIR [--cpu] [--budget-s 500] [--steps a,b]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
# (step, seconds it may take on a GPU machine): they sum to 495 s, inside the kit's 9 minutes
STEPS = {
    "cuda_tests": 160,
    "switch_latency": 50,
    "priority_latency": 100,
    "inference_memory": 70,
    "faults": 80,
    "gang": 35,
}


def machine(cpu: bool) -> dict[str, Any]:
    """The device, driver, CUDA and torch versions, from torch and NVML."""
    import torch

    out: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "torch_cuda": torch.version.cuda, "hostname": platform.node(),
                           "cpu_count": os.cpu_count(), "mode": "cpu" if cpu else "cuda",
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
            "memory_total_bytes": int(pynvml.nvmlDeviceGetMemoryInfo(handle).total),
        }
        pynvml.nvmlShutdown()
    except Exception as exc:  # noqa: BLE001 - no NVML or no driver: say which
        out["nvml"] = {"skipped": f"{type(exc).__name__}: {exc}"[:300]}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        out["device"] = props.name
        out["device_memory_bytes"] = int(props.total_memory)
        out["multiprocessors"] = props.multi_processor_count
    else:
        out["device"] = "cpu"
    return out


def run_step(name: str, limit_s: float, flags: list[str], log: Any) -> dict[str, Any]:
    """One step's JSON object, or {"error": ...} when it failed or ran past `limit_s`."""
    log.write(f"\n==== {name} (limit {limit_s:.0f} s) ====\n")
    log.flush()
    proc = subprocess.Popen([sys.executable, str(HERE / f"{name}.py"), *flags],
                            stdout=subprocess.PIPE, stderr=log, text=True,
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
    parser.add_argument("--budget-s", type=float, default=500.0,
                        help="seconds for all steps together (default 500)")
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
    report: dict[str, Any] = {"kit": "salusd gpu acceptance kit", "machine": machine(cpu),
                              "steps": {}}
    deadline = time.monotonic() + args.budget_s
    with open(args.outdir / "gpu-kit.log", "a") as log:
        for name, limit_s in STEPS.items():
            left = deadline - time.monotonic()
            if name not in chosen:
                result: dict[str, Any] = {"skipped": "not among --steps"}
            elif left < 10:
                result = {"skipped": f"the kit's {args.budget_s:.0f} s budget was spent"}
            else:
                started = time.monotonic()
                result = run_step(name, min(limit_s, left), flags, log)
                result["step_seconds"] = time.monotonic() - started
            report["steps"][name] = result
            path.write_text(json.dumps(report, indent=2) + "\n")
            status = next((k for k in ("error", "skipped") if k in result), "ok")
            print(f"{name}: {status}", file=sys.stderr, flush=True)
    print(path)


if __name__ == "__main__":
    main()
