"""`Comm` across real processes: gloo on loopback, 2 and 4 ranks.

One spawn per world size runs every scenario; each rank compares the Comm's results with plain
``torch.distributed`` calls on the same inputs (an independent implementation) or saves them for
the single-process references computed here. A barrier precedes ``destroy_process_group``: gloo
aborts a process whose groups are destroyed while a peer is still inside a sub-group collective.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from salus.daemon.services.comm import Comm
from salus.daemon.services.procgroup import free_port, init_loopback, leave_group, run_local_group

PG_TIMEOUT_S = 60
JOIN_TIMEOUT_S = 85
SIZES = [1, 7, 1001, 300_001]  # 300_001 float32 is above auto's small-tensor threshold
DTYPES = [torch.float32, torch.float64]
ALGOS = ["ring", "tree", "hierarchical", "auto"]
OPS = {"sum": dist.ReduceOp.SUM, "product": dist.ReduceOp.PRODUCT,
       "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
SUBGROUP = [1, 3]
SPARSE_N = 70_001  # above DENSE_BELOW_NUMEL: the sparse path runs
EF_STEPS, EF_DENSITY = 5, 0.05
BATCH_PER_RANK = 8
PTO_STEPS = 4
OPTIMIZERS = ["sgd", "adam", "adamw"]

Results = list[dict[str, Any]]


def make_input(rank: int, tag: int, n: int, dtype: torch.dtype, integer: bool) -> torch.Tensor:
    """Deterministic per-(rank, tag) input; integer values make every sum exact in any order."""
    g = torch.Generator().manual_seed(1000 * tag + rank)
    if integer:
        return torch.randint(-4, 5, (n,), generator=g).to(dtype)
    return torch.randn(n, generator=g, dtype=dtype)


def make_model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                         nn.Linear(64, 4)).to(dtype)


def make_batch(world: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    n = BATCH_PER_RANK * world
    return torch.randn(n, 16, generator=g, dtype=dtype), torch.randint(0, 4, (n,), generator=g)


def shard(batch: tuple[torch.Tensor, torch.Tensor], rank: int) -> tuple[torch.Tensor, ...]:
    return tuple(t[rank * BATCH_PER_RANK : (rank + 1) * BATCH_PER_RANK] for t in batch)


def make_optimizer(kind: str, model: nn.Module) -> tuple[torch.optim.Optimizer, Any]:
    if kind == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9,
                                                     weight_decay=1e-3)
        return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    if kind == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=1e-3)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))


def grads(model: nn.Module) -> list[torch.Tensor]:
    out = []
    for p in model.parameters():
        assert p.grad is not None
        out.append(p.grad.clone())
    return out


def wchar() -> int:
    """Bytes this process passed to write-type syscalls (gloo's socket writes included)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise RuntimeError("no wchar in /proc/self/io")


def _all_reduce_cases(comm: Comm, rank: int, res: dict[str, Any]) -> None:
    for algo in ALGOS:
        for n in SIZES:
            for dtype in DTYPES:
                for integer in (True, False):
                    x = make_input(rank, n, n, dtype, integer)
                    want = x.clone()
                    dist.all_reduce(want)
                    comm.all_reduce(x, algorithm=algo)
                    key = f"{algo}/{n}/{dtype}/{'int' if integer else 'randn'}"
                    res[f"exact:{key}"] = torch.equal(x, want)
                    res[f"err:{key}"] = float((x - want).abs().max())
                    res[f"chosen:{key}"] = comm.last_algorithm
        for name, op in OPS.items():
            x = make_input(rank, 9, 1001, torch.float64, integer=True)
            want = x.clone()
            dist.all_reduce(want, op=op)
            comm.all_reduce(x, op=op, algorithm=algo)
            res[f"op:{algo}/{name}"] = torch.equal(x, want)
        # A non-contiguous tensor is reduced in place too.
        m = make_input(rank, 11, 35, torch.float64, integer=True).view(5, 7).t()
        want = m.clone()
        dist.all_reduce(want)
        comm.all_reduce(m, algorithm=algo)
        res[f"noncontiguous:{algo}"] = torch.equal(m, want)


def _async_cases(comm: Comm, rank: int, res: dict[str, Any]) -> None:
    xs = [make_input(rank, 20 + i, 200_003, torch.float32, True) for i in range(3)]
    wants = [x.clone() for x in xs]
    for w in wants:
        dist.all_reduce(w)
    b = make_input(rank, 30, 999, torch.float32, False)
    b_want = make_input(1, 30, 999, torch.float32, False)
    works = [comm.all_reduce(x, algorithm=a, async_op=True)
             for x, a in zip(xs, ["tree", "ring", "hierarchical"], strict=True)]
    works.append(comm.broadcast(b, src=1, async_op=True))
    waited = [w.wait() for w in reversed(works) if w is not None]
    res["async_waited"] = len(waited) == 4 and all(waited)
    res["async_completed"] = all(w is not None and w.is_completed() for w in works)
    res["async_results"] = all(torch.equal(x, w) for x, w in zip(xs, wants, strict=True))
    res["async_broadcast"] = torch.equal(b, b_want)


def _other_collectives(comm: Comm, rank: int, world: int, res: dict[str, Any]) -> None:
    x = make_input(rank, 40, 1001, torch.float64, False)
    out_list = [torch.empty_like(x) for _ in range(world)]
    want_list = [torch.empty_like(x) for _ in range(world)]
    comm.all_gather(out_list, x)
    dist.all_gather(want_list, x)
    res["all_gather_list"] = all(torch.equal(a, b) for a, b in zip(out_list, want_list,
                                                                     strict=True))
    out = torch.empty(world * 1001, dtype=torch.float64)
    comm.all_gather(out, x)
    res["all_gather_tensor"] = torch.equal(out, torch.cat(want_list))
    inp = make_input(rank, 41, world * 333, torch.float64, True)
    got = torch.empty(333, dtype=torch.float64)
    comm.reduce_scatter(got, inp)
    total = inp.clone()
    dist.all_reduce(total)
    res["reduce_scatter_tensor"] = torch.equal(got, total[rank * 333 : (rank + 1) * 333])
    got2 = torch.empty(333, dtype=torch.float64)
    comm.reduce_scatter(got2, list(inp.chunk(world)), op=dist.ReduceOp.MAX)
    peak = inp.clone()
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    res["reduce_scatter_list_max"] = torch.equal(got2, peak[rank * 333 : (rank + 1) * 333])


def _bytes_cases(comm: Comm, res: dict[str, Any]) -> None:
    """Counted bytes against the bytes the process really wrote, per algorithm."""
    x = torch.randn(1 << 20)
    for algo in ("ring", "tree", "hierarchical"):
        comm.all_reduce(x, algorithm=algo)  # warm-up: connections
        dist.barrier()
        counted, before = comm.stats.bytes_sent, wchar()
        comm.all_reduce(x, algorithm=algo)
        res[f"bytes:{algo}"] = (comm.stats.bytes_sent - counted, wchar() - before)
        x.div_(dist.get_world_size())  # keep the values bounded


def _sparse_cases(comm: Comm, rank: int, res: dict[str, Any]) -> None:
    x = make_input(rank, 50, SPARSE_N, torch.float32, True)
    want = x.clone()
    dist.all_reduce(want)
    comm.sparse_all_reduce(x, 1.0)
    res["sparse_density1"] = torch.equal(x, want)
    residual = torch.zeros(SPARSE_N)
    outs = []
    for step in range(EF_STEPS):
        y = make_input(rank, 60 + step, SPARSE_N, torch.float32, True)
        work = comm.sparse_all_reduce(y, EF_DENSITY, residual, async_op=True)
        assert work is not None
        work.wait()
        outs.append(y)
    res["ef_out"] = torch.stack(outs)
    res["ef_residual"] = residual


def _gradient_cases(rank: int, world: int, res: dict[str, Any]) -> None:
    batch = make_batch(world, torch.float32)
    x, y = shard(batch, rank)
    # Small buckets: several buckets per call.
    comm = Comm(bucket_bytes=8192)
    for algo in ("ring", "tree", "hierarchical", "auto"):
        model = make_model(torch.float32)
        nn.functional.cross_entropy(model(x), y).backward()
        comm.all_reduce_gradients(model, algorithm=algo)
        res[f"grads:{algo}"] = grads(model)
    model = make_model(torch.float32)
    nn.functional.cross_entropy(model(x), y).backward()
    comm.all_reduce_gradients(model, density=1.0)
    res["grads:density1"] = grads(model)

    # A parameter used on rank 0 only, and one used nowhere.
    model = make_model(torch.float32)
    extra = nn.Parameter(torch.ones(3))
    unused = nn.Parameter(torch.ones(3))
    model.register_parameter("extra", extra)
    model.register_parameter("unused", unused)
    loss = nn.functional.cross_entropy(model(x), y)
    if rank == 0:
        loss = loss + (extra * torch.arange(3.0)).sum()
    loss.backward()
    comm.all_reduce_gradients(model)
    res["extra_grad"] = extra.grad
    res["unused_grad_is_none"] = unused.grad is None
    comm.close()


def _pto_cases(rank: int, world: int, res: dict[str, Any]) -> None:
    batch = make_batch(world, torch.float64)
    x, y = shard(batch, rank)
    comm = Comm()
    for kind in OPTIMIZERS:
        model = make_model(torch.float64)
        opt, sched = make_optimizer(kind, model)
        params = []
        for _ in range(PTO_STEPS):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            comm.all_reduce_gradients(model)
            comm.sharded_step(opt)
            sched.step()
            params.append([p.detach().clone() for p in model.parameters()])
        res[f"pto:{kind}"] = params
        res[f"pto_bytes:{kind}"] = comm.optimizer_state_bytes(opt)
        res[f"pto_user_state:{kind}"] = len(opt.state)
    comm.close()


def _worker(rank: int, port: int, world: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    init_loopback(rank, world, port, timeout_s=PG_TIMEOUT_S)
    res: dict[str, Any] = {}
    comm = Comm()
    res["local_size"] = comm.local_size
    for bad in ({"algorithm": "fast"}, {"op": dist.ReduceOp.AVG}):
        try:
            comm.all_reduce(torch.ones(3), **bad)
            res[f"bad:{sorted(bad)[0]}"] = ""
        except ValueError as exc:
            res[f"bad:{sorted(bad)[0]}"] = str(exc)
    _all_reduce_cases(comm, rank, res)
    _async_cases(comm, rank, res)
    _other_collectives(comm, rank, world, res)
    _bytes_cases(comm, res)
    _sparse_cases(comm, rank, res)
    comm.close()
    if world == 4:
        # Two "nodes" of two ranks: the hierarchical path crosses nodes.
        nodes = Comm(local_size=2)
        for n in (1001, 300_001):
            x = make_input(rank, 70, n, torch.float32, True)
            want = x.clone()
            dist.all_reduce(want)
            nodes.all_reduce(x, algorithm="hierarchical")
            res[f"2x2:{n}"] = torch.equal(x, want)
            y = make_input(rank, 71, n, torch.float32, True)
            nodes.all_reduce(y)
            res[f"2x2_auto:{n}"] = nodes.last_algorithm
        nodes.close()
        # A Comm over a group that is not the default group.
        sub = dist.new_group(SUBGROUP)
        if rank in SUBGROUP:
            part = Comm(sub, local_size=1)
            for algo in ("ring", "tree", "hierarchical"):
                x = make_input(rank, 72, 5003, torch.float64, True)
                want = x.clone()
                dist.all_reduce(want, group=sub)
                part.all_reduce(x, algorithm=algo)
                res[f"subgroup:{algo}"] = torch.equal(x, want)
            part.close()
    _gradient_cases(rank, world, res)
    _pto_cases(rank, world, res)
    torch.save(res, Path(out_dir) / f"rank{rank}.pt")
    leave_group()


@pytest.fixture(scope="module", params=[2, 4])
def results(request: pytest.FixtureRequest,
            tmp_path_factory: pytest.TempPathFactory) -> tuple[int, Results]:
    world = request.param
    out_dir = tmp_path_factory.mktemp(f"comm{world}")
    run_local_group(_worker, world, (free_port(), world, str(out_dir)), timeout_s=JOIN_TIMEOUT_S)
    return world, [torch.load(out_dir / f"rank{r}.pt") for r in range(world)]


@pytest.mark.slow
@pytest.mark.parametrize("algo", ALGOS)
def test_all_reduce_equals_dist_all_reduce(results: tuple[int, Results], algo: str) -> None:
    world, per_rank = results
    for rank, res in enumerate(per_rank):
        assert res["local_size"] == world  # one host: one node
        for n in SIZES:
            for dtype in DTYPES:
                key = f"{algo}/{n}/{dtype}"
                # Integer values: every summation order gives the same bits.
                assert res[f"exact:{key}/int"], (rank, key)
                # Random values: the order of additions differs between algorithms.
                tol = 1e-5 if dtype == torch.float32 else 1e-12
                assert res[f"err:{key}/randn"] <= tol * world, (rank, key)
        for name in OPS:
            assert res[f"op:{algo}/{name}"], (rank, name)
        assert res[f"noncontiguous:{algo}"]


@pytest.mark.slow
def test_bad_arguments_are_refused_before_anything_moves(results: tuple[int, Results]) -> None:
    _, per_rank = results
    for res in per_rank:
        assert "algorithm must be one of" in res["bad:algorithm"]
        assert "op must be SUM, PRODUCT, MIN or MAX" in res["bad:op"]


@pytest.mark.slow
def test_auto_picks_by_size_and_topology(results: tuple[int, Results]) -> None:
    world, per_rank = results
    for res in per_rank:
        assert res["chosen:auto/1001/torch.float32/int"] == "ring"  # small: one backend call
        # Every pair of CPU processes is linked alike: packed rings reach 1 link's rate at 2
        # ranks and 2 at 4 (the complete digraph on 4 nodes has no Hamiltonian decomposition),
        # packed trees reach world - 1 links' rate.
        assert res["chosen:auto/300001/torch.float32/int"] == ("ring" if world == 2 else "tree")
        assert res["chosen:ring/300001/torch.float32/int"] == "ring"
        if world == 4:
            assert res["2x2_auto:1001"] == "ring"
            assert res["2x2_auto:300001"] == "hierarchical"


@pytest.mark.slow
def test_async_handles(results: tuple[int, Results]) -> None:
    _, per_rank = results
    for res in per_rank:
        assert res["async_waited"] and res["async_completed"]
        assert res["async_results"] and res["async_broadcast"]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["all_gather_list", "all_gather_tensor", "reduce_scatter_tensor",
                                  "reduce_scatter_list_max"])
def test_other_collectives(results: tuple[int, Results], case: str) -> None:
    _, per_rank = results
    assert all(res[case] for res in per_rank)


@pytest.mark.slow
def test_hierarchical_across_nodes_and_a_sub_group(results: tuple[int, Results]) -> None:
    world, per_rank = results
    if world != 4:
        pytest.skip("needs 4 ranks")
    for rank, res in enumerate(per_rank):
        assert res["2x2:1001"] and res["2x2:300001"]
        for algo in ("ring", "tree", "hierarchical"):
            assert res.get(f"subgroup:{algo}", rank not in SUBGROUP), (rank, algo)


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["ring", "tree", "hierarchical"])
def test_counted_bytes_match_bytes_written(results: tuple[int, Results], algo: str) -> None:
    world, per_rank = results
    nbytes = 4 << 20
    for res in per_rank:
        counted, written = res[f"bytes:{algo}"]
        assert abs(written - counted) <= 0.02 * nbytes, (algo, counted, written)
    # Every algorithm moves 2 (n - 1) / n of the tensor per rank on average.
    mean = sum(res[f"bytes:{algo}"][0] for res in per_rank) / world
    assert mean == pytest.approx(2 * (world - 1) / world * nbytes, rel=0.01)


