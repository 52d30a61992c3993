"""Three-phase allreduce in real processes: 2 nodes (gloo on loopback) x 3 local CPU devices.

One spawn runs every case; each node saves its results and the tests compare them with a dense
`torch.distributed.all_reduce` of the same data. The nodes have different local topologies
(a DGX-1V slice and a PCIe box) and roots, so their local plans differ."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from salus.daemon.services.collectives import Topology, pack_trees, three_phase_allreduce
from salus.daemon.services.procgroup import free_port, init_loopback, leave_group, run_local_group

NODES, LOCAL = 2, 3
PG_TIMEOUT_S, JOIN_TIMEOUT_S = 60, 150
# (numel, dtype, chunk_bytes): odd sizes, chunk counts from one to thousands.
EXACT_CASES = [
    (1, torch.float64, 8),
    (17, torch.int64, 24),
    (1001, torch.float32, 100),
    (4099, torch.bfloat16, 1 << 20),
    (10007, torch.int32, 4000),
    (0, torch.float32, 64),
]
FLOAT_N = 5003

Results = dict[str, Any]


def _local_inputs(node: int, tag: int, numel: int, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * tag + node)
    return [torch.randint(-8, 9, (numel,), generator=g).to(dtype) for _ in range(LOCAL)]


def _node(node: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    init_loopback(node, NODES, port, timeout_s=PG_TIMEOUT_S)
    topo = Topology.dgx1v().subgraph([0, 1, 4]) if node == 0 else Topology.pcie_box(LOCAL)
    plan = pack_trees(topo, topo.devices()[node])
    res: Results = {}
    for tag, (numel, dtype, chunk) in enumerate(EXACT_CASES):
        xs = _local_inputs(node, tag, numel, dtype)
        dense = torch.stack(xs).sum(0).to(dtype) if numel else torch.zeros(0, dtype=dtype)
        dist.all_reduce(dense)
        three_phase_allreduce(xs, plan, chunk_bytes=chunk)
        res[f"exact{tag}"] = (xs, dense)
    g = torch.Generator().manual_seed(77 + node)
    xs = [torch.randn(FLOAT_N, generator=g) for _ in range(LOCAL)]
    dense = torch.stack(xs).double().sum(0)
    dist.all_reduce(dense)
    three_phase_allreduce(xs, plan, chunk_bytes=3000)
    res["float"] = (xs, dense)
    torch.save(res, Path(out_dir) / f"node{node}.pt")
    leave_group()


@pytest.fixture(scope="module")
def node_results(tmp_path_factory: pytest.TempPathFactory) -> list[Results]:
    out_dir = tmp_path_factory.mktemp("three-phase")
    run_local_group(_node, NODES, (free_port(), str(out_dir)), timeout_s=JOIN_TIMEOUT_S)
    return [torch.load(out_dir / f"node{n}.pt") for n in range(NODES)]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_three_phase_equals_dense_allreduce(node_results: list[Results]) -> None:
    for res in node_results:
        for tag, (_numel, dtype, _chunk) in enumerate(EXACT_CASES):
            xs, dense = res[f"exact{tag}"]
            assert all(x.dtype == dtype and torch.equal(x, dense) for x in xs), f"case {tag}"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_three_phase_float_sum_and_nodes_agree(node_results: list[Results]) -> None:
    first = node_results[0]["float"][0][0]
    for res in node_results:
        xs, dense = res["float"]
        for x in xs:
            torch.testing.assert_close(x.double(), dense, rtol=1e-5, atol=1e-5)
            assert torch.equal(x, first), "every device of every node holds the same sum"


def test_needs_an_initialised_process_group() -> None:
    plan = pack_trees(Topology.pcie_box(2), 0)
    with pytest.raises(RuntimeError, match="init_process_group"):
        three_phase_allreduce([torch.zeros(3), torch.zeros(3)], plan)
