"""`salusd`: the daemon's command line."""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

from salus.daemon.cli import logs as cli_logs
from salus.daemon.cli import run as cli_run
from salus.daemon.cli.run import duration
from salus.daemon.limits import DEFAULT_PRIORITY
from salus.scheduler.policies import POLICIES

EPILOG = """\
examples:
  salusd run -- python train.py --epochs 3       # an unchanged script as a job, on this terminal
  salusd serve                                   # CPU devices (or every GPU), default socket
  salusd serve --cpu-devices 2 --cpu-memory 4G --policy srtf
  SALUS_ADDRESS=unix:///tmp/s.sock salusd serve  # clients find it through the same variable

  salusd status                                  # devices, lanes and jobs (REST, admin token)
  salusd top                                     # the same, live
  salusd submit train.py:make_job --iterations 1000   # a batch job from --job-root
  salusd suspend 3 --swap                        # job 3 leaves the device until `salusd resume 3`
  salusd logs 3 -f                               # what job 3 prints, until it ends
  salusd token add alice                         # a token for unix user alice's jobs

Training scripts connect with:
  import salus.adapters.torch as salus
  job = salus.connect(name="mlp", iterations=500)
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="salusd",
        description="salusd: one daemon per node that owns the accelerators and runs many "
        "jobs' training and inference iterations on them under an iteration scheduler.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve = sub.add_parser(
        "serve",
        help="run the daemon in the foreground",
        description="Run the daemon in the foreground until SIGTERM or Ctrl-C; running iterations "
        "finish before it exits.",
    )
    serve.add_argument("--socket", metavar="PATH",
                       help="unix socket for the data plane (default: $SALUS_ADDRESS, else "
                       "$XDG_RUNTIME_DIR/salusd/salusd.sock or ~/.local/state/salusd/salusd.sock)")
    serve.add_argument("--state-dir", metavar="DIR", type=Path, default=None,
                       help="where the daemon keeps its state (default: $XDG_RUNTIME_DIR/salusd or "
                       "~/.local/state/salusd)")
    serve.add_argument("--cpu-devices", metavar="N", type=int, default=None,
                       help="serve N CPU devices (the default when no GPU is found: 1)")
    serve.add_argument("--cpu-memory", metavar="SIZE", default=None,
                       help="memory budget per CPU device, e.g. 2G (default: a quarter of the "
                       "available memory split across devices, at most 8 GiB each)")
    serve.add_argument("--cpu-device-slowdown", metavar="SPEC", default=None,
                       help="SIMULATE slower CPU devices (heterogeneity for tests and "
                       "benchmarks): seed=N draws each device's compute factor from U[1, 2) "
                       "as Sky Computing's experiments did, or give one factor per CPU device, "
                       "e.g. 1,1.8; a device's executors sleep (factor - 1) x the CPU time of "
                       "each call")
    serve.add_argument("--gpu-memory-fraction", metavar="F", type=float, default=None,
                       help="each GPU's budget: this fraction of its memory that other "
                       "processes leave free at start (default 0.9)")
    serve.add_argument("--cpu-threads", metavar="N", type=int, default=None,
                       help="intra-op threads per torch op on CPU devices (default: half the "
                       "cores per CPU device, at least 1: lanes run in parallel and share them)")
    serve.add_argument("--policy", default=None, choices=list(POLICIES),
                       help="iteration scheduling policy (default: the one last switched to "
                       "live with `salusd policy`, kept in the state dir, else pack)")
    serve.add_argument("--group", metavar="NAME", default=None,
                       help="group that may use the socket (mode 0660)")
    serve.add_argument("--log-level", default="info",
                       choices=["debug", "info", "warning", "error"])
    serve.add_argument("--max-connections", metavar="N", type=int, default=1024,
                       help="clients served at once; one more is refused clearly (default 1024)")
    serve.add_argument("--frame-timeout", metavar="SECONDS", type=float, default=30.0,
                       help="a request must arrive whole within this time of its first byte "
                       "(default 30)")
    serve.add_argument("--cancel-grace", metavar="SECONDS", type=float, default=5.0,
                       help="a cancelled job's running call may finish within this time, then "
                       "its executor is killed (default 5)")
    serve.add_argument("--context-bytes", metavar="BYTES", type=int, default=None,
                       help="what a CUDA context costs each GPU, measured before (the GPU kit "
                       "measures it once for all its daemons); default: measured at start")
    serve.add_argument("--script-grace", metavar="SECONDS", type=float, default=30.0,
                       help="a cancelled script job's command gets SIGTERM, then SIGKILL after "
                       "this time, as Kubernetes' terminationGracePeriodSeconds (default 30)")
    serve.add_argument("--first-call", default="auto", choices=["auto", "estimate", "measure"],
                       help="size a job's lane from its first call estimated on fake tensors "
                       "before it runs, or admit the job with its persistent size as the guess "
                       "and measure the call (it is moved if it needs more); auto: estimate on "
                       "CUDA devices, measure on CPU devices (default auto)")
    serve.add_argument("--standby-executors", metavar="N", type=int, default=2,
                       help="executor processes kept forked and ready for new jobs (default 2)")
    serve.add_argument("--mps", action="store_true",
                       help="start an NVIDIA MPS control daemon per GPU, so that the lanes' "
                       "processes on a GPU run their kernels concurrently (a fatal fault in one "
                       "then reaches every process on that GPU; see docs/runtime.md)")
    serve.add_argument("--device-plugin", action="store_true",
                       help="serve the kubelet device plugin of salusd.io/gpu-mem: each GPU's "
                       "budget in GiB units that pods ask for (needs the k8s extra; "
                       "docs/kubernetes.md); on a host without GPUs it is not started")
    serve.add_argument("--kubelet-dir", metavar="DIR", type=Path, default=Path("/var/lib/kubelet"),
                       help="the kubelet's directory, holding device-plugins/ and "
                       "pod-resources/kubelet.sock (default /var/lib/kubelet)")
    serve.add_argument("--alloc-root", metavar="DIR", type=Path, default=None,
                       help="where the device plugin makes each allocation's directory, at the "
                       "same path on the host (default: alloc/ beside the socket)")
    serve.add_argument("--pod-user", metavar="NAME", default="nobody",
                       help="the unprivileged user that jobs arriving through a pod's "
                       "allocation socket run as; never root (default nobody)")
    serve.add_argument("--device-plugin-test-gpu", metavar="GPU-UUID=GIB", action="append",
                       default=[], help=argparse.SUPPRESS)  # tests without a GPU: device 0
    serve.add_argument("--isolation", choices=("lane", "job"), default="lane",
                       help="lane: the jobs of one owner placed in one lane share one executor "
                       "process (one CUDA context and allocator, the lane's memory); job: every "
                       "job keeps a process of its own (default lane)")
    serve.add_argument("--http", metavar="HOST:PORT", default="127.0.0.1:7077",
                       help="the REST API's address, or 'none' (default 127.0.0.1:7077; port 0 "
                       "picks a free port, written to <state-dir>/http.url)")
    serve.add_argument("--job-root", metavar="DIR", type=Path, default=None,
                       help="where REST batch jobs' entrypoint files live (default "
                       "<state-dir>/job-root)")
    serve.add_argument("--cache-dir", metavar="DIR", type=Path, default=None,
                       help="the data cache of jobs' salus.data.CachedDataset (level 1: raw "
                       "files on local disk, a folder per owner; default <state-dir>/cache)")
    serve.add_argument("--cache-bytes", metavar="SIZE", default="10G",
                       help="level 1's cap per replica, e.g. 50G (default 10G)")
    serve.add_argument("--cluster", metavar="HOST:PORT", default=None,
                       help="join a cluster of daemons whose rendezvous store is HOST:PORT "
                       "(node 0 hosts it), or `env` for torchrun's MASTER_ADDR, MASTER_PORT, "
                       "NNODES and NODE_RANK; multi-node gangs need it")
    serve.add_argument("--nodes", metavar="K", type=int, default=None,
                       help="nodes in the cluster (with --cluster)")
    serve.add_argument("--node-rank", metavar="R", type=int, default=None,
                       help="this node's rank in the cluster, 0 to K-1 (with --cluster)")
    serve.add_argument("--checkpoint-every", metavar="N", default="10m",
                       help="checkpoint each job every N iterations, or every DURATION of the "
                       "job's own run time with a unit: 90s, 10m (default 10m)")
    _control_commands(sub)
    cli_logs.add_parser(sub)
    cli_run.add_parser(sub)
    return parser


def _control_commands(sub: Any) -> None:
    """The operator's commands; they go through the REST API."""
    commands = (
        ("status", "show the devices, lanes and jobs"),
        ("top", "a live view of lanes, memory and jobs (Ctrl-C quits)"),
        ("submit", "submit a batch job: FILE.py:FUNCTION under the daemon's --job-root"),
        ("suspend", "stop scheduling a job at its next iteration boundary"),
        ("resume", "schedule a suspended job again"),
        ("cancel", "end a job at its next iteration boundary"),
        ("priority", "set a job's weight under the fair policy"),
        ("checkpoint", "write a job's checkpoint now"),
        ("policy", "show the scheduling policy, or switch it live"),
        ("token", "manage owner tokens (admin)"),
    )
    for name, text in commands:
        cmd = sub.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".")
        cmd.add_argument("--url", help="the REST API (default: $SALUS_URL, else the address "
                         "the daemon wrote in its state dir, else http://127.0.0.1:7077)")
        cmd.add_argument("--token", help="bearer token (default: $SALUS_TOKEN, else the admin "
                         "token in the state dir when readable)")
        cmd.add_argument("--state-dir", type=Path, default=None,
                         help="the daemon's state dir, to find its address and admin token")
        if name in ("status", "top"):
            ended = cmd.add_mutually_exclusive_group()
            ended.add_argument("--all", action="store_true", help="every ended job too, those "
                               "that ended before salusd's last restart included (default: "
                               "live jobs only)")
            ended.add_argument("--since", type=since, default=None,
                               metavar="DURATION|ISO-TIME",
                               help="the jobs that ended since then too: a duration back from "
                               "now (90s, 15m, 2h, 1d, [[D-]H:]M:S) or a date and time "
                               "(2026-11-29T08:00, local time unless it gives an offset)")
        if name == "status":
            cmd.add_argument("--json", action="store_true", help="print the raw JSON")
        elif name == "top":
            cmd.add_argument("--interval", type=float, default=1.0, help="seconds (default 1)")
            cmd.add_argument("--count", type=int, default=None,
                             help="stop after this many refreshes")
        elif name == "submit":
            cmd.add_argument("entrypoint", metavar="FILE.py:FUNCTION")
            # Checked by the daemon's REST models, with the shared checks (salusd/limits.py).
            cmd.add_argument("--iterations", type=int, required=True)
            cmd.add_argument("--name", help="the job's name (default: the function's)")
            cmd.add_argument("--priority", type=float, default=DEFAULT_PRIORITY)
            cmd.add_argument("--devices", type=int, default=1,
                             help="replicas, one per device: a data-parallel gang (default 1)")
            cmd.add_argument("--pipeline", action="store_true",
                             help="split the model into one stage per device and train it as "
                             "a GPipe pipeline (the entrypoint gives 'loss'; docs/pipeline.md)")
            cmd.add_argument("--placement", choices=["even", "sky", "optimal"], default=None,
                             help="how a pipeline's layers are split (default even)")
            cmd.add_argument("--microbatches", type=int, default=None,
                             help="micro-batches per pipeline step (default 1)")
            cmd.add_argument("--nodes", type=int, default=1,
                             help="nodes of the cluster the gang spans, --devices on each; "
                             "submit it to every node's salusd alike (default 1)")
            cmd.add_argument("--rendezvous", metavar="ID", default=None,
                             help="a multi-node gang's id, the same on every node and new for "
                             "each submission (default: the job's name)")
        elif name == "policy":
            cmd.add_argument("name", nargs="?", choices=list(POLICIES))
        elif name == "token":
            cmd.add_argument("action", choices=["add", "revoke", "list"])
            cmd.add_argument("name", nargs="?", help="the token's name")
            cmd.add_argument("--user", help="unix user its jobs run as (default: the name)")
        else:
            cmd.add_argument("job", type=int, help="the job id (as `salusd status` shows it)")
        if name == "suspend":
            cmd.add_argument("--swap", action="store_true", help="also move the job's state to "
                             "host memory so waiting jobs can use its device memory")
        if name == "priority":
            cmd.add_argument("value", type=float, help="the new weight (> 0; default is 1)")


