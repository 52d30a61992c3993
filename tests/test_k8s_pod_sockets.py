"""A pod reaches salusd through its allocation's socket (issue 35), against the real daemon.

`salusd serve --device-plugin` runs with a made-up GPU (`--device-plugin-test-gpu`: this host
has none; its allocations are served on CPU device 0), a fake kubelet (the device plugin test's
`FakeKubelet` and `FakePodResources`, real gRPC on unix sockets) drives `Allocate` as the
kubelet does, and clients connect with `SALUS_ADDRESS` = the socket in the directory the grant
mounts, as a pod's processes do. Jobs from a pod run as the pod user `nobody`, which needs a
daemon running as root: elsewhere these tests skip.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from client_proc import finish, reap
from daemon_proc import salusd
from rest_client import connect as rest
from test_k8s_device_plugin import FakeKubelet, FakePodResources

from salus.daemon.cli.control import Control
from salus.daemon.k8s.third_party import deviceplugin_pb2 as dp

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.geteuid() != 0, reason="a pod's jobs run as the pod user "
                                 "'nobody': only a daemon running as root can run them so")]

GPU = "GPU-99999999-1111-2222-3333-444444444444"
RESOURCE = "salusd.io/gpu-mem"
POD = "team-a/trainer"
NAMING_S = 25.0  # the plugin lists pods every 10 s


@dataclass
class Node:
    """A running salusd with its fake kubelet: `address` its main socket."""

    root: Path
    state: Path
    address: str
    kubelet: FakeKubelet
    pods: FakePodResources
    daemon: subprocess.Popen[str]

    def allocate(self, units: int, first: int = 0) -> Path:
        """Allocate `units` units from unit `first` on as the kubelet does; the directory the
        grant mounts."""
        stub = self.kubelet.dial()
        ids = [f"{GPU}::{i}" for i in range(first, first + units)]
        reply = stub.Allocate(dp.AllocateRequest(container_requests=[
            dp.ContainerAllocateRequest(devices_ids=ids)]), timeout=10)
        (response,) = reply.container_responses
        assert response.envs["SALUS_ADDRESS"] == "unix:///run/salusd/salusd.sock"
        (mount,) = [m for m in response.mounts if m.container_path == "/run/salusd"]
        directory = Path(mount.host_path)
        wait(lambda: (directory / "salusd.sock").exists(), "the allocation's socket")
        return directory


def wait(check: object, what: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@contextlib.contextmanager
def node(tmp_path: Path, gib: int) -> Iterator[Node]:
    root = Path(tempfile.mkdtemp(prefix="pod-", dir="/tmp"))  # short: socket paths
    os.chmod(root, 0o755)  # the pod user's executors run with it as their directory
    (root / "kubelet" / "device-plugins").mkdir(parents=True)
    (root / "kubelet" / "pod-resources").mkdir()
    kubelet = FakeKubelet(root / "kubelet" / "device-plugins")
    pods = FakePodResources(root / "kubelet" / "pod-resources" / "kubelet.sock")
    try:
        with serve(tmp_path, root, gib) as (daemon, address):
            wait(lambda: kubelet.requests, "the plugin's registration")
            yield Node(root, tmp_path / "state", address, kubelet, pods, daemon)
    finally:
        kubelet.stop()
        pods.stop()
        shutil.rmtree(root, ignore_errors=True)


def serve(tmp_path: Path, root: Path, gib: int) -> contextlib.AbstractContextManager[Any]:
    """salusd with its device plugin meeting the fake kubelet under `root`, under `fair`."""
    return salusd(tmp_path, "--policy", "fair", "--device-plugin", "--kubelet-dir",
                  str(root / "kubelet"),
                  "--alloc-root", str(root / "alloc"), "--pod-user", "nobody",
                  "--device-plugin-test-gpu", f"{GPU}={gib}", "--http", "127.0.0.1:0",
                  devices=1, memory="3G")


def client(node: Node, directory: Path, body: str) -> subprocess.Popen[str]:
    """A pod's process: `body` after `import salus.adapters.torch as salus`, with
    SALUS_ADDRESS at the allocation's socket."""
    script = node.root / "client.py"
    script.write_text("import json, os, sys, torch\nimport salus.adapters.torch as salus\n"
                      + textwrap.dedent(body))
    env = {"SALUS_ADDRESS": f"unix://{directory / 'salusd.sock'}", "OMP_NUM_THREADS": "1",
           "PATH": "/usr/bin:/bin"}
    return subprocess.Popen([sys.executable, str(script)], env=env, cwd=node.root, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def test_a_pods_contract_job_runs_as_the_pod_user_and_shows_its_pod(tmp_path: Path) -> None:
    nobody = pwd.getpwnam("nobody").pw_uid
    with node(tmp_path, gib=2) as n:
        directory = n.allocate(2)
        n.pods.pods[POD] = [("main", RESOURCE, [f"{GPU}::0", f"{GPU}::1"])]
        proc = client(n, directory, """
            with salus.connect(name="in-pod", iterations=1) as job:
                remote = job.attach(model=torch.nn.Linear(4, 4))
                uid = remote.function(lambda model: os.getuid())()
                print(json.dumps({"job": job.id, "uid": uid, "ping": job.ping()}), flush=True)
                sys.stdin.readline()  # the test looks at the live job meanwhile
        """)
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line, finish(proc)[1]
            seen = json.loads(line)
            assert seen["uid"] == nobody != os.getuid()
            assert seen["ping"]["owner"] in (f"alloc:{directory.name}", f"pod:{POD}")
            job_id = int(seen["job"])

            def named() -> bool:
                with Control(n.address) as control:
                    info = control.info(str(job_id))
                return info["pod"] == POD and info["allocation"] == directory.name

            wait(named, "the pod's name in the job's status", NAMING_S)
            with rest(n.state) as http:
                view = http.get(f"/v1/jobs/{job_id}").json()
                metrics = http.get("/metrics").text
            assert (view["allocation"], view["pod"]) == (directory.name, POD)
            assert (f'salusd_job_pod{{allocation="{directory.name}",job_id="{job_id}",'
                    f'pod="{POD}"}} 1.0') in metrics
            # the pod sees its own jobs only, and is not root to salusd
            with Control(f"unix://{directory / 'salusd.sock'}") as pod_control:
                assert [j["job_id"] for j in pod_control.status()["jobs"]] == [job_id]
        finally:
            out, err = finish(proc, "\n")
            reap([proc])
        assert proc.returncode == 0, err


PROBE = ("import sys; from salus.daemon.cli.control import Control; "
         "print(Control(sys.argv[1], timeout_s=10).status()['jobs'])")


def as_nobody(*command: str) -> list[str]:
    user = pwd.getpwnam("nobody")
    return ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups",
            *command]


