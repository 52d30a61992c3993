"""salusd's own packages, and nothing else of the daemon's environment, for another interpreter.

A script job whose `python` is another environment than the daemon's runs in an executor of
that interpreter (`supervisor/zygotes.py`), which needs salusd's executor code but must find torch,
numpy and every other package in its own environment, or not at all. So the daemon does not hand it
its site-packages: it makes one directory (`PythonPath.directory`, created at first use,
removed when the daemon stops) holding only

    salus/daemon -> the daemon's installed `salus.daemon` package (the `salusd/` folder)
    salus/adapters, salus/scheduler, ... -> likewise, for each `salus.*` package installed
    salusd-X.Y.Z.dist-info -> the daemon's installed metadata (the one it reads its own
                              version from: a .dist-info, or a source tree's .egg-info)

and starts the other interpreter with `PYTHONPATH` set to it. Links rather than `.pth` files
or a path hook, because pyproject.toml maps `salus.daemon` to the folder `salusd/`
(setuptools `package-dir`): no directory on disk is named `salus/daemon`, and an editable
install finds it with an import hook the other interpreter does not have. The directory comes
first on that interpreter's path, so the daemon's copy is the one imported; the metadata link
lets the interpreter check that the code it found is the daemon's version (a salusd upgraded
on disk since the daemon started, or another salusd its environment puts before this one, is
refused with a one-line reason: `executor/zygote.py`).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

# The `salus.*` packages pyproject.toml maps to folders (its top-level package-dir entries).
PACKAGES = ("daemon", "scheduler", "adapters", "federated", "data", "demo", "lightning", "hf")


def installed_packages() -> dict[str, str]:
    """Each `salus.*` package of `PACKAGES` this interpreter has: its name under `salus`
    and the real directory it is imported from."""
    found = {}
    for name in PACKAGES:
        spec = importlib.util.find_spec(f"salus.{name}")
        if spec is not None and spec.submodule_search_locations:
            found[name] = os.path.realpath(list(spec.submodule_search_locations)[0])
    return found


def metadata_dir() -> str | None:
    """The directory of the daemon's installed salusd metadata (None: not installed)."""
    try:
        dist = importlib.metadata.distribution("salusd")
    except importlib.metadata.PackageNotFoundError:
        return None
    path = getattr(dist, "_path", None)  # a PathDistribution's .dist-info directory
    return os.path.realpath(path) if isinstance(path, os.PathLike | str) else None


def build(where: Path) -> Path:
    """Fill the empty directory `where` with the links described above; returns it."""
    (where / "salus").mkdir()
    (where / "salus").chmod(0o755)  # whatever the daemon's umask: the owners read it
    for name, target in installed_packages().items():
        (where / "salus" / name).symlink_to(target, target_is_directory=True)
    meta = metadata_dir()
    if meta is not None:
        (where / os.path.basename(meta)).symlink_to(meta, target_is_directory=True)
    return where


class PythonPath:
    """The daemon's one generated path directory for other interpreters."""

    def __init__(self) -> None:
        self._dir: Path | None = None

    def directory(self) -> str:
        """The directory (made now at first use, readable by every owner)."""
        if self._dir is None:
            made = Path(tempfile.mkdtemp(prefix="salusd-python-path-"))
            made.chmod(0o755)  # the owners' interpreters read it; only the daemon writes
            self._dir = build(made)
        return str(self._dir)

    def remove(self) -> None:
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
