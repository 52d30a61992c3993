"""The daemon core in process: training through it equals direct training, jobs share lanes,
bad input and failing jobs stay contained."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn
from workloads import batches, cnn, mlp, train_direct

from salus.daemon.core import Daemon
from salus.daemon.devices import DeviceSpec
from salus.daemon.errors import (
    BadRequest,
    DoesNotFit,
    JobCancelled,
    JobFailed,
    NotOwner,
    UnknownJob,
)


def _train_through(daemon, build, data, owner="alice", name="job"):
    model, opt, loss_fn = build() if callable(build) else build
    jid = daemon.open_job(owner, name, len(data), "training")
    daemon.setup_training(jid, owner, model, opt, loss_fn)
    losses = [daemon.step(jid, owner, x, y).result(timeout=60) for x, y in data]
    state = daemon.state_dict(jid, owner)
    info = daemon.job_info(jid, owner)
    daemon.close_job(jid, owner)
    return state, losses, info


def _assert_same(state: dict[str, torch.Tensor], model: nn.Module) -> None:
    ref = model.state_dict()
    assert state.keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(state[k], ref[k], atol=1e-6, rtol=0)


@pytest.mark.parametrize("build,kind", [
    (lambda: mlp("sgd"), "mlp"), (lambda: mlp("adam"), "mlp"),
    (lambda: cnn("sgd"), "cnn"), (lambda: cnn("adam"), "cnn"),
])
def test_training_through_daemon_equals_direct(daemon_factory, build, kind):
    daemon = daemon_factory()
    data = batches(kind, 12)
    state, losses, info = _train_through(daemon, build, data)
    _assert_same(state, train_direct(build, data))
    assert all(isinstance(v, float) for v in losses)
    assert info["iterations_done"] == 12
    assert info["memory"]["persistent_limit"] == "enforced"
    assert info["memory"]["ephemeral_limit"] == "accounted"
    assert info["memory"]["ephemeral_measured_bytes"] > 0


@pytest.mark.parametrize("policy", ["pack", "fifo", "srtf", "fair"])
def test_concurrent_jobs_each_equal_direct(daemon_factory, policy):
    daemon = daemon_factory(policy)
    builds = [(lambda: mlp("sgd"), "mlp", 1), (lambda: mlp("adam"), "mlp", 2),
              (lambda: cnn("adam"), "cnn", 3)]
    results: dict[int, object] = {}

    def client(i, built, data):
        try:
            results[i] = _train_through(daemon, built, data, name=f"j{i}")
        except Exception as exc:  # reported by the assertion below
            results[i] = exc

    # Models are built before the threads start: torch's seeded RNG is process-global.
    threads = [threading.Thread(target=client, args=(i, build(), batches(kind, 10, seed)))
               for i, (build, kind, seed) in enumerate(builds)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(results) == 3
    assert not [r for r in results.values() if isinstance(r, Exception)]
    daemon.sched.lanes.check_invariants()
    daemon.arenas[0].allocator.check_invariants()
    assert daemon.arenas[0].stats().used == 0  # every job closed: the arena is empty again
    for i, (build, kind, seed) in enumerate(builds):
        state, _, _ = results[i]
        _assert_same(state, train_direct(build, batches(kind, 10, seed)))


def test_pack_gives_small_jobs_their_own_lanes(daemon_factory):
    daemon = daemon_factory("pack")
    jobs = []
    for i in range(3):
        model, opt, loss_fn = mlp()
        jid = daemon.open_job("alice", f"j{i}", 5, "training")
        daemon.setup_training(jid, "alice", model, opt, loss_fn)
        x, y = batches("mlp", 1)[0]
        daemon.step(jid, "alice", x, y).result(timeout=60)
        jobs.append(jid)
    lanes = {daemon.job_info(j, "alice")["lane"] for j in jobs}
    assert len(lanes) == 3
    snap = daemon.snapshot()
    assert snap["devices"][0]["arena"]["used_bytes"] >= sum(
        daemon.job_info(j, "alice")["memory"]["persistent_bytes"] for j in jobs)
    for j in jobs:
        daemon.close_job(j, "alice")
    assert daemon.snapshot()["devices"][0]["lanes"] == []


def test_fifo_runs_the_oldest_job_to_completion_first(daemon_factory):
    daemon = daemon_factory("fifo")
    a_model, a_opt, loss = mlp()
    b_model, b_opt, _ = mlp("adam")
    a = daemon.open_job("alice", "a", 3, "training")
    b = daemon.open_job("alice", "b", 3, "training")
    daemon.setup_training(a, "alice", a_model, a_opt, loss)
    daemon.setup_training(b, "alice", b_model, b_opt, loss)
    x, y = batches("mlp", 1)[0]
    daemon.step(a, "alice", x, y).result(timeout=60)
    fb = daemon.step(b, "alice", x, y)
    with pytest.raises(TimeoutError):
        fb.result(timeout=0.5)  # a holds the lane until it finishes
    daemon.close_job(a, "alice")
    assert isinstance(fb.result(timeout=60), float)


def test_suspend_holds_a_job_at_the_boundary_and_resume_releases_it(daemon_factory):
    daemon = daemon_factory("fair")
    model, opt, loss = mlp()
    j = daemon.open_job("alice", "a", 10, "training")
    daemon.setup_training(j, "alice", model, opt, loss)
    x, y = batches("mlp", 1)[0]
    daemon.step(j, "alice", x, y).result(timeout=60)
    daemon.suspend(j, "alice")
    f = daemon.step(j, "alice", x, y)
    with pytest.raises(TimeoutError):
        f.result(timeout=0.3)
    daemon.resume(j, "alice")
    assert isinstance(f.result(timeout=60), float)


def test_inference_job_returns_the_models_output(daemon_factory):
    daemon = daemon_factory()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8), nn.Tanh())
    expected_model = nn.Sequential(nn.Linear(16, 8), nn.Tanh())
    expected_model.load_state_dict(model.state_dict())
    j = daemon.open_job("bob", "inf", 3, "inference")
    daemon.setup_inference(j, "bob", model)
    x = torch.randn(5, 16)
    out = daemon.infer(j, "bob", x).result(timeout=60)
    torch.testing.assert_close(out, expected_model(x).detach())
    daemon.close_job(j, "bob")


def test_bad_input_is_refused_clearly(daemon_factory):
    daemon = daemon_factory(memory=8 * 2**20)
    with pytest.raises(BadRequest, match="kind"):
        daemon.open_job("alice", "x", 1, "painting")
    with pytest.raises(BadRequest, match="iterations"):
        daemon.open_job("alice", "x", 0, "training")
    with pytest.raises(UnknownJob):
        daemon.step("999", "alice", torch.zeros(1), torch.zeros(1))
    with pytest.raises(UnknownJob):
        daemon.job_info("not-a-number", "alice")
    j = daemon.open_job("alice", "x", 1, "training")
    with pytest.raises(NotOwner):
        daemon.job_info(j, "mallory")
    with pytest.raises(BadRequest, match="train_step"):
        daemon.step(j, "alice", torch.zeros(1), torch.zeros(1))
    model, opt, loss = mlp()
    with pytest.raises(BadRequest, match="optimizer"):
        daemon.setup_training(j, "alice", model, "sgd", loss)
    other, other_opt, _ = mlp()
    with pytest.raises(BadRequest, match="not the model's"):
        daemon.setup_training(j, "alice", model, other_opt, loss)
    big = nn.Linear(2048, 2048)
    with pytest.raises(DoesNotFit):
        daemon.setup_training(j, "alice", big, torch.optim.Adam(big.parameters()), loss)


def test_a_failing_job_does_not_disturb_another(daemon_factory):
    daemon = daemon_factory()

    class Exploding(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 4)
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            if self.calls == 3:
                raise RuntimeError("boom")
            return self.lin(x)

    bad_model = Exploding()
    bad = daemon.open_job("eve", "bad", 5, "training")
    daemon.setup_training(bad, "eve", bad_model, torch.optim.SGD(bad_model.parameters(), 0.1),
                          nn.CrossEntropyLoss())
    data = batches("mlp", 6)
    for x, y in data[:2]:
        daemon.step(bad, "eve", x, y).result(timeout=60)
    with pytest.raises(JobFailed, match="boom"):
        daemon.step(bad, "eve", *data[2]).result(timeout=60)
    with pytest.raises(UnknownJob):
        daemon.step(bad, "eve", *data[3])
    state, _, _ = _train_through(daemon, lambda: mlp("sgd"), data)
    _assert_same(state, train_direct(lambda: mlp("sgd"), data))


def test_shutdown_cancels_queued_work_and_stops_workers(daemon_factory):
    daemon = daemon_factory()
    model, opt, loss = mlp()
    j = daemon.open_job("alice", "a", 5, "training")
    daemon.setup_training(j, "alice", model, opt, loss)
    x, y = batches("mlp", 1)[0]
    daemon.step(j, "alice", x, y).result(timeout=60)
    daemon.suspend(j, "alice")
    queued = daemon.step(j, "alice", x, y)
    assert daemon.workers_alive == 1
    daemon.shutdown()
    with pytest.raises(JobCancelled, match="shutting down"):
        queued.result(timeout=10)
    assert daemon.workers_alive == 0
    with pytest.raises(JobCancelled):
        daemon.open_job("alice", "late", 1, "training")


class _DataDependent(nn.Module):
    """Allocates a buffer sized by the data: the fake-tensor estimate reads `.item()` as 1, so
    the real first iteration needs far more than estimated."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scratch = torch.ones(int(x.abs().sum().item()) * 4096)
        return self.lin(x) + scratch.sum() * 0


