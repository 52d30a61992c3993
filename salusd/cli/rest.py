"""The operator's commands, all through the REST API: status, top, submit, suspend, resume,
cancel, priority, policy, checkpoint, token."""

from __future__ import annotations

import argparse
import json
import signal
import time
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from salus.daemon.devices.discovery import format_size
from salus.daemon.limits import MAX_ITERATIONS
from salus.daemon.rest.client import RestClient, RestError, find_token, find_url
from salus.daemon.state.store import ENDED_STATES


def run(args: argparse.Namespace) -> int:
    console = Console(width=max(120, Console().width))
    client = RestClient(find_url(args.url, args.state_dir), find_token(args.token,
                                                                        args.state_dir))
    try:
        with client:
            return COMMANDS[args.command](client, args, console)
    except RestError as exc:
        console.print(Text(f"salusd {args.command}: {exc}", style="red"))
        return 1
    except KeyboardInterrupt:
        return 130


def _status(client: RestClient, args: argparse.Namespace, console: Console) -> int:
    view = _view(client, _ended_since(args))
    if args.json:
        print(json.dumps(view, indent=2))
    else:
        console.print(render(view))
    return 0


def _top(client: RestClient, args: argparse.Namespace, console: Console) -> int:
    """A live view, refreshed every `--interval` seconds until Ctrl-C (or `--count` frames)."""
    previous = _view(client, _ended_since(args))
    then = time.monotonic()
    with Live(render(previous), console=console, auto_refresh=False,
              screen=console.is_terminal) as live:
        shown = 1
        while args.count is None or shown < args.count:
            time.sleep(args.interval)
            view = _view(client, _ended_since(args))
            now = time.monotonic()
            live.update(render(view, previous, now - then), refresh=True)
            previous, then, shown = view, now, shown + 1
    return 0


def _ended_since(args: argparse.Namespace) -> float | None:
    """The ended jobs `status` and `top` show: those that ended at this unix time or later
    (`--since`; `--all`: 0, every one); None: none."""
    return 0.0 if args.all else args.since


def _view(client: RestClient, ended_since: float | None = None) -> dict[str, Any]:
    """Policy, devices, lanes and the live jobs, with those that ended at `ended_since` (unix
    seconds) or later (None: no ended job)."""
    if ended_since is None:
        jobs = [j for j in client.get("/v1/jobs") if j["state"] not in ENDED_STATES]
    else:
        jobs = client.get(f"/v1/jobs?ended_since={ended_since!r}")
    return {"policy": client.get("/v1/policy"), "devices": client.get("/v1/devices"),
            "lanes": client.get("/v1/lanes"), "jobs": jobs}


def _iterations(job: dict[str, Any]) -> str:
    """`done/planned`; a planned count the job never gave (2**53) is `-`."""
    total = job["iterations_total"]
    return f"{job['iterations_done']}/{'-' if total >= MAX_ITERATIONS else total}"


def exit_text(job: dict[str, Any]) -> str:
    """How a script job's command ended, after its state: ` (0)`, ` (143 SIGTERM time
    limit)`; empty while it runs, or for a job that runs no command."""
    status, signum, limit = job.get("exit_status"), job.get("signal"), job.get("limit")
    parts = [] if status is None else [str(status)]
    if isinstance(signum, int):
        try:
            parts.append(signal.Signals(signum).name)
        except ValueError:
            parts.append(f"signal {signum}")
    if limit is not None:
        parts.append(f"{limit} limit")
    return f" ({' '.join(parts)})" if parts else ""


def _size(nbytes: Any) -> str:
    return format_size(nbytes) if isinstance(nbytes, int) else "-"


def shown(text: object) -> Text:
    """Plain terminal text: no markup; control and format characters escaped."""
    return Text("".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in str(text)))


