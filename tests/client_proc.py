"""Finish a client process whose output a test already began reading line by line."""

from __future__ import annotations

import contextlib
import subprocess
import threading


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
