"""Benchmark phase: per-layer FLOPs, bytes and activations against closed forms, meta tensors,
JSON round trips, device kernels, links from a topology and from a real 2-process exchange."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from salus.daemon.services.collectives.topology import Topology
from salus.daemon.services.placement import (
    ClusterProfile,
    DeviceProfile,
    LinkProfile,
    ModelProfile,
    Profile,
    benchmark_cluster,
    benchmark_device,
    links_from_topology,
    profile_model,
)
from salus.daemon.services.procgroup import free_port, init_loopback, leave_group, run_local_group

os.environ.setdefault("OMP_NUM_THREADS", "1")
M, K, N = 16, 32, 24
F32 = 4


class Pair(nn.Module):
    """Returns a tuple, as a block that carries a residual to the next one does."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 2, x + 1


class AddPair(nn.Module):
    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return pair[0] + pair[1]


def linear_stack(device: str) -> nn.Sequential:
    with torch.device(device):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(K, N), nn.Linear(N, K))


def test_linear_flops_bytes_and_activations_match_closed_forms() -> None:
    prof = profile_model(linear_stack("cpu"), torch.randn(M, K))
    first, second = prof.layers
    assert prof.batch_size == M
    assert [lay.name for lay in prof.layers] == ["0", "1"]
    assert first.forward_flops == 2 * M * N * K
    # The first block's input is data: only the weight gradient, 2mnk.
    assert first.backward_flops == 2 * M * N * K
    # Later blocks also compute the input gradient they would send back: 4mnk in all.
    assert second.forward_flops == 2 * M * K * N
    assert second.backward_flops == 4 * M * K * N
    assert first.param_bytes == (K * N + N) * F32
    assert first.grad_bytes == first.param_bytes
    assert first.optimizer_bytes == 2 * first.param_bytes
    assert first.activation_bytes == M * K * F32  # the input, saved for the weight gradient
    assert first.output_bytes == M * N * F32
    # addmm reads bias, input and weight, writes the output; the weight transpose is a view.
    assert first.forward_bytes_accessed == (N + M * K + K * N + M * N) * F32
    assert first.memory_bytes == 4 * first.param_bytes + first.activation_bytes


def test_meta_tensors_give_the_same_profile_without_computing() -> None:
    real = profile_model(linear_stack("cpu"), torch.randn(M, K))
    meta = profile_model(linear_stack("meta"), torch.randn(M, K, device="meta"))
    assert meta == real


def test_tuple_outputs_pass_as_one_argument_and_count_every_tensor() -> None:
    blocks = [("pair", Pair()), ("add", AddPair())]
    prof = profile_model(blocks, torch.randn(M, K), optimizer_states_per_param=0)
    assert prof.layers[0].output_bytes == 2 * M * K * F32
    assert prof.layers[1].output_bytes == M * K * F32
    assert prof.layers[1].param_bytes == 0


def test_profiling_leaves_gradients_alone() -> None:
    model = linear_stack("cpu")
    profile_model(model, torch.randn(M, K))
    assert all(p.grad is None for p in model.parameters())


def example_profile() -> Profile:
    model = profile_model(linear_stack("cpu"), torch.randn(M, K))
    cluster = ClusterProfile(
        (DeviceProfile("a", 1e12, 1e11, 2**30), DeviceProfile("b", 5e11, 2e11, 2**29)),
        LinkProfile(((0.0, 1e-5), (1e-5, 0.0)), ((0.0, 1.25e10), (1.25e10, 0.0))),
    )
    return Profile(model, cluster)


def test_json_round_trips(tmp_path: Path) -> None:
    prof = example_profile()
    assert Profile.from_json(prof.to_json()) == prof
    assert ModelProfile.from_json(prof.model.to_json()) == prof.model
    assert ClusterProfile.from_json(prof.cluster.to_json()) == prof.cluster
    path = tmp_path / "profile.json"
    prof.save(path)
    assert Profile.load(path) == prof
    assert json.loads(path.read_text())["model"]["layers"][0]["forward_flops"] == 2 * M * N * K


def test_cluster_checks_link_matrix_shape() -> None:
    with pytest.raises(ValueError, match="2x2"):
        ClusterProfile((DeviceProfile("a", 1.0, 1.0, 1), DeviceProfile("b", 1.0, 1.0, 1)),
                       LinkProfile(((0.0,),), ((0.0,),)))


def test_device_benchmark_measures_positive_rates() -> None:
    dev = benchmark_device("cpu", 2**30, matmul_size=128, copy_bytes=2**20,
                           min_run_time_s=0.05)
    assert dev.name == "cpu" and dev.memory_bytes == 2**30
    assert math.isfinite(dev.flops_per_s) and dev.flops_per_s > 1e6
    assert math.isfinite(dev.bytes_per_s) and dev.bytes_per_s > 1e6
    with pytest.raises(ValueError, match="memory_bytes"):
        benchmark_device("cpu", 0)


def test_links_from_topology_use_direct_links_else_switches() -> None:
    topo = Topology(
        [0, 1, 2],
        [(0, 1, 25.0, "nvlink"), (1, 0, 25.0, "nvlink"),
         (0, 1, 25.0, "nvlink"), (1, 0, 25.0, "nvlink"),
         *((d, "sw", 12.0, "pcie") for d in range(3)),
         *(("sw", d, 12.0, "pcie") for d in range(3))],
        switches=["sw"],
    )
    links = links_from_topology(topo, latency_s=2e-6)
    assert links.bandwidth_bytes_per_s[0][1] == pytest.approx(50e9)
    assert links.bandwidth_bytes_per_s[1][0] == pytest.approx(50e9)
    assert links.bandwidth_bytes_per_s[0][2] == pytest.approx(12e9)
    assert links.latency_s[2][1] == 2e-6 and links.latency_s[1][1] == 0.0


def _cluster_worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    init_loopback(rank, 2, port, timeout_s=60)
    cluster = benchmark_cluster(2**28 * (rank + 1), min_run_time_s=0.05)
    (Path(out_dir) / f"rank{rank}.json").write_text(cluster.to_json())
    leave_group()


@pytest.mark.slow
def test_cluster_benchmark_over_two_processes(tmp_path: Path) -> None:
    run_local_group(_cluster_worker, 2, (free_port(), str(tmp_path)), timeout_s=120)
    seen = [ClusterProfile.from_json((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert seen[0] == seen[1]
    cluster = seen[0]
    assert [d.name for d in cluster.devices] == ["rank0", "rank1"]
    assert [d.memory_bytes for d in cluster.devices] == [2**28, 2**29]
    lat, bw = cluster.links.latency_s, cluster.links.bandwidth_bytes_per_s
    assert lat[0][1] == lat[1][0] and 0 <= lat[0][1] < 0.1
    assert bw[0][1] == bw[1][0] and bw[0][1] > 1e6
