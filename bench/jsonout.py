"""Shared by the benchmark scripts: stdout carries their one JSON object and nothing else."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Send the process's C-level stdout to stderr meanwhile: native libraries (HiGHS's solver
    log) write there, and it must not mix with the JSON object."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
