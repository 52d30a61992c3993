"""Executors per (owner, lane): the real `salusd serve`, jobs of one owner placed in one lane
run in one executor process, each trains exactly as directly (dropout and a shuffled batch
draw from each job's own random stream), and a crash costs exactly that process's jobs."""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path

import pytest
from client_proc import TRAINER as GOOD
from client_proc import finish, go, reap, start_client
from daemon_proc import salusd

from salus.daemon.cli.control import Control

pytestmark = pytest.mark.slow


CRASH = textwrap.dedent("""
    import ctypes, sys, torch
    from torch import nn
    import salus.adapters.torch as salus

    def crash(s, x, now=False):
        if now:
            ctypes.string_at(0)
        return s.model(x).sum()

    with salus.connect(name="crash", iterations=10) as job:
        remote = job.attach(model=nn.Linear(4, 2))
        it = remote.iteration(crash)
        it(torch.randn(2, 4))
        print(job.id, flush=True)
        sys.stdin.readline()
        try:
            it(torch.randn(2, 4), now=True)
        except BaseException as exc:
            print(f"ERROR {type(exc).__name__}: {exc}", flush=True)
""")


def _first_line(client: subprocess.Popen[str]) -> str:
    assert client.stdout is not None
    line = client.stdout.readline().strip()
    assert line, finish(client, timeout_s=30)
    return line


def _executors(address: str) -> dict[str, dict[str, object]]:
    with Control(address) as ctl:
        return {str(j["job_id"]): j["executor"] for j in ctl.status()["jobs"]
                if j["state"] not in ("finished", "failed", "cancelled")}


def test_two_jobs_of_one_owner_share_an_executor_and_train_exactly(tmp_path: Path) -> None:
    (tmp_path / "good.py").write_text(GOOD)
    with salusd(tmp_path, "--policy", "fair", devices=1) as (proc, address):
        goods = [start_client(tmp_path / "good.py", str(seed), address=address) for seed in (1, 2)]
        try:
            ids = [json.loads(_first_line(g))["job"] for g in goods]
            executors = _executors(address)
            one, two = (executors[i] for i in ids)
            assert one["pid"] == two["pid"] is not None, executors
            assert one["shared_with"] == [int(ids[1])] and two["shared_with"] == [int(ids[0])]
            assert "one process per owner and lane" in str(one["why"])
            for g in goods:
                go(g)
            for g in goods:
                out, err = finish(g, timeout_s=120)
                assert g.returncode == 0, err
                assert json.loads(out.strip().splitlines()[-1]) == {"max_abs_diff": 0.0}, out
        finally:
            reap(goods)
        assert proc.poll() is None
    assert "keeps its own executor" not in (tmp_path / "salusd.log").read_text()


def test_isolation_job_keeps_one_process_per_job(tmp_path: Path) -> None:
    (tmp_path / "good.py").write_text(GOOD)
    with salusd(tmp_path, "--policy", "fair", "--isolation", "job", devices=1) as (_, address):
        goods = [start_client(tmp_path / "good.py", str(seed), address=address) for seed in (1, 2)]
        try:
            ids = [json.loads(_first_line(g))["job"] for g in goods]
            one, two = (_executors(address)[i] for i in ids)
            assert one["pid"] != two["pid"] and one["shared_with"] == two["shared_with"] == []
            assert "--isolation job" in str(one["why"])
            for g in goods:
                go(g)
            for g in goods:
                out, err = finish(g, timeout_s=120)
                assert json.loads(out.strip().splitlines()[-1]) == {"max_abs_diff": 0.0}, err
        finally:
            reap(goods)