@pytest.mark.slow
def test_sparse_density_one_equals_dense(results: tuple[int, Results]) -> None:
    _, per_rank = results
    assert all(res["sparse_density1"] for res in per_rank)


@pytest.mark.slow
def test_error_feedback_conserves_the_sum(results: tuple[int, Results]) -> None:
    world, per_rank = results
    outs = per_rank[0]["ef_out"]
    for res in per_rank[1:]:
        assert torch.equal(res["ef_out"], outs)
    held = torch.stack([res["ef_residual"] for res in per_rank]).sum(0)
    inputs = torch.stack([make_input(r, 60 + s, SPARSE_N, torch.float32, True)
                          for r in range(world) for s in range(EF_STEPS)]).sum(0)
    assert torch.equal(outs.sum(0) + held, inputs)
    assert int((outs[0] != 0).sum()) < SPARSE_N / 2  # really sparse
    assert held.any()


def _reference_grads(world: int) -> list[torch.Tensor]:
    model = make_model(torch.float32)
    x, y = make_batch(world, torch.float32)
    nn.functional.cross_entropy(model(x), y).backward()
    return grads(model)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["ring", "tree", "hierarchical", "auto", "density1"])
def test_all_reduce_gradients_equal_one_process_on_the_whole_batch(
    results: tuple[int, Results], case: str
) -> None:
    world, per_rank = results
    want = _reference_grads(world)
    for res in per_rank:
        for got, ref in zip(res[f"grads:{case}"], want, strict=True):
            # Mean of per-rank means vs one mean over the whole batch: the same sum, added in
            # another order (per shard, then across ranks) and divided at another point, so
            # float32 agrees to rounding, well under 1e-6.
            assert float((got - ref).abs().max()) <= 1e-6