def test_a_job_over_its_lane_is_readmitted_and_nothing_over_commits(daemon_factory):
    daemon = daemon_factory("pack")
    torch.manual_seed(0)
    model = _DataDependent()
    j = daemon.open_job("alice", "greedy", 4, "training")
    daemon.setup_training(j, "alice", model, torch.optim.SGD(model.parameters(), 0.1),
                          nn.CrossEntropyLoss())
    for x, y in batches("mlp", 4):
        daemon.step(j, "alice", x, y).result(timeout=60)
    info = daemon.job_info(j, "alice")["memory"]
    assert info["ephemeral_measured_bytes"] > 10 * info["ephemeral_estimate_bytes"]
    assert info["lane_bytes"] >= info["ephemeral_measured_bytes"]
    assert any(e.kind == "requeue" and e.job_id == int(j) for e in daemon.events)
    daemon.sched.lanes.check_invariants()
    daemon.arenas[0].allocator.check_invariants()


def test_a_measured_peak_beyond_any_device_fails_only_that_job(daemon_factory):
    daemon = daemon_factory("pack", memory=4 * 2**20)
    torch.manual_seed(0)
    model = _DataDependent()
    j = daemon.open_job("alice", "too-big", 4, "training")
    daemon.setup_training(j, "alice", model, torch.optim.SGD(model.parameters(), 0.1),
                          nn.CrossEntropyLoss())
    x, y = batches("mlp", 1)[0]
    daemon.step(j, "alice", x * 100, y).result(timeout=60)
    with pytest.raises((DoesNotFit, UnknownJob)):
        daemon.step(j, "alice", x, y).result(timeout=60)
    state, _, _ = _train_through(daemon, lambda: mlp("sgd"), batches("mlp", 3))
    _assert_same(state, train_direct(lambda: mlp("sgd"), batches("mlp", 3)))


