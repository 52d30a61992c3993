"""Client processes of a test: start one, let one waiting on its stdin go on, and finish one
whose output the test already began reading line by line."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import textwrap
import threading
from pathlib import Path


def finish(proc: subprocess.Popen[str], input: str | None = None, timeout_s: float = 60.0
           ) -> tuple[str, str]:
    """`proc.communicate(input, timeout)` for a text-mode process whose stdout was read with
    `readline()` before: `communicate` reads the raw pipes, so lines `readline` had already
    buffered would be lost; this reads the rest through the same file objects. Returns
    (stdout, stderr); raises subprocess.TimeoutExpired (leaving `proc` running) when it does
    not exit within `timeout_s` seconds."""
    got: dict[str, str] = {}

    def drain(name: str, stream: object) -> None:
        got[name] = stream.read() if hasattr(stream, "read") else ""

    readers = [threading.Thread(target=drain, args=(name, stream), daemon=True)
               for name, stream in (("out", proc.stdout), ("err", proc.stderr))]
    for reader in readers:
        reader.start()
    if proc.stdin is not None:
        with contextlib.suppress(BrokenPipeError, ValueError):
            if input:
                proc.stdin.write(input)
            proc.stdin.close()
    proc.wait(timeout_s)
    for reader in readers:
        reader.join(timeout_s)
    return got.get("out", ""), got.get("err", "")


def start_client(script: Path, *args: str, address: str) -> subprocess.Popen[str]:
    """`python script args...` as a client of the daemon at `address` (one intra-op thread),
    with pipes for its stdin, stdout and stderr."""
    env = {"SALUS_ADDRESS": address, "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    return subprocess.Popen([sys.executable, str(script), *args], env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def reap(clients: list[subprocess.Popen[str]]) -> None:
    """Kill and wait for the clients still running (a test's clean-up)."""
    for client in clients:
        if client.poll() is None:
            client.kill()
            client.wait()


def go(client: subprocess.Popen[str]) -> None:
    """Let a client waiting on its stdin go on."""
    assert client.stdin is not None
    client.stdin.write("go\n")
    client.stdin.flush()


# A client that trains a small model (dropout, and a shuffled half-batch drawn from the job's
# own random stream) through the daemon, pauses after 5 iterations (printing {"job": id} and
# waiting for a line on stdin), then trains the same model directly and prints
# {"max_abs_diff": ...} between the two; a call that fails prints {"error": ...} and exits 0.
TRAINER = textwrap.dedent('''
    import json, sys
    from types import SimpleNamespace
    import torch
    from torch import nn
    import salus.adapters.torch as salus

    torch.set_num_threads(1)
    seed = int(sys.argv[1])

    def build():
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 4))
        return model, torch.optim.Adam(model.parameters(), lr=1e-2)

    g = torch.Generator().manual_seed(seed)
    data = [(torch.randn(16, 16, generator=g), torch.randint(0, 4, (16,), generator=g))
            for _ in range(20)]

    def step(s, x, y):
        order = torch.randperm(x.shape[0])[:8]  # a shuffled half-batch, from the job's stream
        s.opt.zero_grad()
        loss = nn.functional.cross_entropy(s.model(x[order]), y[order])
        loss.backward()
        s.opt.step()
        return loss

    model, opt = build()
    torch.manual_seed(1000 + seed)
    with salus.connect(name=f"good{seed}", iterations=len(data)) as job:
        remote = job.attach(model=model, opt=opt)
        train = remote.iteration(step)
        for i, (x, y) in enumerate(data):
            if i == 5:
                print(json.dumps({"job": job.id}), flush=True)
                sys.stdin.readline()  # the test looks at the executors, or a job crashes
            try:
                train(x, y)
            except Exception as exc:
                print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
                sys.exit(0)
        remote.pull()
    direct, dopt = build()
    torch.manual_seed(1000 + seed)
    s = SimpleNamespace(model=direct, opt=dopt)
    for x, y in data:
        step(s, x, y)
    diff = max((a - b).abs().max().item()
               for a, b in zip(model.state_dict().values(), direct.state_dict().values()))
    print(json.dumps({"max_abs_diff": diff}), flush=True)
''')