def since(text: str, now: float | None = None) -> float:
    """`--since`: the unix time a duration before `now` (default: the current time) or an
    ISO 8601 date and time (naive: local time). A clock alone (`10:00`) is a duration, M:S, as
    `salusd run --time` reads it."""
    try:
        seconds = duration(text)
    except argparse.ArgumentTypeError:
        pass
    else:
        return max(0.0, (time.time() if now is None else now) - seconds)
    try:
        return max(0.0, datetime.datetime.fromisoformat(text).timestamp())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither a duration (90s, 15m, 2h, 1d, [[D-]H:]M:S) nor an ISO date "
            "and time (2026-11-29T08:00)") from None


def parse_every(text: str) -> tuple[int | None, float]:
    """`--checkpoint-every`: `500` iterations, or `90s` / `10m` / `1h` of job time."""
    text = text.strip().lower()
    units = {"s": 1.0, "m": 60.0, "h": 3600.0}
    if text and text[-1] in units:
        seconds = float(text[:-1]) * units[text[-1]]
        if not seconds > 0:
            raise ValueError(f"--checkpoint-every must be positive, got {text!r}")
        return None, seconds
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"--checkpoint-every wants iterations (500) or a duration (10m), got "
                         f"{text!r}")
    return int(text), float("inf")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if args.command == "serve":
        return serve(args)
    if args.command == "logs":
        return cli_logs.run(args)
    if args.command == "run":
        return cli_run.run(args)
    if args.command == "token" and args.action in ("add", "revoke") and not args.name:
        parser.error(f"token {args.action} needs the token's name")
    from salus.daemon.cli.rest import run

    return run(args)


