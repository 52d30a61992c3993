"""How a client waits for a reply on its job's direct line (`adapters/torch/waiting.py`,
`Channel.poll`): it sleeps until shortly before a reply is due, polls for it from there, and
stops polling as soon as another process wants its CPU."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from salus.adapters.torch.waiting import BACK_OFF_AFTER, ReplyWait, spin_s
from salus.daemon.wire import channel as channel_module
from salus.daemon.wire.channel import YIELD_TAKEN_S, Channel


@pytest.fixture
def line() -> Iterator[tuple[Channel, Channel]]:
    a, b = socket.socketpair()
    yield Channel(a), Channel(b)
    a.close()
    b.close()


def _other_cpus() -> tuple[set[int], set[int]]:
    cpus = sorted(os.sched_getaffinity(0))
    return {cpus[0]}, set(cpus[1:])


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_poll_sees_a_frame_sent_while_it_polls(line: tuple[Channel, Channel]) -> None:
    client, executor = line
    here, there = _other_cpus()
    mine = os.sched_getaffinity(0)
    pid = os.fork()
    if pid == 0:  # the executor's side, on another CPU, answers 5 ms later
        os.sched_setaffinity(0, there)
        time.sleep(0.005)
        executor.send({"ok": True, "result": 1})
        os._exit(0)
    try:
        os.sched_setaffinity(0, here)
        deadline = time.perf_counter() + 5.0
        # On a busy machine a poll may give the CPU up early (False); it never says True
        # before the frame is there.
        while not client.poll(1.0):
            assert not client.readable(0) or time.perf_counter() < deadline
        assert client.recv() == {"ok": True, "result": 1}
    finally:
        os.sched_setaffinity(0, mine)
        os.waitpid(pid, 0)


def test_poll_gives_up_after_its_window(line: tuple[Channel, Channel]) -> None:
    client, _ = line
    began = time.perf_counter()
    assert not client.poll(0.002)
    assert time.perf_counter() - began < 0.5  # at most its window (less where the CPU is wanted)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs CPU affinity")
def test_poll_stops_once_another_process_wants_the_cpu(line: tuple[Channel, Channel]) -> None:
    client, _ = line
    cpu = min(os.sched_getaffinity(0))
    mine = os.sched_getaffinity(0)
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        os.sched_setaffinity(hog.pid, {cpu})
        os.sched_setaffinity(0, {cpu})
        time.sleep(0.05)
        began = time.perf_counter()
        assert not client.poll(2.0)
        assert time.perf_counter() - began < 1.0  # a yield ran the hog: this side sleeps
    finally:
        os.sched_setaffinity(0, mine)
        hog.kill()
        hog.wait()


class _Recording:
    """A line whose reply never comes early: what the wait asked of it (it sleeps as asked)."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, float]] = []

    def buffered(self) -> bool:
        return False

    def readable(self, seconds: float) -> bool:
        self.asked.append(("sleep", seconds))
        time.sleep(seconds)
        return False

    def poll(self, seconds: float) -> bool:
        self.asked.append(("poll", seconds))
        return True


def test_a_short_call_is_polled_for_from_the_start() -> None:
    wait, line = ReplyWait(0.001), _Recording()
    wait.expected = 0.0005
    wait.sent()
    wait.before_recv(line)  # type: ignore[arg-type]
    [(what, seconds)] = line.asked
    assert what == "poll" and 0.001 < seconds <= 0.0015


def test_a_long_call_sleeps_until_its_reply_is_nearly_due_then_polls() -> None:
    wait, line = ReplyWait(0.002), _Recording()
    wait.expected = 0.010
    wait.sent()
    wait.before_recv(line)  # type: ignore[arg-type]
    (sleep, slept), (poll, polled) = line.asked
    assert sleep == "sleep" and poll == "poll"
    assert 0.006 < slept <= 0.008  # until `spin` before the reply is due
    assert polled <= 0.0041  # from there until `spin` after it


def test_a_reply_that_comes_early_wakes_the_sleep(line: tuple[Channel, Channel]) -> None:
    client, executor = line
    wait = ReplyWait(0.001)
    wait.expected = 5.0  # the last call took 5 s; this one answers at once
    wait.sent()
    executor.send({"ok": True})
    began = time.perf_counter()
    wait.before_recv(client)
    assert time.perf_counter() - began < 1.0
    assert client.recv() == {"ok": True}


