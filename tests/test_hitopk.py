"""Hierarchical top-k allreduce across real processes: gloo on loopback, 2x2 and 4x1 layouts.

One spawn per layout runs every scenario and saves each rank's results; the tests below compare
them with each other and with a single-process reference computed here from the same inputs.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from salus.daemon.services.hitopk import hitopk_allreduce
from salus.daemon.services.procgroup import free_port, init_loopback, leave_group, run_local_group

WORLD = 4
LAYOUTS = {"2x2": 2, "4x1": 1}  # nodes x local ranks -> local_size
DENSE_N = 4099
SPARSE_SHAPES: list[tuple[int, ...]] = [(1,), (7,), (1001,), (3, 5, 7), (4099,)]
SPARSE_DENSITY = 0.3
EF_N, EF_STEPS, EF_DENSITY = 999, 6, 0.05
NAN_RANK = 1
SUBGROUP = [1, 3]
OTHER_DTYPES = [torch.float16, torch.bfloat16, torch.float64]
PG_TIMEOUT_S = 30
JOIN_TIMEOUT_S = 150

Results = list[dict[str, Any]]


def make_input(rank: int, tag: int, shape: tuple[int, ...], integer: bool = False) -> torch.Tensor:
    """Deterministic per-(rank, tag) input; integer-valued floats make every sum exact."""
    g = torch.Generator().manual_seed(10_000 * tag + rank)
    if integer:
        return torch.randint(-8, 9, shape, generator=g).float()
    return torch.randn(shape, generator=g)


def _worker(rank: int, port: int, local_size: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    init_loopback(rank, WORLD, port, timeout_s=PG_TIMEOUT_S)
    res: dict[str, Any] = {}
    x = make_input(rank, 0, (DENSE_N,), integer=True)
    dense = x.clone()
    dist.all_reduce(dense)
    res["dense"] = dense
    returned = hitopk_allreduce(x, 1.0, local_size=local_size, dense_below=0)
    res["density1"] = x
    res["returns_its_input"] = returned is x
    for dtype in OTHER_DTYPES:
        y = make_input(rank, 0, (DENSE_N,), integer=True).to(dtype)
        z = y.clone()
        hitopk_allreduce(y, 1.0, local_size=local_size, dense_below=0)
        res[f"density1{dtype}"] = y
        dist.all_reduce(z)
        res[f"dense{dtype}"] = z

    # Two asynchronous calls in flight at once, then waited for in reverse order.
    a = make_input(rank, 70, (DENSE_N,))
    b = make_input(rank, 71, (DENSE_N,))
    work_a = hitopk_allreduce(a, 0.2, local_size=local_size, method="exact", dense_below=0,
                              async_op=True)
    work_b = hitopk_allreduce(b, 0.2, local_size=local_size, method="exact", dense_below=0,
                              async_op=True)
    res["async_waited"] = work_b.wait() and work_a.wait()
    res["async_completed"] = work_a.is_completed() and work_b.is_completed()
    res["async_a"], res["async_b"] = a, b

    # A group that is not the default group: ranks 1 and 3 only, one rank per node.
    sub = dist.new_group(SUBGROUP)
    if rank in SUBGROUP:
        s = make_input(rank, 80, (DENSE_N,))
        hitopk_allreduce(s, 0.3, local_size=1, group=sub, method="exact", dense_below=0)
        res["subgroup"] = s

    for i, shape in enumerate(SPARSE_SHAPES):
        res[f"sparse{shape}"] = hitopk_allreduce(
            make_input(rank, 1 + i, shape),
            SPARSE_DENSITY,
            local_size=local_size,
            method="exact",
            dense_below=0,
        )

    residual = torch.zeros(EF_N)
    res["ef_out"] = torch.stack(
        [
            hitopk_allreduce(
                make_input(rank, 20 + step, (EF_N,), integer=True),
                EF_DENSITY,
                residual,
                local_size=local_size,
                dense_below=0,
            )
            for step in range(EF_STEPS)
        ]
    )
    res["ef_residual"] = residual

    small_residual = torch.ones(100)
    res["small"] = hitopk_allreduce(
        make_input(rank, 40, (100,)), 0.01, small_residual, local_size=local_size
    )
    res["small_residual"] = small_residual

    bad = make_input(rank, 50, (5000,))
    if rank == NAN_RANK:
        bad[4321] = float("nan")
    bad_before = bad.clone()
    nan_residual = torch.ones(5000)
    try:
        hitopk_allreduce(bad, 0.1, nan_residual, local_size=local_size, dense_below=0)
        res["nan_error"] = ""
    except ValueError as exc:
        res["nan_error"] = str(exc)
    res["nan_residual"] = nan_residual
    res["nan_tensor_untouched"] = torch.equal(bad.nan_to_num(), bad_before.nan_to_num())
    res["after_nan"] = hitopk_allreduce(
        make_input(rank, 51, (5000,)), 0.1, local_size=local_size, method="exact", dense_below=0
    )

    try:
        hitopk_allreduce(make_input(rank, 60, (600 + (rank == 0),)), 0.1, local_size=local_size)
        res["mismatch_error"] = ""
    except ValueError as exc:
        res["mismatch_error"] = str(exc)

    torch.save(res, Path(out_dir) / f"rank{rank}.pt")
    leave_group()


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout_results(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[int, Results]:
    local_size = LAYOUTS[request.param]
    out_dir = tmp_path_factory.mktemp(f"hitopk-{request.param}")
    run_local_group(
        _worker, WORLD, (free_port(), local_size, str(out_dir)), timeout_s=JOIN_TIMEOUT_S
    )
    return local_size, [torch.load(out_dir / f"rank{r}.pt") for r in range(WORLD)]


def reference(inputs: list[torch.Tensor], density: float, local_size: int) -> torch.Tensor:
    """Single-process hierarchical top-k: node sums, top-k per node shard, sum over nodes."""
    shape = inputs[0].shape
    flat = [x.reshape(-1) for x in inputs]
    n = flat[0].numel()
    shard = -(-n // local_size)
    padded = [torch.cat([x, x.new_zeros(shard * local_size - n)]) for x in flat]
    nodes = [
        torch.stack(padded[i : i + local_size]).sum(0) for i in range(0, WORLD, local_size)
    ]
    k = min(shard, max(1, math.ceil(density * shard - 1e-9)))
    out = torch.zeros(shard * local_size)
    for lr in range(local_size):
        part = slice(lr * shard, (lr + 1) * shard)
        for node_sum in nodes:
            s = node_sum[part]
            idx = torch.topk(s.abs(), k).indices
            out[part][idx] += s[idx]
    return out[:n].view(shape)


def assert_same_on_every_rank(results: Results, key: str) -> torch.Tensor:
    first = results[0][key]
    for r, res in enumerate(results[1:], start=1):
        assert torch.equal(res[key], first), f"rank {r} disagrees with rank 0 on {key}"
    return first


@pytest.mark.slow
def test_density_one_equals_dense_allreduce(layout_results: tuple[int, Results]) -> None:
    _, results = layout_results
    want = torch.stack([make_input(r, 0, (DENSE_N,), integer=True) for r in range(WORLD)]).sum(0)
    for res in results:
        assert res["returns_its_input"]  # in place, like torch.distributed
        assert torch.equal(res["density1"], res["dense"])
        assert torch.equal(res["density1"], want)


@pytest.mark.slow
def test_async_calls_in_flight_together_give_the_sync_results(
    layout_results: tuple[int, Results],
) -> None:
    local_size, results = layout_results
    for res in results:
        assert res["async_waited"] and res["async_completed"]
    for key, tag in (("async_a", 70), ("async_b", 71)):
        got = assert_same_on_every_rank(results, key)
        want = reference([make_input(r, tag, (DENSE_N,)) for r in range(WORLD)], 0.2, local_size)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_a_group_other_than_the_default_group(layout_results: tuple[int, Results]) -> None:
    _, results = layout_results
    got = [results[r]["subgroup"] for r in SUBGROUP]
    assert torch.equal(got[0], got[1])
    for r, res in enumerate(results):
        assert ("subgroup" in res) == (r in SUBGROUP)
    # Two nodes of one rank each: every rank's top 30% of its own tensor, summed.
    want = torch.zeros(DENSE_N)
    k = math.ceil(0.3 * DENSE_N - 1e-9)
    for r in SUBGROUP:
        x = make_input(r, 80, (DENSE_N,))
        idx = torch.topk(x.abs(), k).indices
        want[idx] += x[idx]
    torch.testing.assert_close(got[0], want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", OTHER_DTYPES)
def test_density_one_in_other_float_dtypes(
    layout_results: tuple[int, Results], dtype: torch.dtype
) -> None:
    _, results = layout_results
    for res in results:
        got = res[f"density1{dtype}"]
        assert got.dtype == dtype
        assert torch.equal(got, res[f"dense{dtype}"])


@pytest.mark.slow
@pytest.mark.parametrize("shape", SPARSE_SHAPES)
def test_sparse_matches_reference_and_ranks_agree(
    layout_results: tuple[int, Results], shape: tuple[int, ...]
) -> None:
    local_size, results = layout_results
    i = SPARSE_SHAPES.index(shape)
    got = assert_same_on_every_rank(results, f"sparse{shape}")
    inputs = [make_input(r, 1 + i, shape) for r in range(WORLD)]
    want = reference(inputs, SPARSE_DENSITY, local_size)
    assert got.shape == shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if math.prod(shape) > 10:
        assert 0 < int(torch.count_nonzero(got)) < math.prod(shape)  # really sparse


@pytest.mark.slow
def test_error_feedback_conserves_gradient_mass(layout_results: tuple[int, Results]) -> None:
    _, results = layout_results
    outs = assert_same_on_every_rank(results, "ef_out")
    sent = outs.sum(0)
    held = torch.stack([res["ef_residual"] for res in results]).sum(0)
    inputs = torch.stack(
        [
            make_input(r, 20 + step, (EF_N,), integer=True)
            for r in range(WORLD)
            for step in range(EF_STEPS)
        ]
    ).sum(0)
    assert torch.equal(sent + held, inputs)
    assert int(torch.count_nonzero(held)) > 0  # something was held back
    per_step = (outs != 0).sum(1)
    assert int(per_step.max()) < EF_N  # each step sent a sparse result


@pytest.mark.slow
def test_small_tensors_take_the_dense_path(layout_results: tuple[int, Results]) -> None:
    _, results = layout_results
    got = assert_same_on_every_rank(results, "small")
    want = torch.stack([make_input(r, 40, (100,)) for r in range(WORLD)]).sum(0) + WORLD
    torch.testing.assert_close(got, want)
    for res in results:
        assert not res["small_residual"].any()


@pytest.mark.slow
def test_nan_on_one_rank_raises_on_every_rank(layout_results: tuple[int, Results]) -> None:
    local_size, results = layout_results
    for r, res in enumerate(results):
        assert f"rank(s) [{NAN_RANK}]" in res["nan_error"], f"rank {r}: {res['nan_error']!r}"
        assert torch.equal(res["nan_residual"], torch.ones(5000))
        assert res["nan_tensor_untouched"]
    # The group is still in step afterwards.
    got = assert_same_on_every_rank(results, "after_nan")
    want = reference([make_input(r, 51, (5000,)) for r in range(WORLD)], 0.1, local_size)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_ranks_disagreeing_on_the_call_raise_everywhere(
    layout_results: tuple[int, Results],
) -> None:
    _, results = layout_results
    for r, res in enumerate(results):
        assert "disagree" in res["mismatch_error"] and "numel" in res["mismatch_error"], r


@pytest.mark.parametrize(
    ("kwargs", "err", "match"),
    [
        ({"tensor": torch.ones(4, dtype=torch.int32)}, TypeError, "float"),
        ({"density": 0.0}, ValueError, "density"),
        ({"density": 1.5}, ValueError, "density"),
        ({"local_size": 0}, ValueError, "local_size"),
        ({"residual": torch.ones(5)}, ValueError, "residual"),
        ({"method": "fast"}, ValueError, "method"),
        ({}, RuntimeError, "init_process_group"),
    ],
)
def test_bad_arguments_are_clear_errors(
    kwargs: dict[str, Any], err: type[Exception], match: str
) -> None:
    call: dict[str, Any] = {"tensor": torch.ones(4), "density": 0.5, "local_size": 1}
    call.update(kwargs)
    with pytest.raises(err, match=match):
        hitopk_allreduce(**call)
