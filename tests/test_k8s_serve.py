"""`salusd serve --device-plugin` as the daemon's operator runs it: on this host, which has no
GPU, the daemon serves its CPU devices, says clearly that the plugin is not started, and
makes no socket in the kubelet's directory."""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from daemon_proc import salusd


def test_serve_with_the_device_plugin_on_a_host_without_gpus_says_so(tmp_path: Path) -> None:
    kubelet = Path(tempfile.mkdtemp(prefix="kl-", dir=tmp_path))
    (kubelet / "device-plugins").mkdir()
    with salusd(tmp_path, "--device-plugin", "--kubelet-dir", str(kubelet),
                devices=1, memory="64M") as (proc, _):
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    log = " ".join((tmp_path / "salusd.log").read_text().split())
    assert ("--device-plugin: this host has no GPU (salusd serves CPU devices), so the device "
            "plugin is not started") in log
    assert list((kubelet / "device-plugins").iterdir()) == []


def test_serve_with_the_device_plugin_refuses_a_pod_user_that_is_root(tmp_path: Path) -> None:
    """Pods' jobs would run as root on the node: salusd does not start, and says why."""
    run = subprocess.run(
        [sys.executable, "-m", "salus.daemon.cli", "serve", "--socket",
         str(tmp_path / "s.sock"), "--state-dir", str(tmp_path / "state"), "--http", "none",
         "--cpu-devices", "1", "--cpu-memory", "64M", "--device-plugin", "--pod-user", "root"],
        capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert "--pod-user 'root' is uid 0: pods' jobs would run as root" in run.stderr
    assert not (tmp_path / "s.sock").exists()