@pytest.mark.slow
def test_gradients_of_parameters_unused_on_some_or_all_ranks(
    results: tuple[int, Results],
) -> None:
    world, per_rank = results
    for res in per_rank:
        assert torch.equal(res["extra_grad"], torch.arange(3.0) / world)
        assert res["unused_grad_is_none"]


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
               if isinstance(v, torch.Tensor))


@pytest.mark.slow
@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_sharded_step_equals_the_unsharded_step(results: tuple[int, Results], kind: str) -> None:
    world, per_rank = results
    model = make_model(torch.float64)
    opt, sched = make_optimizer(kind, model)
    x, y = make_batch(world, torch.float64)
    for step in range(PTO_STEPS):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        sched.step()
        for rank, res in enumerate(per_rank):
            for got, want in zip(res[f"pto:{kind}"][step], model.parameters(), strict=True):
                # float64: the gradients differ from the whole-batch ones only by the order of
                # additions (~1e-16 relative); the update itself is the same arithmetic.
                assert float((got - want.detach()).abs().max()) <= 1e-10, (rank, step)
    full = _state_bytes(opt)
    for res in per_rank:
        assert res[f"pto_user_state:{kind}"] == 0  # the user's optimizer holds no state
        share = res[f"pto_bytes:{kind}"] / full
        # 1/N of every state tensor, plus a few scalar step counters (Adam) per piece.
        assert math.isclose(share, 1 / world, abs_tol=0.01), share