def _bar(parts: list[tuple[int, str]], total: int, width: int = 30) -> Text:
    bar = Text()
    used = 0
    for nbytes, style in parts:
        cells = round(width * nbytes / total) if total else 0
        bar.append("█" * cells, style=style)
        used += cells
    bar.append("·" * max(0, width - used), style="dim")
    return bar


def render(view: dict[str, Any], previous: dict[str, Any] | None = None,
           seconds: float = 0.0) -> Group:
    """Devices with a memory bar (persistent, lanes, free), lanes, and jobs with their rate."""
    policy = view["policy"]
    title = f"salusd devices (policy {policy['policy']}" + (
        f", switching to {policy['pending']})" if policy.get("pending") else ")")
    devices = Table(title=title)
    for col in ("device", "memory (persistent▮ lanes▮ free·)", "capacity", "persistent",
                "lanes", "free", "jobs"):
        devices.add_column(col)
    lanes_by_device: dict[int, int] = {}
    for ln in view["lanes"]:
        lanes_by_device[ln["device"]] = lanes_by_device.get(ln["device"], 0) + ln["size_bytes"]
    for d in view["devices"]:
        lane_bytes = lanes_by_device.get(d["index"], 0)
        slow = d.get("compute_slowdown", 1.0)
        devices.add_row(
            f"{d['index']} {d['torch_device']}" + (
                f" (SIMULATED x{slow:.3g} slower)" if slow != 1.0 else ""),
            _bar([(d["persistent_bytes"], "cyan"), (lane_bytes, "magenta")],
                 d["capacity_bytes"]),
            _size(d["capacity_bytes"]), _size(d["persistent_bytes"]),
            f"{d['lanes']} ({_size(lane_bytes)})", _size(d["unreserved_bytes"]), str(d["jobs"]))
    lanes = Table(title="lanes")
    for col in ("device.lane", "size", "jobs", "running"):
        lanes.add_column(col)
    for ln in view["lanes"]:
        lanes.add_row(f"{ln['device']}.{ln['lane_id']}", _size(ln["size_bytes"]),
                      " ".join(map(str, ln["jobs"])), str(ln["busy_job"] or "-"))
    before = {j["id"]: j["iterations_done"] for j in (previous or {}).get("jobs", [])}
    jobs = Table(title=f"jobs ({len(view['jobs'])})")
    for col in ("id", "owner", "name", "kind", "state", "iterations", "it/s", "dev.lane",
                "persistent", "ephemeral", "lane", "checkpoint", "reason"):
        jobs.add_column(col, overflow="fold")
    for j in view["jobs"]:
        if j.get("waiting_for") and not j["reason"]:
            j = {**j, "reason": "waiting for job(s) " + ", ".join(map(str, j["waiting_for"]))
                 + " (--after)"}
        rate = "-"
        if seconds > 0 and j["id"] in before:
            rate = f"{(j['iterations_done'] - before[j['id']]) / seconds:.1f}"
        ckpt = j.get("checkpoint")
        jobs.add_row(
            str(j["id"]), shown(j["owner"]), shown(j["name"]), j["kind"],
            shown(j["state"] + exit_text(j)), _iterations(j), rate,
            f"{j['device']}.{j['lane']}" if j["device"] is not None else "-",
            _size(j["persistent_bytes"]), _size(j["ephemeral_bytes"]), _size(j["lane_bytes"]),
            f"@{ckpt['iteration']}" if ckpt else "-", shown(j["reason"])[:80])
    return Group(devices, lanes, jobs, _executors(view["jobs"]))


def _executors(jobs: list[dict[str, Any]]) -> Table:
    """The executor processes of live jobs: which jobs each hosts, and why."""
    table = Table(title="executors")
    for col in ("pid", "jobs", "why"):
        table.add_column(col, overflow="fold")
    seen: dict[object, tuple[list[int], str]] = {}
    for j in jobs:
        ex = j.get("executor")
        if ex and ex.get("pid"):
            seen.setdefault(ex["pid"], ([], str(ex.get("why", ""))))[0].append(j["id"])
    for pid, (ids, why) in sorted(seen.items(), key=lambda kv: str(kv[0])):
        table.add_row(str(pid), " ".join(map(str, sorted(ids))), why)
    return table


