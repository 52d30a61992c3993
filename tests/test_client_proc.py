"""`finish` reads what `readline` already buffered (`communicate` would lose it)."""

from __future__ import annotations

import subprocess
import sys

from client_proc import finish


def test_finish_keeps_the_lines_readline_buffered() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "print('a'); print('b'); print('c')"],
                            text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.wait(30)  # all three lines sit in the pipe: readline buffers past the first
    assert proc.stdout is not None and proc.stdout.readline() == "a\n"
    assert finish(proc, timeout_s=30) == ("b\nc\n", "")
    assert proc.returncode == 0
