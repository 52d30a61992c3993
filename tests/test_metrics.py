"""Prometheus metrics from the engine's events: the exposition parsed back with
prometheus-client's own parser, values checked against counts kept by the test itself.

Three sources of events: hand-made sequences (edge cases), the real `Engine` with executors
that answer the way executor processes do (states, swaps, re-admission, rejection, deaths,
deterministic), and a real daemon in this process with client scripts in their own processes.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import pwd
import select
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from client_proc import finish
from fake_executor import FakeExecutor, FakeExecutors
from prometheus_client.parser import text_string_to_metric_families

from salus.daemon.cli.control import Control
from salus.daemon.daemon import Daemon, DaemonConfig
from salus.daemon.devices.discovery import cpu_devices
from salus.daemon.engine.engine import Engine
from salus.daemon.engine.events import Event
from salus.daemon.engine.ledger import aligned
from salus.daemon.engine.registry import JobRecord, Owner
from salus.daemon.metrics import JOB_STATES, Metrics
from salus.daemon.wire.frames import json_frame

MiB = 2**20
Labels = tuple[tuple[str, str], ...]
Samples = dict[tuple[str, Labels], float]


# ---- reading the exposition ---------------------------------------------------------------------
def scrape(metrics: Metrics) -> Samples:
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body.decode())
            for s in family.samples}


def value(samples: Samples, metric: str, /, **labels: str) -> float:
    return samples[(metric, tuple(sorted(labels.items())))]


def job_series(samples: Samples) -> set[str]:
    """Names of the samples that carry a job_id label."""
    return {name for name, labels in samples if any(k == "job_id" for k, _ in labels)}


def state_of(samples: Samples, job_id: int) -> str:
    """The one state whose series is 1 for the job (all four exist)."""
    states = {s: value(samples, "salusd_job_state", job_id=str(job_id), state=s)
              for s in JOB_STATES}
    assert sorted(states.values()) == [0, 0, 0, 1], states
    return next(s for s, v in states.items() if v == 1)


def feed(metrics: Metrics, *events: tuple[Any, ...]) -> None:
    """Events as (kind, job, device, lane, detail) tuples, `detail` optional."""
    for t, (kind, job, device, lane, *detail) in enumerate(events):
        metrics.observe(Event(float(t), kind, job, device, lane, detail[0] if detail else {}))


# ---- hand-made events ---------------------------------------------------------------------------
def test_build_info_names_the_installed_version() -> None:
    samples = scrape(Metrics())
    assert value(samples, "salusd_build_info",
                 version=importlib.metadata.version("salusd")) == 1


def test_job_series_follow_the_states_and_vanish_when_the_job_ends() -> None:
    m = Metrics()
    feed(m, ("open", 1, -1, -1, {"owner": "ada", "name": 'say "hi"\\n', "job_kind": "batch"}))
    s = scrape(m)
    assert value(s, "salusd_job_info", job_id="1", name='say "hi"\\n', owner="ada",
                 kind="batch") == 1
    assert state_of(s, 1) == "open"
    steps = [(("submit", 1, -1, -1, {"persistent": 512, "ephemeral": 1024}), "pending"),
             (("admit", 1, 0, 3), "running"),
             (("suspend", 1, -1, -1, {"swap": True}), "suspended"),
             (("swap_out", 1, -1, -1), "suspended"),
             (("resume", 1, -1, -1), "pending"),  # swapped out: waits to be admitted again
             (("admit", 1, 0, 4), "running"),
             (("requeue", 1, 0, 4, {"peak": 4096}), "pending"),
             (("admit", 1, 0, 5), "running")]
    for event, expected in steps:
        feed(m, event)
        assert state_of(scrape(m), 1) == expected, event
    s = scrape(m)
    assert value(s, "salusd_job_persistent_bytes", job_id="1") == 512
    assert value(s, "salusd_job_ephemeral_bytes", job_id="1") == 4096
    assert value(s, "salusd_admissions_total") == 3

    for job_id, end in ((2, "finish"), (3, "cancelled"), (4, "failed")):
        feed(m, ("open", job_id, -1, -1, {"owner": "bob", "name": "j"}),
             ("end", job_id, 0, 9, {"seconds": 0.01, "iterations": 1}), (end, job_id, -1, -1))
    feed(m, ("end", 3, 0, 9, {"seconds": 0.5, "iterations": 1}),  # returned after the cancel
         ("executor_died", 2, -1, -1, {"reason": "executor (pid 9) died: exit status 0"}),
         ("executor_died", 4, -1, -1, {"reason": "executor (pid 8) died: exit status 0"}))
    s = scrape(m)
    assert {labels for name, labels in s if name == "salusd_job_info"} == {
        (("job_id", "1"), ("kind", "batch"), ("name", 'say "hi"\\n'), ("owner", "ada"))}
    assert value(s, "salusd_jobs_total", state="finished") == 1
    assert value(s, "salusd_jobs_total", state="cancelled") == 1
    assert value(s, "salusd_jobs_total", state="failed") == 1
    assert value(s, "salusd_executor_deaths_total") == 0  # executors retired after their end
    assert value(s, "salusd_iterations_total") == 4  # the late call ran: counted in the total
    died = "executor (pid 7) died: signal 11 (SIGSEGV)"
    feed(m, ("open", 5, -1, -1), ("failed", 5, -1, -1, {"reason": f"{died} while job 5 ran"}),
         ("memory", -1, -1, -1, {"devices": [], "pending": 0}),
         ("executor_died", 5, -1, -1, {"reason": died}))
    assert value(scrape(m), "salusd_executor_deaths_total") == 1

    feed(m, ("finish", 1, -1, -1))
    s = scrape(m)
    assert job_series(s) == set()
    assert value(s, "salusd_jobs_total", state="finished") == 2
    assert value(s, "salusd_jobs_total", state="failed") == 2


def test_data_cache_counters_are_the_last_reported_per_live_job() -> None:
    m = Metrics()
    first = {"memory": {"hits": 0, "misses": 8}, "disk": {"hits": 1, "misses": 7},
             "source_bytes": 700}
    later = {"memory": {"hits": 16, "misses": 8}, "disk": {"hits": 1, "misses": 7},
             "source_bytes": 700}
    feed(m, ("open", 1, -1, -1), ("end", 1, 0, 0, {"seconds": 0.1, "iterations": 1,
                                                  "cache": first}),
         ("end", 1, 0, 0, {"seconds": 0.1, "iterations": 1}),  # no data set: keeps the last
         ("end", 1, 0, 0, {"seconds": 0.1, "iterations": 1, "cache": later}),
         ("open", 2, -1, -1))
    s = scrape(m)
    assert value(s, "salusd_job_cache_hits_total", job_id="1", level="memory") == 16
    assert value(s, "salusd_job_cache_misses_total", job_id="1", level="disk") == 7
    assert value(s, "salusd_job_cache_source_bytes_total", job_id="1") == 700
    assert not [k for k in s if k[0].startswith("salusd_job_cache") and ("job_id", "2") in k[1]]
    feed(m, ("finish", 1, -1, -1))
    assert not [k for k in scrape(m) if k[0].startswith("salusd_job_cache")]


def test_a_leased_batch_is_observed_as_its_mean_per_iteration() -> None:
    m = Metrics()
    feed(m, ("open", 7, -1, -1), ("admit", 7, 0, 0),
         ("end", 7, 0, 0, {"seconds": 0.2, "iterations": 1}),
         ("end", 7, 0, 0, {"seconds": 9.0, "iterations": 0}),  # a function: not an iteration
         ("ran", 7, 0, 0, {"calls": 12, "iterations": 10, "seconds": 0.03}),
         ("ran", 7, 0, 0, {"calls": 1, "iterations": 10**12, "seconds": 2e9}))  # O(1) anyway
    s = scrape(m)
    total = 1 + 10 + 10**12
    assert value(s, "salusd_job_iterations_total", job_id="7") == total
    assert value(s, "salusd_iterations_total") == total
    assert value(s, "salusd_job_iteration_seconds_count", job_id="7") == total
    assert value(s, "salusd_job_iteration_seconds_sum", job_id="7") == pytest.approx(2e9 + 0.23)
    bucket = {le: value(s, "salusd_job_iteration_seconds_bucket", job_id="7", le=le)
              for le in ("0.0025", "0.005", "0.1", "0.25", "+Inf")}
    # 10 iterations of 3 ms, one of 200 ms, 10**12 of 2 ms
    assert bucket == {"0.0025": 10**12, "0.005": 10**12 + 10, "0.1": 10**12 + 10,
                      "0.25": total, "+Inf": total}


def test_switches_count_a_lane_changing_between_live_jobs() -> None:
    m = Metrics()
    feed(m, *[("open", j, -1, -1) for j in (1, 2, 3)])
    it = {"seconds": 0.01, "iterations": 1}
    lane_runs = [(1, 0, 0), (1, 0, 0), (2, 0, 0), (1, 0, 0),  # lane 0.0: 1 1 2 1 -> 2
                 (3, 1, 5), (2, 1, 6), (3, 1, 5),  # different lanes: nothing switches
                 (2, 1, 5)]  # lane 1.5: 3 3 2 -> 1
    feed(m, *[("ran" if i % 2 else "end", job, dev, lane, it)
              for i, (job, dev, lane) in enumerate(lane_runs)])
    feed(m, ("finish", 2, -1, -1),
         ("end", 3, 1, 5, it),  # its lane's last job ended: a new occupant, not a switch
         ("end", 1, 1, 6, it))
    s = scrape(m)
    assert value(s, "salusd_switches_total", device="0") == 2
    assert value(s, "salusd_switches_total", device="1") == 1


def test_device_memory_checkpoints_and_rejections() -> None:
    m = Metrics()
    devices = [{"device": d, "capacity_bytes": 100 * MiB, "persistent_bytes": d * MiB,
                "lane_bytes": 2 * d * MiB, "free_bytes": (100 - 3 * d) * MiB, "lanes": d}
               for d in (0, 1)]
    feed(m, ("memory", -1, -1, -1, {"devices": devices, "pending": 3}),
         ("reject", 5, -1, -1, {"reason": "too big"}), ("failed", 5, -1, -1),
         ("checkpoint", 1, -1, -1, {"iteration": 10, "seconds": 0.07, "bytes": 1000}),
         ("checkpoint", 1, -1, -1, {"iteration": 20, "seconds": 2.0, "bytes": 3000}))
    s = scrape(m)
    for d in (0, 1):
        dev = str(d)
        assert value(s, "salusd_device_capacity_bytes", device=dev) == 100 * MiB
        assert value(s, "salusd_device_persistent_bytes", device=dev) == d * MiB
        assert value(s, "salusd_device_ephemeral_bytes", device=dev) == 2 * d * MiB
        assert value(s, "salusd_device_free_bytes", device=dev) == (100 - 3 * d) * MiB
        assert value(s, "salusd_device_lanes", device=dev) == d
    assert value(s, "salusd_pending_jobs") == 3
    assert value(s, "salusd_rejections_total") == 1
    assert value(s, "salusd_checkpoint_bytes_total") == 4000
    assert value(s, "salusd_checkpoint_seconds_count") == 2
    assert value(s, "salusd_checkpoint_seconds_bucket", le="0.1") == 1
    assert value(s, "salusd_checkpoint_seconds_bucket", le="5.0") == 2


def test_a_scrape_during_events_sees_one_consistent_snapshot() -> None:
    """Events on one thread (the engine's), scrapes on another (the HTTP server's): in every
    scrape the live jobs' iterations plus those of ended jobs equal the total."""
    m = Metrics()
    jobs, per_job = 40, 50
    done = threading.Event()

    def engine_thread() -> None:
        for j in range(jobs):
            feed(m, ("open", j, -1, -1), ("admit", j, 0, j % 3))
            for _ in range(per_job):
                feed(m, ("end", j, 0, j % 3, {"seconds": 0.001, "iterations": 1}))
            feed(m, ("finish", j, -1, -1))
        done.set()

    thread = threading.Thread(target=engine_thread)
    thread.start()
    scrapes = 0
    while not done.is_set() or scrapes == 0:
        s = scrape(m)
        ended = value(s, "salusd_jobs_total", state="finished")
        live = sum(v for (name, _), v in s.items() if name == "salusd_job_iterations_total")
        assert live + ended * per_job == value(s, "salusd_iterations_total")
        scrapes += 1
    thread.join(timeout=60)
    s = scrape(m)
    assert value(s, "salusd_iterations_total") == jobs * per_job
    assert job_series(s) == set()


