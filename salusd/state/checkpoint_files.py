"""Which checkpoints of a job are complete, judged from their manifests alone.

The daemon never imports torch, so it cannot load a checkpoint; it can still tell, before it
restores a job, whether the job's checkpoint directory holds one an executor could load. The
rules are those of `salus.daemon.executor.checkpoint` (which writes and loads them; its layout
is described there): a `ckpt-<iteration:012d>/` directory whose `manifest.json` is at most
MAX_MANIFEST_BYTES, parses, has this format version, names the directory's own iteration and
gives the exact sizes of `tensors.safetensors` and `objects.pkl`. A test checks that the two
modules agree on the names and limits.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

FORMAT_VERSION = 1
MAX_MANIFEST_BYTES = 16 * 2**20
TENSORS_FILE = "tensors.safetensors"
OBJECTS_FILE = "objects.pkl"
MANIFEST_FILE = "manifest.json"
CHECKPOINT_DIR = re.compile(r"ckpt-(\d{12})")


def complete_iterations(root: Path) -> list[int]:
    """The iterations of the complete checkpoints directly under `root`, newest first."""
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = CHECKPOINT_DIR.fullmatch(path.name)
        if match is not None and path.is_dir() and _manifest_ok(path, int(match.group(1))):
            found.append(int(match.group(1)))
    return sorted(found, reverse=True)


def job_has_checkpoint(job_dir: Path) -> bool:
    """Whether a job's checkpoint directory (or, for a gang, each `replica<r>/` in it) holds a
    complete checkpoint."""
    replicas = sorted(job_dir.glob("replica*")) if job_dir.is_dir() else []
    return all(complete_iterations(d) for d in replicas) if replicas else bool(
        complete_iterations(job_dir))


def _manifest_ok(path: Path, iteration: int) -> bool:
    try:
        with open(path / MANIFEST_FILE, "rb") as f:
            if os.fstat(f.fileno()).st_size > MAX_MANIFEST_BYTES:
                return False
            manifest = json.loads(f.read(MAX_MANIFEST_BYTES + 1))
        if not isinstance(manifest, dict) or manifest.get("format_version") != FORMAT_VERSION:
            return False
        sizes = manifest["bytes"]
        return manifest.get("iteration") == iteration and all(
            (path / name).stat().st_size == sizes[name] for name in (TENSORS_FILE, OBJECTS_FILE))
    except (OSError, ValueError, KeyError, TypeError):
        return False
