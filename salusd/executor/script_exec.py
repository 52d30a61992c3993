"""The script executor in the caller's interpreter (`interpreter.py`): an executor that
replaced itself with that interpreter goes on with its script job here.

    python -m salus.daemon.executor.script_exec STATE

STATE (JSON) names the daemon's socket and the client's (descriptors kept across the exec),
the `Script` message, the job's id, the intra-op thread count, whether the first `ready` says
why there is no estimate, the job's log file, its working directory, and whether the executor
is one salusd did not fork (`in_pod.py`).
"""

from __future__ import annotations

import json
import os
import socket
import sys

import torch

from salus.daemon.executor import script
from salus.daemon.executor.boundaries import Boundaries
from salus.daemon.executor.in_pod import InPodChannel
from salus.daemon.wire.channel import Channel
from salus.daemon.wire.executor_ops import Script, decode_request


def main(argv: list[str]) -> int:
    state = json.loads(argv[1])
    torch.set_num_threads(int(state["threads"]))
    sock = socket.socket(fileno=int(state["daemon"]))
    daemon = InPodChannel(sock) if state.get("in_pod") else Channel(sock)
    message = decode_request(state["script"])
    if not isinstance(message, Script):
        raise ValueError(f"{argv[0]} runs a 'script' message, not {message.op!r}")
    client = state.get("client")
    request = None if client is None else {"socket_fd": int(client)}
    job = int(state["job"])
    if not script.run(daemon, message, request, job, bool(state["estimate"]), state.get("log"),
                      state.get("cwd")):
        Boundaries(daemon, job, False).drain()  # the job failed: until the daemon lets it go
    return 0


if __name__ == "__main__":
    code = main(sys.argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