# ---- the real engine, executors answering as executor processes do -------------------------------
class NoTimers:
    def call_later(self, delay_s: float, fn: Callable[[], None]) -> None:
        pass


ITERATION, FUNCTION = 0, 1  # the function ids every job here defines


def _open(engine: Engine, executors: FakeExecutors, name: str, persistent: int,
          ephemeral: int) -> JobRecord:
    """A job whose state measures `persistent` bytes and whose calls are estimated at
    `ephemeral` bytes (measured at 0 unless a test says otherwise), with an iteration and a
    function defined."""
    record = engine.open(Owner("ada", 1000, 1000), name, 100, None)
    engine.attach(record, json_frame({}), lambda f: None)
    executor = record.executor
    assert isinstance(executor, FakeExecutor)
    executor.persistent_bytes, executor.ephemeral_bytes = persistent, ephemeral
    executor.seconds, executor.peak = 0.004, 0
    executors.answer_all()
    for fid, kind in ((ITERATION, "iteration"), (FUNCTION, "function")):
        engine.define(record, fid, kind, False,
                      json_frame({"op": "define", "fid": fid, "kind": kind}), lambda f: None)
    executors.answer_all()
    return record


def _calls(engine: Engine, record: JobRecord, counted: int, uncounted: int = 0) -> None:
    for i in range(counted + uncounted):
        fid = ITERATION if i < counted else FUNCTION
        engine.call(record, json_frame({"op": "call", "fid": fid}), lambda f: None,
                    counted=record.functions[fid] == "iteration")


