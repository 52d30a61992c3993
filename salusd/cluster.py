"""Several daemons as one cluster: where the rendezvous store is and where this node stands.

`salusd serve --cluster HOST:PORT --nodes K --node-rank R` joins this daemon to a cluster of K
nodes. The node of rank 0 hosts the cluster's `torch.distributed` TCP store on HOST:PORT (in a
child process, `salusd/services/cluster_store.py`: the daemon itself never imports torch); the
replicas of a multi-node gang on every node join their process group through it. `--cluster
env` reads the same from the variables `torchrun` sets (MASTER_ADDR, MASTER_PORT, NNODES,
NODE_RANK or GROUP_RANK), so a launcher that already sets them needs no flags.

A multi-node gang is submitted to the daemon of every node it spans, with the same `nodes`,
`devices` (per node) and `rendezvous` id (the job's name when absent), as `torchrun` is started
on every node with one `--rdzv-id`. Global ranks are node-major: node n's replica r has rank
``n * devices + r``.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass

log = logging.getLogger("salusd")

MAX_NODES = 1024


@dataclass(frozen=True)
class ClusterSpec:
    """This node's place in the cluster and the rendezvous store's address."""

    host: str
    port: int
    nodes: int
    node_rank: int

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("--cluster needs a host: HOST:PORT")
        if not 0 < self.port < 65536:
            raise ValueError(f"the cluster store's port must be in 1..65535, got {self.port}")
        if not 1 <= self.nodes <= MAX_NODES:
            raise ValueError(f"--nodes must be from 1 to {MAX_NODES}, got {self.nodes}")
        if not 0 <= self.node_rank < self.nodes:
            raise ValueError(f"--node-rank must be in [0, {self.nodes}), got {self.node_rank}")

    @property
    def store(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def loopback(self) -> bool:
        """Every node on this machine (tests, a trial run): gloo is pinned to `lo`."""
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return self.host == "localhost"

    def describe(self) -> str:
        return f"node {self.node_rank} of {self.nodes}, rendezvous store {self.store}"


def parse_cluster(address: str | None, nodes: int | None, node_rank: int | None,
                  environ: Mapping[str, str] = os.environ) -> ClusterSpec | None:
    """The cluster `salusd serve` was asked to join, or None for a single node.

    `address` is HOST:PORT or ``env`` (torchrun's variables); `nodes` and `node_rank`, when
    given, win over the environment. ValueError says what is missing or wrong.
    """
    if address is None:
        if nodes not in (None, 1) or node_rank not in (None, 0):
            raise ValueError("--nodes and --node-rank need --cluster HOST:PORT (or env)")
        return None
    if address == "env":
        missing = [v for v in ("MASTER_ADDR", "MASTER_PORT", "NNODES") if v not in environ]
        rank_var = "NODE_RANK" if "NODE_RANK" in environ else "GROUP_RANK"
        if node_rank is None and rank_var not in environ:
            missing.append("NODE_RANK")
        if missing:
            raise ValueError(f"--cluster env needs {', '.join(missing)} in the environment "
                             "(as torchrun sets them)")
        host, port = environ["MASTER_ADDR"], _int(environ["MASTER_PORT"], "MASTER_PORT")
        nodes = nodes if nodes is not None else _int(environ["NNODES"], "NNODES")
        node_rank = node_rank if node_rank is not None else _int(environ[rank_var], rank_var)
    else:
        host, sep, port_text = address.rpartition(":")
        if not sep:
            raise ValueError(f"--cluster must be HOST:PORT or env, got {address!r}")
        port = _int(port_text, "the --cluster port")
        if nodes is None or node_rank is None:
            raise ValueError("--cluster HOST:PORT needs --nodes K and --node-rank R")
    return ClusterSpec(host.strip("[]"), port, nodes, node_rank)


def _int(text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{what} must be an integer, got {text!r}") from None


def start_store(spec: ClusterSpec) -> subprocess.Popen[bytes]:
    """Host the cluster's TCP store (node 0 only) in a child process that ends when this
    daemon does (it exits when its standard input closes)."""
    return subprocess.Popen(
        [sys.executable, "-m", "salus.daemon.services.cluster_store", spec.host,
         str(spec.port)], stdin=subprocess.PIPE)


def stop_store(proc: subprocess.Popen[bytes]) -> None:
    if proc.stdin is not None:
        proc.stdin.close()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
