"""The job contract on real training scripts: each script in tests/scripts/ trains the same way
directly and through a real `salusd serve`, and the final state must be the same, bit for bit.

Every comparison is exact (max |difference| == 0): both sides run the same kernels in the same
order with one intra-op thread, on the same random stream, so no pattern here needs a tolerance.
`pytest tests/test_scripts.py -s` prints one markdown row per script (docs/contract-scripts.md).
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import inspect
import os
import subprocess
import sys
import textwrap
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import salus.adapters.torch as salus
from salus.daemon.cli.launch import running_daemon

pytestmark = pytest.mark.slow

SCRIPTS_DIR = Path(__file__).resolve().parent / "scripts"
SCRIPTS = sorted(p.stem for p in SCRIPTS_DIR.glob("*.py"))
CONCURRENT = ("dropout_shuffle", "dcgan", "lstm_lm")  # all draw random numbers in the job
SCRIPT_TIMEOUT_S = 180


class Daemon:
    def __init__(self, address: str, log: Path) -> None:
        self.address = address
        self.log = log

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("salusd")
    log = root / "salusd.log"
    with running_daemon(root / "s.sock", state_dir=root / "state", cpu_devices=2,
                        cpu_memory="1G", cpu_threads=1, log_file=log) as proc:
        yield Daemon(proc.address, log)


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the scripts write their final state; direct runs are kept for later tests."""
    return tmp_path_factory.mktemp("outputs")


# ---- running the scripts ------------------------------------------------------------------------
def start(name: str, address: str | None, out: Path) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k != "SALUS_ADDRESS"}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.Popen([sys.executable, str(SCRIPTS_DIR / f"{name}.py"), address or "-",
                             str(out)], env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)


def finish(procs: list[subprocess.Popen[str]], daemon: Daemon) -> list[str]:
    """Wait for every process; their outputs, or a failure that shows them and the daemon log."""
    texts: list[str] = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=SCRIPT_TIMEOUT_S)
            texts.append(out)
            assert proc.returncode == 0, f"{proc.args} failed:\n{out}\n--- salusd log ---\n" \
                                         f"{daemon.log_tail()}"
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return texts


def direct_output(name: str, outputs: Path, daemon: Daemon) -> Path:
    path = outputs / f"{name}.direct.pt"
    if not path.exists():
        finish([start(name, None, path)], daemon)
    return path


# ---- comparing their state --------------------------------------------------------------------
def flatten(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from flatten(value, f"{prefix}/{key}")
    elif isinstance(obj, list | tuple):
        for i, value in enumerate(obj):
            yield from flatten(value, f"{prefix}[{i}]")
    else:
        yield prefix, obj


def max_abs_difference(direct: Path, through_salusd: Path) -> float:
    """Largest |difference| over every tensor the two runs saved (model and optimizer state,
    buffers, step counters); non-tensor entries must be equal."""
    a = dict(flatten(torch.load(direct, weights_only=False)))
    b = dict(flatten(torch.load(through_salusd, weights_only=False)))
    assert a.keys() == b.keys(), f"saved entries differ: {sorted(a.keys() ^ b.keys())}"
    worst = 0.0
    for key, x in a.items():
        y = b[key]
        if not isinstance(x, torch.Tensor):
            assert x == y, f"{key}: {x!r} directly, {y!r} through salusd"
            continue
        assert isinstance(y, torch.Tensor), key
        assert (x.dtype, x.shape) == (y.dtype, y.shape), key
        if x.numel():
            worst = max(worst, (x.double() - y.double()).abs().max().item())
    return worst


# ---- lines changed ----------------------------------------------------------------------------
def load_script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"contract_script_{name}",
                                                  SCRIPTS_DIR / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def logical_lines(fn: Any) -> list[str]:
    """The body of `fn` as `ast.unparse` prints it (no comments, no docstring, one line per
    statement or clause header, long calls on one line), without indentation."""
    (node,) = ast.parse(textwrap.dedent(inspect.getsource(fn))).body
    assert isinstance(node, ast.FunctionDef)
    return [text for stmt in node.body for line in ast.unparse(stmt).splitlines()
            if (text := line.strip())]


def lines_changed(module: ModuleType) -> int:
    """Logical lines of `run_salus` added or edited relative to `run_direct` (or removed, when
    more were removed). A line moved unchanged (the loop body into a `@remote.iteration`
    function, a loop now inside `with salus.connect(...)`) is not a change; `s.model` for
    `model` is."""
    direct, through_salusd = Counter(logical_lines(module.run_direct)), Counter(
        logical_lines(module.run_salus))
    return max((through_salusd - direct).total(), (direct - through_salusd).total())


# ---- the scripts ------------------------------------------------------------------------------
def test_there_are_at_least_ten_scripts() -> None:
    assert len(SCRIPTS) >= 10, SCRIPTS


@pytest.mark.parametrize("name", SCRIPTS)
def test_lines_changed_is_what_the_script_declares(name: str) -> None:
    module = load_script(name)
    assert isinstance(module.PATTERN, str) and module.PATTERN
    assert lines_changed(module) == module.SALUS_LINES_CHANGED


def _script_checks(name: str, path: Path) -> None:
    """What a script's own pattern promises beyond matching the direct run."""
    saved = torch.load(path, weights_only=False)
    if name == "finetune_frozen":  # eval-mode BatchNorm: the running statistics did not move
        for key, value in saved["pretrained_backbone"].items():
            assert torch.equal(saved["model"][f"backbone.{key}"], value), key
    if name == "early_stopping":  # it did stop early, so the stopping rule was exercised
        assert saved["stopped_epoch"] < load_script(name).MAX_EPOCHS - 1


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_through_salusd_matches_direct_run(name: str, daemon: Daemon,
                                                  outputs: Path) -> None:
    direct, remote = outputs / f"{name}.direct.pt", outputs / f"{name}.salusd.pt"
    procs = [start(name, daemon.address, remote)]
    if not direct.exists():
        procs.append(start(name, None, direct))
    texts = finish(procs, daemon)
    diff = max_abs_difference(direct, remote)
    module = load_script(name)
    print(f"| {module.PATTERN} | `{name}.py` | {module.SALUS_LINES_CHANGED} | "
          f"{len(logical_lines(module.run_direct))} | {diff:g} |")
    assert diff == 0.0
    if len(texts) == 2:  # the logs print losses and metrics: the same numbers both ways
        assert texts[0] == texts[1]
    _script_checks(name, remote)
    _script_checks(name, direct)


def test_three_scripts_at_once_through_one_daemon(daemon: Daemon, outputs: Path) -> None:
    directs = {name: direct_output(name, outputs, daemon) for name in CONCURRENT}
    remotes = {name: outputs / f"{name}.concurrent.pt" for name in CONCURRENT}
    finish([start(name, daemon.address, remotes[name]) for name in CONCURRENT], daemon)
    for name in CONCURRENT:
        diff = max_abs_difference(directs[name], remotes[name])
        print(f"concurrent {name}: max |difference| {diff:g}")
        assert diff == 0.0, name


# ---- a call that fails ------------------------------------------------------------------------
def _classifier() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 4))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g))
            for _ in range(n)]


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
          y: torch.Tensor) -> torch.Tensor:
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss.detach()