def test_the_real_engine_states_memory_and_ends() -> None:
    executors = FakeExecutors()
    clock = iter(range(10**9))
    capacity = 96 * MiB
    engine = Engine([capacity], "fair", executors, clock=lambda: float(next(clock)),
                    timers=NoTimers(), torch_devices=["cpu"])
    executors.engine = engine
    m = Metrics()
    engine.events.subscribe(m.observe)

    a = _open(engine, executors, "a", 10 * MiB, 4 * MiB)
    b = _open(engine, executors, "b", 20 * MiB, 2 * MiB)
    assert state_of(scrape(m), a.job_id) == "open"
    _calls(engine, a, 3)
    _calls(engine, b, 2, uncounted=1)
    executors.answer_all()
    s = scrape(m)
    assert state_of(s, a.job_id) == state_of(s, b.job_id) == "running"
    assert value(s, "salusd_job_iterations_total", job_id=str(a.job_id)) == 3
    assert value(s, "salusd_job_iterations_total", job_id=str(b.job_id)) == 2
    assert value(s, "salusd_job_iteration_seconds_count", job_id=str(b.job_id)) == 2
    assert value(s, "salusd_job_persistent_bytes", job_id=str(b.job_id)) == aligned(20 * MiB)
    assert value(s, "salusd_device_capacity_bytes", device="0") == capacity
    booked = aligned(10 * MiB) + aligned(20 * MiB)
    assert value(s, "salusd_device_persistent_bytes", device="0") == booked
    assert value(s, "salusd_device_ephemeral_bytes", device="0") == aligned(4 * MiB)  # 1 lane
    assert value(s, "salusd_device_lanes", device="0") == 1
    assert value(s, "salusd_device_free_bytes", device="0") == (
        capacity - booked - aligned(4 * MiB))

    engine.suspend(a, swap=True)
    executors.answer_all()
    s = scrape(m)
    assert state_of(s, a.job_id) == "suspended"
    assert value(s, "salusd_device_persistent_bytes", device="0") == aligned(20 * MiB)
    engine.resume(a)
    executors.answer_all()
    assert state_of(scrape(m), a.job_id) == "running"

    # a call measures more than a's lane: a is re-admitted with the measured peak
    a.executor.peaks.append(40 * MiB)
    _calls(engine, a, 1)
    executors.answer_all()
    s = scrape(m)
    assert value(s, "salusd_job_ephemeral_bytes", job_id=str(a.job_id)) == 40 * MiB
    assert state_of(s, a.job_id) == "running"

    big = _open(engine, executors, "big", capacity, MiB)  # can never fit
    _calls(engine, big, 1)
    executors.answer_all()
    dies = _open(engine, executors, "dies", MiB, MiB)
    _calls(engine, dies, 2)
    executors.answer_all()
    executors.die(dies.executor, "signal 9 (SIGKILL)")
    engine.close(a)
    engine.cancel(b)
    executors.answer_all()

    s = scrape(m)
    assert job_series(s) == set()
    ran = sum(ex.iterations for ex in executors.executors)
    assert ran == 3 + 2 + 1 + 2
    assert value(s, "salusd_iterations_total") == ran
    assert value(s, "salusd_jobs_total", state="finished") == 1
    assert value(s, "salusd_jobs_total", state="cancelled") == 1
    assert value(s, "salusd_jobs_total", state="failed") == 2  # big, dies
    assert value(s, "salusd_rejections_total") == 1
    assert value(s, "salusd_executor_deaths_total") == 1
    assert value(s, "salusd_device_persistent_bytes", device="0") == 0
    assert value(s, "salusd_device_lanes", device="0") == 0
    assert value(s, "salusd_device_free_bytes", device="0") == capacity
    assert value(s, "salusd_pending_jobs") == 0
    assert value(s, "salusd_switches_total", device="0") == _switches(list(engine.events.recent))


