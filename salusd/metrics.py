"""Prometheus metrics of one daemon, built only from the engine's event stream.

`Metrics.observe` is an event subscriber (it runs on the engine's thread and never calls into
the engine); `Metrics.render` gives the exposition for `GET /metrics` (on the HTTP thread). All
state sits behind one lock and is read in one piece per scrape, so a scrape never sees a job's
iterations without the total that includes them.

Exposed (seconds and bytes; `job_id` series exist only while the job is live):

| metric | labels | from |
|---|---|---|
| salusd_build_info | version | the installed package |
| salusd_job_info (1) | job_id, name, owner, kind (interactive, batch, script) | open |
| salusd_job_pod (1) | job_id, allocation, pod ("" until the kubelet names it) | open, pod |
| salusd_job_state (1 for the current state, else 0) | job_id, state | see `JOB_STATES` |
| salusd_job_iterations_total | job_id | end, ran |
| salusd_job_iteration_seconds (histogram) | job_id | end (1 iteration), ran (mean) |
| salusd_job_persistent_bytes, salusd_job_ephemeral_bytes | job_id | submit, requeue |
| salusd_job_restarts_total | job_id | restart (a script job's reruns) |
| salusd_job_step, salusd_job_loss | job_id | progress (a script's framework callback) |
| salusd_iterations_total | | end, ran |
| salusd_jobs_total | state (finished, cancelled, failed) | finish, cancelled, failed |
| salusd_device_{capacity,persistent,ephemeral,free}_bytes, salusd_device_lanes | device | memory |
| salusd_pending_jobs | | memory |
| salusd_switches_total | device | end, ran |
| salusd_admissions_total, salusd_rejections_total | | admit, reject |
| salusd_executor_deaths_total | | failed + executor_died |
| salusd_checkpoint_seconds (histogram), salusd_checkpoint_bytes_total | | checkpoint |
| salusd_job_cache_{hits,misses}_total | job_id, level (memory, disk) | end (`cache`) |
| salusd_job_cache_source_bytes_total | job_id | end (`cache`) |

The cache counters are a batch job's `salus.data.CachedDataset` reads, as its executors
last reported them (all replicas); they start again from zero when the job is restored.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
)
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from salus.daemon import installed_version
from salus.daemon.engine.events import Event
from salus.daemon.engine.jobstate import ENDED, EventState
from salus.daemon.state.store import LIVE_STATES

JOB_STATES = LIVE_STATES
"""A live job's states, as `salusd/engine/jobstate.py` defines them."""
ITERATION_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                       2.5, 5.0, 10.0, 30.0, 60.0)
CHECKPOINT_BUCKETS_S = (0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0)
DEVICE_GAUGES = (("capacity_bytes", "capacity_bytes", "Memory budget of the device."),
                 ("persistent_bytes", "persistent_bytes", "Persistent state of admitted jobs."),
                 ("ephemeral_bytes", "lane_bytes", "Memory of the device's lanes."),
                 ("free_bytes", "free_bytes", "Budget neither persistent nor in a lane."),
                 ("lanes", "lanes", "Lanes on the device."))


