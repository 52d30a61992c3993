"""The systemd unit in deploy/: one systemd accepts (`systemd-analyze verify`, with salusd where
this checkout installed it; skipped where systemd-analyze or curl is missing), that keeps state
in /var/lib/salusd, serves HTTP on loopback, restarts on failure, and whose start-up health
check passes against a real daemon and fails, within its bound, where nothing answers."""

from __future__ import annotations

import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from daemon_proc import salusd

UNIT = Path(__file__).resolve().parent.parent / "deploy" / "salusd.service"


def directives() -> dict[str, list[str]]:
    """The [Service] section's directives (a directive may repeat)."""
    found: dict[str, list[str]] = {}
    section = ""
    for raw in UNIT.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            section = line
        elif section == "[Service]":
            key, _, val = line.partition("=")
            found.setdefault(key, []).append(val)
    return found


def health_check() -> list[str]:
    (command,) = directives()["ExecStartPost"]
    return shlex.split(command)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
@pytest.mark.skipif(not Path("/usr/bin/curl").exists(),
                    reason="the unit's health check runs /usr/bin/curl, missing here")
def test_systemd_accepts_the_unit(tmp_path: Path) -> None:
    salusd_bin = Path(sys.executable).parent / "salusd"
    assert salusd_bin.exists(), "the package's console script is not installed beside python"
    text = UNIT.read_text().replace("/usr/local/bin/salusd", str(salusd_bin))
    unit = tmp_path / "salusd.service"
    unit.write_text(text)
    result = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True,
                            text=True, timeout=120)
    complaints = [line for line in (result.stdout + result.stderr).splitlines()
                  if "salusd.service" in line]
    assert result.returncode == 0 and not complaints, result.stdout + result.stderr


def test_state_http_restart_and_the_privilege_drop() -> None:
    d = directives()
    (start,) = d["ExecStart"]
    args = shlex.split(start)
    assert args[1] == "serve"
    flags = dict(zip(args[2::2], args[3::2], strict=True))
    assert flags["--state-dir"] == "/var/lib/salusd" and d["StateDirectory"] == ["salusd"]
    assert flags["--http"] == "127.0.0.1:7077"
    assert Path(flags["--socket"]).parent == Path("/run/salusd")
    assert d["RuntimeDirectory"] == ["salusd"]
    assert d["Restart"] == ["on-failure"]
    assert "/var/lib/salusd" in d["ReadWritePaths"][0].split()
    assert "User" not in d  # root: executors drop to each job's owner (docs/runtime.md)
    assert {"CAP_SETUID", "CAP_SETGID", "CAP_CHOWN"} <= set(d["CapabilityBoundingSet"][0].split())
    # descriptors for many clients, executors and connections (salusd raises its soft limit)
    assert int(d["LimitNOFILE"][0]) >= 65536

    check = health_check()
    assert check[0] == "/usr/bin/curl" and "--fail" in check
    assert check[-1] == f"http://{flags['--http']}/healthz"
    retries, delay = int(check[check.index("--retry") + 1]), float(
        check[check.index("--retry-delay") + 1])
    attempt = float(check[check.index("--max-time") + 1])
    assert float(check[check.index("--retry-max-time") + 1]) == retries * delay
    # the whole check ends before systemd would give up on the start
    assert retries * delay + attempt < float(d["TimeoutStartSec"][0])


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("curl") is None, reason="the health check runs curl")
def test_the_health_check_passes_against_the_daemon(tmp_path: Path) -> None:
    with salusd(tmp_path, "--http", "127.0.0.1:0") as (proc, _):
        url = (tmp_path / "state" / "http.url").read_text().strip()
        check = [shutil.which("curl") or "curl", *health_check()[1:-1], f"{url}/healthz"]
        result = subprocess.run(check, capture_output=True, text=True, timeout=150)
        assert result.returncode == 0, result.stderr
        assert proc.poll() is None


@pytest.mark.skipif(shutil.which("curl") is None, reason="the health check runs curl")
def test_the_health_check_fails_where_nothing_answers() -> None:
    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    check = health_check()
    check[0] = shutil.which("curl") or "curl"
    check[check.index("--retry") + 1] = "2"  # the unit's own bound is two minutes
    check[check.index("--retry-max-time") + 1] = "2"
    check[-1] = f"http://127.0.0.1:{port}/healthz"
    result = subprocess.run(check, capture_output=True, text=True, timeout=60)
    assert result.returncode == 7, result.stderr  # curl: failed to connect