def _switches(events: list[Event]) -> int:
    """Reference count from the engine's own event log: calls in a lane whose previous call
    there was of another job that had not ended."""
    last: dict[tuple[int, int], int] = {}
    ended: set[int] = set()
    count = 0
    for e in events:
        if e.kind in ("finish", "cancelled", "failed"):
            ended.add(e.job_id)
        elif e.kind in ("end", "ran") and e.job_id not in ended:
            previous = last.get((e.device, e.lane_id))
            count += previous is not None and previous != e.job_id and previous not in ended
            last[(e.device, e.lane_id)] = e.job_id
    return count


# ---- a real daemon in this process, clients in their own processes ------------------------------
CLIENT = textwrap.dedent("""
    import json, sys
    import torch
    from torch import nn
    import salus.adapters.torch as salus

    name, n = sys.argv[1], int(sys.argv[2])
    torch.manual_seed(n)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def step(s, x, y):
        s.opt.zero_grad()
        loss = nn.functional.cross_entropy(s.model(x), y)
        loss.backward()
        s.opt.step()
        return loss

    def evaluate(s, x):
        return s.model(x).sum()

    def crash(s):
        import os
        os._exit(3)

    with salus.connect(name=name, iterations=n) as job:
        remote = job.attach(model=model, opt=opt)
        train, ev, die = remote.iteration(step), remote.function(evaluate), remote.function(crash)
        for i in range(n):
            train(torch.randn(8, 16), torch.randint(0, 4, (8,)))
            if i % 3 == 0:
                ev(torch.randn(8, 16))  # functions are not iterations
        print(json.dumps({"job": job.id, "iterations": n}), flush=True)
        if sys.stdin.readline().strip() == "crash":
            try:
                die()
            except Exception as exc:
                print(type(exc).__name__, flush=True)
""")


