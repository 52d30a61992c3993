"""Which checkpoints of a job are complete, judged from their manifests alone.

The daemon never imports torch, so it cannot load a checkpoint; it can still tell, before it
restores a job, whether the job's checkpoint directory holds one an executor could load. The
executors (`salus.daemon.executor.checkpoint`, which writes and loads them; its layout is
described there) judge them by these same rules: a `ckpt-<iteration:012d>/` directory whose
`manifest.json` is at most MAX_MANIFEST_BYTES, parses, has this format version, names the
directory's own iteration and gives the exact sizes of `tensors.safetensors` and `objects.pkl`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat
from pathlib import Path
from typing import Any

log = logging.getLogger("salusd.checkpoint")

FORMAT_VERSION = 1
MAX_MANIFEST_BYTES = 16 * 2**20
TENSORS_FILE = "tensors.safetensors"
OBJECTS_FILE = "objects.pkl"
MANIFEST_FILE = "manifest.json"
CHECKPOINT_DIR = re.compile(r"ckpt-(\d{12})")


def complete(root: Path) -> list[tuple[Path, dict[str, Any]]]:
    """The complete checkpoints directly under `root` and their manifests, newest first."""
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = CHECKPOINT_DIR.fullmatch(path.name)
        if match is None or not path.is_dir():
            continue
        manifest = read_manifest(path)
        if manifest is not None and manifest.get("iteration") == int(match.group(1)):
            found.append((path, manifest))
        else:
            log.warning("skipping incomplete checkpoint %s", path)
    found.sort(key=lambda item: item[1]["iteration"], reverse=True)
    return found


def complete_iterations(root: Path) -> list[int]:
    """The iterations of the complete checkpoints directly under `root`, newest first."""
    return [manifest["iteration"] for _, manifest in complete(root)]


def gang_iteration(job_dir: Path, replicas: int) -> int | None:
    """The newest iteration that each of a gang's `replicas` (`replica<r>/` under `job_dir`)
    holds a complete checkpoint of: a gang killed while writing one goes on from the one
    before, together. None when they share none."""
    common = set.intersection(*(set(complete_iterations(job_dir / f"replica{r}"))
                                for r in range(replicas)))
    return max(common) if common else None


def job_has_checkpoint(job_dir: Path) -> bool:
    """Whether a job's checkpoint directory (or, for a gang, each `replica<r>/` in it) holds a
    complete checkpoint."""
    replicas = sorted(job_dir.glob("replica*")) if job_dir.is_dir() else []
    return all(complete_iterations(d) for d in replicas) if replicas else bool(
        complete_iterations(job_dir))


def read_manifest(path: Path) -> dict[str, Any] | None:
    """The manifest of checkpoint directory `path` when it is of this format and its files
    have the sizes it records, else None."""
    try:
        # The job's owner writes the directory: no link followed, no FIFO waited on, and the
        # descriptor closed on every path.
        fd = os.open(path / MANIFEST_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
                     | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_MANIFEST_BYTES:
                log.warning("%s: manifest not a regular file of at most %d bytes, refused",
                            path, MAX_MANIFEST_BYTES)
                return None
            raw = os.pread(fd, MAX_MANIFEST_BYTES + 1, 0)
        finally:
            os.close(fd)
        manifest = json.loads(raw)
        if not isinstance(manifest, dict) or manifest.get("format_version") != FORMAT_VERSION:
            return None
        sizes = manifest["bytes"]
        truncated = any((path / name).stat().st_size != sizes[name]
                        for name in (TENSORS_FILE, OBJECTS_FILE))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return None if truncated else manifest
