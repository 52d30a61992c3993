"""`salusd run -- python train.py`: unchanged scripts as jobs of a real daemon.

Every expected value comes from running the same script directly (`OMP_NUM_THREADS=1`; the
daemon runs one intra-op thread per job): five public example scripts (`tests/examples/`, copies
of pytorch/examples) end with bit-equal parameters, alone and two at once under `fair`; output,
exit statuses, Ctrl-C, stdin, forks and scheduling commands behave as in a direct run.
"""

from __future__ import annotations

import argparse
import grp
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from daemon_proc import salusd, wait_until

from salus.daemon.cli.control import Control

EXAMPLES = Path(__file__).parent / "examples"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
TIMEOUT_S = 120


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One CPU device under `fair`: jobs that run at once share its one lane."""
    tmp = tmp_path_factory.mktemp("salusd")
    with salusd(tmp, "--policy", "fair", devices=1, memory="2G") as (_, address):
        yield address


def salusd_run(address: str, argv: list[str], cwd: Path, *options: str,
               **popen: Any) -> subprocess.Popen[str]:
    """`salusd run [options] -- python ARGV...` in `cwd` (the test's interpreter, as the
    caller's shell would find it)."""
    return subprocess.Popen(
        [sys.executable, "-m", "salus.daemon.cli", "run", "--socket",
         address.removeprefix("unix://"), *options, "--", sys.executable, *argv],
        cwd=cwd, text=True, **{"env": ENV, **popen})


def direct(argv: list[str], cwd: Path, **popen: Any) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, *argv], cwd=cwd, text=True,
                            **{"env": ENV, **popen})


def finish(proc: subprocess.Popen[str], stdin: str | None = None) -> tuple[int, str, str]:
    out, err = proc.communicate(stdin, timeout=TIMEOUT_S)
    return proc.returncode, out or "", err or ""


# ---- five public examples ---------------------------------------------------------------------
def write_data(cwd: Path) -> None:
    """Synthetic, seeded data in the formats the examples read: Cora's two files (for gcn,
    gat) and a word-level corpus (for word_language_model)."""
    rng = np.random.default_rng(0)
    (cwd / "cora").mkdir()
    nodes, features, classes = 1700, 32, 7
    with open(cwd / "cora" / "cora.content", "w") as f:
        for i in range(nodes):
            bits = " ".join(map(str, rng.integers(0, 2, features)))
            f.write(f"{1000 + i} {bits} class{rng.integers(0, classes)}\n")
    with open(cwd / "cora" / "cora.cites", "w") as f:
        for a, b in rng.integers(0, nodes, (4000, 2)):
            f.write(f"{1000 + a} {1000 + b}\n")
    (cwd / "corpus").mkdir()
    words = [f"w{i}" for i in range(60)]
    for name, lines in (("train", 120), ("valid", 30), ("test", 30)):
        with open(cwd / "corpus" / f"{name}.txt", "w") as f:
            for _ in range(lines):
                f.write(" ".join(rng.choice(words, rng.integers(3, 12))) + "\n")


STATE = str(EXAMPLES / "run_saving_state.py")
# name: (arguments after `python`, the files it saves that are compared)
CASES: dict[str, tuple[list[str], list[str]]] = {
    "mnist": ([str(EXAMPLES / "mnist" / "main.py"), "--epochs", "1", "--save-model",
               "--no-accel", "--log-interval", "2"], ["mnist_cnn.pt"]),
    "mnist_rnn": ([str(EXAMPLES / "mnist_rnn" / "main.py"), "--epochs", "1", "--save-model",
                   "--log-interval", "2"], ["mnist_rnn.pt"]),
    # No optimizer (it steps its parameters by hand): one iteration, the whole script.
    "word_language_model": ([STATE, "state.pt", str(EXAMPLES / "word_language_model" /
                                                    "main.py"),
                             "--data", "corpus", "--epochs", "1", "--emsize", "16", "--nhid",
                             "16", "--nlayers", "1", "--bptt", "8", "--batch_size", "4",
                             "--save", "model.pt"], ["state.pt"]),
    "gcn": ([STATE, "state.pt", str(EXAMPLES / "gcn" / "main.py"), "--epochs", "10",
             "--no-accel"], ["state.pt"]),
    "gat": ([STATE, "state.pt", str(EXAMPLES / "gat" / "main.py"), "--epochs", "2",
             "--hidden-dim", "8", "--num-heads", "2", "--no-accel"], ["state.pt"]),
}


def saved(cwd: Path, names: list[str]) -> dict[str, Any]:
    return {name: torch.load(cwd / name, weights_only=True) for name in names}


