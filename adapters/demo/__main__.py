"""`make demo`: what salusd is for, measured on this machine in one run.

One CPU daemon serves every part; its policy is switched live between them (`PUT /v1/policy`).
1. Four unchanged training scripts (`train.py`), started at once as plain processes and with
   `salusd run` under `pack` (executors forked warm from a zygote that imported torch), then
   one after another as plain processes against `salusd run` under `fifo` and `srtf`: each
   job's completion time (JCT), start-up included, and its final loss.
2. N resident training jobs: their memory (PSS) in the daemon against N plain processes.
3. A priority-10 inference job's latency alone and beside a training script, under `fair`,
   against the same two as plain processes.
4. A PNG of which job held each lane during the daemon's parts, sampled from its status.

    python -m salus.demo [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from salus.daemon.cli.launch import running_daemon
from salus.daemon.devices.discovery import cpu_threads_default
from salus.daemon.rest.client import RestClient
from salus.demo import latency
from salus.demo.scripts import (
    STAGGER_S,
    Ended,
    Resident,
    ScriptJob,
    at_once,
    group_memory,
    one_after_another,
    tree,
)
from salus.demo.timeline import LaneSampler, plot

console = Console(width=max(100, Console().width))
MIB = 1 << 20
JOBS = (ScriptJob("mlp-sgd", 120), ScriptJob("cnn-adam", 45), ScriptJob("mlp-adam", 30),
        ScriptJob("small-mlp", 20))
RESIDENT = ScriptJob("mlp-adam", 5)
BESIDE = ScriptJob("mlp-sgd", 150)
SAMPLE_S = 0.05


def _say(text: str) -> None:
    console.print(f"[dim]{time.strftime('%H:%M:%S')}[/dim] {text}")


def _switch(rest: RestClient, policy: str) -> None:
    """Switch the daemon's policy live and wait until it has taken effect."""
    rest.call("PUT", "/v1/policy", {"policy": policy})
    deadline = time.monotonic() + 30
    while (now := rest.get("/v1/policy"))["policy"] != policy or now["pending"]:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the daemon did not switch to {policy}: {now}")
        time.sleep(0.05)