def serve(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.logging import RichHandler

    handler: logging.Handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[%(asctime)s] %(levelname)-8s %(message)s",
                                           "%H:%M:%S"))
    if sys.stderr.isatty():
        handler = RichHandler(console=Console(stderr=True), show_path=False,
                              rich_tracebacks=False)
    # A file or the journal gets one line per event: Rich would wrap at 80 columns there.
    logging.basicConfig(level=args.log_level.upper(), format="%(message)s", datefmt="[%X]",
                        handlers=[handler])
    log = logging.getLogger("salusd")

    from salus.daemon.cluster import parse_cluster
    from salus.daemon.daemon import Daemon, DaemonConfig
    from salus.daemon.devices.discovery import (
        SAFETY_FRACTION,
        cpu_threads_default,
        discover,
        format_size,
        parse_size,
        with_cpu_slowdown,
    )
    from salus.daemon.wire.address import default_socket_path, default_state_dir, parse_listen

    try:
        memory = parse_size(args.cpu_memory) if args.cpu_memory else None
        devices = discover(args.cpu_devices, memory,
                           gpu_fraction=SAFETY_FRACTION if args.gpu_memory_fraction is None
                           else args.gpu_memory_fraction)
        if args.cpu_device_slowdown is not None:
            devices = with_cpu_slowdown(devices, args.cpu_device_slowdown)
        http = parse_listen(args.http)
        every, every_s = parse_every(args.checkpoint_every)
        cluster = parse_cluster(args.cluster, args.nodes, args.node_rank)
        cache_bytes = parse_size(args.cache_bytes)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    if args.device_plugin:
        try:
            import salus.daemon.k8s.plugin  # noqa: F401 - grpcio and protobuf are there
        except ImportError as exc:
            log.error("--device-plugin needs grpcio and protobuf: pip install 'salusd[k8s]' "
                      "(%s)", exc)
            return 2
    before, now = raise_descriptor_limit()
    if now != before:
        log.info("open files: soft limit raised from %d to %d", before, now)
    state_dir = args.state_dir or default_state_dir()
    socket_path = args.socket or default_socket_path()
    threads = args.cpu_threads or cpu_threads_default(len(devices))
    config = DaemonConfig(socket_path, devices, args.policy, threads=threads, group=args.group,
                          max_connections=args.max_connections,
                          frame_timeout_s=args.frame_timeout, cancel_grace_s=args.cancel_grace,
                          script_grace_s=args.script_grace, context_bytes=args.context_bytes,
                          standby_executors=args.standby_executors, state_dir=state_dir,
                          isolation=args.isolation, mps=args.mps,
                          http=http, job_root=args.job_root, checkpoint_every=every,
                          checkpoint_every_s=every_s, cluster=cluster,
                          cache_dir=args.cache_dir, cache_bytes=cache_bytes,
                          first_call=args.first_call, device_plugin=args.device_plugin,
                          kubelet_dir=args.kubelet_dir, alloc_root=args.alloc_root,
                          pod_user=args.pod_user,
                          device_plugin_test_gpus=tuple(args.device_plugin_test_gpu))
    try:
        daemon = Daemon(config)
        daemon.start()
    except (OSError, ValueError, RuntimeError) as exc:
        log.error("cannot start: %s", exc)
        return 1
    # Before it says it listens: a SIGTERM right after that line stops it cleanly.
    daemon.install_signal_handlers()
    if cluster is not None:
        log.info("cluster: %s", cluster.describe())
    for d in devices:
        log.info("device %d: %s (%s), budget %s%s", d.index, d.name, d.kind,
                 format_size(d.memory_bytes), "" if d.compute_slowdown == 1.0 else
                 f", SIMULATED compute slowdown x{d.compute_slowdown:.3g}")
    log.info("policy %s; %d intra-op thread(s) per job; state in %s; running as %s",
             daemon.policy, threads, state_dir,
             "root: each job runs as its owner" if os.geteuid() == 0 else
             "an ordinary user: jobs accepted from this user and root only")
    print(f"salusd listening on unix://{socket_path}", flush=True)
    if daemon.rest is not None:
        print(f"salusd REST API on {daemon.rest.url}", flush=True)
    daemon.run()
    return 0


def raise_descriptor_limit() -> tuple[int, int]:
    """Raise this process's soft limit of open files to its hard limit (the unit sets
    LimitNOFILE): every client, executor and REST connection holds descriptors, and a soft
    limit of 1024 or less runs out under load. Returns (the old soft limit, the new one)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        return soft, hard
    return soft, soft


if __name__ == "__main__":
    sys.exit(main())