def assert_equal(got: Any, want: Any, where: str = "") -> None:
    """Every tensor bit-equal (max difference 0) and everything else equal."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), where
        for key in want:
            assert_equal(got[key], want[key], f"{where}/{key}")
    elif isinstance(want, list | tuple):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_equal(g, w, f"{where}[{i}]")
    elif isinstance(want, torch.Tensor):
        assert torch.equal(got, want), f"{where}: max difference {(got - want).abs().max()}"
    else:
        assert got == want, where


@pytest.fixture(scope="module")
def expected(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """What each example saves when run directly (two at a time: the machine has 2 cores)."""
    results: dict[str, dict[str, Any]] = {}
    names = list(CASES)
    for pair in (names[i:i + 2] for i in range(0, len(names), 2)):
        runs = {}
        for name in pair:
            cwd = tmp_path_factory.mktemp(f"direct-{name}")
            write_data(cwd)
            runs[name] = (cwd, direct(CASES[name][0], cwd, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE))
        for name, (cwd, proc) in runs.items():
            code, _, err = finish(proc)
            assert code == 0, err
            results[name] = saved(cwd, CASES[name][1])
    return results


@pytest.mark.slow
def test_five_public_examples_end_bit_equal_to_their_direct_runs(
        daemon: str, expected: dict[str, dict[str, Any]], tmp_path: Path) -> None:
    for name, (argv, files) in CASES.items():
        cwd = tmp_path / name
        cwd.mkdir()
        write_data(cwd)
        code, _, err = finish(salusd_run(daemon, argv, cwd, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.PIPE))
        assert code == 0, f"{name}: {err}"
        assert_equal(saved(cwd, files), expected[name], name)


@pytest.mark.slow
def test_two_examples_at_once_under_fair_share_the_lane_and_equal_their_direct_runs(
        daemon: str, expected: dict[str, dict[str, Any]], tmp_path: Path) -> None:
    runs = {}
    for name in ("mnist", "gcn"):
        cwd = tmp_path / name
        cwd.mkdir()
        write_data(cwd)
        runs[name] = (cwd, salusd_run(daemon, CASES[name][0], cwd, "--name", name,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    with Control(daemon) as ctl:
        placed = in_one_lane(ctl, {name: proc for name, (_, proc) in runs.items()})
    assert any(len(p) == 1 for p in placed), placed  # both in one lane at once
    for name, (cwd, proc) in runs.items():
        code, _, err = finish(proc)
        assert code == 0, f"{name}: {err}"
        assert_equal(saved(cwd, CASES[name][1]), expected[name], name)


def in_one_lane(ctl: Control,
                procs: dict[str, subprocess.Popen[str]]) -> list[set[tuple[int, int]]]:
    """Where the jobs named as `procs`' keys were (device, lane), each time all were placed,
    until a time they were all in one lane or a process ended."""
    placed: list[set[tuple[int, int]]] = []
    while (all(proc.poll() is None for proc in procs.values())
           and not any(len(p) == 1 for p in placed)):
        jobs = [j for j in ctl.status()["jobs"] if j["name"] in procs]
        if len(jobs) == len(procs) and all(j["lane"] is not None for j in jobs):
            placed.append({(j["device"], j["lane"]) for j in jobs})
        time.sleep(0.05)
    return placed


# ---- frameworks: Lightning and Hugging Face Trainer -------------------------------------------
FRAMEWORKS = Path(__file__).parent / "frameworks"


@pytest.mark.slow
@pytest.mark.parametrize("file, steps", [("lightning_fit.py", 24), ("hf_trainer.py", 12)])
def test_framework_trainers_equal_their_direct_runs_with_the_callback_and_without(
        daemon: str, tmp_path: Path, file: str, steps: int) -> None:
    """Unchanged, and with the one-line callback that reports the trainer's steps (its
    max_steps become the job's planned iterations) and its logged loss."""
    argv = [str(FRAMEWORKS / file), "model.pt"]
    runs = {}
    for how in ("direct", "plain", "callback"):
        cwd = tmp_path / how
        cwd.mkdir()
        if how == "direct":
            proc = direct(argv, cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        else:
            extra = ["--callback"] if how == "callback" else []
            proc = salusd_run(daemon, [*argv, *extra], cwd, "--name", f"{file}-{how}",
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        runs[how] = (cwd, proc)
    for how, (_, proc) in runs.items():
        code, _, err = finish(proc)
        assert code == 0, f"{how}: {err}"
    want = saved(runs["direct"][0], ["model.pt"])
    for how in ("plain", "callback"):
        assert_equal(saved(runs[how][0], ["model.pt"]), want, how)
    with Control(daemon) as ctl:
        plain, callback = (_ended_job(ctl, f"{file}-{how}") for how in ("plain", "callback"))
    assert plain["iterations_done"] == callback["iterations_done"] == steps
    assert plain["last_loss"] is None and plain["iterations_planned"] == 2**53
    assert callback["iterations_planned"] == steps
    assert isinstance(callback["last_loss"], float)


def _ended_job(ctl: Control, name: str) -> dict[str, Any]:
    """The info of the job named `name` (ended jobs are not in `status`: by id)."""
    for job_id in range(1, 1000):
        try:
            info = ctl.info(str(job_id))
        except Exception:  # no such job: the ids end here
            break
        if info["name"] == name:
            return info
    raise AssertionError(f"no job {name!r}")


# ---- the process: output, exit status, signals, stdin, forks ---------------------------------
def script(tmp_path: Path, body: str, name: str = "s.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


@pytest.mark.parametrize("ending, status", [
    ("sys.exit(0)", 0),
    ("sys.exit(3)", 3),
    ("raise ValueError('bad value')", 1),
    ("os.kill(os.getpid(), signal.SIGKILL)", 128 + signal.SIGKILL),
])
def test_output_order_and_exit_status_are_a_direct_runs(
        daemon: str, tmp_path: Path, ending: str, status: int) -> None:
    path = script(tmp_path, f"""\
        import os, signal, subprocess, sys
        print("one", sys.argv[1:])
        print("two to stderr", file=sys.stderr)
        sys.stdout.flush()
        subprocess.run(["echo", "three from a child"])
        print("four", os.getcwd() == {str(tmp_path)!r}, os.environ["MARK"])
        sys.stdout.flush()
        {ending}
    """)
    env = {**ENV, "MARK": "caller's"}
    want = finish(direct([str(path), "a b", "c"], tmp_path, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT))
    got = finish(salusd_run(daemon, [str(path), "a b", "c"], tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    assert got[0] == status
    assert want[0] in (status, -signal.SIGKILL)
    if status == 128 + signal.SIGKILL:  # salusd run says how the job ended, after the output
        assert got[1].startswith(want[1]), got[1]
        assert "signal 9 (SIGKILL)" in got[1][len(want[1]):]
    else:
        assert got[1] == want[1]


def test_ctrl_c_is_the_scripts_keyboard_interrupt(daemon: str, tmp_path: Path) -> None:
    ctrl_c_is_the_scripts_keyboard_interrupt(
        tmp_path, lambda argv: salusd_run(daemon, argv, tmp_path, stdout=subprocess.PIPE))


def ctrl_c_is_the_scripts_keyboard_interrupt(
        tmp_path: Path, start: Callable[[list[str]], subprocess.Popen[str]]) -> None:
    """A Ctrl-C to the process `start` makes (a `salusd run` of the script, stdout piped) is
    the script's KeyboardInterrupt, as in a direct run."""
    path = script(tmp_path, """\
        import time
        try:
            print("ready", flush=True)
            time.sleep(60)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
            raise SystemExit(5)
    """)
    proc = start([str(path)])
    assert proc.stdout is not None
    assert proc.stdout.readline() == "ready\n"
    proc.send_signal(signal.SIGINT)
    code, out, _ = finish(proc)
    assert (code, out) == (5, "interrupted\n")


def test_a_second_ctrl_c_cancels_the_job(daemon: str, tmp_path: Path) -> None:
    path = script(tmp_path, """\
        import time
        import salus.adapters.torch as salus
        ready = True
        while True:
            try:  # a Ctrl-C right after the ready line is caught too
                if ready:
                    ready = False
                    print("ready", flush=True)
                time.sleep(0.01)
                salus.step()
            except KeyboardInterrupt:
                print("ignored", flush=True)
    """)
    proc = salusd_run(daemon, [str(path)], tmp_path, stdout=subprocess.PIPE,
                      stderr=subprocess.PIPE)
    assert proc.stdout is not None
    assert proc.stdout.readline() == "ready\n"
    proc.send_signal(signal.SIGINT)
    assert proc.stdout.readline() == "ignored\n"
    proc.send_signal(signal.SIGINT)
    code, _, err = finish(proc)
    assert code == 128 + signal.SIGTERM  # the cancel's SIGTERM ended the script
    assert "cancelled" in err


def test_sigterm_to_salusd_run_runs_the_scripts_handler(daemon: str, tmp_path: Path) -> None:
    """Slurm's and Kubernetes' preemption: SIGTERM sent to `salusd run` reaches the script,
    whose handler saves a checkpoint and exits 0; `salusd run` exits with that status."""
    path = script(tmp_path, """\
        import pathlib, signal, sys, time
        import salus.adapters.torch as salus

        def save(signum, frame):
            pathlib.Path("checkpoint").write_text(f"saved on {signal.Signals(signum).name}")
            sys.exit(0)

        signal.signal(signal.SIGTERM, save)
        print("ready", flush=True)
        while True:
            time.sleep(0.01)
            salus.step()
    """)
    proc = salusd_run(daemon, [str(path)], tmp_path, stdout=subprocess.PIPE)
    assert proc.stdout is not None
    assert proc.stdout.readline() == "ready\n"
    proc.send_signal(signal.SIGTERM)
    code, _, _ = finish(proc)
    assert code == 0
    assert (tmp_path / "checkpoint").read_text() == "saved on SIGTERM"


def test_a_script_without_a_handler_dies_of_the_forwarded_signal_and_is_not_finished(
        daemon: str, tmp_path: Path) -> None:
    """As a direct run: SIGUSR1 without a handler ends the script with that signal; `salusd
    run` exits 128 + 10 and says the job failed."""
    path = script(tmp_path, """\
        import time
        print("ready", flush=True)
        time.sleep(60)
    """)
    proc = salusd_run(daemon, [str(path)], tmp_path, stdout=subprocess.PIPE,
                      stderr=subprocess.PIPE)
    assert proc.stdout is not None
    assert proc.stdout.readline() == "ready\n"
    proc.send_signal(signal.SIGUSR1)
    code, _, err = finish(proc)
    assert code == 128 + signal.SIGUSR1
    assert "failed" in err and "SIGUSR1" in err


def test_a_cancelled_script_gets_sigterm_and_its_grace(daemon: str, tmp_path: Path) -> None:
    """Cancelling a script job (here by a second Ctrl-C) sends its command SIGTERM and lets it
    run on to its handler's end: the handler flags, the next step saves a checkpoint and the
    script exits 0 within the grace."""
    path = script(tmp_path, """\
        import pathlib, signal, sys, time
        import salus.adapters.torch as salus
        stop = []
        signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
        ready = True
        while True:
            try:
                if ready:
                    ready = False
                    print("ready", flush=True)
                time.sleep(0.01)
                salus.step()
                if stop:
                    pathlib.Path("checkpoint").write_text("saved after the last step")
                    sys.exit(0)
            except KeyboardInterrupt:
                print("ignored", flush=True)
    """)
    proc = salusd_run(daemon, [str(path)], tmp_path, stdout=subprocess.PIPE,
                      stderr=subprocess.PIPE)
    assert proc.stdout is not None
    assert proc.stdout.readline() == "ready\n"
    proc.send_signal(signal.SIGINT)
    assert proc.stdout.readline() == "ignored\n"
    proc.send_signal(signal.SIGINT)  # the second cancels the job
    code, _, err = finish(proc)
    assert code == 0, err
    assert (tmp_path / "checkpoint").read_text() == "saved after the last step"


@pytest.mark.slow
def test_a_stopping_salusd_gives_a_script_sigterm_and_its_grace_then_restores_it(
        tmp_path: Path) -> None:
    """Kubernetes' and systemd's stop: SIGTERM to `salusd serve` sends the script SIGTERM; its
    handler takes two seconds to save a checkpoint and exits 0, which `salusd run` reports;
    salusd waited for it, then stopped. After the restart the job is not `finished`: it says
    salusd stopped while it ran (before: the script was killed at once, its handler never ran)."""
    path = script(tmp_path, """\
        import pathlib, signal, sys, time
        import salus.adapters.torch as salus

        def save(signum, frame):
            time.sleep(2.0)
            pathlib.Path("checkpoint").write_text(f"saved on {signal.Signals(signum).name}")
            sys.exit(0)

        signal.signal(signal.SIGTERM, save)
        print("ready", flush=True)
        while True:
            time.sleep(0.01)
            salus.step()
    """)
    with salusd(tmp_path, devices=1) as (daemon, address):
        proc = salusd_run(address, [str(path)], tmp_path, "--name", "stopped",
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert proc.stdout is not None
        assert proc.stdout.readline() == "ready\n"
        with Control(address) as ctl:
            job = _job_named(ctl, "stopped")
        daemon.send_signal(signal.SIGTERM)
        code, _, err = finish(proc)
        assert code == 0, err
        assert daemon.wait(timeout=TIMEOUT_S) == 0
    assert (tmp_path / "checkpoint").read_text() == "saved on SIGTERM"
    with salusd(tmp_path, devices=1) as (_, address), Control(address) as ctl:
        ended = ctl.info(job)
    assert ended["state"] == "failed" and "salusd restarted while job" in ended["reason"], ended


def test_the_script_knows_its_job_id_and_name(daemon: str, tmp_path: Path) -> None:
    """As Slurm's SLURM_JOB_ID: `SALUS_JOB_ID` is the id `salusd status` shows."""
    path = script(tmp_path, """\
        import os
        print(os.environ["SALUS_JOB_ID"], os.environ["SALUS_JOB_NAME"])
    """)
    code, out, _ = finish(salusd_run(daemon, [str(path)], tmp_path, "--name", "sweep-3",
                                     stdout=subprocess.PIPE))
    job_id, name = out.split()
    assert code == 0 and name == "sweep-3"
    with Control(daemon) as ctl:
        assert ctl.info(job_id)["name"] == "sweep-3"


def test_stdin_is_the_callers(daemon: str, tmp_path: Path) -> None:
    path = script(tmp_path, """\
        import sys
        for line in sys.stdin:
            print(line.strip().upper())
    """)
    proc = salusd_run(daemon, [str(path)], tmp_path, stdin=subprocess.PIPE,
                      stdout=subprocess.PIPE)
    assert finish(proc, "alpha\nbeta\n")[:2] == (0, "ALPHA\nBETA\n")


def test_a_script_that_forks_and_steps_optimizers_in_both_processes(
        daemon: str, tmp_path: Path) -> None:
    """The child's optimizer steps are not boundaries of the job (only its executor asks for
    turns); the parent's are, and both end as in a direct run."""
    path = script(tmp_path, """\
        import os, sys, torch
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        def train(steps):
            for _ in range(steps):
                opt.zero_grad()
                model(torch.randn(8, 3)).pow(2).mean().backward()
                opt.step()
        pid = os.fork()
        train(5)
        who = "child" if pid == 0 else "parent"
        torch.save(model.state_dict(), f"{who}.pt")
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        print("done")
    """)
    (tmp_path / "direct").mkdir()
    (tmp_path / "job").mkdir()
    assert finish(direct([str(path)], tmp_path / "direct", stdout=subprocess.PIPE)) == (
        0, "done\n", "")
    assert finish(salusd_run(daemon, [str(path)], tmp_path / "job",
                             stdout=subprocess.PIPE)) == (0, "done\n", "")
    for who in ("parent", "child"):
        assert_equal(saved(tmp_path / "job", [f"{who}.pt"]),
                     saved(tmp_path / "direct", [f"{who}.pt"]), who)


def test_an_unsupported_interpreter_option_is_refused_clearly(
        daemon: str, tmp_path: Path) -> None:
    code, _, err = finish(salusd_run(daemon, ["-O", "train.py"], tmp_path,
                                     stderr=subprocess.PIPE))
    assert code == 125
    assert "the interpreter option '-O' is not supported" in err


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("useradd") is None,
                    reason="creating a user and running as it needs root and useradd")
def test_a_root_daemon_runs_the_script_as_its_caller(tmp_path: Path) -> None:
    """`salusd run` by a user of the socket's group: the script runs with that user's uid,
    gid and groups in the user's directory, and what it writes is the user's."""
    tag = uuid.uuid4().hex[:6]
    group, user = f"saluss{tag}", f"salusr{tag}"
    subprocess.run(["groupadd", group], check=True, capture_output=True)
    try:
        subprocess.run(["useradd", "-M", "-G", group, user], check=True, capture_output=True)
        entry, gid = pwd.getpwnam(user), grp.getgrnam(group).gr_gid
        root = Path(tempfile.mkdtemp(prefix="salusd-caller-"))
        root.chmod(0o755)
        home = root / "home"
        home.mkdir()
        os.chown(home, entry.pw_uid, entry.pw_gid)
        path = script(home, """\
            import json, os
            with open("made.txt", "w") as f:
                f.write("mine")
            print(json.dumps({"uid": os.getuid(), "gid": os.getgid(),
                              "groups": sorted(os.getgroups()), "cwd": os.getcwd()}))
        """)
        with salusd(root, "--group", group) as (_, address):
            # The interpreter's files are root's here: it starts as root, then becomes the user.
            become = ("import os, sys; from salus.daemon.cli import main as cli, run as cli_run; "
                      "args = cli.build_parser().parse_args(sys.argv[1:]); "
                      f"os.setgroups([{entry.pw_gid}, {gid}]); os.setgid({entry.pw_gid}); "
                      f"os.setuid({entry.pw_uid}); sys.exit(cli_run.run(args))")
            proc = subprocess.Popen(
                [sys.executable, "-c", become, "run", "--socket",
                 address.removeprefix("unix://"), "--", sys.executable, str(path)],
                cwd=home, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                env={"PATH": "/usr/bin:/bin", "HOME": str(home), "OMP_NUM_THREADS": "1"})
            code, out, err = finish(proc)
        assert code == 0, err
        seen = json.loads(out)
        assert (seen["uid"], seen["gid"], seen["cwd"]) == (entry.pw_uid, entry.pw_gid, str(home))
        assert gid in seen["groups"]
        assert (home / "made.txt").stat().st_uid == entry.pw_uid
        # `salusd run` copied what it relayed to the job's log, as the user, in its folder.
        log = root / "state" / "checkpoints" / "1" / "output.log"
        assert log.stat().st_uid == entry.pw_uid and log.read_text() == out
    finally:
        subprocess.run(["userdel", user], capture_output=True)
        subprocess.run(["groupdel", group], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("useradd") is None,
                    reason="creating a user and running as it needs root and useradd")
def test_a_cwd_the_caller_cannot_enter_reaches_its_terminal(tmp_path: Path) -> None:
    """`salusd run` by a user in a directory they cannot enter (root's, mode 0700), and with an
    interpreter they cannot run (in root's directory, whether it exists or not): checked as the
    user at submission, each is refused on the user's terminal in one line (125), the same for
    a file that exists as for one that does not, and no job is left behind (before: a job that
    failed 'executor died: exit status 1', or one stuck open after an internal error)."""
    tag = uuid.uuid4().hex[:6]
    group, user = f"saluss{tag}", f"salusr{tag}"
    subprocess.run(["groupadd", group], check=True, capture_output=True)
    try:
        subprocess.run(["useradd", "-M", "-G", group, user], check=True, capture_output=True)
        entry, gid = pwd.getpwnam(user), grp.getgrnam(group).gr_gid
        root = Path(tempfile.mkdtemp(prefix="salusd-caller-"))
        root.chmod(0o755)
        locked = root / "locked"
        locked.mkdir(mode=0o700)
        with salusd(root, "--group", group) as (_, address):
            become = ("import os, sys; from salus.daemon.cli import main as cli, run as cli_run; "
                      "args = cli.build_parser().parse_args(sys.argv[1:]); "
                      f"os.setgroups([{entry.pw_gid}, {gid}]); os.setgid({entry.pw_gid}); "
                      f"os.setuid({entry.pw_uid}); sys.exit(cli_run.run(args))")
            def run(cwd: Path, python: str) -> tuple[int, str]:
                proc = subprocess.Popen(
                    [sys.executable, "-c", become, "run", "--socket",
                     address.removeprefix("unix://"), "--", python, "train.py"],
                    cwd=cwd, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                    env={"PATH": "/usr/bin:/bin", "HOME": "/", "OMP_NUM_THREADS": "1"})
                code, _, err = finish(proc)
                return code, err

            code, err = run(locked, sys.executable)
            assert code == 125, err
            assert err.strip() == (f"salusd run: 'cwd' {locked}: the job's owner cannot enter "
                                   "it"), err
            shutil.copy(sys.executable, locked / "python")  # root's, behind a 0700 directory
            answers = {}
            for python in (locked / "python", locked / "missing"):
                code, err = run(root, str(python))
                assert code == 125, err
                answers[python.name] = err.strip().replace(str(python), "PATH")
            assert answers["python"] == answers["missing"] == (
                "salusd run: PATH: PATH is not a file the job's owner can execute"), answers
            with Control(address) as control:
                assert control.status()["jobs"] == [], control.status()
    finally:
        subprocess.run(["userdel", user], capture_output=True)
        subprocess.run(["groupdel", group], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


# ---- the caller's interpreter ----------------------------------------------------------------
def make_venv(where: Path, *, with_salusd: bool) -> Path:
    """A virtualenv with a package of its own (`only_here`) that the daemon's lacks; with
    `with_salusd`, the daemon's packages (salusd, torch) are importable in it too. Its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True,
                   timeout=TIMEOUT_S)
    python = where / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; "
                                "print(sysconfig.get_paths()['purelib'])"], check=True,
                               capture_output=True, text=True).stdout.strip())
    (site / "only_here").mkdir()
    (site / "only_here" / "__init__.py").write_text("VALUE = 42\n")
    if with_salusd:
        ours = sysconfig.get_paths()["purelib"]
        (site / "daemon.pth").write_text(f"import site; site.addsitedir({ours!r})\n")
    return python


@pytest.mark.slow
def test_the_script_runs_in_the_callers_interpreter_with_its_packages(
        daemon: str, tmp_path: Path) -> None:
    """`python` is the caller's: a package only the caller's virtualenv has is imported, in an
    executor forked by a zygote of that interpreter, which stays warm for the next job; the
    daemon's interpreter lacks the package, as a direct run with that interpreter does; an
    interpreter whose environment has neither salusd nor torch runs the script too, which fails
    at `import torch` exactly as its direct run does (what is refused, and how, is in
    test_foreign_interpreter.py)."""
    path = script(tmp_path, """\
        import os, sys
        import only_here
        import torch
        print(only_here.VALUE, sys.prefix)
        with open(f"/proc/{os.getppid()}/cmdline") as f:
            print(os.getppid(), *f.read().split("\\0")[:3])
        opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
        for _ in range(3):
            opt.step()
    """)
    venv = make_venv(tmp_path / "venv", with_salusd=True)
    bare = make_venv(tmp_path / "bare", with_salusd=False)
    parents = []
    for _ in range(2):
        code, out, err = finish(subprocess.Popen(
            [sys.executable, "-m", "salus.daemon.cli", "run", "--socket",
             daemon.removeprefix("unix://"), "--", str(venv), str(path)], cwd=tmp_path,
            env=ENV, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        first, parent = out.splitlines()
        assert (code, first) == (0, f"42 {tmp_path / 'venv'}"), err
        parents.append(parent)
    zygote = f"{venv} -m salus.daemon.executor.zygote"
    assert parents[0] == parents[1] and parents[0].split(" ", 1)[1] == zygote, parents
    # A contract job's functions run under its client's interpreter: a function that uses
    # the virtualenv's own package unpickles in an executor of the same warm zygote.
    client = script(tmp_path, """\
        import os
        import only_here
        import torch
        import salus.adapters.torch as salus
        with salus.connect("contract", 10) as job:
            remote = job.attach(w=torch.ones(2))

            @remote.function
            def value(s):
                return only_here.VALUE + int(s.w.sum()), os.getppid()

            print(*value(), job.info()["executor"]["why"])
    """, "client.py")
    done = subprocess.run([str(venv), str(client)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=TIMEOUT_S, env={**ENV, "SALUS_ADDRESS": daemon})
    assert done.returncode == 0, done.stderr
    value, parent, why = done.stdout.strip().split(" ", 2)
    assert (int(value), parent) == (44, parents[0].split()[0])
    assert why == "its own process: an interactive job of another interpreter than the daemon's"
    code, _, err = finish(salusd_run(daemon, [str(path)], tmp_path, stderr=subprocess.PIPE))
    assert code == 1 and "No module named 'only_here'" in err
    got = finish(subprocess.Popen(
        [sys.executable, "-m", "salus.daemon.cli", "run", "--socket",
         daemon.removeprefix("unix://"), "--", str(bare), str(path)], cwd=tmp_path, env=ENV,
        text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    want = finish(subprocess.Popen([str(bare), str(path)], cwd=tmp_path, env=ENV, text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    assert want[0] == 1 and "No module named 'torch'" in want[2], want
    assert got == want


@pytest.mark.slow
def test_the_zygote_of_another_interpreter_stops_with_the_daemon(tmp_path: Path) -> None:
    path = script(tmp_path, """\
        import os
        print(os.getppid())
    """)
    venv = make_venv(tmp_path / "venv", with_salusd=True)
    with salusd(tmp_path) as (proc, address):
        code, out, err = finish(subprocess.Popen(
            [sys.executable, "-m", "salus.daemon.cli", "run", "--socket",
             address.removeprefix("unix://"), "--", str(venv), str(path)], cwd=tmp_path,
            env=ENV, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        assert code == 0, err
        zygote = int(out)
        with open(f"/proc/{zygote}/cmdline") as f:
            assert f.read().split("\0")[:3] == [str(venv), "-m", "salus.daemon.executor.zygote"]
        with open(f"/proc/{zygote}/environ", "rb") as f:
            env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        packages = Path(env[b"PYTHONPATH"].decode())  # salusd's own, generated by the daemon
        assert (packages / "salus" / "daemon").is_symlink()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=TIMEOUT_S) == 0
    assert not os.path.exists(f"/proc/{zygote}") or _zombie_or_gone(zygote)
    assert not packages.exists()  # removed with the daemon


def _zombie_or_gone(pid: int) -> bool:
    """Whether process `pid` has exited (a zombie awaiting its parent's wait, or gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


# ---- scheduling at the boundaries --------------------------------------------------------------
def test_suspend_resume_priority_and_status_act_at_boundaries(
        daemon: str, tmp_path: Path) -> None:
    path = script(tmp_path, """\
        import time
        import salus.adapters.torch as salus
        for i in range(400):
            time.sleep(0.005)
            salus.step()
        print("done")
    """)
    proc = salusd_run(daemon, [str(path)], tmp_path, "--name", "boundaries",
                      "--iterations", "400", stdout=subprocess.PIPE,
                      env={**ENV, "SALUS_BOUNDARY": "explicit"})
    with Control(daemon) as ctl:
        job = _job_named(ctl, "boundaries")
        wait_until(lambda: ctl.info(job)["iterations_done"] >= 20, TIMEOUT_S, "20 iterations")
        ctl.suspend(job)
        # The iteration running when suspended ends at its boundary and gives its lane back.
        wait_until(lambda: not _in_a_lane(ctl, job), TIMEOUT_S,
                   "the suspended job's last iteration to end")
        held = ctl.info(job)["iterations_done"]
        time.sleep(0.3)  # not a wait: the window in which a suspended job must not run
        assert ctl.info(job)["iterations_done"] == held
        assert ctl.info(job)["state"] == "suspended"
        ctl.priority(job, 3.0)
        ctl.resume(job)
        wait_until(lambda: ctl.info(job)["iterations_done"] > held, TIMEOUT_S,
                   "an iteration after the resume")
        info = ctl.info(job)
        assert info["iterations_planned"] == 400
        assert info["mean_iteration_s"] > 0.004
    assert finish(proc)[:2] == (0, "done\n")
    with Control(daemon) as ctl:
        info = ctl.info(job)
    assert (info["state"], info["iterations_done"]) == ("finished", 400)
    assert info["reason"].startswith("its command exited with status 0")


def _job_named(ctl: Control, name: str) -> str:
    """The id of the last job named `name`, once there is one."""
    jobs = wait_until(lambda: [j for j in ctl.status()["jobs"] if j["name"] == name], 60,
                      f"a job named {name!r}")
    return str(jobs[-1]["job_id"])


def _in_a_lane(ctl: Control, job: str) -> bool:
    """Whether job `job` runs an iteration in a lane, or holds a lane's lease, now."""
    return any(str(lane["busy_job"]) == job
               for device in ctl.status()["devices"] for lane in device["lanes"])


# ---- REST, the job's log, restarts -------------------------------------------------------------
@pytest.mark.slow
def test_rest_script_jobs_keep_their_output_and_a_restart_fails_or_reruns_them(
        tmp_path: Path) -> None:
    """`POST /v1/jobs {"command"}` runs the script with its output in the job's log (REST and
    `salusd logs`); after `kill -9` and a restart the job that ran with `restart: never` is
    failed saying why, and the `on-failure` one runs again and goes on from the checkpoint it
    kept in `salus.resume_dir()`."""
    from rest_client import connect, job, wait_for

    path = script(tmp_path, """\
        import os, sys, time
        import salus.adapters.torch as salus
        where = os.path.join(salus.resume_dir(), "done")
        start = int(open(where).read()) if os.path.exists(where) else 0
        print("from", start, "cwd", os.getcwd(), flush=True)
        print("to stderr", file=sys.stderr, flush=True)
        for i in range(start, int(sys.argv[1])):
            time.sleep(0.02)
            salus.step()
            with open(where + ".tmp", "w") as f:  # written whole: a kill may come at any time
                f.write(str(i + 1))
            os.replace(where + ".tmp", where)
        print("ended at", int(open(where).read()))
    """)
    body = {"command": [sys.executable, str(path)], "cwd": str(tmp_path),
            "env": {"PATH": os.environ["PATH"]}}
    with salusd(tmp_path, "--http", "127.0.0.1:0") as (proc, address):
        with connect(tmp_path / "state") as client:
            quick = client.post("/v1/jobs", json={**body, "name": "quick",
                                                  "command": [*body["command"], "3"]})
            assert quick.status_code == 201, quick.text
            quick_id = quick.json()["id"]
            assert quick.json()["kind"] == "script"
            wait_for(lambda: job(client, quick_id)["state"] == "finished", "the quick job")
            log = client.get(f"/v1/jobs/{quick_id}/log", params={"offset": 0}).text
            assert log == f"from 0 cwd {tmp_path}\nto stderr\nended at 3\n"
            logs = subprocess.run([sys.executable, "-m", "salus.daemon.cli", "logs",
                                   str(quick_id), "--socket", address.removeprefix("unix://")],
                                  capture_output=True, text=True, env=ENV, timeout=TIMEOUT_S)
            assert logs.stdout == log
            ids = {}
            for restart in ("never", "on-failure"):
                reply = client.post("/v1/jobs", json={
                    **body, "name": restart, "restart": restart, "cwd": str(tmp_path),
                    "command": [*body["command"], "100"]})
                assert reply.status_code == 201, reply.text
                ids[restart] = reply.json()["id"]
            # Rerun after the restart, it gets its time limit again (the clock went with the
            # daemon); far from it now.
            limited = client.post("/v1/jobs", json={
                **body, "name": "limited", "restart": "on-failure", "time_limit_s": 15,
                "command": [*body["command"], str(10**6)]})
            assert limited.status_code == 201, limited.text
            ids["limited"] = limited.json()["id"]
            wait_for(lambda: all(job(client, i)["iterations_done"] >= 5
                                 for i in ids.values()), "both jobs running")
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    with salusd(tmp_path, "--http", "127.0.0.1:0") as daemon, \
            connect(tmp_path / "state") as client:
        failed = wait_for(lambda: (j := job(client, ids["never"]))["state"] == "failed" and j,
                          "the never job failed")
        assert "salusd restarted while job" in failed["reason"]
        assert "--restart on-failure" in failed["reason"]
        rows = [job(client, ids["on-failure"])]
        try:
            wait_for(lambda: rows.append(job(client, ids["on-failure"]))
                     or rows[-1]["state"] in ("finished", "failed", "cancelled"),
                     "the on-failure job to end")
        finally:
            log = client.get(f"/v1/jobs/{ids['on-failure']}/log", params={"offset": 0}).text
        assert rows[-1]["state"] == "finished", (
            f"the job: {rows[-1]}\nits log:\n{log}\n"
            f"the daemon's log:\n{daemon.log_text()[-6000:]}")
        ended = wait_for(lambda: (j := job(client, ids["limited"]))["state"] == "failed" and j,
                         "the limited job's rerun to hit its time limit")
        assert "hit its time limit of 15 s" in ended["reason"], ended
        limited_log = client.get(f"/v1/jobs/{ids['limited']}/log", params={"offset": 0}).text
        assert limited_log.count("from ") == 2, limited_log  # it ran before and after
        starts = [int(line.split()[1]) for line in log.splitlines() if line.startswith("from")]
        assert starts[0] == 0 and starts[1] >= 5, log
        assert log.endswith("ended at 100\n")


def test_a_time_limit_sends_the_early_signal_then_sigterm_and_says_so(
        daemon: str, tmp_path: Path) -> None:
    """Slurm's `--time 4 --signal USR1@2`: USR1 about 2 s in, SIGTERM at 4 s (the handler
    saves and exits), and `salusd run` exits 124 saying the job hit its time limit."""
    path = script(tmp_path, """\
        import signal, sys, time
        import salus.adapters.torch as salus
        seen = []
        signal.signal(signal.SIGUSR1, lambda *_: seen.append(("USR1", time.monotonic())))

        def term(*_):
            print(*[name for name, _ in seen], "TERM", flush=True)
            sys.exit(0)

        signal.signal(signal.SIGTERM, term)
        start = time.monotonic()
        print("ready", flush=True)
        while True:
            time.sleep(0.01)
            salus.step()
    """)
    started = time.monotonic()
    proc = salusd_run(daemon, [str(path)], tmp_path, "--time", "4", "--signal", "USR1@2",
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    code, out, err = finish(proc)
    took = time.monotonic() - started
    assert out.splitlines() == ["ready", "USR1 TERM"]
    assert code == 124 and "hit its time limit of 4 s" in err
    assert 3.5 < took < 20


def test_a_jobs_own_grace_cuts_the_wait_for_a_script_that_ignores_sigterm(
        daemon: str, tmp_path: Path) -> None:
    """`--time 2 --grace 1` on a script whose SIGTERM handler does nothing: killed about a
    second after its limit (the daemon's grace is 30 s), failed saying it hit its limit."""
    path = script(tmp_path, """\
        import signal, time
        import salus.adapters.torch as salus
        signal.signal(signal.SIGTERM, lambda *_: print("TERM ignored", flush=True))
        print("ready", flush=True)
        while True:
            time.sleep(0.01)
            salus.step()
    """)
    started = time.monotonic()
    proc = salusd_run(daemon, [str(path)], tmp_path, "--time", "2", "--grace", "1",
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    code, out, err = finish(proc)
    took = time.monotonic() - started
    assert out.splitlines() == ["ready", "TERM ignored"]
    assert code == 124 and "hit its time limit of 2 s" in err
    assert 2.5 < took < 15


@pytest.mark.slow
def test_rest_takes_a_script_jobs_time_limit_signal_and_grace(tmp_path: Path) -> None:
    """`POST /v1/jobs` with `time_limit_s`, `signal` and `grace_s`: the early signal, then
    SIGTERM (ignored), then SIGKILL after the job's own grace; the job fails saying it hit its
    time limit. Bodies that give them without a script or a limit are refused (422)."""
    from rest_client import connect, job, wait_for

    path = script(tmp_path, """\
        import os, signal, time
        # When this process started, in seconds since boot (/proc/self/stat's starttime).
        ticks = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])
        began = ticks / os.sysconf("SC_CLK_TCK")
        def uptime(): return float(open("/proc/uptime").read().split()[0])
        def usr1(*_): print("USR1", round(uptime() - began, 2), file=open("usr1", "w"))
        signal.signal(signal.SIGUSR1, lambda *_: print("USR1", flush=True) or usr1())
        signal.signal(signal.SIGTERM, lambda *_: print("TERM ignored", flush=True))
        import salus.adapters.torch as salus
        while True:
            time.sleep(0.01)
            salus.step()
    """)
    body = {"name": "limited", "command": [sys.executable, str(path)], "cwd": str(tmp_path),
            "time_limit_s": 3, "signal": int(signal.SIGUSR1), "signal_before_s": 1.5,
            "grace_s": 1}
    with salusd(tmp_path, "--http", "127.0.0.1:0"), connect(tmp_path / "state") as client:
        started = time.monotonic()
        reply = client.post("/v1/jobs", json=body)
        assert reply.status_code == 201, reply.text
        jid = reply.json()["id"]
        failed = wait_for(lambda: (j := job(client, jid))["state"] == "failed" and j,
                          "the job failed")
        took = time.monotonic() - started
        assert "hit its time limit of 3 s" in failed["reason"], failed
        assert 3 < took < 20
        log = wait_for(lambda: (t := client.get(f"/v1/jobs/{jid}/log").text)
                       .count("TERM ignored") and t, "the log")
        assert log.splitlines() == ["USR1", "TERM ignored"], log
        # The limit counts from the command's start, not from the POST: the daemon had just
        # started (its executors wait for its zygote's preloading), yet the early signal came
        # no sooner than 1.5 s into the script's own process (clock ticks: 0.01 s).
        assert float((tmp_path / "usr1").read_text().split()[1]) >= 1.5 - 0.02
        for wrong in ({"name": "b", "entrypoint": "x.py:f", "iterations": 1, "grace_s": 1},
                      {**body, "time_limit_s": None}):
            refused = client.post("/v1/jobs", json=wrong)
            assert refused.status_code == 422, refused.text


def test_durations_and_signals_read_as_slurms() -> None:
    from salus.daemon.cli.run import duration, early_signal

    assert [duration(t) for t in ("90", "90s", "15m", "2h", "1d", "1:30", "1:00:05",
                                  "1-00:00:10")] == [90, 90, 900, 7200, 86400, 90, 3605, 86410]
    assert early_signal("USR1@30") == (signal.SIGUSR1, 30.0)
    assert early_signal("TERM") == (signal.SIGTERM, 60.0)
    assert early_signal("10@5") == (10, 5.0)
    with pytest.raises(argparse.ArgumentTypeError):
        duration("soon")
