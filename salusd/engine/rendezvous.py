"""How a gang's replicas find each other: each replica's place, as its executor is told it.

A gang on one node (``"devices": N``) rendezvouses on a loopback port the daemon picks anew
each time the gang loads. A gang across nodes (``"nodes": K``, `salusd/cluster.py`) has
``devices`` replicas on each of K nodes; every node's daemon tells its replicas their global
rank (node-major), the cluster store's address and the key all nodes share: the owner's name
and the job's rendezvous id.
"""

from __future__ import annotations

import re
from typing import Any

from salus.daemon.cluster import ClusterSpec
from salus.daemon.engine.job_spec import JobSpec
from salus.daemon.wire.address import free_port
from salus.daemon.wire.errors import BadRequest
from salus.daemon.wire.executor_ops import GangPlace

RENDEZVOUS_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def check_nodes(nodes: object, rendezvous: object, name: str,
                cluster: ClusterSpec | None) -> dict[str, Any]:
    """The spec entries of a job asking for `nodes` nodes (none for one node); BadRequest
    says why this daemon cannot take it."""
    if nodes == 1:
        return {}
    if cluster is None:
        raise BadRequest(f"a job on {nodes!r} nodes needs a cluster: this salusd was started "
                         "without --cluster")
    if type(nodes) is not int or not 1 <= nodes <= cluster.nodes:
        raise BadRequest(f"the cluster has {cluster.nodes} node(s); a job may span 1 to "
                         f"{cluster.nodes}, not {nodes!r}")
    if cluster.node_rank >= nodes:
        raise BadRequest(f"a job on {nodes} nodes runs on nodes 0 to {nodes - 1}; this is "
                         f"node {cluster.node_rank}")
    key = name if rendezvous is None else rendezvous
    if not isinstance(key, str) or not RENDEZVOUS_ID.fullmatch(key):
        raise BadRequest("a multi-node job needs a rendezvous id (default: its name) of 1-128 "
                         "letters, digits, '.', '_' or '-', the same on every node; got "
                         f"{key!r}")
    return {"nodes": nodes, "rendezvous": key}


def gang_places(spec: JobSpec, devices: int, owner: str,
                cluster: ClusterSpec | None) -> list[GangPlace] | None:
    """Each local replica's place in its gang, by local rank; None for a job that is no gang."""
    nodes = spec.nodes
    if nodes == 1:
        if devices == 1:
            return None
        port = free_port()
        return [GangPlace(r, devices, port=port) for r in range(devices)]
    assert cluster is not None, "a multi-node job was admitted without a cluster"
    first = cluster.node_rank * devices
    return [GangPlace(first + r, nodes * devices, local=devices, store=cluster.store,
                      key=f"salus/{owner}/{spec.rendezvous}", loopback=cluster.loopback)
            for r in range(devices)]
