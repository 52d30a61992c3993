"""How much slower a small training step runs right after the CPU served another process.

A call through salusd is a hop to another process and back, and a direct training loop has
none. This measures what such a switch costs the step that follows it, without salusd and
with it, on the tiny MLP of `overhead.py` (width 16, batch 32; one intra-op thread):

1. `in_process`: the step timed in this process after (a) nothing, the direct loop; (b) a
   one-byte echo through a child process that does nothing else, this side blocking in
   `recv` for the answer; (c) the same echo with this side polling for it instead
   (`channel.spin`, as a client waits; the child always polls for its next message, as an
   executor does); (d) an echo through a child that runs a little Python (it builds a list of
   2000 strings, as a hop's bookkeeping touches code and data of its own) before it answers,
   this side blocking; and, in this process alone, after (e) a 100 µs sleep (the vCPU may
   idle), (f) 100 µs of a tight loop (a small working set), (g) allocating and filling 4 MiB
   (caches evicted), (h) a call's wire work at both ends, with no other process: the step's
   batch sent as a compact call through a pair of `Channel`s, received and decoded, and a
   one-tensor result sent back and decoded (`channel_round_trip_us` is its own time), (i) the
   same bytes through the bare socket pair. `*_over_loop` are ratios to (a). The cases take
   turns, one step each per round.
2. `through_salusd`: a job's call that runs the same step twice and times each inside the
   executor: the first step follows the hop, the second follows the first.
   `first_over_second` is their ratio.

Prints one JSON object (p50s, microseconds).

    .venv/bin/python bench/cold_step.py [--steps 3000]
"""

from __future__ import annotations

import argparse
import json
import os
import select
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from overhead import mlp  # the same model as bench/overhead.py

import salus.adapters.torch as salus
from salus.daemon.cli.launch import running_daemon
from salus.daemon.wire import compact
from salus.daemon.wire.channel import Channel, spin


def _echo_child(sock: socket.socket) -> None:  # pragma: no cover - runs in the child
    """Answer each message, waiting for the next as an executor does: polling for a while
    (longer than a round of all cases), then blocked."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    while True:
        spin(lambda: poller.poll(0), time.perf_counter() + 0.05)
        message = sock.recv(8)
        if not message:
            break
        if message == b"w":
            _ = [str(i) for i in range(2000)]
        sock.send(b"y")
    os._exit(0)


def _in_process(steps: int) -> dict[str, float]:
    model, opt, loss_fn = mlp(16)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))

    def step() -> None:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()

    mine, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child echoes until the socket closes
        mine.close()
        _echo_child(theirs)
    theirs.close()
    for _ in range(300):
        step()
    out = {}
    poller = select.poll()
    poller.register(mine, select.POLLIN)

    def echo(message: bytes) -> None:
        mine.send(message)
        if message == b"p":  # the answer polled for, as a client does
            spin(lambda: poller.poll(0), time.perf_counter() + 0.01)
        mine.recv(8)

    def busy() -> None:
        until = time.perf_counter() + 100e-6
        while time.perf_counter() < until:
            pass

    near, far = socket.socketpair()
    client, executor = Channel(near), Channel(far)
    call = compact.Message(compact.OP_CALL, tensors=(x, y), aux=1)
    result = compact.Message(compact.OP_RESULT, tensors=(torch.tensor(1.0),),
                             aux=compact.KIND_TENSOR)
    frame, reply, scratch = bytes(8400), bytes(100), bytearray(9000)

    def channel_round_trip() -> None:
        client.send(call)
        executor.recv()
        executor.send(result)
        client.recv()

    def socket_round_trip() -> None:
        near.sendall(frame)
        far.recv_into(scratch)
        far.sendall(reply)
        near.recv_into(scratch)

    before: dict[str, Any] = {
        "loop": lambda: None, "after_echo": lambda: echo(b"x"),
        "after_polled_echo": lambda: echo(b"p"), "after_echo_work": lambda: echo(b"w"),
        "after_sleep_100us": lambda: time.sleep(100e-6),
        "after_busy_100us": busy, "after_4MiB_filled": lambda: torch.empty(1 << 20).fill_(1.0),
        "after_channel_round_trip": channel_round_trip,
        "after_socket_round_trip": socket_round_trip}
    # Round-robin: each round runs every case once, so a VM that speeds up or slows down
    # between rounds moves all cases alike (blocks of one case at a time drifted by 20 %).
    times: dict[str, list[float]] = {name: [] for name in before}
    for _ in range(steps):
        for name, first in before.items():
            first()
            began = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - began)
    for name in before:
        out[f"{name}_p50_us"] = statistics.median(times[name]) * 1e6
    began = time.perf_counter()
    for _ in range(steps):
        channel_round_trip()
    out["channel_round_trip_us"] = (time.perf_counter() - began) / steps * 1e6
    for sock in (mine, near, far):
        sock.close()
    os.waitpid(pid, 0)
    for name in list(before)[1:]:
        out[f"{name}_over_loop"] = out[f"{name}_p50_us"] / out["loop_p50_us"]
    return out


def _two_steps(s: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    times = []
    for _ in range(2):
        began = time.perf_counter()
        s.opt.zero_grad()
        s.loss_fn(s.model(x), y).backward()
        s.opt.step()
        times.append(time.perf_counter() - began)
    return torch.tensor(times, dtype=torch.float64)


def _through_salusd(steps: int) -> dict[str, float]:
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    with (tempfile.TemporaryDirectory(prefix="salusd-bench-") as tmp,
          running_daemon(Path(tmp) / "salusd.sock", state_dir=Path(tmp), cpu_memory="1G",
                         cpu_threads=1) as daemon,
          salus.connect(name="cold-step", iterations=steps + 300,
                        address=daemon.address) as job):
        model, opt, loss_fn = mlp(16)
        call = job.attach(model=model, opt=opt, loss_fn=loss_fn).iteration(_two_steps)
        rows = [call(x, y).tolist() for _ in range(steps + 300)][300:]
        job.close(pull=False)
    first = statistics.median(r[0] for r in rows) * 1e6
    second = statistics.median(r[1] for r in rows) * 1e6
    return {"first_step_p50_us": first, "second_step_p50_us": second,
            "first_over_second": first / second}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    out: dict[str, Any] = {"bench": "cold_step", "unit": "microseconds"}
    print("the step after nothing, after an echo, after an echo with work ...", file=sys.stderr)
    out["in_process"] = _in_process(args.steps)
    print("two steps in one call through salusd ...", file=sys.stderr)
    out["through_salusd"] = _through_salusd(args.steps)
    out["cpu_count"], out["loadavg_1m"] = os.cpu_count(), os.getloadavg()[0]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