def test_bad_batch_fails_its_call_only_and_training_goes_on(daemon: Daemon) -> None:
    torch.set_num_threads(1)
    data = _batches(6)
    bad = (torch.randn(8, 15), data[3][1])  # 15 features for a Linear(16, ...): wrong shape
    model, opt = _classifier()
    for x, y in data:  # the direct run skips the bad batch
        _step(model, opt, x, y)
    expected = model.state_dict()

    model, opt = _classifier()
    with salus.connect(name="bad-batch", iterations=len(data) + 1,
                       address=daemon.address) as job:
        remote = job.attach(model=model, opt=opt)
        train = remote.iteration(lambda s, x, y: _step(s.model, s.opt, x, y))
        for i, (x, y) in enumerate(data):
            if i == 3:
                before = job.state_dict()
                with pytest.raises(RuntimeError, match="shapes cannot be multiplied") as info:
                    train(*bad)
                assert type(info.value) is RuntimeError  # the job's own error, not a wrapper
                assert any("raised in salusd" in note for note in info.value.__notes__)
                after = job.state_dict()
                assert all(torch.equal(before[k], after[k]) for k in before)
            train(x, y)
        final = job.state_dict()
    assert final.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(final[key], value), key


def test_a_call_that_fails_after_drawing_hands_back_the_random_stream(daemon: Daemon) -> None:
    """Dropout draws, then the loss fails (a target of the wrong length); the client then draws
    augmentation noise. A direct loop that catches the error has the dropout draw in its stream,
    so the client must continue from the job's random state, not from the one it sent."""
    torch.set_num_threads(1)
    data = _batches(6)
    data[2] = (data[2][0], data[2][1][:5])

    def run(step: Any) -> None:
        for x, y in data:
            x = x + 0.1 * torch.randn_like(x)
            with contextlib.suppress(ValueError):
                step(x, y)

    model, opt = _classifier()
    run(lambda x, y: _step(model, opt, x, y))
    expected, expected_rng = model.state_dict(), torch.get_rng_state()

    model, opt = _classifier()
    with salus.connect(name="fail-after-draw", iterations=len(data),
                       address=daemon.address) as job:
        remote = job.attach(model=model, opt=opt)
        run(remote.iteration(lambda s, x, y: _step(s.model, s.opt, x, y)))
        final = job.state_dict()
    assert torch.equal(torch.get_rng_state(), expected_rng)
    for key, value in expected.items():
        assert torch.equal(final[key], value), key
