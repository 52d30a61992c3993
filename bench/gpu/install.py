"""Make this checkout importable for the kit on a machine without network, before anything
imports salus: `pip install --no-deps -e .` (without build isolation, which would fetch
setuptools), falling back to a folder of links where that fails; then the wheels under
`.whl/` (`make gpu-wheels`) of the distributions this Python lacks or has in an older version,
with `--target`. Logs to stderr; prints one line, the folders to put on PYTHONPATH (colon
separated, maybe empty), made under SITEDIR and readable by every user (the kit's two-owner
case runs a client as a throw-away user).

    python bench/gpu/install.py SITEDIR
    python bench/gpu/install.py --check   # every wheel's requirements: in .whl/ or on the GPU
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# pyproject.toml's package-dir: salus.NAME -> folder
PACKAGES = {"daemon": "salusd", "scheduler": "scheduler", "adapters": "adapters",
            "federated": "adapters/federated", "data": "adapters/data", "demo": "adapters/demo"}
WHEELS = ROOT / ".whl"
# What the lent GPU machine has installed (docs/gpu.md): torch, cupy, nvidia-ml-py,
# prometheus-client, httpx, pytest and their own requirements.
ON_DEVICE = {"torch", "numpy", "cupy-cuda13x", "fastrlock", "nvidia-ml-py", "prometheus-client",
             "httpx", "httpcore", "anyio", "idna", "h11", "certifi", "sniffio", "pytest",
             "pluggy", "iniconfig", "packaging", "pygments", "filelock", "sympy", "mpmath",
             "networkx", "jinja2", "markupsafe", "fsspec", "setuptools"}


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


def _name(text: str) -> str:
    return re.sub(r"[-_.]+", "-", text).lower()


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text.split("+")[0])[:4])


def needed() -> list[str]:
    """The wheels' distributions that this Python lacks or has older than the wheel's."""
    missing = []
    for wheel in sorted(WHEELS.glob("*.whl")):
        name, version = wheel.name.split("-")[:2]
        try:
            have = importlib.metadata.version(_name(name))
        except importlib.metadata.PackageNotFoundError:
            missing.append(_name(name))
            continue
        if _version(have) < _version(version):
            log(f"{_name(name)} {have} is older than the wheel's {version}")
            missing.append(_name(name))
    return missing


def wheels(out: Path) -> list[str]:
    missing = needed()
    if not missing:
        log(f"no wheels needed ({len(list(WHEELS.glob('*.whl')))} in {WHEELS})")
        return []
    log(f"installing from {WHEELS}: {' '.join(missing)}")
    target = out / "site-wheels"
    common = ["install", "--no-index", "--no-deps", "--find-links", str(WHEELS)]
    return [str(target)] if pip(*common, "--target", str(target), *missing) else []


def check() -> int:
    """Exit status 1, naming them, when a wheel in .whl/ needs (on Python 3.12, no extras) a
    distribution neither .whl/ nor the GPU machine has."""
    wheels = sorted(WHEELS.glob("*.whl"))
    present = {_name(w.name.split("-")[0]) for w in wheels} | ON_DEVICE
    unmet = []
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            lines = z.read(meta).decode().splitlines()
        for line in lines:
            if not line.startswith("Requires-Dist:") or "extra ==" in line:
                continue
            req, _, marker = line[len("Requires-Dist:"):].partition(";")
            if re.search(r"python_version\s*[<>=]+\s*['\"]3\.(1[0-2]|[0-9])['\"]", marker) and (
                    "<" in marker and "<=" not in marker):
                continue  # python_version < '3.12' or older: not on the machine's 3.12
            dist = _name(re.split(r"[\s<>=!~\[(;]", req.strip(), maxsplit=1)[0])
            if dist not in present:
                unmet.append(f"{wheel.name} needs {req.strip()}")
    for line in unmet:
        print(line, file=sys.stderr)
    print(f"{len(wheels)} wheels in {WHEELS}; {len(unmet)} unmet requirements")
    return 1 if unmet or not wheels else 0


def main() -> None:
    if sys.argv[1:] == ["--check"]:
        raise SystemExit(check())
    out = Path(sys.argv[1]).resolve()
    out.mkdir(parents=True, exist_ok=True)
    folders = wheels(out) + project(out)
    for folder, dirs, files in os.walk(out):  # a throw-away user's client imports from them
        for name in (*dirs, *files):
            path = Path(folder, name)
            if not path.is_symlink():
                path.chmod(path.stat().st_mode | 0o444 | (0o111 if path.is_dir() else 0))
    out.chmod(0o755)
    print(":".join(folders))


if __name__ == "__main__":
    main()
