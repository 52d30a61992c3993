"""deploy/prometheus.yml and deploy/grafana-dashboard.json against the metrics salusd exposes,
and a real Prometheus (Debian package `prometheus`; those tests skip without it) scraping a
real `salusd serve --http` while clients train: it must see the iterations they ran.

Everything listens on loopback; every wait is bounded in count and time.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from client_proc import finish
from daemon_proc import salusd
from prometheus_client.parser import text_string_to_metric_families

from salus.daemon.engine.events import Event
from salus.daemon.metrics import Metrics

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
CONFIG = DEPLOY / "prometheus.yml"
DASHBOARD = DEPLOY / "grafana-dashboard.json"
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
METRIC = re.compile(r"\bsalusd_[a-z_]+\b")


def scrape_jobs() -> dict[str, dict[str, Any]]:
    return {job["job_name"]: job for job in yaml.safe_load(CONFIG.read_text())["scrape_configs"]}


def dashboard_exprs() -> list[str]:
    return [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"]
            for t in p["targets"]]


# ---- the files ----------------------------------------------------------------------------------
def relabel(labels: dict[str, str], rules: list[dict[str, Any]]) -> dict[str, str] | None:
    """Prometheus's `keep` and `replace` relabelling (anchored regexes, `;` between source
    labels, `$n` in replacements); None when the target is dropped."""
    labels = dict(labels)
    for rule in rules:
        joined = rule.get("separator", ";").join(labels.get(s, "")
                                                 for s in rule.get("source_labels", []))
        match = re.fullmatch(str(rule.get("regex", "(.*)")), joined)
        action = rule.get("action", "replace")
        if action == "keep" and match is None:
            return None
        if action == "replace" and match is not None:
            replacement = re.sub(r"\$(\d+)", r"\\\1", rule.get("replacement", "$1"))
            labels[rule["target_label"]] = match.expand(replacement)
        assert action in ("keep", "replace"), f"relabel action {action} is not simulated here"
    return labels


def pod_meta(pod: dict[str, Any], address: str) -> dict[str, str]:
    """What kubernetes_sd (role: pod) says of a pod made from `pod` (a pod template)."""
    def sanitized(key: str) -> str:
        return re.sub(r"[^a-zA-Z0-9_]", "_", key)
    meta = {"__address__": address, "__metrics_path__": "/metrics",
            "__meta_kubernetes_namespace": "salusd", "__meta_kubernetes_pod_name": "salusd-x1",
            "__meta_kubernetes_pod_node_name": "gpu-7"}
    for key, val in pod["metadata"].get("labels", {}).items():
        meta[f"__meta_kubernetes_pod_label_{sanitized(key)}"] = val
    for key, val in pod["metadata"].get("annotations", {}).items():
        meta[f"__meta_kubernetes_pod_annotation_{sanitized(key)}"] = val
    return meta


def test_the_pod_job_scrapes_the_daemonset_pods_only() -> None:
    rules = scrape_jobs()["salusd-pods"]["relabel_configs"]
    daemonset = yaml.safe_load((DEPLOY / "k8s" / "daemonset.yaml").read_text())
    pod = daemonset["spec"]["template"]
    for address in ("10.1.2.3:7077", "10.1.2.3", "10.1.2.3:9999"):  # per port, or none
        target = relabel(pod_meta(pod, address), rules)
        assert target is not None
        assert target["__address__"] == "10.1.2.3:7077"
        assert target["__metrics_path__"] == "/metrics"
        assert (target["node"], target["namespace"], target["pod"]) == (
            "gpu-7", "salusd", "salusd-x1")
    unannotated = {"metadata": {"labels": pod["metadata"]["labels"]}}
    assert relabel(pod_meta(unannotated, "10.1.2.3:7077"), rules) is None
    other = {"metadata": {"labels": {"app.kubernetes.io/name": "web"},
                          "annotations": pod["metadata"]["annotations"]}}
    assert relabel(pod_meta(other, "10.1.2.4:80"), rules) is None


def test_the_node_job_scrapes_what_the_unit_serves() -> None:
    job = scrape_jobs()["salusd"]
    unit = (DEPLOY / "salusd.service").read_text()
    http = re.search(r"--http (\S+)", unit)
    assert http is not None
    assert job["static_configs"] == [{"targets": [http.group(1)]}]
    assert job["metrics_path"] == "/metrics"


@pytest.mark.skipif(PROMTOOL is None, reason="needs promtool (Debian package prometheus)")
def test_promtool_accepts_the_config(tmp_path: Path) -> None:
    assert PROMTOOL is not None
    full = subprocess.run([PROMTOOL, "check", "config", str(CONFIG)], capture_output=True,
                          text=True, timeout=60)
    if "field kubernetes_sd_configs not found" in full.stdout + full.stderr:
        # Debian builds Prometheus without Kubernetes discovery: check the rest of the file
        config = yaml.safe_load(CONFIG.read_text())
        config["scrape_configs"] = [j for j in config["scrape_configs"]
                                    if "kubernetes_sd_configs" not in j]
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        full = subprocess.run([PROMTOOL, "check", "config", str(tmp_path / "prometheus.yml")],
                              capture_output=True, text=True, timeout=60)
    assert full.returncode == 0, full.stdout + full.stderr


def exposed_names() -> set[str]:
    """Every sample name salusd's metrics have once each kind of event has happened."""
    m = Metrics()
    device = {"device": 0, "capacity_bytes": 1, "persistent_bytes": 0, "lane_bytes": 0,
              "free_bytes": 1, "lanes": 0}
    for kind, job, detail in (("open", 1, {}), ("admit", 1, {}), ("open", 2, {}),
                              ("end", 1, {"iterations": 1, "seconds": 0.1}),
                              ("end", 2, {"iterations": 1, "seconds": 0.1}),
                              ("memory", -1, {"devices": [device], "pending": 0}),
                              ("checkpoint", 1, {"seconds": 1.0, "bytes": 1})):
        m.observe(Event(0.0, kind, job, 0, 0, detail))
    return {s.name for family in text_string_to_metric_families(m.render()[0].decode())
            for s in family.samples}


