"""Who held each lane, and when: sampled from the daemon's status and drawn as a PNG.

The daemon keeps no log of lane holders, so a thread asks it for its status (what `salusd
status` shows: each lane's `busy_job`, the job running a call there or holding the lane's
lease) every `period_s` seconds; a lane is drawn held by the job seen there from one sample to
the next, so each bar's ends are exact to one period.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from salus.daemon.cli.control import Control

Lane = tuple[int, int]  # (device, lane id)


@dataclass
class Phase:
    """One part of the demo: a title and the samples taken meanwhile, (seconds from the
    phase's start, {(device, lane id): job name or None})."""

    title: str
    began: float
    samples: list[tuple[float, dict[Lane, str | None]]] = field(default_factory=list)


class LaneSampler:
    """Samples the lanes of the daemon at `address` on a thread, into the current phase."""

    def __init__(self, address: str, period_s: float = 0.05) -> None:
        self.address = address
        self.period_s = period_s
        self.phases: list[Phase] = []
        self._names: dict[int, str] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="lane-sampler", daemon=True)

    def phase(self, title: str) -> None:
        """Samples from now on belong to a new phase called `title`."""
        with self._lock:
            self.phases.append(Phase(title, time.monotonic()))

    def pause(self) -> None:
        """Keep no samples until the next `phase`."""
        with self._lock:
            self.phases.append(Phase("", time.monotonic()))

    def _run(self) -> None:
        with Control(self.address) as ctl:
            while not self._stop.wait(self.period_s):
                status = ctl.status()
                now = time.monotonic()
                self._names.update({int(j["job_id"]): str(j["name"]) for j in status["jobs"]})
                lanes = {(int(d["index"]), int(ln["lane_id"])):
                         None if ln["busy_job"] is None else
                         self._names.get(int(ln["busy_job"]), str(ln["busy_job"]))
                         for d in status["devices"] for ln in d["lanes"]}
                with self._lock:
                    if self.phases and self.phases[-1].title:
                        phase = self.phases[-1]
                        phase.samples.append((now - phase.began, lanes))

    def __enter__(self) -> LaneSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def drawn(self) -> list[Phase]:
        return [p for p in self.phases if p.title and p.samples]


def intervals(phase: Phase) -> dict[Lane, list[tuple[float, float, str]]]:
    """Per lane, the (start, end, job) intervals of `phase`, seconds from its start."""
    out: dict[Lane, list[tuple[float, float, str]]] = {}
    for (t, lanes), (t_next, _) in zip(phase.samples, phase.samples[1:], strict=False):
        for lane, job in lanes.items():
            spans = out.setdefault(lane, [])
            if job is None:
                continue
            if spans and spans[-1][2] == job and abs(spans[-1][1] - t) < 1e-9:
                spans[-1] = (spans[-1][0], t_next, job)
            else:
                spans.append((t, t_next, job))
    return out


def plot(phases: list[Phase], path: Path, period_s: float) -> None:
    """One panel per phase: a row per lane, a bar per job holding it; written to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    jobs = sorted({job for p in phases for _, lanes in p.samples for job in lanes.values()
                   if job is not None})
    colors = {job: plt.get_cmap("tab10")(i % 10) for i, job in enumerate(jobs)}
    rows = [max(1, len(intervals(p))) for p in phases]
    fig, axes = plt.subplots(len(phases), 1, figsize=(10, 1.2 + sum(0.45 * r + 0.6 for r in rows)),
                             gridspec_kw={"height_ratios": rows}, squeeze=False)
    for ax, phase in zip(axes[:, 0], phases, strict=True):
        spans = intervals(phase)
        labels = sorted(spans)
        for row, lane in enumerate(labels):
            for start, end, job in spans[lane]:
                ax.barh(row, end - start, left=start, color=colors[job], height=0.7)
        ax.set_yticks(range(len(labels)), [f"device {d} lane {n}" for d, n in labels],
                      fontsize=8)
        ax.set_title(phase.title, fontsize=9, loc="left")
        ax.set_xlim(left=0)
        ax.invert_yaxis()
    axes[-1, 0].set_xlabel(f"seconds from the start of each phase (lanes sampled every "
                           f"{period_s * 1e3:.0f} ms from the daemon's status)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[j]) for j in jobs]
    fig.legend(handles, jobs, loc="upper right", fontsize=8, ncols=min(len(jobs), 6))
    fig.suptitle("salusd demo: which job held each lane", x=0.01, ha="left", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)
