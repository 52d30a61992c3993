"""`torchrun` (`python -m torch.distributed.run`) as a script job's command: a gang of ranks.

torchrun starts `--nproc-per-node` copies of a training script on one node, each with its rank
in its environment, and they meet in `init_process_group` (env:// rendezvous, rank 0 hosting
the store on `MASTER_ADDR:MASTER_PORT`). salusd does the same with its own executors instead of
torchrun's agent: `salusd run --devices N -- torchrun --nproc_per_node N train.py` is one gang
job whose replica r runs `python train.py` as rank r, on its own device, with the variables
torchrun's agent gives a worker (`rank_env`). This module reads the launcher's command line;
options that need torchrun's agent (several nodes, elastic rendezvous, its restarts, its log
redirection) are refused with one line saying so. It never imports torch: `salusd run` and the
daemon both read a command with it.
"""

from __future__ import annotations

import argparse
import os
import uuid
from dataclasses import dataclass
from typing import NoReturn

MODULE = "torch.distributed.run"  # what the `torchrun` console script runs
MAX_RANKS = 1024
DEFAULT_ADDR = "127.0.0.1"


@dataclass(frozen=True)
class Launch:
    """What torchrun was asked to run: `nproc` ranks on this node, each running its
    interpreter with `argv` (`SCRIPT ARGS` or `-m MODULE ARGS`); the store's address and port
    (`master_port` None: a free port, chosen when the gang starts); torchrun's role name and
    run id (None: `none`, torchrun's for a given `--master-port`)."""

    nproc: int
    argv: tuple[str, ...]
    master_addr: str = DEFAULT_ADDR
    master_port: int | None = None
    role: str = "default"
    run_id: str | None = None

    def rank_env(self, rank: int, port: int, env: dict[str, str]) -> dict[str, str]:
        """The variables torchrun's agent sets for worker `rank` of one node (its
        `LocalElasticAgent._start_workers`), `port` the store's port; `env` is the caller's
        environment, whose `OMP_NUM_THREADS` and `TORCH_NCCL_ASYNC_ERROR_HANDLING` are kept
        (torchrun sets them to 1 where the caller did not)."""
        size = str(self.nproc)
        out = {"RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0",
               "ROLE_RANK": str(rank), "ROLE_NAME": self.role, "WORLD_SIZE": size,
               "LOCAL_WORLD_SIZE": size, "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": size,
               "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(port),
               "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
               "TORCHELASTIC_RUN_ID": self.run_id or "none",
               # rank 0 hosts the store (env:// rendezvous), as no agent does
               "TORCHELASTIC_USE_AGENT_STORE": "False",
               "TORCH_NCCL_ASYNC_ERROR_HANDLING": env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING",
                                                          "1")}
        if "OMP_NUM_THREADS" not in env and self.nproc > 1:
            out["OMP_NUM_THREADS"] = "1"
        return out


def is_launcher(command: list[str] | tuple[str, ...]) -> bool:
    """Whether `command` runs torchrun: `torchrun ...` or `python -m torch.distributed.run`."""
    return (bool(command) and os.path.basename(command[0]) == "torchrun"
            or list(command[1:3]) == ["-m", MODULE])


def parse(command: list[str] | tuple[str, ...]) -> Launch | None:
    """The launch `command` asks for (`python -m torch.distributed.run OPTIONS SCRIPT ARGS`),
    or None when it is no torchrun command; ValueError, in one line, for an option salusd
    cannot honour, or for `torchrun` given by name (the interpreter it runs must be known:
    `salusd run` finds it, see `interpreter_of`)."""
    if not is_launcher(command):
        return None
    if list(command[1:3]) != ["-m", MODULE]:
        raise ValueError(f"give torchrun as `python -m {MODULE} ...` (salusd runs each rank "
                         "in torchrun's interpreter, which it must be told)")
    args = _parser().parse_args(list(command[3:]))
    for option, value in (("--rdzv-backend", args.rdzv_backend),
                          ("--rdzv-endpoint", args.rdzv_endpoint), ("--rdzv-id", args.rdzv_id),
                          ("--rdzv-conf", args.rdzv_conf)):
        if value is not None:
            raise ValueError(f"torchrun's {option} is not supported: salusd starts the ranks "
                             "itself on this node (use --standalone, or --master-port)")
    if not _one_node(args.nnodes):
        raise ValueError(f"torchrun --nnodes {args.nnodes}: salusd runs a torchrun gang on "
                         "this node only (--nnodes 1)")
    if args.node_rank != 0:
        raise ValueError(f"torchrun --node-rank {args.node_rank}: salusd runs a torchrun "
                         "gang on this node only (--node-rank 0)")
    if args.max_restarts:
        raise ValueError("torchrun's --max-restarts is not supported: salusd does not rerun "
                         "a torchrun gang")
    for name in ("no_python", "log_dir", "redirects", "tee", "local_ranks_filter",
                 "logs_specs", "local_addr", "numa_binding", "event_log_handler",
                 "virtual_local_rank"):
        if getattr(args, name) not in (None, False):
            option = "--" + name.replace("_", "-")
            raise ValueError(f"torchrun's {option} is not supported by salusd run (each "
                             "rank's output goes to this terminal; one rank per device)")
    nproc = _nproc(args.nproc_per_node)
    if not args.script:
        raise ValueError(f"torchrun was given no training script: python -m {MODULE} "
                         "--nproc-per-node N SCRIPT [ARGS...]")
    script, rest = args.script[0], tuple(args.script[1:])
    argv = ("-m", script, *rest) if args.module else (script, *rest)
    # torchrun's: a fresh id for its one-node rendezvous, "none" for a static one on a port
    run_id = None if args.master_port is not None and not args.standalone else str(
        uuid.uuid4())
    return Launch(nproc, argv, args.master_addr or DEFAULT_ADDR, args.master_port, args.role,
                  run_id)