@contextlib.contextmanager
def daemon_in_process(tmp: Path, metrics: Metrics) -> Iterator[tuple[Daemon, str]]:
    """The real daemon (zygote and executors are processes) with its loop on a thread of this
    process, `metrics` subscribed to its engine; yields it and its address."""
    config = DaemonConfig(str(tmp / "salusd.sock"), cpu_devices(1, 256 * MiB), "fair",
                          threads=1, standby_executors=1)
    daemon = Daemon(config)
    daemon.engine.events.subscribe(metrics.observe)
    daemon.start()
    thread = threading.Thread(target=daemon.run, name="salusd-loop", daemon=True)
    thread.start()
    try:
        yield daemon, f"unix://{config.socket_path}"
    finally:
        daemon.request_stop()
        thread.join(timeout=90)
        assert not thread.is_alive(), "the daemon did not stop"


def read_line(proc: subprocess.Popen[str], timeout_s: float) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    assert ready, f"no output within {timeout_s} s"
    return proc.stdout.readline()


def poll(metrics: Metrics, done: Callable[[Samples], bool], show: Callable[[Samples], object],
         timeout_s: float = 60.0) -> Samples:
    """Scrape until `done` holds (at most `timeout_s` seconds, every 50 ms); on failure say
    what `show` makes of the last scrape."""
    for _ in range(int(timeout_s / 0.05)):
        samples = scrape(metrics)
        if done(samples):
            return samples
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout_s} s; last scrape: {show(samples)}")