class _ManyBuffers(nn.Module):
    """A linear layer with 100 one-element buffers: under 1 KiB of state that takes 26 KiB of
    arena chunks once every tensor is rounded up to the arena's 256-byte granularity."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(1, 1)
        for i in range(100):
            self.register_buffer(f"b{i}", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def test_admission_books_arena_alignment_so_placement_never_fails(daemon_factory):
    """Twelve such jobs fit a 256 KiB device by exact bytes but not by arena chunks: admission
    must count the rounding, admit only what the arena holds, and run the rest later."""
    daemon = Daemon([DeviceSpec(0, "cpu", "cpu", "cpu0", 2**18)], "pack")
    jobs, futures = [], []
    for i in range(12):
        model = _ManyBuffers()
        j = daemon.open_job("alice", f"b{i}", 1, "training")
        daemon.setup_training(j, "alice", model, torch.optim.SGD(model.parameters(), 0.1),
                              nn.MSELoss())
        jobs.append(j)
        futures.append(daemon.step(j, "alice", torch.randn(4, 1), torch.randn(4, 1)))
    admitted = [j for j, f in zip(jobs, futures, strict=True) if f.done()]
    assert 0 < len(admitted) < len(jobs)  # the device is full: some jobs wait
    for j, f in zip(jobs, futures, strict=True):
        f.result(timeout=60)  # raises JobFailed if a placement ran out of arena
        daemon.close_job(j, "alice")
    assert daemon.arenas[0].stats().peak <= daemon.arenas[0].capacity
    daemon.arenas[0].allocator.check_invariants()
    daemon.shutdown()


def test_swap_out_gives_memory_to_a_waiting_job_and_resume_continues_exactly(daemon_factory):
    """Two jobs that cannot both fit: swapping the first out admits the second; after the
    second closes, the first resumes from host memory and ends as direct training does."""
    daemon = daemon_factory("pack", memory=4 * 2**20)

    def build() -> tuple[nn.Module, torch.optim.Optimizer, nn.Module]:
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(400, 400), nn.Tanh(), nn.Linear(400, 4))
        return m, torch.optim.Adam(m.parameters(), lr=1e-3), nn.CrossEntropyLoss()

    g = torch.Generator().manual_seed(5)
    data = [(torch.randn(8, 400, generator=g), torch.randint(0, 4, (8,), generator=g))
            for _ in range(6)]
    a_model, a_opt, loss = build()
    a = daemon.open_job("alice", "a", 6, "training")
    daemon.setup_training(a, "alice", a_model, a_opt, loss)
    for x, y in data[:3]:
        daemon.step(a, "alice", x, y).result(timeout=60)
    b_model, b_opt, _ = build()
    b = daemon.open_job("bob", "b", 1, "training")
    daemon.setup_training(b, "bob", b_model, b_opt, loss)
    fb = daemon.step(b, "bob", *data[0])
    with pytest.raises(TimeoutError):
        fb.result(timeout=0.5)  # b does not fit beside a
    used_with_a = daemon.arenas[0].stats().used
    daemon.suspend(a, "alice", swap=True)
    assert isinstance(fb.result(timeout=60), float)
    assert daemon.job_info(a, "alice")["memory"]["resident"] is False
    daemon.close_job(b, "bob")
    assert daemon.arenas[0].stats().used < used_with_a
    daemon.resume(a, "alice")
    for x, y in data[3:]:
        daemon.step(a, "alice", x, y).result(timeout=60)
    state = daemon.state_dict(a, "alice")
    _assert_same(state, train_direct(build, data))
    assert [e.kind for e in daemon.events if e.job_id == int(a) and e.kind in
            ("swap_out", "admit")] == ["admit", "swap_out", "admit"]


class _Branchy(nn.Module):
    """Uses its second layer only on some batches: on the others that layer gets no gradient,
    and a direct loop's Adam leaves it alone (grad None), which the daemon must match."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 4)
        self.b = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.a(x)
        return out + self.b(x) if x[0, 0] > 0 else out


def test_parameters_without_a_gradient_are_left_alone_as_in_a_direct_loop(daemon_factory):
    def build() -> tuple[nn.Module, torch.optim.Optimizer, nn.Module]:
        torch.manual_seed(0)
        m = _Branchy()
        return m, torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1), \
            nn.CrossEntropyLoss()

    data = batches("mlp", 12, seed=3)
    assert len({bool(x[0, 0] > 0) for x, _ in data}) == 2  # both branches occur
    state, _, _ = _train_through(daemon_factory(), build, data)
    _assert_same(state, train_direct(build, data))


def test_a_priority_set_before_admission_is_kept(daemon_factory):
    daemon = daemon_factory("fair")
    model, opt, loss = mlp()
    j = daemon.open_job("alice", "weighted", 3, "training")
    daemon.setup_training(j, "alice", model, opt, loss)
    daemon.set_priority(j, "alice", 3.0)  # before the first batch, so before admission
    with pytest.raises(BadRequest, match="priority"):
        daemon.set_priority(j, "alice", 0)
    daemon.step(j, "alice", *batches("mlp", 1)[0]).result(timeout=60)
    assert daemon.sched.jobs[int(j)].priority == 3.0