def interpreter_of(torchrun: str) -> str:
    """The Python interpreter the `torchrun` console script at `torchrun` runs, from its
    first line (`#!/path/python`, `#!/usr/bin/env python3`, or pip's `/bin/sh` wrapper for a
    long path); ValueError when it cannot be told."""
    try:
        with open(torchrun, "rb") as f:
            head = f.read(4096).decode("utf-8", "replace").splitlines()
    except OSError as exc:
        raise ValueError(f"{torchrun}: {exc.strerror}") from None
    first = head[0] if head else ""
    words = first[2:].split() if first.startswith("#!") else []
    if words and os.path.basename(words[0]) == "env" and len(words) > 1:
        return words[1]
    if words and os.path.basename(words[0]) in ("sh", "bash") and len(head) > 1:
        wrapped = head[1].split('"')  # '''exec' "/long/path/python" "$0" "$@"
        if head[1].startswith("'''exec'") and len(wrapped) > 1:
            return wrapped[1]
    if words and "python" in os.path.basename(words[0]):
        return words[0]
    raise ValueError(f"cannot tell which Python {torchrun} runs; run `python -m {MODULE} "
                     "...` with that interpreter instead")


def _one_node(nnodes: str) -> bool:
    return all(part.strip() == "1" for part in nnodes.split(":")) and nnodes.count(":") <= 1


def _nproc(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= MAX_RANKS:
        raise ValueError(f"torchrun --nproc-per-node {text!r}: salusd needs the number of "
                         f"ranks, 1 to {MAX_RANKS} (one per device: salusd run --devices N)")
    return int(text)


class _Parser(argparse.ArgumentParser):
    """torchrun's options; an error is a ValueError, not an exit."""

    def error(self, message: str) -> NoReturn:
        raise ValueError(f"torchrun: {message}")


def _parser() -> _Parser:
    """The options of `torch.distributed.run` (torch 2.x), in both of torchrun's spellings."""
    p = _Parser(prog="torchrun", add_help=False)

    def names(name: str, *short: str) -> list[str]:
        return [*short, "--" + name.replace("_", "-"), "--" + name]

    p.add_argument("--nnodes", default="1")
    p.add_argument(*names("nproc_per_node"), default="1")
    p.add_argument(*names("redirects"), "-r", default=None)
    p.add_argument(*names("tee"), "-t", default=None)
    for name in ("rdzv_backend", "rdzv_endpoint", "rdzv_id", "rdzv_conf", "start_method",
                 "log_dir", "local_ranks_filter", "logs_specs", "local_addr",
                 "event_log_handler", "numa_binding", "signals_to_handle",
                 "duplicate_stdout_filters", "duplicate_stderr_filters", "master_addr"):
        p.add_argument(*names(name), default=None)
    p.add_argument(*names("role"), default="default")
    p.add_argument(*names("max_restarts"), type=int, default=0)
    p.add_argument(*names("monitor_interval"), type=float, default=0.1)  # nothing to poll
    p.add_argument(*names("shutdown_timeout"), type=int, default=None)
    p.add_argument(*names("node_rank"), type=int, default=0)
    p.add_argument(*names("master_port"), type=int, default=None)
    p.add_argument("--standalone", action="store_true")
    p.add_argument("-m", "--module", action="store_true")
    for name in ("no_python", "run_path", "virtual_local_rank"):
        p.add_argument(*names(name), action="store_true")
    p.add_argument("script", nargs=argparse.REMAINDER)
    return p