def _single_rank_worker(rank: int, port: int, out_dir: str) -> None:
    init_loopback(rank, 1, port, timeout_s=PG_TIMEOUT_S)
    comm = Comm()
    res: dict[str, Any] = {}
    for algo in ALGOS:
        x = make_input(0, 90, 300_001, torch.float32, False)
        comm.all_reduce(x, algorithm=algo)
        res[f"identity:{algo}"] = torch.equal(x, make_input(0, 90, 300_001, torch.float32, False))
    model = make_model(torch.float64)
    opt, sched = make_optimizer("adam", model)
    x, y = shard(make_batch(1, torch.float64), 0)
    for _ in range(2):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        comm.all_reduce_gradients(model)
        comm.sharded_step(opt)
        sched.step()
    res["params"] = [p.detach().clone() for p in model.parameters()]
    res["bytes_sent"] = comm.stats.bytes_sent
    torch.save(res, Path(out_dir) / "rank0.pt")
    comm.close()
    leave_group()


@pytest.mark.slow
def test_a_gang_of_one(tmp_path: Path) -> None:
    run_local_group(_single_rank_worker, 1, (free_port(), str(tmp_path)),
                    timeout_s=JOIN_TIMEOUT_S)
    res = torch.load(tmp_path / "rank0.pt")
    assert all(res[f"identity:{algo}"] for algo in ALGOS)
    assert res["bytes_sent"] == 0
    model = make_model(torch.float64)
    opt, sched = make_optimizer("adam", model)
    x, y = make_batch(1, torch.float64)
    for _ in range(2):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        sched.step()
    for got, want in zip(res["params"], model.parameters(), strict=True):
        assert torch.equal(got, want.detach())