class _Histogram:
    """Bucket counts that take `n` observations of one value at once (a leased job reports
    a batch of iterations as one mean), so a report costs the same whatever its size."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def add(self, value: float, n: int = 1) -> None:
        self.counts[bisect_left(self.bounds, value)] += n
        self.sum += value * n

    def cumulative(self) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        total = 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            total += count
            out.append((floatToGoString(bound), float(total)))
        return out


@dataclass
class _Job:
    name: str
    owner: str
    kind: str
    state: EventState = field(default_factory=EventState)
    iterations: int = 0
    seconds: _Histogram = field(default_factory=lambda: _Histogram(ITERATION_BUCKETS_S))
    persistent_bytes: int = 0
    ephemeral_bytes: int = 0
    cache: dict[str, Any] | None = None  # the data cache's counters, as last reported
    restarts: int = 0
    step: int | None = None  # a script's framework step and loss, as last reported
    loss: float | None = None
    allocation: str | None = None  # a Kubernetes pod's job: its allocation, and its pod
    pod: str = ""


class Metrics(Collector):
    """The daemon's metrics in a registry of their own: subscribe `observe` to the engine's
    events, serve `render()`."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self._lock = threading.Lock()
        self._version = installed_version()
        self._jobs: dict[int, _Job] = {}
        self._last_in_lane: dict[tuple[int, int], int] = {}  # (device, lane) -> live job id
        self._devices: dict[int, dict[str, int]] = {}
        self._pending = 0
        self._iterations = 0
        self._ended = dict.fromkeys(ENDED.values(), 0)
        self._switches: dict[int, int] = {}
        self._admissions = self._rejections = self._deaths = 0
        self._last_failure: tuple[int, str] | None = None  # (job, reason) if the last end failed
        self._checkpoint_seconds = _Histogram(CHECKPOINT_BUCKETS_S)
        self._checkpoint_bytes = 0
        self.registry.register(self)

    def render(self) -> tuple[bytes, str]:
        """The exposition in the Prometheus text format, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def observe(self, event: Event) -> None:
        """Account one engine event (called on the engine's thread)."""
        with self._lock:
            self._observe(event)

    def _observe(self, e: Event) -> None:
        job = self._jobs.get(e.job_id)
        d = e.detail
        if job is not None:
            job.state.observe(e.kind)
        match e.kind:
            case "open":
                owner = str(d.get("owner", ""))
                self._jobs[e.job_id] = _Job(
                    owner=owner, name=str(d.get("name", "")),
                    kind=str(d.get("job_kind", "interactive")),
                    allocation=None if d.get("allocation") is None else str(d["allocation"]),
                    pod=owner.removeprefix("pod:") if owner.startswith("pod:") else "")
            case "pod" if job is not None:
                job.pod = str(d.get("pod", ""))
            case "submit" if job is not None:
                job.persistent_bytes = int(d.get("persistent", 0))
                job.ephemeral_bytes = int(d.get("ephemeral", 0))
            case "requeue" if job is not None:
                job.ephemeral_bytes = int(d.get("peak", job.ephemeral_bytes))
            case "admit":
                self._admissions += 1
            case "restart" if job is not None:
                job.restarts += 1
            case "progress" if job is not None:
                step, loss = d.get("step"), d.get("loss")
                job.step = step if isinstance(step, int) else job.step
                job.loss = float(loss) if isinstance(loss, int | float) else job.loss
            case "end" | "ran":
                self._iterations_ran(e, job, max(0, int(d.get("iterations", 0))),
                                     max(0.0, float(d.get("seconds", 0.0))))
                if job is not None and isinstance(d.get("cache"), dict):
                    job.cache = d["cache"]
            case "finish" | "cancelled" | "failed":
                self._ended[ENDED[e.kind]] += 1
                self._last_failure = (e.job_id, str(d.get("reason", ""))) if (
                    e.kind == "failed") else None
                if self._jobs.pop(e.job_id, None) is not None:
                    for lane in [k for k, j in self._last_in_lane.items() if j == e.job_id]:
                        del self._last_in_lane[lane]
            case "reject":
                self._rejections += 1
            case "executor_died":
                # Every exit of a job's executor is reported, a retired one's too; a death
                # fails its live job first, with the death's reason, in the same engine step.
                job_id, reason = self._last_failure or (-1, "")
                self._deaths += job_id == e.job_id and reason.startswith(str(d.get("reason")))
                self._last_failure = None
            case "checkpoint":
                self._checkpoint_seconds.add(max(0.0, float(d.get("seconds", 0.0))))
                self._checkpoint_bytes += max(0, int(d.get("bytes", 0)))
            case "memory":
                self._pending = int(d.get("pending", 0))
                for dev in d.get("devices", []):
                    self._devices[int(dev["device"])] = {k: int(dev.get(k, 0)) for _, k, _ in
                                                         DEVICE_GAUGES}

    def _iterations_ran(self, e: Event, job: _Job | None, iterations: int,
                        seconds: float) -> None:
        """Calls of job `e.job_id` ran in lane (e.device, e.lane_id): `iterations` of them
        counted, taking `seconds` in all. A lane switches when it runs a call of another job
        than the live job it ran last."""
        self._iterations += iterations
        if job is None:  # a call that returned after its job ended
            return
        job.iterations += iterations
        if iterations:
            job.seconds.add(seconds / iterations, iterations)
        lane = (e.device, e.lane_id)
        last = self._last_in_lane.get(lane)
        if last is not None and last != e.job_id:
            self._switches[e.device] = self._switches.get(e.device, 0) + 1
        self._last_in_lane[lane] = e.job_id

    def _cache_families(self) -> Iterator[Metric]:
        hits = CounterMetricFamily("salusd_job_cache_hits", "Samples a live job's data sets "
                                   "served from a cache level.", labels=["job_id", "level"])
        misses = CounterMetricFamily("salusd_job_cache_misses", "Samples a live job's data "
                                     "sets did not find in a cache level.",
                                     labels=["job_id", "level"])
        source = CounterMetricFamily("salusd_job_cache_source_bytes", "Bytes a live job's data "
                                     "sets read from their source.", labels=["job_id"])
        for job_id, job in sorted(self._jobs.items()):
            if job.cache is None:
                continue
            for level in ("memory", "disk"):
                counts = job.cache.get(level) or {}
                hits.add_metric([str(job_id), level], float(counts.get("hits", 0)))
                misses.add_metric([str(job_id), level], float(counts.get("misses", 0)))
            source.add_metric([str(job_id)], float(job.cache.get("source_bytes", 0)))
        yield from (hits, misses, source)

    def collect(self) -> Iterator[Metric]:
        with self._lock:  # built whole under the lock: one consistent snapshot per scrape
            return iter(list(self._families()))

    def _families(self) -> Iterator[Metric]:
        yield InfoMetricFamily("salusd_build", "The running salusd.",
                               value={"version": self._version})
        info = GaugeMetricFamily("salusd_job_info", "A live job's name, owner and kind (always "
                                 "1).", labels=["job_id", "name", "owner", "kind"])
        pods = GaugeMetricFamily("salusd_job_pod", "A live Kubernetes pod's job: its "
                                 "allocation and pod (always 1).",
                                 labels=["job_id", "allocation", "pod"])
        state = GaugeMetricFamily("salusd_job_state", "1 for a live job's current state.",
                                  labels=["job_id", "state"])
        iterations = CounterMetricFamily("salusd_job_iterations", "Iterations a live job ran.",
                                         labels=["job_id"])
        seconds = HistogramMetricFamily("salusd_job_iteration_seconds",
                                        "Time of a live job's iterations.", labels=["job_id"])
        persistent = GaugeMetricFamily("salusd_job_persistent_bytes",
                                       "A live job's state booked on its device.",
                                       labels=["job_id"])
        ephemeral = GaugeMetricFamily("salusd_job_ephemeral_bytes", "A live job's memory per "
                                      "call: its estimate, or its measured peak once it "
                                      "outgrew its lane.", labels=["job_id"])
        restarts = CounterMetricFamily("salusd_job_restarts", "Times a live script job's "
                                       "command ran again (--restart on-failure).",
                                       labels=["job_id"])
        step = GaugeMetricFamily("salusd_job_step", "A script's step as its framework "
                                 "callback last reported it.", labels=["job_id"])
        loss = GaugeMetricFamily("salusd_job_loss", "The loss a script's framework callback "
                                 "last logged.", labels=["job_id"])
        for job_id, job in sorted(self._jobs.items()):
            jid = str(job_id)
            if job.kind == "script":
                restarts.add_metric([jid], job.restarts)
            if job.step is not None:
                step.add_metric([jid], job.step)
            if job.loss is not None:
                loss.add_metric([jid], job.loss)
            info.add_metric([jid, job.name, job.owner, job.kind], 1)
            if job.allocation is not None:
                pods.add_metric([jid, job.allocation, job.pod], 1)
            now = job.state.state
            for s in JOB_STATES:
                state.add_metric([jid, s], 1 if s == now else 0)
            iterations.add_metric([jid], job.iterations)
            seconds.add_metric([jid], job.seconds.cumulative(), job.seconds.sum)
            persistent.add_metric([jid], job.persistent_bytes)
            ephemeral.add_metric([jid], job.ephemeral_bytes)
        yield from (info, pods, state, iterations, seconds, persistent, ephemeral, restarts, step,
                    loss)
        yield from self._cache_families()

        yield CounterMetricFamily("salusd_iterations", "Iterations run by all jobs.",
                                  value=self._iterations)
        ended = CounterMetricFamily("salusd_jobs", "Jobs ended, by how they ended.",
                                    labels=["state"])
        for name, count in self._ended.items():
            ended.add_metric([name], count)
        yield ended
        for metric, key, text in DEVICE_GAUGES:
            gauge = GaugeMetricFamily(f"salusd_device_{metric}", text, labels=["device"])
            for device, values in sorted(self._devices.items()):
                gauge.add_metric([str(device)], values[key])
            yield gauge
        yield GaugeMetricFamily("salusd_pending_jobs", "Jobs waiting for admission.",
                                value=self._pending)
        switches = CounterMetricFamily("salusd_switches", "Times a lane ran a call of another "
                                       "job than the live job it ran last.", labels=["device"])
        for device, count in sorted(self._switches.items()):
            switches.add_metric([str(device)], count)
        yield switches
        yield CounterMetricFamily("salusd_admissions", "Jobs admitted into a lane (again after "
                                  "a swap-out or a re-admission).", value=self._admissions)
        yield CounterMetricFamily("salusd_rejections", "Jobs no device could ever hold.",
                                  value=self._rejections)
        yield CounterMetricFamily("salusd_executor_deaths", "Executors that died while their "
                                  "job was live (the job failed).", value=self._deaths)
        checkpoint = HistogramMetricFamily("salusd_checkpoint_seconds",
                                           "Time to write a job's state.")
        checkpoint.add_metric([], self._checkpoint_seconds.cumulative(),
                              self._checkpoint_seconds.sum)
        yield checkpoint
        yield CounterMetricFamily("salusd_checkpoint_bytes", "Bytes of job state written.",
                                  value=self._checkpoint_bytes)
