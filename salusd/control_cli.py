"""`salusd status|suspend|resume|cancel|priority`: the control commands of the CLI."""

from __future__ import annotations

import argparse
import json
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from salus.daemon.control import Control
from salus.daemon.devices import format_size
from salus.daemon.wire.errors import SalusError


def run_control(args: argparse.Namespace) -> int:
    """Run one control command; prints the daemon's error and returns 1 when it refuses."""
    console = Console(width=max(130, Console().width))
    address = f"unix://{args.socket}" if args.socket else None
    try:
        with Control(address) as ctl:
            if args.command == "status":
                snapshot = ctl.status()
                if args.json:
                    print(json.dumps(snapshot, indent=2))
                else:
                    print_status(console, snapshot)
            elif args.command == "suspend":
                ctl.suspend(args.job, swap=args.swap)
            elif args.command == "resume":
                ctl.resume(args.job)
            elif args.command == "cancel":
                ctl.cancel(args.job)
            elif args.command == "priority":
                ctl.priority(args.job, args.value)
    except SalusError as exc:
        console.print(f"[red]salusd {args.command}: {exc}[/red]")
        return 1
    if args.command != "status":
        console.print(f"job {args.job}: {args.command} done (takes effect at its next "
                      "iteration boundary)")
    return 0


def _size(nbytes: Any) -> str:
    return format_size(nbytes) if isinstance(nbytes, int) else "-"


def shown(text: object) -> Text:
    """`text` as plain terminal text: no markup, control and format characters escaped (a name
    from an older daemon or a reason may hold anything)."""
    out = "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in str(text))
    return Text(out)


def print_status(console: Console, snapshot: dict[str, Any]) -> None:
    """Two tables: devices with their budgets and lanes, then jobs."""
    devices = Table(title=f"salusd devices (policy {snapshot['policy']})")
    for col in ("device", "capacity", "booked", "persistent", "unreserved", "lanes (id:size×jobs)"):
        devices.add_column(col, justify="left" if col in ("device", "lanes (id:size×jobs)")
                           else "right")
    for d in snapshot["devices"]:
        lanes = ", ".join(f"{ln['lane_id']}:{_size(ln['size_bytes'])}×{len(ln['jobs'])}"
                          for ln in d["lanes"]) or "-"
        devices.add_row(f"{d['index']} {d['torch_device']}", _size(d["capacity_bytes"]),
                        _size(d["used_bytes"]), _size(d["persistent_bytes"]),
                        _size(d["unreserved_bytes"]), lanes)
    console.print(devices)
    jobs = Table(title=f"jobs ({len(snapshot['jobs'])}; pending {snapshot['pending']})")
    for col in ("id", "owner", "name", "state", "iterations", "iter ms", "dev/lane",
                "persistent", "ephemeral (measured/est.)", "lane", "limits"):
        jobs.add_column(col, justify="right" if col in ("id", "iterations", "iter ms") else "left")
    for j in snapshot["jobs"]:
        mem = j["memory"]
        mean = j["mean_iteration_s"]
        over = f" [over: {mem['over_lane']}]" if mem.get("over_lane") else ""
        jobs.add_row(
            str(j["job_id"]), shown(j["owner"]), shown(j["name"]), shown(j["state"]),
            f"{j['iterations_done']}/{j['iterations_planned']}",
            f"{mean * 1e3:.2f}" if mean else "-",
            f"{j['device']}/{j['lane']}" if j["device"] is not None else "-",
            _size(mem["persistent_bytes"]),
            f"{_size(mem['ephemeral_measured_bytes'])}/{_size(mem['ephemeral_estimate_bytes'])}",
            _size(mem["lane_bytes"]),
            shown(f"{mem['persistent_limit']}/{mem['ephemeral_limit']}{over}"),
        )
    console.print(jobs)
    console.print("limits: 'enforced' is capped by the platform (CUDA memory fraction); "
                  "'accounted' is measured every call against the job's lane (CPU)")
