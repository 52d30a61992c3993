"""`make demo`: start the daemon on the CPU, run three training jobs and one inference job from
separate client processes at once, and compare the makespan with running them one after another
without the daemon."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from salus.daemon.launch import running_daemon
from salus.demo.jobs import DEMO_JOBS, WORKLOADS, launch, run_direct

console = Console(width=max(100, Console().width))


def main() -> None:
    policy = sys.argv[1] if len(sys.argv) > 1 else "pack"
    with tempfile.TemporaryDirectory(prefix="salusd-demo-") as tmp:
        socket = Path(tmp) / "salusd.sock"
        log_file = Path(tmp) / "salusd.log"
        console.rule(f"salusd demo: 3 training jobs + 1 inference job, policy {policy}")
        console.print("starting salusd on the CPU ...")
        with running_daemon(socket, state_dir=Path(tmp) / "state", policy=policy,
                            log_file=log_file, log_level="info") as daemon:
            console.print("running 4 client processes at once through the daemon ...")
            results = launch(list(DEMO_JOBS), daemon.address)
        console.print("running the same 4 jobs one after another without the daemon ...")
        direct = [run_direct(WORKLOADS[n]) for n in DEMO_JOBS]

    table = Table(title="jobs through salusd")
    for col in ("job", "kind", "iters", "JCT s", "mean iter ms", "dev/lane", "final loss",
                "direct loss"):
        table.add_column(col, justify="left" if col in ("job", "kind") else "right")
    for r, d in zip(results, direct, strict=True):
        mean = r["mean_iteration_s"]
        table.add_row(
            r["name"], r["kind"], str(r["iterations"]), f"{r['seconds']:.2f}",
            f"{mean * 1e3:.2f}" if mean else "-", f"{r['device']}/{r['lane']}",
            f"{r['final_loss']:.4f}" if r["final_loss"] is not None else "-",
            f"{d['final_loss']:.4f}" if d["final_loss"] is not None else "-",
        )
    console.print(table)
    makespan = max(r["end_wall"] for r in results) - min(r["start_wall"] for r in results)
    sequential = sum(d["seconds"] for d in direct)
    console.print(
        f"makespan through salusd ({policy}): {makespan:.2f} s; one after another without the "
        f"daemon: {sequential:.2f} s; ratio {makespan / sequential:.2f}x "
        f"({os.cpu_count()} CPU cores: the four lanes run in parallel and share them, while "
        f"each job alone gets every core; on a GPU the lanes overlap on the device)"
    )


if __name__ == "__main__":
    main()