def pipeline_options(args: argparse.Namespace) -> dict[str, Any]:
    """The pipeline fields of a submission, as given on the command line."""
    given = {"pipeline": args.pipeline or None, "placement": args.placement,
             "microbatches": args.microbatches}
    return {k: v for k, v in given.items() if v is not None}


def _submit(client: RestClient, args: argparse.Namespace, console: Console) -> int:
    job = client.call("POST", "/v1/jobs", {
        "name": args.name or args.entrypoint.rsplit(":", 1)[-1], "entrypoint": args.entrypoint,
        "iterations": args.iterations, "priority": args.priority,
        "devices": args.devices, "nodes": args.nodes,
        **({"rendezvous": args.rendezvous} if args.rendezvous else {}),
        **pipeline_options(args)})
    console.print(f"job {job['id']} submitted: {job['name']} ({job['entrypoint']}, "
                  f"{job['iterations_total']} iterations) as {job['owner']}")
    return 0


def _job_action(client: RestClient, args: argparse.Namespace, console: Console) -> int:
    path = f"/v1/jobs/{args.job}"
    if args.command == "suspend":
        job = client.call("POST", f"{path}/suspend", {"swap": args.swap})
    elif args.command == "resume":
        job = client.call("POST", f"{path}/resume")
    elif args.command == "cancel":
        job = client.call("DELETE", path)
    else:
        job = client.call("PUT", f"{path}/priority", {"priority": args.value})
    console.print(f"job {job['id']}: {args.command} done; it is {job['state']} (changes take "
                  "effect at its next iteration boundary)")
    return 0


def _checkpoint(client: RestClient, args: argparse.Namespace, console: Console) -> int:
    done = client.call("POST", f"/v1/jobs/{args.job}/checkpoint")
    c = done["checkpoint"]
    console.print(f"job {args.job}: checkpoint at iteration {c['iteration']}, "
                  f"{_size(c['bytes'])}, in {c['path']}")
    return 0


def _policy(client: RestClient, args: argparse.Namespace, console: Console) -> int:
    if args.name is None:
        out = client.get("/v1/policy")
    else:
        out = client.call("PUT", "/v1/policy", {"policy": args.name})
    pending = f" (switching to {out['pending']} at the next boundaries)" if out["pending"] else ""
    console.print(f"policy: {out['policy']}{pending}")
    return 0


def _token(client: RestClient, args: argparse.Namespace, console: Console) -> int:
    if args.action == "add":
        made = client.call("POST", "/v1/tokens", {"name": args.name,
                                                  "user": args.user or args.name})
        console.print(f"token {made['name']} for user {made['owner']} (shown once; keep it as "
                      "$SALUS_TOKEN):")
        print(made["token"])
    elif args.action == "revoke":
        client.call("DELETE", f"/v1/tokens/{args.name}")
        console.print(f"token {args.name} revoked")
    else:
        table = Table(title="tokens")
        for col in ("name", "user", "uid", "created", "revoked"):
            table.add_column(col)
        for t in client.get("/v1/tokens"):
            table.add_row(t["name"], t["owner"], str(t["uid"]), time.strftime(
                "%Y-%m-%d %H:%M", time.localtime(t["created"])),
                time.strftime("%Y-%m-%d %H:%M", time.localtime(t["revoked_at"]))
                if t["revoked_at"] else "-")
        console.print(table)
    return 0


COMMANDS = {"status": _status, "top": _top, "submit": _submit, "suspend": _job_action,
            "resume": _job_action, "cancel": _job_action, "priority": _job_action,
            "checkpoint": _checkpoint, "policy": _policy, "token": _token}
