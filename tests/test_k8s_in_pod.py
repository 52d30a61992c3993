"""A pod runs its own script under salusd's turns (issue 35's in-pod execution), against the real
daemon with its device plugin and a fake kubelet (`test_k8s_pod_sockets.py`'s node).

The "pod" is a process in its own mount namespace that sees salusd only through its
allocation's directory, bind-mounted as the container runtime mounts it, and its own copy of
the script in a tmpfs the node never sees; it runs as `nobody` with the grant's environment
(`SALUS_ADDRESS`, `SALUS_GRANT`), where `salusd run` runs the script in its own process
(`--here` by default). Expected values come from direct runs of the same script. Needs root
(the mounts, and the daemon's pod user), as the rest of the pod tests.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from client_proc import finish, reap
from test_k8s_pod_sockets import as_nobody, node, wait

from salus.daemon.cli.control import Control

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None
                                 or shutil.which("setpriv") is None,
                                 reason="a pod is a mount namespace (unshare) whose process "
                                 "runs as 'nobody' (setpriv): needs root and util-linux")]

TRAIN = """\
    import hashlib, sys, time, torch
    torch.manual_seed(int(sys.argv[1]))
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = torch.randn(128, 32), torch.randn(128, 1)
    for _ in range(int(sys.argv[2])):
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        time.sleep(0.01)
    print(hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                  for p in model.parameters())).hexdigest(), flush=True)
"""
STEPS = {"1": "300", "2": "120"}  # by seed: the pod's job runs while the node's starts
ENV = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}


def in_pod(allocation: Path, mount: Path, work: Path, source: Path,
           *argv: str) -> subprocess.Popen[str]:
    """`salusd run ARGV...` as a pod's process: its own mount namespace, the allocation's
    directory at `mount` (its /run/salusd), the script copied into a fresh tmpfs at `work`
    (its working directory, which the node does not see), as `nobody`, with the grant's
    environment."""
    inside = ('mount --bind "$1" "$2" && mount -t tmpfs -o mode=0777 pod "$3" && '
              'cp "$4" "$3/train.py" && chmod 0644 "$3/train.py" && cd "$3" && shift 4 && '
              'exec "$@"')
    env = {**ENV, "SALUS_ADDRESS": f"unix://{mount / 'salusd.sock'}", "SALUS_GRANT": "1"}
    return subprocess.Popen(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", inside, "sh",
         str(allocation), str(mount), str(work), str(source),
         *as_nobody(sys.executable, "-m", "salus.daemon.cli", "run", *argv)],
        env=env, cwd="/", text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_a_pods_script_runs_in_the_pod_taking_turns_with_a_host_job_and_within_its_grant(
        tmp_path: Path) -> None:
    source = tmp_path / "train.py"
    source.write_text(textwrap.dedent(TRAIN))
    want = {seed: subprocess.run([sys.executable, str(source), seed, steps], env=ENV,
                                 capture_output=True, text=True, timeout=120, check=True
                                 ).stdout.strip() for seed, steps in STEPS.items()}
    assert want["1"] != want["2"] and len(want["1"]) == len(hashlib.sha256().hexdigest())
    with node(tmp_path, gib=1) as n:
        allocation = n.allocate(1)
        mount, work = n.root / "pod-run", n.root / "pod-work"
        mount.mkdir(mode=0o755)
        work.mkdir(mode=0o755)
        pod = in_pod(allocation, mount, work, source, "--name", "in-pod", "--", sys.executable,
                     "train.py", "1", STEPS["1"])
        host = None
        try:
            with Control(n.address) as control:
                wait(lambda: pod.poll() is not None or any(
                    j["name"] == "in-pod" and j["lane"] is not None
                    for j in control.status()["jobs"]), "the pod's job placed", 120.0)
            host = subprocess.Popen(
                [sys.executable, "-m", "salus.daemon.cli", "run", "--socket",
                 n.address.removeprefix("unix://"), "--name", "on-host", "--", sys.executable,
                 str(source), "2", STEPS["2"]], env=ENV, cwd=tmp_path, text=True,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            # Where the two jobs were, each time both were placed: `fair` keeps one lane per
            # device (its id changes when a job's measured peak resizes it).
            placed: list[set[tuple[int, int]]] = []
            seen: dict[str, dict[str, Any]] = {}
            with Control(n.address) as control:
                while pod.poll() is None or host.poll() is None:
                    jobs = [j for j in control.status()["jobs"]
                            if j["name"] in ("in-pod", "on-host")]
                    if len(jobs) == 2 and all(j["lane"] is not None for j in jobs):
                        placed.append({(j["device"], j["lane"]) for j in jobs})
                    seen |= {j["name"]: control.info(str(j["job_id"])) for j in jobs}
                    assert not list(work.iterdir()), "the node sees the pod's files"
                    time.sleep(0.05)
            pod_out, pod_err = finish(pod, timeout_s=180)
            host_out, host_err = finish(host, timeout_s=180)
            with Control(n.address) as control:
                ended = control.info(str(seen["in-pod"]["job_id"]))
        finally:
            reap([pod, *([host] if host is not None else [])])
        too_big = in_pod(allocation, mount, work, source, "--name", "too-big", "--mem", "2G",
                         "--", sys.executable, "train.py", "1", "1")
        big_out, big_err = finish(too_big, timeout_s=120)
    assert pod.returncode == 0 and host.returncode == 0, (pod_err, host_err)
    assert pod_out.strip() == want["1"] and host_out.strip() == want["2"]
    assert any(len(p) == 1 for p in placed), placed  # in one lane at once: they took turns
    assert seen["in-pod"]["allocation"] == allocation.name, seen["in-pod"]  # the pod's job
    assert ended["state"] == "finished" and ended["iterations_done"] == int(STEPS["1"]), ended
    assert seen["in-pod"]["executor"]["pid"] is None, seen["in-pod"]  # no salusd executor
    assert "--here" in seen["in-pod"]["executor"]["why"]
    assert too_big.returncode != 0 and big_out == "", (big_out, big_err)
    assert "the pod's grant is 1 GiB" in " ".join(big_err.split()), big_err