@pytest.mark.slow
def test_a_real_daemon_counts_what_clients_ran(tmp_path: Path) -> None:
    script = tmp_path / "client.py"
    script.write_text(CLIENT)
    m = Metrics()
    planned = {"long": 12, "short": 7}
    with daemon_in_process(tmp_path, m) as (daemon, address):
        env = {**os.environ, "SALUS_ADDRESS": address, "OMP_NUM_THREADS": "1"}
        clients = {name: subprocess.Popen([sys.executable, str(script), name, str(n)], env=env,
                                          text=True, stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                   for name, n in planned.items()}
        try:
            ran = {name: json.loads(read_line(c, 180)) for name, c in clients.items()}
            ids = {name: str(r["job"]) for name, r in ran.items()}
            assert {name: r["iterations"] for name, r in ran.items()} == planned

            def per_job(s: Samples) -> dict[str, float | None]:
                return {n: s.get(("salusd_job_iterations_total", (("job_id", ids[n]),)))
                        for n in planned}

            # leased calls are reported in batches: wait until the daemon has them all
            s = poll(m, lambda s: per_job(s) == planned, per_job)
            me = pwd.getpwuid(os.getuid()).pw_name
            for name, job_id in ids.items():
                assert value(s, "salusd_job_info", job_id=job_id, name=name, owner=me,
                             kind="interactive") == 1
                assert state_of(s, int(job_id)) == "running"
                assert value(s, "salusd_job_iteration_seconds_count",
                             job_id=job_id) == planned[name]
                assert value(s, "salusd_job_persistent_bytes", job_id=job_id) > 0
            assert value(s, "salusd_iterations_total") == sum(planned.values())
            assert value(s, "salusd_device_capacity_bytes", device="0") == 256 * MiB
            assert value(s, "salusd_device_lanes", device="0") == 1  # fair: one lane

            with Control(address) as ctl:
                ctl.suspend(ids["long"])
                assert state_of(scrape(m), int(ids["long"])) == "suspended"
                ctl.resume(ids["long"])
                assert state_of(scrape(m), int(ids["long"])) == "running"

            for name, line in (("long", "close\n"), ("short", "crash\n")):
                out, err = finish(clients[name], line, timeout_s=120)
                assert clients[name].returncode == 0, err
            assert out.strip() == "JobFailed", out
            s = poll(m, lambda s: not job_series(s), job_series)
        finally:
            for c in clients.values():
                if c.poll() is None:
                    c.kill()
                    c.wait()
    assert value(s, "salusd_iterations_total") == sum(planned.values())
    assert value(s, "salusd_jobs_total", state="finished") == 1
    assert value(s, "salusd_jobs_total", state="failed") == 1
    assert value(s, "salusd_executor_deaths_total") == 1
    assert value(s, "salusd_admissions_total") == 2
    assert value(s, "salusd_device_persistent_bytes", device="0") == 0
    assert value(s, "salusd_device_free_bytes", device="0") == 256 * MiB
    assert value(s, "salusd_pending_jobs") == 0
    assert value(s, "salusd_switches_total", device="0") == _switches(
        list(daemon.engine.events.recent))  # read once the daemon has stopped
