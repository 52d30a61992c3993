"""A job's persistent state on disk: one directory per checkpoint, made visible by one rename.

    root/ckpt-000000001200/
        tensors.safetensors   every tensor reachable from the state, by key (t0, t1, ...)
        objects.pkl           the rest, pickled with cloudpickle; tensors are persistent ids
        manifest.json         what is inside, written last

The executor writes it as the job's owner and reads it back after a restart. Tensors go to
safetensors so the bulk is plain bytes that any tool can read and no unpickling touches; the
pickle keeps only the structure (modules, optimizers, schedulers, the job's functions). A tensor
reached twice is stored once and comes back as one object, so an optimizer's parameters are
still the module's parameters after a load. Tensors come back on the CPU (the manifest says
where they were); the executor places the state afterwards, as for a fresh job.

What safetensors cannot hold falls back to ordinary pickling inside objects.pkl: sparse,
quantized, nested and meta tensors, tensor subclasses other than `nn.Parameter`, tensors that
carry Python attributes, dtypes it has no code for. Distinct tensors that are views of one
storage come back as separate copies.

Crash safety: everything is written into `tmp-<iteration>-<pid>/`, each file and the directory
fsynced, then renamed to `ckpt-<iteration:012d>/` and `root` fsynced. A reader only considers
`ckpt-*` directories whose manifest parses and whose file sizes match it, so a crash at any point
leaves the previous checkpoint as the latest. Loading unpickles: it trusts `root` as much as the
job's own code, which is why `root` is made private (0700) to the owner who writes it.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import cloudpickle
import safetensors.torch
import torch
from torch import nn

from salus.daemon.state.checkpoint_files import (
    CHECKPOINT_DIR,
    FORMAT_VERSION,
    MANIFEST_FILE,
    OBJECTS_FILE,
    TENSORS_FILE,
    complete,
)
from salus.daemon.state.durable import fsync_dir

log = logging.getLogger("salusd.checkpoint")

_PID_TAG = "salus.tensor"
_SAFE_DTYPES = frozenset(
    getattr(torch, name) for name in (
        "float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8",
        "uint8", "bool", "float8_e4m3fn", "float8_e5m2") if hasattr(torch, name))


@dataclass(frozen=True)
class SavedCheckpoint:
    """A checkpoint just written: its directory, iteration, bytes on disk and seconds taken."""

    path: Path
    iteration: int
    bytes: int
    seconds: float


@dataclass(frozen=True)
class LoadedCheckpoint:
    """The newest complete checkpoint: its iteration, the payload as saved, and its manifest."""

    iteration: int
    payload: dict[str, Any]
    manifest: dict[str, Any]
    path: Path


def _storable(t: torch.Tensor) -> bool:
    """Whether safetensors can hold `t` as plain dense bytes without losing what it is."""
    if type(t) not in (torch.Tensor, nn.Parameter) or t.__dict__:
        return False
    if t.layout != torch.strided or t.is_quantized or t.is_nested or t.is_meta:
        return False
    if t.dtype not in _SAFE_DTYPES:
        return False
    try:
        t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # e.g. functional or wrapper tensors
        return False
    return True


class _TensorPickler(cloudpickle.CloudPickler):
    """cloudpickle that lifts every storable tensor out into `self.tensors`, once per object."""

    def __init__(self, file: IO[bytes]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: dict[str, torch.Tensor] = {}
        self.records: dict[str, dict[str, Any]] = {}
        # id -> (pid, object): holding the object keeps its id from being reused mid-pickle
        self._seen: dict[int, tuple[tuple[Any, ...], torch.Tensor]] = {}
        self._storages: set[int] = set()

    def persistent_id(self, obj: Any) -> tuple[Any, ...] | None:
        if not isinstance(obj, torch.Tensor) or not _storable(obj):
            return None
        seen = self._seen.get(id(obj))
        if seen is not None:
            return seen[0]
        key = f"t{len(self.tensors)}"
        self.tensors[key] = self._host_copy(obj)
        grad = obj.grad if obj.is_leaf else None
        pid = (_PID_TAG, key, isinstance(obj, nn.Parameter), obj.requires_grad, grad)
        self._seen[id(obj)] = (pid, obj)
        self.records[key] = {
            "dtype": str(obj.dtype).removeprefix("torch."), "shape": list(obj.shape),
            "device": str(obj.device), "parameter": isinstance(obj, nn.Parameter),
            "requires_grad": obj.requires_grad, "bytes": obj.numel() * obj.element_size()}
        return pid

    def _host_copy(self, obj: torch.Tensor) -> torch.Tensor:
        """A dense CPU tensor with the values of `obj` that shares no storage with any other
        stored tensor (safetensors refuses aliases)."""
        data = obj.detach().cpu().resolve_conj().resolve_neg()
        if data.numel() == 0:
            return torch.empty(data.shape, dtype=data.dtype)
        storage = data.untyped_storage().data_ptr()
        if storage in self._storages or not data.is_contiguous():
            data = data.clone(memory_format=torch.contiguous_format)
            storage = data.untyped_storage().data_ptr()
        self._storages.add(storage)
        return data


class _TensorUnpickler(pickle.Unpickler):
    """Rebuilds the payload, answering each persistent id with one tensor per key."""

    def __init__(self, file: IO[bytes], tensors: dict[str, torch.Tensor]) -> None:
        super().__init__(file)
        self._tensors = tensors
        self._made: dict[str, torch.Tensor] = {}

    def persistent_load(self, pid: Any) -> torch.Tensor:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == _PID_TAG):
            raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")
        _, key, parameter, requires_grad, grad = pid
        made = self._made.get(key)
        if made is not None:
            return made
        data = self._tensors[key]
        if parameter:
            made = nn.Parameter(data, requires_grad=requires_grad)
        else:
            made = data.requires_grad_(requires_grad)
        if grad is not None:
            made.grad = grad
        self._made[key] = made
        return made


def save(root: Path, iteration: int, payload: dict[str, Any], *, extra: dict[str, Any] | None
         = None, keep: int = 2, job_id: int | None = None,
         _before_rename: Callable[[], None] | None = None) -> SavedCheckpoint:
    """Write `payload` as the checkpoint of `iteration` under `root` and keep the newest `keep`
    complete checkpoints. `extra` (JSON-serialisable) goes into the manifest as is.
    `_before_rename` is a test hook called after every file is durable, before the rename."""
    if type(iteration) is not int or iteration < 0:
        raise ValueError(f"iteration must be a non-negative int, got {iteration!r}")
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    start = time.perf_counter()
    root = Path(root)
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = root / f"tmp-{iteration}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(mode=0o700)

    with open(tmp / OBJECTS_FILE, "wb") as f:
        pickler = _TensorPickler(f)
        pickler.dump(payload)
        _fsync_file(f)
    safetensors.torch.save_file(pickler.tensors, tmp / TENSORS_FILE,
                                metadata={"format": "salusd-checkpoint"})
    fd = os.open(tmp / TENSORS_FILE, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    del pickler.tensors  # the host copies of device tensors can be large

    manifest = {
        "format_version": FORMAT_VERSION, "job_id": job_id, "iteration": iteration,
        "time": time.time(), "torch_version": torch.__version__,
        "names": {str(k): sorted(map(str, v)) if isinstance(v, dict) else []
                  for k, v in payload.items()},
        "tensors": pickler.records,
        "bytes": {name: (tmp / name).stat().st_size for name in (TENSORS_FILE, OBJECTS_FILE)},
        "extra": extra or {},
    }
    with open(tmp / MANIFEST_FILE, "w") as f:
        json.dump(manifest, f, indent=1)
        _fsync_file(f)
    fsync_dir(tmp)

    if _before_rename is not None:
        _before_rename()
    final = root / f"ckpt-{iteration:012d}"
    if final.exists():  # saved again at this iteration: the new one wins
        os.rename(final, root / f"tmp-replaced-{iteration}-{os.getpid()}")
    os.rename(tmp, final)
    fsync_dir(root)
    _prune(root, keep)
    size = sum(p.stat().st_size for p in final.iterdir())
    return SavedCheckpoint(final, iteration, size, time.perf_counter() - start)


def load_latest(root: Path, at: int | None = None) -> LoadedCheckpoint | None:
    """The newest complete checkpoint under `root` (of iteration `at` when given), or None
    when there is none. Incomplete directories are skipped; an error unpickling a complete one
    propagates (falling back to an older one would silently lose progress)."""
    for path, manifest in complete(Path(root)):
        if at is not None and manifest["iteration"] != at:
            continue
        tensors = safetensors.torch.load_file(path / TENSORS_FILE)
        with open(path / OBJECTS_FILE, "rb") as f:
            payload = _TensorUnpickler(f, tensors).load()
        return LoadedCheckpoint(manifest["iteration"], payload, manifest, path)
    return None


def latest_iteration(root: Path) -> int | None:
    """The iteration of the newest complete checkpoint, from manifests only; None when none."""
    for _, manifest in complete(Path(root)):
        return int(manifest["iteration"])
    return None


def _prune(root: Path, keep: int) -> None:
    """Remove all but the newest `keep` complete checkpoints, every incomplete `ckpt-*`, and
    every `tmp-*` (this process holds none now: one writer per root)."""
    kept = {path for path, _ in complete(root)[:keep]}
    for path in root.iterdir():
        stale = path.name.startswith("tmp-") or (
            CHECKPOINT_DIR.fullmatch(path.name) is not None and path not in kept)
        if stale and path.is_dir():
            shutil.rmtree(path, ignore_errors=True)


def _fsync_file(f: IO[Any]) -> None:
    f.flush()
    os.fsync(f.fileno())


__all__ = ["FORMAT_VERSION", "LoadedCheckpoint", "SavedCheckpoint", "latest_iteration",
           "load_latest", "save"]