def _scaled(jobs: tuple[ScriptJob, ...], quick: bool) -> list[ScriptJob]:
    return [ScriptJob(j.name, max(2, j.iterations // 10) if quick else j.iterations)
            for j in jobs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="two of the scripts with a tenth of their steps, 2 resident jobs, "
                        "20 inference calls: checks that every part runs (its figures mean "
                        "little)")
    parser.add_argument("--out", type=Path, default=Path("out/demo"),
                        help="folder for the timeline plot (default: out/demo)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    jobs = _scaled(JOBS[:2] if args.quick else JOBS, args.quick)
    resident_count = 2 if args.quick else 4
    calls = 20 if args.quick else 150
    beside_job = _scaled((BESIDE,), args.quick)[0]
    threads = cpu_threads_default(1)
    torch.set_num_threads(threads)

    console.rule("salusd demo: unchanged training scripts, scheduling, memory, priority")
    console.print(
        f"{os.cpu_count()} CPU cores; every job runs torch with {threads} intra-op thread(s) "
        f"(the daemon's default: half the cores per lane; plain processes get OMP_NUM_THREADS="
        f"{threads}). Times are wall-clock seconds on this machine, all measured in this run; "
        f"load average at the start {os.getloadavg()[0]:.2f} (other work shares the cores).")
    with tempfile.TemporaryDirectory(prefix="salusd-demo-") as tmp:
        socket = Path(tmp) / "salusd.sock"
        state = Path(tmp) / "state"
        _say("starting salusd on the CPU (its executor zygote imports torch once) ...")
        with running_daemon(socket, state_dir=state, policy="pack",
                            log_file=Path(tmp) / "salusd.log", log_level="info") as daemon:
            rest = RestClient((state / "http.url").read_text().strip(),
                              (state / "admin.token").read_text().strip())
            with rest, LaneSampler(daemon.address, SAMPLE_S) as lanes:
                runs, memory, lat = _run_parts(daemon.address, daemon.pid, socket, rest, lanes,
                                               jobs, resident_count, calls, beside_job, threads)
    plot_path = args.out / "lanes.png"
    plot(lanes.drawn(), plot_path, SAMPLE_S)
    _report(jobs, runs, memory, lat, resident_count, plot_path)


Runs = dict[str, list[Ended]]
Memory = dict[str, tuple[int, int]]


def _run_parts(address: str, daemon_pid: int, socket: Path, rest: RestClient,
               lanes: LaneSampler, jobs: list[ScriptJob], resident_count: int, calls: int,
               beside_job: ScriptJob, threads: int,
               ) -> tuple[Runs, Memory, dict[str, latency.Latency]]:
    names = ", ".join(f"{j.name} ({j.iterations} steps)" for j in jobs)
    runs: Runs = {}
    _say(f"{len(jobs)} scripts at once as plain processes: {names} ...")
    runs["plain, at once"] = at_once(jobs, None, threads)
    _say(f"the same {len(jobs)} at once with `salusd run` (policy pack) ...")
    lanes.phase(f"pack: {len(jobs)} scripts at once with salusd run (a lane each, in parallel)")
    runs["salusd, pack"] = at_once(jobs, socket, threads)
    lanes.pause()
    _say("the same scripts one after another as plain processes ...")
    runs["plain, in turn"] = one_after_another(jobs, threads)
    for policy, what in (("fifo", "oldest first, each to its end"),
                         ("srtf", "shortest remaining time first, at every step")):
        _say(f"policy switched live to {policy}; the {len(jobs)} scripts at once with "
             f"`salusd run` ...")
        _switch(rest, policy)
        lanes.phase(f"{policy}: the same {len(jobs)} scripts, one lane ({what})")
        runs[f"salusd, {policy}"] = at_once(jobs, socket, threads)
        lanes.pause()

    _switch(rest, "pack")
    memory: Memory = {}
    _say(f"{resident_count} resident {RESIDENT.name} jobs with `salusd run`, memory read ...")
    with Resident(RESIDENT, resident_count, socket, threads) as group:
        memory["salusd daemon, zygote, executors"] = group_memory(tree(daemon_pid))
        memory["salusd run clients"] = group_memory(group.clients)
    _say(f"{resident_count} resident {RESIDENT.name} jobs as plain processes, memory read ...")
    with Resident(RESIDENT, resident_count, None, threads) as group:
        memory["plain processes"] = group_memory(group.pids)

    _switch(rest, "fair")
    _say(f"inference (priority {latency.PRIORITY:g}) alone, then beside {beside_job.name} "
         f"through salusd (policy fair) ...")
    lanes.phase(f"fair: inference job (priority {latency.PRIORITY:g}) beside a training script")
    lat = {"salusd": latency.through_salusd(address, socket, beside_job, calls, threads)}
    lanes.pause()
    _say("the same as plain processes ...")
    lat["plain"] = latency.plain(beside_job, calls, threads)
    return runs, memory, lat


def _mean(ended: list[Ended]) -> float:
    return statistics.mean(e.jct_s for e in ended)


def _report(jobs: list[ScriptJob], runs: Runs, memory: Memory,
            lat: dict[str, latency.Latency], resident_count: int, plot_path: Path) -> None:
    order = ("plain, in turn", "salusd, fifo", "salusd, srtf", "plain, at once", "salusd, pack")
    table = Table(title="JCT of each script, seconds from the batch's start to its command's "
                  "exit (start-up included)")
    table.add_column("job", no_wrap=True)
    table.add_column("steps", justify="right")
    for name in order:
        table.add_column(name, justify="right")
    table.add_column("final loss", justify="right")
    table.add_column("salusd's = plain", justify="right")
    for i, job in enumerate(jobs):
        plain = runs["plain, in turn"][i].final_loss
        same = all(runs[r][i].final_loss == plain for r in order)
        table.add_row(job.name, str(job.iterations),
                      *(f"{runs[r][i].jct_s:.2f}" for r in order),
                      "-" if plain is None else f"{plain:.6f}", "yes" if same else "NO")
    table.add_row("mean JCT", "", *(f"{_mean(runs[r]):.2f}" for r in order), "", "",
                  style="bold")
    table.add_row("makespan", "", *(f"{max(e.jct_s for e in runs[r]):.2f}" for r in order),
                  "", "", style="bold")
    console.print(table)
    console.print(
        "[dim]in turn / fifo / srtf: one job runs at a time; at once / pack: all of them share "
        f"the cores. Each batch started its commands {STAGGER_S} s apart in this order (in "
        "turn: each when the one before exited); the daemon was already running (its start is "
        "not counted). Losses compared bitwise, all five runs. While salusd ran, the demo "
        f"asked it for its lane table {1 / SAMPLE_S:.0f} times a second for the plot: that "
        "cost is in its figures.[/dim]")

    mem = Table(title=f"memory of {resident_count} resident {RESIDENT.name} jobs (trained, "
                "model and Adam state alive), MiB")
    for col in ("processes", "PSS", "RSS summed"):
        mem.add_column(col, justify="left" if col == "processes" else "right")
    for name, (pss, rss) in memory.items():
        mem.add_row(name, f"{pss / MIB:.0f}", f"{rss / MIB:.0f}")
    salusd_pss = (memory["salusd daemon, zygote, executors"][0]
                  + memory["salusd run clients"][0])
    mem.add_row("salusd, all of it", f"{salusd_pss / MIB:.0f}", "", style="bold")
    console.print(mem)
    console.print(
        "[dim]PSS (proportional set size, /proc/PID/smaps_rollup) splits pages shared between "
        "processes among them, so a group's sum is what it costs the machine; executors share "
        "torch's pages with the zygote they were forked from. RSS sums count shared pages "
        "once per process. The daemon's group includes its idle pre-started executors.[/dim]")

    lt = Table(title=f"inference ({latency.INFERENCE}, one batch every "
               f"{latency.GAP_S * 1e3:.0f} ms), milliseconds per call at the caller")
    for col in ("", "p50 alone", "p99 alone", "p50 beside training", "p99 beside training",
                "calls beside", "training, step 1 to exit"):
        lt.add_column(col, justify="left" if not col else "right")
    for name, label in (("salusd", f"salusd, fair, priority {latency.PRIORITY:g}"),
                        ("plain", "plain processes")):
        r = lat[name]
        beside = ([f"{latency.median(r.beside) * 1e3:.2f}",
                   f"{latency.percentile(r.beside, 99) * 1e3:.2f}"] if r.beside else ["-", "-"])
        lt.add_row(label, f"{latency.median(r.alone) * 1e3:.2f}",
                   f"{latency.percentile(r.alone, 99) * 1e3:.2f}", *beside,
                   str(len(r.beside)), f"{r.training_s:.2f} s")
    console.print(lt)
    _summary(runs, memory, lat, resident_count, plot_path)


def _ratio(a: float, b: float, better: str, worse: str) -> str:
    """`a` against `b` in words: 'N.NNx better' when a < b."""
    return f"{b / a:.2f}x {better}" if a < b else f"{a / b:.2f}x {worse}"


def _summary(runs: Runs, memory: Memory, lat: dict[str, latency.Latency],
             resident_count: int, plot_path: Path) -> None:
    ended = {r: max(e.jct_s for e in runs[r]) for r in runs}  # each batch's makespan
    pack, crowd = ended["salusd, pack"], ended["plain, at once"]
    turn, fifo, srtf = (_mean(runs[r]) for r in ("plain, in turn", "salusd, fifo",
                                                 "salusd, srtf"))
    in_turn = [e.jct_s for e in runs["plain, in turn"]]
    own = [b - a for a, b in zip([0.0, *in_turn], in_turn, strict=False)]
    short = own.index(min(own))  # the job that took least time of its own, run alone
    salusd_pss = sum(memory[k][0] for k in ("salusd daemon, zygote, executors",
                                            "salusd run clients"))
    plain_pss = memory["plain processes"][0]
    s, p = lat["salusd"], lat["plain"]
    console.rule("what this run measured")
    shortest = runs["plain, in turn"][short].name
    lines = [
        f"warm start: the {len(in_turn)} scripts at once all ended by {pack:.2f} s with `salusd "
        f"run` (pack) against {crowd:.2f} s as plain processes "
        f"({_ratio(pack, crowd, 'sooner', 'later')}): each plain process imports torch "
        f"itself, each executor was forked with it imported. One at a time under fifo they "
        f"all ended by {ended['salusd, fifo']:.2f} s.",
        f"scheduling, one job at a time: mean JCT {turn:.2f} s for plain processes in turn, "
        f"{fifo:.2f} s under fifo, {srtf:.2f} s under srtf; the shortest job, {shortest}, "
        f"ended at {runs['plain, in turn'][short].jct_s:.2f} s in turn, "
        f"{runs['salusd, fifo'][short].jct_s:.2f} s under fifo and "
        f"{runs['salusd, srtf'][short].jct_s:.2f} s under srtf.",
        f"memory: {resident_count} resident jobs cost {salusd_pss / MIB:.0f} MiB PSS in salusd "
        f"(daemon, executors and clients) against {plain_pss / MIB:.0f} MiB as plain "
        f"processes ({_ratio(salusd_pss, plain_pss, 'less', 'more')}).",
        f"priority: inference p99 {latency.percentile(s.beside, 99) * 1e3:.1f} ms beside "
        f"training through salusd (alone {latency.percentile(s.alone, 99) * 1e3:.1f} ms), "
        f"{latency.percentile(p.beside, 99) * 1e3:.1f} ms as plain processes (alone "
        f"{latency.percentile(p.alone, 99) * 1e3:.1f} ms): under fair the inference calls and "
        f"the training steps take turns in one lane, a call waiting for the step in progress, "
        f"while the OS ran the two plain processes side by side on the {os.cpu_count()} cores."
        if s.beside and p.beside else "priority: no inference call overlapped the training.",
        "final losses: every script's loss under salusd equals its plain run's "
        "(bitwise)." if all(
            e.final_loss == t.final_loss for r in runs.values()
            for e, t in zip(r, runs["plain, in turn"], strict=True))
        else "final losses: some differ from the plain runs (see the table).",
        f"timeline of who held each lane: {plot_path.resolve()}",
        "on a GPU (not measured here): a plain process also pays for its CUDA context "
        "(start-up time and device memory per process), which warm executors and one executor "
        "per owner and lane save; lanes overlap on the device instead of sharing CPU cores; "
        "and kernels of separate processes time-slice the device, where salusd hands a "
        "priority job the device at the next iteration boundary. bench/gpu/run.sh measures "
        "these on a GPU.",
    ]
    for line in lines:
        console.print(f"- {line}")


if __name__ == "__main__":
    main()