def test_the_dashboard_shows_only_metrics_salusd_exposes() -> None:
    board = json.loads(DASHBOARD.read_text())
    assert board["uid"] and board["title"] and board["schemaVersion"] >= 36
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    panels = board["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells = [(x, y) for p in panels for x in range(p["gridPos"]["x"], p["gridPos"]["x"]
                                                    + p["gridPos"]["w"])
             for y in range(p["gridPos"]["y"], p["gridPos"]["y"] + p["gridPos"]["h"])]
    assert len(cells) == len(set(cells)), "panels overlap"
    for p in panels:
        assert p["datasource"]["uid"] == "${datasource}"
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"])
    exprs = dashboard_exprs()
    used = {name for expr in exprs for name in METRIC.findall(expr)}
    assert used <= exposed_names(), used - exposed_names()
    wanted = ("salusd_device_persistent_bytes", "salusd_device_ephemeral_bytes",
              "salusd_job_ephemeral_bytes", "salusd_pending_jobs", "salusd_switches_total")
    assert set(wanted) <= used
    assert any("rate(salusd_job_iterations_total" in e and "[1m])" in e for e in exprs)


# ---- a real Prometheus scraping a real daemon ---------------------------------------------------
CLIENT = textwrap.dedent("""
    import sys
    import torch
    from torch import nn
    import salus.adapters.torch as salus

    name, n = sys.argv[1], int(sys.argv[2])
    model = nn.Linear(8, 2)

    def step(s, x):
        s.model.zero_grad()
        s.model(x).sum().backward()
        return None

    with salus.connect(name=name, iterations=n) as job:
        train = job.attach(model=model).iteration(step)
        for _ in range(n):
            train(torch.randn(4, 8))
        print(job.id, flush=True)
        sys.stdin.readline()  # the test looks at the metrics while the job is live
""")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_for(what: str, fn: Callable[[], Any], done: Callable[[Any], bool] = bool,
             timeout_s: float = 60.0, every_s: float = 0.5) -> Any:
    """`fn()` once `done` says so, trying every `every_s` for at most `timeout_s` seconds."""
    last: Any = None
    for _ in range(int(timeout_s / every_s) + 1):
        with contextlib.suppress(httpx.HTTPError):
            last = fn()
            if done(last):
                return last
        time.sleep(every_s)
    raise AssertionError(f"{what}: not within {timeout_s} s (last: {last!r})")