@pytest.mark.skipif(shutil.which("unshare") is None or shutil.which("setpriv") is None,
                    reason="needs unshare and setpriv (util-linux)")
def test_only_the_pod_reaches_its_socket_and_a_gang_or_a_host_script_is_refused_saying_why(
        tmp_path: Path) -> None:
    """The allocation root is root's alone (0700): another user of the node cannot reach an
    allocation's socket by its host path, even knowing its id, while a process of the pod
    (its own mount namespace, the grant's directory bind-mounted as the runtime does) can,
    whatever its uid."""
    with node(tmp_path, gib=1) as n:
        directory = n.allocate(1)
        env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
        host = subprocess.run(as_nobody(sys.executable, "-c", PROBE,
                                        f"unix://{directory / 'salusd.sock'}"),
                              capture_output=True, text=True, timeout=60, env=env, cwd="/")
        assert host.returncode != 0 and "ermission denied" in host.stderr, host
        mount = n.root / "pod-run"  # where the pod sees /run/salusd
        mount.mkdir(mode=0o755)
        pod = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c",
             'mount --bind "$0" "$1" && shift && exec "$@"', str(directory), str(mount),
             *as_nobody(sys.executable, "-c", PROBE, f"unix://{mount / 'salusd.sock'}")],
            capture_output=True, text=True, timeout=60, env=env, cwd="/")
        assert pod.returncode == 0 and pod.stdout.strip() == "[]", pod
        gang = client(n, directory, """
            try:
                salus.connect(name="gang", iterations=1, devices=2)
            except Exception as exc:
                print(exc, flush=True)
        """)
        out, err = finish(gang, timeout_s=120)
        assert "a pod's job runs on its allocation's one GPU: 'devices' must be 1" in out, err
        run = subprocess.run(
            [sys.executable, "-m", "salus.daemon.cli", "run", "--socket",
             str(directory / "salusd.sock"), "--no-here", "--", sys.executable, "-c",
             "print(1)"],
            cwd=n.root, capture_output=True, text=True, timeout=120,
            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 125
    assert "a pod's script runs in the pod, taking turns from salusd" in " ".join(
        (run.stdout + run.stderr).split()), run.stderr


def test_a_job_bigger_than_the_pods_grant_is_refused_naming_the_grant(tmp_path: Path) -> None:
    # 1.5 GiB in all: 1.5 GiB less 16 MiB of state, and the 16 MiB a CPU device books for a
    # first call before measuring it (admission.first_call_guess)
    floats = (3 * 2**29 - 16 * 2**20) // 4
    with node(tmp_path, gib=1) as n:
        directory = n.allocate(1)
        proc = client(n, directory, f"""
            with salus.connect(name="too-big", iterations=1) as job:
                remote = job.attach(weights=torch.zeros({floats}))
                try:
                    remote.function(lambda weights: 1)()
                except Exception as exc:
                    print(json.dumps({{"job": job.id, "error": str(exc)}}), flush=True)
        """)
        out, err = finish(proc, timeout_s=180)
        assert proc.returncode == 0, err
        seen = json.loads(out.splitlines()[-1])
        with Control(n.address) as control:
            info = control.info(str(seen["job"]))
    assert "the pod's grant is 1 GiB; this job needs 1.5 GiB" in seen["error"], seen
    assert info["state"] == "failed"
    assert "the pod's grant is 1 GiB; this job needs 1.5 GiB" in str(info["reason"])


def test_a_freed_allocations_socket_goes_and_its_jobs_are_cancelled(tmp_path: Path) -> None:
    with node(tmp_path, gib=1) as n:
        directory = n.allocate(1)
        n.pods.pods[POD] = [("main", RESOURCE, [f"{GPU}::0"])]
        proc = client(n, directory, """
            job = salus.connect(name="held", iterations=10)
            job.attach(model=torch.nn.Linear(2, 2))
            print(job.id, flush=True)
            sys.stdin.readline()
        """)
        try:
            assert proc.stdout is not None
            job_id = proc.stdout.readline().strip()
            assert job_id, finish(proc)[1]

            def named() -> bool:
                with Control(n.address) as control:
                    return bool(control.info(job_id)["pod"] == POD)

            wait(named, "the pod named", NAMING_S)
            del n.pods.pods[POD]  # the pod is gone: the plugin frees its allocation
            wait(lambda: not (directory / "salusd.sock").exists(), "the socket removed",
                 NAMING_S)
            with Control(n.address) as control:
                wait(lambda: control.info(job_id)["state"] == "cancelled", "the job cancelled")
                info = control.info(job_id)
        finally:
            finish(proc, "\n")
            reap([proc])
    assert not directory.exists()
    assert (f"job {job_id} was cancelled: its pod's allocation {directory.name} was freed "
            f"(its pod {POD} is gone)") == info["reason"]


KEEP = """
    job = salus.connect(name="keep", iterations=10)
    remote = job.attach(w=torch.zeros(3))
    step = remote.iteration(lambda s: s.w.add_(1).sum().item())
    for _ in range(3 - job.resumed_from):
        step()
    print(json.dumps({"job": job.id, "resumed_from": job.resumed_from,
                      "w": remote.function(lambda s: s.w.tolist())()}), flush=True)
    sys.stdin.readline()
"""


def test_a_restart_gives_a_pods_job_back_to_its_pod_alone() -> None:
    """A pod's job restored after salusd was killed goes back to a client of its own
    allocation, at its checkpoint; another pod asking for a job of the same name (every pod
    runs as the same user) gets a new one."""
    # The daemon's state where the pod user may pass (a checkpoint is written as the pod user)
    home = Path(tempfile.mkdtemp(prefix="pod-home-", dir="/tmp"))
    os.chmod(home, 0o755)
    try:
        _restart_and_reconnect(home)
    finally:
        shutil.rmtree(home, ignore_errors=True)


def _restart_and_reconnect(home: Path) -> None:
    with node(home, gib=2) as n:
        mine, other = n.allocate(1), n.allocate(1, first=1)
        n.pods.pods[POD] = [("main", RESOURCE, [f"{GPU}::0"])]
        n.pods.pods["team-b/other"] = [("main", RESOURCE, [f"{GPU}::1"])]
        first = client(n, mine, KEEP)
        try:
            assert first.stdout is not None
            line = first.stdout.readline()
            assert line, finish(first)[1]
            job_id = json.loads(line)["job"]
            with rest(n.state) as http:
                made = http.post(f"/v1/jobs/{job_id}/checkpoint")
            assert made.status_code == 200, made.text
            assert made.json()["checkpoint"]["iteration"] == 3
            n.daemon.kill()  # SIGKILL: nothing of the stop's own saving
            n.daemon.wait()
        finally:
            finish(first, "\n")
            reap([first])
        with serve(home, n.root, 2) as (_, address):
            wait(lambda: (mine / "salusd.sock").exists() and (other / "salusd.sock").exists(),
                 "the allocations' sockets served again")
            with Control(address) as control:
                wait(lambda: control.info(str(job_id))["state"] == "suspended",
                     "the pod's job restored")
            seen = []
            for directory in (other, mine):  # the other pod first: it must not get the job
                proc = client(n, directory, KEEP)
                out, err = finish(proc, "\n", timeout_s=180)
                assert proc.returncode == 0, err
                seen.append(json.loads(out.splitlines()[0]))
    assert seen[0]["job"] != job_id and seen[0]["resumed_from"] == 0
    assert seen[0]["w"] == [3.0, 3.0, 3.0]
    assert seen[1] == {"job": job_id, "resumed_from": 3, "w": [3.0, 3.0, 3.0]}
