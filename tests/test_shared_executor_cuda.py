"""Executors per (owner, lane) on a GPU: two jobs of one owner on cuda:0 share one executor
process, so NVML sees one process (one CUDA context) for both, and each trains as its direct
run on the same GPU does. Run by the GPU kit (`bench/gpu/run.sh`); skipped without a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from client_proc import finish, go, reap
from daemon_proc import salusd

from salus.daemon.cli.control import Control

pytestmark = [pytest.mark.cuda, pytest.mark.slow,
              pytest.mark.skipif(not os.path.exists("/dev/nvidiactl"),
                                 reason="needs a CUDA device")]

GOOD = textwrap.dedent("""
    import json, sys
    from types import SimpleNamespace
    import torch
    from torch import nn
    import salus.adapters.torch as salus

    seed = int(sys.argv[1])

    def build():
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))
        return model, torch.optim.Adam(model.parameters(), lr=1e-3)

    g = torch.Generator().manual_seed(seed)
    data = [(torch.randn(64, 64, generator=g), torch.randint(0, 8, (64,), generator=g))
            for _ in range(20)]

    def step(s, x, y):
        device = next(s.model.parameters()).device
        order = torch.randperm(x.shape[0])[:32]  # the CPU generator: the job's own stream
        s.opt.zero_grad()
        out = s.model(x[order].to(device))
        loss = nn.functional.cross_entropy(out, y[order].to(device))
        loss.backward()
        s.opt.step()
        return loss.detach().cpu()

    model, opt = build()
    torch.manual_seed(1000 + seed)
    with salus.connect(name=f"gpu{seed}", iterations=len(data)) as job:
        remote = job.attach(model=model, opt=opt)
        train = remote.iteration(step)
        for i, (x, y) in enumerate(data):
            if i == 5:
                print(json.dumps({"job": job.id}), flush=True)
                sys.stdin.readline()
            train(x, y)
        remote.pull()
    direct, dopt = build()
    direct.cuda()
    dopt = torch.optim.Adam(direct.parameters(), lr=1e-3)
    torch.manual_seed(1000 + seed)
    s = SimpleNamespace(model=direct, opt=dopt)
    for x, y in data:
        step(s, x, y)
    diff = max((a.cpu() - b.cpu()).abs().max().item()
               for a, b in zip(model.state_dict().values(), direct.state_dict().values()))
    print(json.dumps({"max_abs_diff": diff}), flush=True)
""")


def _gpu_processes() -> set[int]:
    import pynvml
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    return {p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)}


def test_two_jobs_of_one_owner_share_one_cuda_context(tmp_path: Path) -> None:
    (tmp_path / "good.py").write_text(GOOD)
    env = {"OMP_NUM_THREADS": "1", "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    with salusd(tmp_path, "--policy", "fair", gpus=True) as (proc, address):
        goods = [subprocess.Popen([sys.executable, str(tmp_path / "good.py"), str(seed)],
                                  env={**env, "SALUS_ADDRESS": address}, text=True,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE) for seed in (1, 2)]
        try:
            ids = []
            for g in goods:
                assert g.stdout is not None
                line = g.stdout.readline()
                assert line, finish(g, timeout_s=60)
                ids.append(str(json.loads(line)["job"]))
            with Control(address) as ctl:
                jobs = {str(j["job_id"]): j for j in ctl.status()["jobs"]}
            pids = {jobs[i]["executor"]["pid"] for i in ids}
            assert len(pids) == 1, jobs
            assert {jobs[i]["device"] for i in ids} == {0}
            assert pids <= _gpu_processes()  # one context on the GPU for both jobs
            for g in goods:
                go(g)
            for g in goods:
                out, err = finish(g, timeout_s=300)
                assert g.returncode == 0, err
                # The same kernels on the same GPU: equal to float rounding at most.
                assert json.loads(out.strip().splitlines()[-1])["max_abs_diff"] < 1e-5, out
        finally:
            reap(goods)
        assert proc.poll() is None
