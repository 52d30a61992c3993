"""The daemon process never imports torch: it serves a job that trains with torch in its
executor, and its REST API and metrics, without loading any of torch.

Importing any module of torch loads torch's compiled core (`torch/_C`, `libtorch*`), which
then shows in the process's memory map (/proc/PID/maps). The job's executor, which runs torch,
is checked the same way, so that the check is seen to find torch where it is loaded. The
daemon is started with CPU devices; finding devices is checked on its own, down the path a GPU
host without nvidia-ml-py takes (a `torch.cuda` probe in a subprocess)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from daemon_proc import salusd
from rest_client import connect as rest
from torch import nn

import salus.adapters.torch as salus

pytestmark = pytest.mark.slow

TORCH_DIR = str(Path(torch.__file__).resolve().parent) + "/"


def torch_files_mapped(pid: int) -> set[str]:
    """The files of the torch package (and any libtorch) mapped into process `pid`."""
    with open(f"/proc/{pid}/maps") as f:
        fields = [line.split(maxsplit=5) for line in f]
    paths = {f[5].strip() for f in fields if len(f) == 6}  # the sixth field: the file, if any
    return {p for p in paths if p.startswith(TORCH_DIR) or "libtorch" in Path(p).name}


FIND_DEVICES = """
import json, os, sys
from salus.daemon.devices import discovery as devices
exists = os.path.exists
os.path.exists = lambda p: p == "/dev/nvidiactl" or exists(p)  # as on a GPU host
probed = devices.probe_cuda_devices()
found = devices.discover()
print(json.dumps([len(probed), [d.kind for d in found], "torch" in sys.modules]))
"""


def test_finding_devices_never_imports_torch() -> None:
    done = subprocess.run([sys.executable, "-c", FIND_DEVICES], capture_output=True, text=True,
                          timeout=300, check=True)
    gpus = torch.cuda.device_count()
    assert json.loads(done.stdout) == [gpus, ["cuda"] * gpus or ["cpu"], False]


def test_the_daemon_process_never_loads_torch(tmp_path: Path) -> None:
    with salusd(tmp_path, "--http", "127.0.0.1:0") as (proc, address):
        assert torch_files_mapped(proc.pid) == set()  # started: devices, zygote, REST
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        with salus.connect(name="no-torch-in-salusd", iterations=5, address=address) as job:
            step = job.train_step(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                  nn.MSELoss())
            losses = [step(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(5)]
            executor = int(job.info()["executor_pid"])
            assert any("libtorch" in Path(p).name for p in torch_files_mapped(executor))
            with rest(tmp_path / "state") as client:
                for route in ("/v1/jobs", "/v1/devices", "/v1/lanes", "/healthz"):
                    assert client.get(route).status_code == 200, route
                assert "CPU" in client.get("/v1/devices").json()[0]["sharing"]
            metrics = httpx.get((tmp_path / "state" / "http.url").read_text().strip()
                                + "/metrics", timeout=30)
            assert "salusd_job_persistent_bytes" in metrics.text
            assert torch_files_mapped(proc.pid) == set()  # while the job is resident
        assert all(math.isfinite(loss) for loss in losses)
        assert torch_files_mapped(proc.pid) == set()  # and after it ended
        assert proc.poll() is None
