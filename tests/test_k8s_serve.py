"""`salusd serve --device-plugin` as the daemon's operator runs it: on this host, which has no
GPU, the daemon serves its CPU devices, says clearly that the plugin is not started, and
makes no socket in the kubelet's directory."""

from __future__ import annotations

import signal
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
