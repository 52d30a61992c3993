"""Make this checkout importable for the kit on a machine without network, before anything
imports salus: `pip install --no-deps -e .` (without build isolation, which would fetch
setuptools), falling back to a folder of links where that fails; then the wheels under
`.whl/` (`make gpu-wheels`) of the distributions this Python lacks, with `--target`. Logs to
stderr; prints one line, the folders to put on PYTHONPATH (colon separated, maybe empty), made
under SITEDIR.

    python bench/gpu/install.py SITEDIR
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# pyproject.toml's package-dir: salus.NAME -> folder
PACKAGES = {"daemon": "salusd", "scheduler": "scheduler", "adapters": "adapters",
            "federated": "adapters/federated", "data": "adapters/data", "demo": "adapters/demo"}


def log(text: str) -> None:
    print(f"install: {text}", file=sys.stderr, flush=True)


def pip(*args: str) -> bool:
    done = subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
                          capture_output=True, text=True)
    if done.returncode != 0:
        log(f"pip {' '.join(args)} failed: {(done.stdout + done.stderr)[-1500:]}")
    return done.returncode == 0


def ours() -> bool:
    """Whether `salus.daemon` already imports from this checkout."""
    try:
        spec = importlib.util.find_spec("salus.daemon")
    except ModuleNotFoundError:
        return False
    return bool(spec and spec.origin and Path(spec.origin).resolve().is_relative_to(ROOT))


def project(out: Path) -> list[str]:
    if ours():
        log("salus.daemon already imports from this checkout")
        return []
    if pip("install", "--no-deps", "--no-build-isolation", "-e", str(ROOT)):
        importlib.invalidate_caches()
        if ours():
            log("installed this checkout with pip install --no-deps -e .")
            return []
    site = out / "site"
    for name, folder in PACKAGES.items():
        link = site / "salus" / name
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.exists():
            link.symlink_to(ROOT / folder)
    log(f"pip could not install the checkout; salus.* links under {site}")
    return [str(site)]


def wheels(out: Path) -> list[str]:
    folder = ROOT / ".whl"
    names = sorted({re.sub(r"[-_.]+", "-", w.name.split("-")[0]).lower()
                    for w in folder.glob("*.whl")})
    missing = []
    for name in names:
        try:
            importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(name)
    if not missing:
        log(f"no wheels needed ({len(names)} in {folder})")
        return []
    log(f"installing from {folder}: {' '.join(missing)}")
    target = out / "site-wheels"
    common = ["install", "--no-index", "--no-deps", "--find-links", str(folder)]
    return [str(target)] if pip(*common, "--target", str(target), *missing) else []


def main() -> None:
    out = Path(sys.argv[1]).resolve()
    out.mkdir(parents=True, exist_ok=True)
    print(":".join(wheels(out) + project(out)))


if __name__ == "__main__":
    main()