def test_a_crash_costs_exactly_the_jobs_of_its_executor(tmp_path: Path) -> None:
    """Two devices under fair, one lane each: good 1 on device 0, good 2 on device 1, and the
    crashing job joins good 1's lane, so its process. The segfault fails both of them with
    its reason; good 2, in the other process, trains on exactly as directly."""
    (tmp_path / "good.py").write_text(GOOD)
    (tmp_path / "crash.py").write_text(CRASH)
    with salusd(tmp_path, "--policy", "fair", devices=2) as (proc, address):
        goods = []
        try:
            for seed in (1, 2):
                goods.append(start_client(tmp_path / "good.py", str(seed), address=address))
                json.loads(_first_line(goods[-1]))
            crash = start_client(tmp_path / "crash.py", address=address)
            goods.append(crash)
            crash_id = _first_line(crash)
            executors = _executors(address)
            by_pid: dict[object, list[str]] = {}
            for job, ex in executors.items():
                by_pid.setdefault(ex["pid"], []).append(job)
            assert sorted(len(jobs) for jobs in by_pid.values()) == [1, 2], executors
            sharing = next(jobs for jobs in by_pid.values() if crash_id in jobs)
            victim = next(j for j in sharing if j != crash_id)
            go(crash)
            out, _ = finish(crash, timeout_s=60)
            assert "signal 11 (SIGSEGV)" in out and f"running job {crash_id}" in out, out
            results = {}
            for g in goods[:2]:
                go(g)
                out, err = finish(g, timeout_s=120)
                results[g] = json.loads(out.strip().splitlines()[-1])
            errors = [r for r in results.values() if "error" in r]
            assert len(errors) == 1 and "SIGSEGV" in errors[0]["error"], results
            assert f"job {victim}" in errors[0]["error"] or "died" in errors[0]["error"]
            assert [r for r in results.values() if "error" not in r] == [{"max_abs_diff": 0.0}]
            assert proc.poll() is None, "the daemon died"
        finally:
            reap(goods)


POOLED = textwrap.dedent("""
    import json, sys
    import torch
    from torch import nn
    import salus.adapters.torch as salus

    def in_pool(t):  # whether `t` is read in place in the client's pool (lent to the call)
        at = t.data_ptr()
        with open("/proc/self/maps") as f:
            for line in f:
                span, *rest = line.split(maxsplit=5)
                low, high = (int(a, 16) for a in span.split("-"))
                if low <= at < high:
                    return "memfd:salus-pool" in line
        return False

    def total(s, big):
        return torch.stack([big.sum() + s.model.weight.sum() * 0,
                            torch.tensor(float(in_pool(big)))])

    torch.manual_seed(int(sys.argv[1]))
    with salus.connect(name=f"pooled{sys.argv[1]}", iterations=6) as job:
        remote = job.attach(model=nn.Linear(4, 2))
        step = remote.iteration(total)
        sums, pooled = [], []
        for i in range(6):
            big = torch.randn(512, 512)  # 1 MiB: through the direct line's shared memory
            got, lent = step(big).tolist()
            sums.append(abs(got - float(big.sum())) < 1e-3)
            pooled.append(lent == 1.0)
        print(json.dumps({"job": job.id, "all_equal": all(sums), "in_pool": pooled}),
              flush=True)
""")


def test_a_job_that_moved_keeps_sending_large_tensors_on_its_direct_line(
        tmp_path: Path) -> None:
    """Under fair on one device the second job moves into the first's process at its first
    placement, after its client's direct line set up shared memory for large tensors: its
    later calls still arrive whole in the new process, and are read in its pool there."""
    (tmp_path / "good.py").write_text(GOOD)
    (tmp_path / "pooled.py").write_text(POOLED)
    with salusd(tmp_path, "--policy", "fair", devices=1) as (_, address):
        first = start_client(tmp_path / "good.py", "1", address=address)
        try:
            json.loads(_first_line(first))  # placed: its process serves the lane
            pooled = start_client(tmp_path / "pooled.py", "2", address=address)
            out, err = finish(pooled, timeout_s=120)
            assert pooled.returncode == 0, err
            result = json.loads(out.strip().splitlines()[-1])
            assert result["all_equal"] is True, out
            # Calls the daemon dispatches in the shared lane read their arguments in place in
            # the pool, each given back before its reply; the first may have come along in
            # the moved job's bundle (a copy).
            assert all(result["in_pool"][1:]), result
            go(first)
            out, err = finish(first, timeout_s=120)
            assert json.loads(out.strip().splitlines()[-1]) == {"max_abs_diff": 0.0}, err
        finally:
            reap([first])