def test_a_long_call_costs_the_cpu_only_the_end_of_its_wait(
        line: tuple[Channel, Channel]) -> None:
    """The reply comes 0.3 s after the request, as the last one did: the client sleeps
    through most of that and is polling when it comes (or, on a busy machine, gave the
    poll up for another process)."""
    client, executor = line
    wait = ReplyWait(0.05)
    wait.expected = 0.3
    pid = os.fork()
    if pid == 0:
        time.sleep(0.3)
        executor.send({"ok": True})
        os._exit(0)
    try:
        wait.sent()
        began, cpu = time.perf_counter(), time.thread_time()
        wait.before_recv(client)
        took, used = time.perf_counter() - began, time.thread_time() - cpu
        assert took >= 0.2  # it waited for the reply, not blocked in recv at once
        assert used < 0.6 * took
        assert client.readable(0) or wait.turned_away or took >= 0.35
        assert client.recv() == {"ok": True}
    finally:
        os.waitpid(pid, 0)


def test_the_window_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SALUS_CLIENT_SPIN_US", "0")
    assert spin_s() == 0.0
    monkeypatch.setenv("SALUS_CLIENT_SPIN_US", "150")
    assert spin_s() == pytest.approx(150e-6)
    monkeypatch.setenv("SALUS_CLIENT_SPIN_US", "lots")
    assert spin_s() == pytest.approx(300e-6)


def test_a_slow_yield_that_ran_no_other_task_does_not_stop_the_poll(
        line: tuple[Channel, Channel], monkeypatch: pytest.MonkeyPatch) -> None:
    """In a VM a yield also takes long when the host ran something else on the vCPU: no task
    of this machine ran, the CPU is still free, and polling goes on to its deadline."""
    client, _ = line
    slow = []

    def slow_yield() -> None:  # takes 3x the threshold without giving the CPU away
        end = time.perf_counter() + 3 * YIELD_TAKEN_S
        while time.perf_counter() < end:
            pass
        slow.append(1)

    monkeypatch.setattr(channel_module.os, "sched_yield", slow_yield)
    # No task ran: the count stays (the real count could rise here if the machine preempted
    # this busy loop; a yield that really switches is the hog tests' case).
    monkeypatch.setattr(channel_module, "involuntary_switches", lambda: 7)
    began = time.perf_counter()
    assert not client.poll(0.02)
    assert time.perf_counter() - began >= 0.02
    assert len(slow) > 10


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs CPU affinity")
def test_after_polls_in_a_row_gave_the_cpu_away_the_client_blocks_for_a_while(
        line: tuple[Channel, Channel]) -> None:
    client, _ = line
    wait = ReplyWait(0.5)
    wait.expected = 0.0001
    cpu, mine = min(os.sched_getaffinity(0)), os.sched_getaffinity(0)
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        os.sched_setaffinity(hog.pid, {cpu})
        os.sched_setaffinity(0, {cpu})
        time.sleep(0.05)
        wait.sent()
        for turn in range(BACK_OFF_AFTER):
            # One poll turned away is no reason to stop polling; BACK_OFF_AFTER in a row are.
            assert wait.calm_at < time.perf_counter(), turn
            began = time.perf_counter()
            wait.before_recv(client)  # the hog wants the CPU: the poll gives up early
            assert time.perf_counter() - began < 0.4
    finally:
        os.sched_setaffinity(0, mine)
        hog.kill()
        hog.wait()
    assert wait.calm_at > time.perf_counter()
    began = time.perf_counter()
    wait.before_recv(client)  # backing off: no polling at all
    assert time.perf_counter() - began < 0.05


def test_a_poll_that_found_its_reply_forgives_the_ones_turned_away(
        line: tuple[Channel, Channel]) -> None:
    client, executor = line
    wait = ReplyWait(0.001)
    wait.expected = 0.0001
    wait.turned_away = BACK_OFF_AFTER - 1
    wait.sent()
    executor.send({"ok": True})
    wait.before_recv(client)
    assert wait.turned_away == 0 and wait.calm_at == 0.0