def started(proc: subprocess.Popen[bytes], url: str) -> bool:
    """Wait until Prometheus at `url` is ready (True) or has exited (False)."""
    with httpx.Client(trust_env=False, timeout=5) as http:
        wait_for("prometheus ready or gone", lambda: proc.poll() is not None or http.get(
            f"{url}/-/ready").status_code == 200)
    return proc.poll() is None


@contextlib.contextmanager
def prometheus(tmp: Path, target: str) -> Iterator[str]:
    """A Prometheus on a loopback port scraping `target` every second with the shipped node
    job; yields its URL."""
    assert PROMETHEUS is not None
    config = yaml.safe_load(CONFIG.read_text())
    config["global"].update(scrape_interval="1s", scrape_timeout="1s")
    job = scrape_jobs()["salusd"]
    job["static_configs"] = [{"targets": [target]}]
    config["scrape_configs"] = [job]
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = tmp / "prometheus.log"
    for _ in range(3):  # another process may take the free port first
        port = free_port()
        with open(log, "w") as out:
            proc = subprocess.Popen(
                [PROMETHEUS, f"--config.file={tmp / 'prometheus.yml'}",
                 f"--storage.tsdb.path={tmp / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                stdout=out, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            if started(proc, url):
                yield url
                return
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    raise AssertionError(f"prometheus did not start: {log.read_text()[-3000:]}")


def query(http: httpx.Client, url: str, promql: str) -> list[dict[str, Any]]:
    reply = http.get(f"{url}/api/v1/query", params={"query": promql}).json()
    assert reply["status"] == "success", (promql, reply)
    result: list[dict[str, Any]] = reply["data"]["result"]
    return result


@pytest.mark.slow
@pytest.mark.skipif(PROMETHEUS is None, reason="needs the prometheus binary (Debian package "
                    "prometheus; .ci/run installs it when running as root)")
def test_a_real_prometheus_sees_the_iterations_jobs_ran(tmp_path: Path) -> None:
    script = tmp_path / "client.py"
    script.write_text(CLIENT)
    planned = {"alpha": 9, "beta": 14}
    with salusd(tmp_path, "--http", "127.0.0.1:0", devices=1) as (daemon, address):
        http_url = (tmp_path / "state" / "http.url").read_text().strip()
        env = {**os.environ, "SALUS_ADDRESS": address, "OMP_NUM_THREADS": "1"}
        clients = {name: subprocess.Popen([sys.executable, str(script), name, str(n)],
                                          env=env, text=True, stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                   for name, n in planned.items()}
        try:
            ids = {}
            for name, client in clients.items():
                assert client.stdout is not None
                ready, _, _ = select.select([client.stdout], [], [], 180)
                line = client.stdout.readline().strip() if ready else ""
                assert line.isdigit(), finish(client, timeout_s=30)
                ids[line] = name
            with prometheus(tmp_path, http_url.removeprefix("http://")) as url, httpx.Client(
                    trust_env=False, timeout=5) as http:
                def per_job() -> dict[str, float]:
                    return {ids[r["metric"]["job_id"]]: float(r["value"][1])
                            for r in query(http, url, "salusd_job_iterations_total")}

                wait_for("each job's iterations", per_job, lambda got: got == planned)
                (up,) = query(http, url, 'up{job="salusd"}')
                assert up["value"][1] == "1"
                named = query(http, url, "salusd_job_iterations_total * on(instance, job_id) "
                              "group_left(name) salusd_job_info")
                assert {r["metric"]["name"]: float(r["value"][1]) for r in named} == planned
                for expr in dashboard_exprs():  # every panel's query is valid PromQL
                    query(http, url, expr.replace("$instance", ".*"))

                for client in clients.values():
                    _, err = finish(client, "\n", timeout_s=120)
                    assert client.returncode == 0, err

                def after_end() -> tuple[list[float], int]:
                    total = query(http, url, "salusd_iterations_total")
                    return ([float(r["value"][1]) for r in total],
                            len(query(http, url, "salusd_job_iterations_total")))

                wait_for("the total, and no job series once the jobs ended", after_end,
                         lambda got: got == ([sum(planned.values())], 0))
                (finished,) = query(http, url, 'salusd_jobs_total{state="finished"}')
                assert float(finished["value"][1]) == len(planned)
        finally:
            for client in clients.values():
                if client.poll() is None:
                    client.kill()
                    client.wait()
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=90) == 0
