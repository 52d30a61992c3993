"""The cluster's rendezvous store: `python -m salus.daemon.services.cluster_store HOST PORT`.

Started by the daemon of node 0 (`salusd/cluster.py`), it hosts a `torch.distributed.TCPStore`
on HOST:PORT, through which the replicas of multi-node gangs on every node find each other, and
runs until its standard input closes (the daemon stopped or died). It prints one line once the
store listens.
"""

from __future__ import annotations

import sys
from datetime import timedelta

import torch.distributed as dist


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m salus.daemon.services.cluster_store HOST PORT", file=sys.stderr)
        return 2
    host, port = argv[0], int(argv[1])
    try:
        store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=60))
    except (RuntimeError, OSError) as exc:
        print(f"salusd cluster store: cannot listen on {host}:{port}: {exc}", file=sys.stderr)
        return 1
    print(f"salusd cluster store listening on {host}:{port}", file=sys.stderr, flush=True)
    sys.stdin.read()  # until the daemon closes the pipe
    del store
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
