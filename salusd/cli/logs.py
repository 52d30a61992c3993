"""`salusd logs JOB [-f] [--tail BYTES]`: what a job printed, read over the unix socket as the
job's owner (root: any job's), from its output file in the daemon's state dir."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from salus.daemon.cli.control import Control
from salus.daemon.wire.address import format_address
from salus.daemon.wire.errors import SalusError

POLL_S = 0.5  # -f asks for more this often
DEFAULT_TAIL_BYTES = 64 << 10


def add_parser(sub: Any) -> None:
    text = "print what a job printed (its stdout and stderr)"
    cmd = sub.add_parser("logs", help=text, description=text[0].upper() + text[1:] + ".")
    cmd.add_argument("job", type=int, help="the job id (as `salusd status` shows it)")
    cmd.add_argument("-f", "--follow", action="store_true",
                     help="keep printing new lines until the job ends")
    cmd.add_argument("--tail", metavar="BYTES", type=int, default=DEFAULT_TAIL_BYTES,
                     help="start this many bytes before the end of the output (default 65536)")
    cmd.add_argument("--socket", metavar="PATH", default=None,
                     help="the daemon's socket (default: $SALUS_ADDRESS, else the default path)")


def run(args: argparse.Namespace) -> int:
    try:
        with Control(None if args.socket is None else format_address(args.socket)) as ctl:
            follow(ctl, str(args.job), max(0, args.tail), args.follow)
    except SalusError as exc:
        print(f"salusd logs: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


def follow(ctl: Control, job: str, tail: int, keep_on: bool) -> None:
    """Print the job's output from `tail` bytes before its end; with `keep_on`, then what it
    prints until it ends (asking every POLL_S seconds)."""
    offset = max(0, ctl.logs(job)["offset"] - tail)
    while True:
        part = ctl.logs(job, offset)
        sys.stdout.write(part["text"])
        sys.stdout.flush()
        moved = part["offset"] != offset
        offset = part["offset"]
        if moved:
            continue
        if part["ended"] or not keep_on:
            return
        time.sleep(POLL_S)
