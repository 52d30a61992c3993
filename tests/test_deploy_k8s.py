"""The Kubernetes manifests in deploy/k8s/ and its examples/: every document is valid against
the API schemas kubernetes-validate ships (offline, strict: no unknown fields) for a pinned
Kubernetes version, the DaemonSet runs one salusd per GPU node the way the daemon needs, and
the example Job asks the device plugin for its share."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from salus.daemon.cli.main import build_parser
from salus.daemon.k8s.units import RESOURCE

K8S = Path(__file__).resolve().parent.parent / "deploy" / "k8s"
KUBERNETES_VERSION = "1.30.0"  # a version whose schemas kubernetes-validate ships
MANIFESTS = sorted(K8S.glob("*.yaml"))  # what `kubectl apply -f deploy/k8s/` applies
EXAMPLES = sorted((K8S / "examples").glob("*.yaml"))


def documents() -> list[dict[str, Any]]:
    return [doc for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text())
            if doc is not None]


def daemonset() -> dict[str, Any]:
    (ds,) = [d for d in documents() if d["kind"] == "DaemonSet"]
    return ds


@pytest.mark.parametrize("path", MANIFESTS + EXAMPLES, ids=lambda p: p.name)
def test_every_document_is_valid(path: Path) -> None:
    import kubernetes_validate  # here: its import is most of this file's collection time

    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert docs
    for doc in docs:
        assert kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True) == "1.30"


def test_the_validator_refuses_a_broken_daemonset() -> None:
    """What the test above relies on: a wrong type and an unknown field are caught."""
    import kubernetes_validate

    broken = daemonset()
    broken["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "7077"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)
    unknown = daemonset()
    unknown["spec"]["template"]["spec"]["hostPaths"] = []
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(unknown, KUBERNETES_VERSION, strict=True)


def test_the_command_line_validator_agrees() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kubernetes_validate", "--kubernetes-version",
         KUBERNETES_VERSION, "--strict", *map(str, MANIFESTS + EXAMPLES)],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_one_salusd_per_gpu_node_as_root_with_its_host_paths() -> None:
    docs = documents()
    ds = daemonset()
    namespace = ds["metadata"]["namespace"]
    assert any(d["kind"] == "Namespace" and d["metadata"]["name"] == namespace for d in docs)
    pod = ds["spec"]["template"]
    assert ds["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    spec = pod["spec"]
    assert spec["nodeSelector"] == {"salusd.io/gpu-node": "true"}
    assert spec["priorityClassName"] == "system-node-critical"
    # outside kube-system a critical pod needs a quota that covers its priority class
    assert any(d["kind"] == "ResourceQuota" and d["metadata"]["namespace"] == namespace
               and "system-node-critical" in d["spec"]["scopeSelector"]["matchExpressions"][0]
               ["values"] for d in docs)
    account = spec["serviceAccountName"]
    assert any(d["kind"] == "ServiceAccount" and d["metadata"]["name"] == account
               for d in docs)

    (container,) = spec["containers"]
    args = container["args"]
    assert args[0] == "serve"
    assert "--device-plugin" in args
    valued = [a for a in args[1:] if a != "--device-plugin"]
    flags = dict(zip(valued[0::2], valued[1::2], strict=True))
    assert flags == {"--http": "0.0.0.0:7077", "--state-dir": "/var/lib/salusd",
                     "--socket": "/run/salusd/salusd.sock"}
    assert container["ports"] == [{"name": "http", "containerPort": 7077, "protocol": "TCP"}]
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "http"}, probe
    assert {"cpu", "memory"} <= container["resources"]["requests"].keys()

    security = container["securityContext"]
    assert security["runAsUser"] == 0 and security["runAsNonRoot"] is False
    assert security["allowPrivilegeEscalation"] is False and not security["privileged"]
    assert security["capabilities"]["drop"] == ["ALL"]
    # what dropping each executor to its job's owner needs (docs/runtime.md)
    assert {"SETUID", "SETGID", "CHOWN"} <= set(security["capabilities"]["add"])

    host = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    # the kubelet's directories where salusd looks for them by default (`--kubelet-dir`)
    kubelet = build_parser().parse_args(["serve"]).kubelet_dir
    for path in ("/run/salusd", "/var/lib/salusd", f"{kubelet}/device-plugins",
                 f"{kubelet}/pod-resources"):
        (name,) = [n for n, p in host.items() if p == path]
        assert mounts[name] == path
    assert Path(flags["--socket"]).parent == Path("/run/salusd")  # the socket is on the host

    annotations = pod["metadata"]["annotations"]
    assert annotations == {"prometheus.io/scrape": "true", "prometheus.io/port": "7077",
                           "prometheus.io/path": "/metrics"}


def test_the_example_job_asks_the_device_plugin_for_16_gib_and_runs_salusd_run() -> None:
    (path,) = [p for p in EXAMPLES if p.name == "train-job.yaml"]
    (job,) = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert job["kind"] == "Job"
    pod = job["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == daemonset()["spec"]["template"]["spec"]["nodeSelector"]
    (container,) = pod["containers"]
    assert container["command"] == ["salusd", "run", "--", "python", "train.py"]
    assert RESOURCE == "salusd.io/gpu-mem"
    assert container["resources"]["limits"][RESOURCE] == 16
    # the grant brings what the pod needs: never the shared socket dir, nor root
    assert "volumes" not in pod and "volumeMounts" not in container
    security = container["securityContext"]
    assert security["runAsNonRoot"] is True and security["runAsUser"] != 0
    assert security["allowPrivilegeEscalation"] is False

