"""The job contract as an executor runs it, in process: results come back detached on the CPU
whatever their container, errors carry the job's own traceback, the job's state survives them,
and a call hands back the random stream only when it drew from it."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import torch
from torch import nn

from salus.daemon.executor.results import to_host
from salus.daemon.executor.runtime import JobRuntime, State
from salus.daemon.wire import compact


@dataclasses.dataclass
class Output:
    loss: torch.Tensor
    parts: list[Any]


Pair = collections.namedtuple("Pair", "a b")


def test_results_come_back_detached_through_any_container() -> None:
    grad = torch.ones(3, requires_grad=True) * 2
    result = to_host({"out": Output(grad, [grad, (grad, 1)]), "pair": Pair(grad, None),
                      "ordered": collections.OrderedDict(x=grad), "size": torch.Size([2, 3])})
    assert not result["out"].loss.requires_grad
    assert not result["out"].parts[0].requires_grad and not result["out"].parts[1][0].requires_grad
    assert isinstance(result["pair"], Pair) and not result["pair"].a.requires_grad
    assert type(result["ordered"]) is collections.OrderedDict
    assert result["size"] == torch.Size([2, 3])
    assert torch.equal(result["out"].loss, torch.full((3,), 2.0))


def _runtime() -> JobRuntime:
    torch.manual_seed(0)
    runtime = JobRuntime()
    runtime.state = State(model=nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)))
    runtime.names = ["model"]
    runtime.functions[0] = lambda s, x: s.model(x).sum()
    runtime.kinds[0] = "iteration"
    return runtime


def test_an_error_keeps_the_state_and_names_the_jobs_own_line() -> None:
    runtime = _runtime()
    before = {k: v.clone() for k, v in runtime.state.model.state_dict().items()}
    reply, _, _ = runtime.run(compact.Message(compact.OP_CALL, "1", (torch.ones(2, 5),), 0))
    assert reply["ok"] is False and reply["code"] == "call_failed"
    assert "RuntimeError" in reply["message"] and "mat1 and mat2" in reply["message"]
    first_frame = reply["traceback"].split("\n")[1]
    assert __file__ in first_frame  # the traceback starts in the job's own code
    for key, value in runtime.state.model.state_dict().items():
        assert torch.equal(value, before[key])
    ok, _, _ = runtime.run(compact.Message(compact.OP_CALL, "1", (torch.ones(2, 4),), 0))
    assert type(ok) is compact.Message


def test_the_random_stream_comes_back_only_when_the_call_drew() -> None:
    runtime = _runtime()
    runtime.state.model.train()
    drew, _, _ = runtime.run(compact.Message(compact.OP_CALL, "1", (torch.ones(2, 4),), 0))
    assert drew.aux & compact.AUX_RNG  # dropout drew: the new state rides along
    assert torch.equal(drew.tensors[-1], torch.get_rng_state())
    runtime.state.model.eval()
    quiet, _, _ = runtime.run(compact.Message(compact.OP_CALL, "1", (torch.ones(2, 4),), 0))
    assert not quiet.aux & compact.AUX_RNG


def _exit_three(s: State, x: torch.Tensor) -> None:
    raise SystemExit(3)


def test_system_exit_in_job_code_is_an_error_of_that_call() -> None:
    runtime = _runtime()
    runtime.functions[1] = _exit_three
    runtime.kinds[1] = "function"
    before = {k: v.clone() for k, v in runtime.state.model.state_dict().items()}
    reply, _, peak = runtime.run(compact.Message(compact.OP_CALL, "1", (torch.ones(2, 4),), 1))
    assert reply["ok"] is False and reply["code"] == "call_failed" and peak is None
    assert reply["type"] == "builtins.SystemExit" and reply["message"] == "SystemExit: 3"
    assert "_exit_three" in reply["traceback"].split("\n")[1]  # the job's own frame first
    for key, value in runtime.state.model.state_dict().items():
        assert torch.equal(value, before[key])
    ok, _, _ = runtime.run(compact.Message(compact.OP_CALL, "1", (torch.ones(2, 4),), 0))
    assert type(ok) is compact.Message  # the executor goes on serving the job
