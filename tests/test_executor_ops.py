"""The daemon↔executor protocol (`salusd/wire/executor_ops.py`): every message type survives
encode → JSON → decode; a malformed dict is refused with a ValueError naming its field; and the
dicts a real daemon and its real executors exchanged, captured on the wire while interactive,
gang, batch, failing and restored jobs ran, decode and encode back to themselves."""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_proc import wait_until
from hypothesis import given
from hypothesis import strategies as st

import salus.daemon.supervisor.pool as pool_module
import salus.daemon.supervisor.supervisor as supervisor_module
from salus.daemon.cli.control import Control
from salus.daemon.daemon import Daemon, DaemonConfig
from salus.daemon.devices.discovery import cpu_devices
from salus.daemon.engine.registry import JobRecord, Owner
from salus.daemon.wire.channel import Channel
from salus.daemon.wire.executor_ops import (
    Ack,
    Adopt,
    Attach,
    Attached,
    Become,
    CachePlace,
    CallDone,
    Checkpoint,
    Checkpointed,
    Define,
    DirectChannel,
    Estimate,
    Estimated,
    EstimateFailed,
    Exit,
    Failed,
    GangPlace,
    HandedOver,
    Handover,
    Host,
    Lease,
    Load,
    Loaded,
    Message,
    PipelineOptions,
    Place,
    Placed,
    Poisoned,
    Pull,
    Ran,
    Ready,
    Refuse,
    Reply,
    Request,
    Restore,
    Run,
    Script,
    Signal,
    Step,
    StepDone,
    SwapOut,
    Swapped,
    addressed,
    client_frame_follows,
    decode_reply,
    decode_request,
    encode,
)
from salus.daemon.wire.frames import RawFrame

MiB = 2**20

# ---- every message type, generated ---------------------------------------------------------------
ints = st.integers(-(2**63), 2**63)
floats = st.floats(allow_nan=False, allow_infinity=False)
texts = st.text(max_size=12)
maybe = st.none().__or__
counters = st.dictionaries(texts, st.integers(0, 2**40) | texts, max_size=3)
gangs = st.builds(GangPlace, ints, ints, maybe(ints), maybe(ints), maybe(texts), maybe(texts),
                  maybe(st.booleans()))
estimates = (st.builds(Estimated, ints, texts, st.just(False), maybe(ints))
             | st.builds(EstimateFailed, texts, st.just(False)))

requests: st.SearchStrategy[Request] = st.one_of(
    st.builds(Become, ints, ints, st.lists(ints, max_size=4).map(tuple), texts, texts, ints),
    st.builds(Host, maybe(texts), st.booleans(), maybe(texts)),
    st.just(Handover()), st.builds(Adopt, st.booleans(), st.booleans()),
    st.builds(Attach, maybe(gangs)),
    st.just(Define()), st.just(Pull()), st.just(DirectChannel()), st.just(Step()),
    st.just(SwapOut()),
    st.builds(Estimate, maybe(st.booleans())),
    st.builds(Run, st.booleans(), maybe(st.booleans())),
    st.builds(Lease, st.booleans()),
    st.builds(Place, texts, ints, floats, maybe(texts), maybe(ints), maybe(ints),
              st.booleans(), maybe(texts), maybe(ints)),
    st.builds(Load, texts, texts, st.booleans(), maybe(st.builds(PipelineOptions, texts, ints)),
              maybe(st.builds(CachePlace, texts, ints)), maybe(texts), maybe(gangs)),
    st.builds(Restore, maybe(texts), maybe(gangs)),
    st.builds(Checkpoint, maybe(texts), ints),
    st.builds(Refuse, texts, texts),
    st.builds(Exit, texts, texts),
    st.builds(Script, texts, st.lists(texts, max_size=3).map(tuple),
              st.dictionaries(texts, texts, max_size=3), maybe(texts), maybe(st.booleans()),
              st.integers(0, 2**31)),
    st.builds(Signal, st.integers(1, 64)),
)


@st.composite
def step_replies(draw: st.DrawFn) -> StepDone:
    ok = draw(st.booleans())
    return StepDone(ok, draw(floats), draw(maybe(ints)), draw(st.booleans()), draw(floats),
                    draw(floats), draw(ints), draw(maybe(floats)) if ok else None,
                    draw(maybe(floats | texts)), draw(maybe(texts)), draw(maybe(texts)),
                    draw(maybe(counters)), draw(maybe(counters)), draw(st.booleans()),
                    draw(st.booleans()))


replies: st.SearchStrategy[Reply] = st.one_of(
    st.builds(Ack, st.booleans()),
    st.builds(Failed, maybe(texts), st.booleans()),
    st.builds(HandedOver, st.booleans(), st.booleans(), maybe(texts), st.booleans(),
              st.booleans()),
    st.builds(Estimated, ints, texts, st.booleans(), maybe(ints)),
    st.builds(EstimateFailed, texts, st.booleans()),
    st.builds(Attached, ints, ints, st.booleans(), maybe(ints)),
    st.builds(Loaded, ints, ints, st.booleans(), maybe(ints)),
    st.builds(Checkpointed, ints, ints, floats, texts, floats, st.booleans()),
    st.builds(CallDone, st.booleans(), floats, maybe(ints), st.booleans(), maybe(floats),
              maybe(floats), maybe(texts), maybe(counters), maybe(counters), st.booleans(),
              st.booleans(), st.booleans()),
    step_replies(),
    st.builds(Ready, st.booleans(), maybe(estimates)),
    st.builds(Ran, ints, ints, ints, floats, maybe(ints), floats, floats, st.booleans()),
    st.builds(Swapped, st.dictionaries(texts, maybe(ints | texts), max_size=4),
              st.booleans()),
    st.builds(Placed, ints, st.booleans()),
    st.builds(Poisoned, texts),
)


def _through_json(msg: Message) -> dict[str, Any]:
    wire = encode(msg)
    sent: dict[str, Any] = json.loads(json.dumps(wire))
    assert sent == wire
    return sent


@given(requests)
def test_every_request_survives_the_wire(msg: Request) -> None:
    sent = _through_json(msg)
    assert sent["op"] == msg.op
    assert decode_request(sent) == msg
    assert encode(decode_request(sent)) == sent


@given(replies)
def test_every_reply_survives_the_wire(msg: Reply) -> None:
    sent = _through_json(msg)
    assert decode_reply(sent) == msg
    assert encode(decode_reply(sent)) == sent


def test_the_wire_dicts_are_the_messages_fields_under_their_op() -> None:
    """Written out by hand: each message is its op and its fields, a field holding its default
    left out."""
    assert encode(Become(7, 8, (9,), "u", "/h", 1)) == {
        "op": "become", "uid": 7, "gid": 8, "groups": [9], "user": "u", "home": "/h",
        "threads": 1}
    assert encode(Host(None, True)) == {"op": "host", "cwd": None, "estimate": True}
    assert encode(Host("/w", True, "/s/3/output.log"))["log"] == "/s/3/output.log"
    assert encode(Place("cpu", 5 << 20, 1.0, lane=4, lane_bytes=1 << 20, shared=True)) == {
        "op": "place", "device": "cpu", "budget_bytes": 5 << 20, "slowdown": 1.0, "lane": 4,
        "lane_bytes": 1 << 20, "shared": True}
    assert encode(HandedOver(False, False, "cannot pickle")) == {
        "op": "handed_over", "ok": False, "channel": False, "message": "cannot pickle"}
    assert encode(Run(True, True)) == {"op": "run", "counted": True, "frame": True}
    assert encode(Run(False)) == {"op": "run", "counted": False}  # a gang's call
    assert encode(Estimate(False)) == {"op": "estimate", "frame": False}
    assert encode(Estimate()) == {"op": "estimate"}
    assert encode(Attach(None)) == {"op": "attach", "gang": None}
    assert encode(Restore("/c", GangPlace(1, 2, port=4000))) == {
        "op": "restore", "dir": "/c", "gang": {"rank": 1, "world": 2, "port": 4000}}
    assert encode(Load("/j.py", "make", False, None, None, None)) == {
        "op": "load", "path": "/j.py", "function": "make", "restore": False, "pipeline": None,
        "cache": None, "dir": None}
    assert encode(Place("cpu:1", 5 << 20, 2.0)) == {
        "op": "place", "device": "cpu:1", "budget_bytes": 5 << 20, "slowdown": 2.0}
    assert encode(Place("cuda:1", 5 << 20, 1.0, "GPU-5e7a")) == {
        "op": "place", "device": "cuda:1", "budget_bytes": 5 << 20, "slowdown": 1.0,
        "uuid": "GPU-5e7a"}
    assert encode(CallDone(False, 0.0, None, False, None, None, empty=True)) == {
        "op": "call_done", "ok": False, "seconds": 0.0, "peak": None, "counted": False,
        "began": None, "ended": None, "empty": True}
    assert encode(Failed(None, forward=True)) == {"op": "failed", "message": None,
                                                  "forward": True}
    assert encode(Ack()) == {"op": "ack"}
    assert encode(Placed(3 * MiB)) == {"op": "placed", "reserved_bytes": 3 * MiB}
    assert "oom" not in encode(CallDone(False, 0.0, 5, True, 1.0, 2.0, "boom"))
    assert "oom" not in encode(StepDone(False, 0.1, 5, True, 1.0, 2.0, 3, message="boom"))
    assert "oom" not in encode(Ran(1, 1, 1, 0.1, 5, 1.0, 2.0))
    assert encode(Ready(True, EstimateFailed("no"))) == {
        "op": "ready", "counted": True, "estimate": {"op": "estimate_failed", "reason": "no"}}
    assert encode(Estimated(4096, "fake-tensor")) == {
        "op": "estimated", "bytes": 4096, "method": "fake-tensor"}
    assert encode(Attached(1 << 20, 1)) == {
        "op": "attached", "persistent_bytes": 1 << 20, "threads": 1}
    assert encode(Loaded(1 << 20, 4)) == {
        "op": "loaded", "persistent_bytes": 1 << 20, "iteration": 4}


def test_reserved_figures_are_optional_fields_beside_the_exact_ones() -> None:
    """An executor that sends no reserved figure (off CUDA) leaves the key out; one that does
    adds a key the daemon reads on CUDA devices."""
    assert encode(Estimated(4096, "fake-tensor", reserved_bytes=2 * MiB)) == {
        "op": "estimated", "bytes": 4096, "method": "fake-tensor", "reserved_bytes": 2 * MiB}
    assert encode(Attached(1 << 20, 1, True, 20 * MiB)) == {
        "op": "attached", "persistent_bytes": 1 << 20, "threads": 1, "forward": True,
        "persistent_reserved_bytes": 20 * MiB}
    assert encode(Loaded(1 << 20, 4, persistent_reserved_bytes=20 * MiB)) == {
        "op": "loaded", "persistent_bytes": 1 << 20, "iteration": 4,
        "persistent_reserved_bytes": 20 * MiB}
    ready = encode(Ready(True, Estimated(4096, "fake-tensor", reserved_bytes=2 * MiB)))
    assert ready["estimate"]["reserved_bytes"] == 2 * MiB
    assert decode_reply(ready) == Ready(True, Estimated(4096, "fake-tensor",
                                                        reserved_bytes=2 * MiB))
    without = {"op": "attached", "persistent_bytes": 1 << 20, "threads": 1}
    assert decode_reply(without) == Attached(1 << 20, 1)
    for wire in (without, {"op": "estimated", "bytes": 1, "method": "m"}):
        key = "persistent_reserved_bytes" if "threads" in wire else "reserved_bytes"
        with pytest.raises(ValueError, match=repr(key)):  # left out, not null
            decode_reply({**wire, key: None})


def test_which_requests_carry_the_clients_frame() -> None:
    assert client_frame_follows(encode(Run(True, True)))
    assert client_frame_follows(encode(Run(True)))
    assert not client_frame_follows(encode(Run(True, False)))
    assert client_frame_follows(encode(Estimate()))
    assert not client_frame_follows(encode(Estimate(False)))
    assert client_frame_follows(encode(Attach(None)))
    assert not client_frame_follows(encode(Step()))
    assert not client_frame_follows({"op": "nonsense"})
    assert not client_frame_follows(["run"])
    assert not client_frame_follows({"op": ["run"]})


# ---- malformed dicts ----------------------------------------------------------------------------
SAMPLES: list[Message] = [
    Become(1000, 1000, (1000, 27), "ada", "/home/ada", 1),
    Host("/tmp", True), Host(None, False, "/state/7/output.log"), Handover(), Adopt(True),
    Place("cuda:0", 3 << 20, 1.0, "GPU-1", 5, 1 << 20, True, workspace_bytes=34 << 20),
    HandedOver(True, True),
    Attach(GangPlace(0, 2, local=2, store="h:29500", key="salus/ada/j", loopback=True)),
    Estimate(False), Run(True, True), Lease(True), Place("cpu:0", 1 << 20, 1.0),
    Load("/j.py", "make", True, PipelineOptions("even", 2), CachePlace("/c", 1 << 30), "/d",
         GangPlace(1, 2, port=29400)),
    Restore("/d"), Checkpoint("/d", 3), Refuse("job_cancelled", "gone"), Exit("x", "y"),
    Ack(True), Failed("no"), Estimated(4096, "fake-tensor"), EstimateFailed("data-dependent"),
    Attached(1 << 20, 1, True), Loaded(1 << 20, 4), Checkpointed(4, 100, 0.5, "/d/4", 1e9),
    Estimated(4096, "fake-tensor", reserved_bytes=2 * MiB), Attached(1 << 20, 1, True, 2 * MiB),
    Loaded(1 << 20, 4, persistent_reserved_bytes=20 * MiB),
    Ready(True, Estimated(4096, "fake-tensor", reserved_bytes=2 * MiB)),
    CallDone(True, 0.01, 4096, True, 1.0, 1.01, None, {"hits": 1}, {"bytes_sent": 2}),
    StepDone(True, 0.01, None, True, 1.0, 1.01, 3, 0.25, 0.5),
    StepDone(False, 0.01, None, True, 1.0, 1.01, 3, message="boom", traceback="tb"),
    Ready(True, Estimated(4096, "fake-tensor")),
    Ran(3, 2, 1, 0.02, 4096, 1.0, 1.05),
    CallDone(False, 0.01, 1 << 30, True, 1.0, 1.01, "OutOfMemoryError: CUDA out of memory",
             oom=True),
    StepDone(False, 0.01, 1 << 30, True, 1.0, 1.01, 3, message="oom", oom=True),
    Ran(3, 2, 1, 0.02, 1 << 30, 1.0, 1.05, oom=True),
]


def test_an_out_of_memory_failure_carries_its_flag_and_peak() -> None:
    """`oom` is on the wire only when true; a false one is not a form the executor sends."""
    call = encode(CallDone(False, 0.01, 1 << 30, True, 1.0, 1.01, "oom", oom=True))
    assert call["oom"] is True and call["peak"] == 1 << 30
    step = encode(StepDone(False, 0.01, 1 << 30, True, 1.0, 1.01, 3, message="oom", oom=True))
    assert step["oom"] is True
    ran = encode(Ran(2, 2, 1, 0.02, 1 << 30, 1.0, 1.05, oom=True))
    assert ran["oom"] is True
    for wire in (call, step, ran):
        decoded = decode_reply(wire)
        assert isinstance(decoded, CallDone | StepDone | Ran) and decoded.oom
        with pytest.raises(ValueError, match="field 'oom' is left out"):
            decode_reply({**wire, "oom": False})


def _decode(wire: dict[str, Any], msg: Message) -> Message:
    return decode_reply(wire) if isinstance(msg, Reply) else decode_request(wire)


def _fields(wire: dict[str, Any]) -> Iterator[tuple[tuple[str, ...], object]]:
    """(path, value) of every field of `wire` but its op, and of the fields of its structured
    objects (a gang, a pipeline, a load's cache, a ready's estimate; a reply's `cache` and `comm`
    counters are free-form)."""
    for key, value in wire.items():
        if key == "op":
            continue
        yield (key,), value
        structured = key in ("gang", "pipeline", "estimate") or (
            key == "cache" and wire.get("op") == "load")
        if structured and isinstance(value, dict):
            for inner, inner_value in value.items():
                yield (key, inner), inner_value


def _with(wire: dict[str, Any], path: tuple[str, ...], value: object) -> dict[str, Any]:
    if len(path) == 1:
        return {**wire, path[0]: value}
    return {**wire, path[0]: _with(wire[path[0]], path[1:], value)}


_WRONG: dict[type, object] = {bool: 1, int: True, float: True, str: 1, dict: "1", list: "1",
                              type(None): True}
"""A value of another type than a field's (ints are not bools, nor bools ints or floats)."""


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_a_field_of_the_wrong_type_is_named(msg: Message) -> None:
    wire = encode(msg)
    assert _decode(wire, msg) == msg
    for path, value in _fields(wire):
        for wrong in ([[]], _WRONG[type(value)]):
            with pytest.raises(ValueError, match=repr(path[-1])):
                _decode(_with(wire, path, wrong), msg)


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_an_unknown_field_is_refused_and_named(msg: Message) -> None:
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['colour'\]"):
        _decode({**encode(msg), "colour": "blue"}, msg)


@pytest.mark.parametrize(("wire", "field"), [
    ({"op": "lease"}, "'granted' is missing"),
    ({"op": "run", "counted": 1}, "'counted' must be true or false, got 1"),
    ({"op": "checkpoint", "dir": "/d", "job": True}, "'job' must be an int"),
    ({"op": "place", "device": "cpu", "budget_bytes": 1.5, "slowdown": 1.0}, "'budget_bytes'"),
    ({"op": "load", "path": "/j.py", "function": "f", "restore": False, "pipeline": None,
      "cache": None, "dir": None, "gang": {"rank": 0}}, "'load': gang: field 'world' is missing"),
    ({"op": "become", "uid": 0, "gid": 0, "groups": ["wheel"], "user": "u", "home": "/",
      "threads": 1}, "'groups' must be a list of ints"),
    ({"op": "signal", "signum": 0}, "'signum' must be a signal number in 1..64, got 0"),
    ({"op": "signal", "signum": "TERM"}, "'signal': field 'signum' must be an int"),
    ({"op": "teleport"}, "unknown executor request 'teleport'"),
    ({"op": ["run"]}, "unknown executor request"),
])
def test_malformed_requests_name_what_is_wrong(wire: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field.replace("(", r"\(").replace(")", r"\)")):
        decode_request(wire)


@pytest.mark.parametrize(("wire", "field"), [
    ({"op": "call_done", "ok": True, "seconds": 0.1, "peak": None, "counted": "yes",
      "began": 1.0, "ended": 2.0}, "'call_done': field 'counted'"),
    ({"op": "call_done", "ok": True, "seconds": 0.1, "peak": None, "counted": True,
      "began": 1.0}, "'ended' is missing"),
    ({"op": "call_done", "ok": True, "seconds": 0.1, "peak": None, "counted": True,
      "began": 1.0, "ended": 2.0, "forward": False}, "'forward' is left out"),
    ({"op": "ack", "bytes": 4096}, "unknown field\\(s\\) \\['bytes'\\]"),
    ({"op": "ready", "counted": True, "forward": True}, "'forward'"),
    ({"op": "ready", "counted": True, "estimate": 5}, "'estimate'"),
    ({"op": "ready", "counted": True, "estimate": {"op": "ack"}},
     "'ready': estimate: field 'op' must be one of"),
    ({"op": "ready", "counted": True, "estimate": {"op": "estimated", "bytes": 1}},
     "'ready': estimate: field 'method' is missing"),
    ({"op": "hello"}, "unknown executor reply 'hello'"),
    ({"ok": True, "forward": False}, "unknown executor reply None"),
])
def test_malformed_replies_name_what_is_wrong(wire: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        decode_reply(wire)


def test_anything_but_an_object_is_refused() -> None:
    with pytest.raises(ValueError, match="JSON object"):
        decode_request(["op", "run"])
    with pytest.raises(ValueError, match="JSON object"):
        decode_reply(None)


# ---- a real executor refuses what does not decode ----------------------------------------------
EXECUTOR = ("import socket, sys; from salus.daemon.executor.main import serve; "
            "sys.exit(serve(socket.socket(fileno=int(sys.argv[1]))))")


def _reply_for(daemon: Channel, job: int) -> Any:
    """The executor's next reply, which must name `job`, without its address."""
    reply = daemon.recv()
    assert reply.pop("for_job") == job
    return decode_reply(reply)


@pytest.mark.slow
def test_an_executor_answers_a_malformed_message_with_its_reason_and_goes_on(
        tmp_path: Path) -> None:
    ours, theirs = socket.socketpair()
    proc = subprocess.Popen([sys.executable, "-c", EXECUTOR, str(theirs.fileno())],
                            pass_fds=(theirs.fileno(),))
    theirs.close()
    daemon = Channel(ours)
    try:
        me = pwd.getpwuid(os.getuid())
        daemon.send(encode(Become(me.pw_uid, me.pw_gid, tuple(os.getgroups()), me.pw_name,
                                  me.pw_dir, 1)))
        daemon.send(addressed(encode(Host(str(tmp_path), False)), 1))
        assert daemon.recv() == {"op": "ack", "for_job": 1}
        daemon.send(encode(Lease(True)))  # a job's message must name its job
        assert decode_reply(daemon.recv()) == Failed("'lease' must name its job")
        daemon.send(addressed(encode(Lease(True)), 2))
        assert daemon.recv() == {"op": "failed", "message": "this executor hosts no job 2",
                                 "for_job": 2}
        daemon.send({"op": "lease", "granted": 1, "for_job": 1})
        assert _reply_for(daemon, 1) == Failed(
            "executor message 'lease': field 'granted' must be true or false, got 1")
        daemon.send({"op": "teleport", "for_job": 1})
        assert _reply_for(daemon, 1) == Failed("unknown executor request 'teleport'")
        # A request that carries the client's frame: the frame is read, and the client answered.
        daemon.send_many([{"op": "define", "fid": 0, "for_job": 1}, {"op": "define", "fid": 0}])
        failed = _reply_for(daemon, 1)
        assert failed == Failed("executor message 'define': unknown field(s) ['fid']; it has "
                                "['op']", forward=True)
        forwarded = daemon.recv()
        assert forwarded["ok"] is False and forwarded["code"] == "bad_request"
        daemon.send(addressed(encode(Lease(True)), 1))  # still in step
        assert _reply_for(daemon, 1) == Ack()
        daemon.send(encode(Exit("job_cancelled", "done")))
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        daemon.close()


# ---- what a real daemon and its executors say ---------------------------------------------------
CLIENT = textwrap.dedent("""
    import sys
    import torch
    from torch import nn
    import salus.adapters.torch as salus

    name, devices = sys.argv[1], int(sys.argv[2])
    torch.manual_seed(0)
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(s, x):
        s.opt.zero_grad()
        loss = s.model(x).square().mean()
        loss.backward()
        s.opt.step()
        return loss

    def look(s, x):
        return s.model(x).sum()

    job = salus.connect(name=name, iterations=100, devices=devices)
    remote = job.attach(model=model, opt=opt)
    train, ev = remote.iteration(step), remote.function(look)
    for i in range(6):
        train(torch.randn(4, 8))
        if i % 2:
            ev(torch.randn(4, 8))
    remote.call(lambda s: None)
    remote.pull()
    print(job.id, flush=True)
    sys.stdin.readline()
    job.close()
""")

BATCH = textwrap.dedent("""
    import torch
    from torch import nn

    def make_job():
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def iteration(s, batch):
            s.opt.zero_grad()
            loss = s.model(batch).square().mean()
            loss.backward()
            s.opt.step()
            return loss

        def evaluate(s):
            return float(s.model.weight.sum())

        return {"state": {"model": model, "opt": opt}, "iteration": iteration,
                "data": [torch.randn(2, 4) for _ in range(3)], "evaluate": evaluate,
                "every": 2}

    def make_failing():
        job = make_job()

        def iteration(s, batch):
            raise RuntimeError("this iteration always raises")

        job["iteration"] = iteration
        return job
""")


class Wire:
    """What crossed the daemon's executor links: the metas it sent (the supervisor's
    and its pool's `json_frame` see each) and the metas the executors sent back (each as the
    supervisor decodes it)."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.replies: list[dict[str, Any]] = []
        self._json_frame = supervisor_module.json_frame

    def json_frame(self, message: object) -> RawFrame:
        if isinstance(message, dict) and message.get("op") != "fork":  # the zygote's
            request = json.loads(json.dumps(message))
            request.pop("for_job", None)  # the envelope: which job it is for
            self.requests.append(request)
        return self._json_frame(message)

    def decode_reply(self, meta: object) -> Reply:
        self.replies.append(json.loads(json.dumps(meta)))
        return decode_reply(meta)


@contextlib.contextmanager
def running(tmp: Path) -> Iterator[tuple[Daemon, str]]:
    """A real daemon (2 CPU devices, checkpoints in `tmp/state`, first calls estimated) with
    its loop on a thread of this process."""
    config = DaemonConfig(str(tmp / "salusd.sock"), cpu_devices(2, 256 * MiB), "pack",
                          threads=1, standby_executors=1, state_dir=tmp / "state",
                          first_call="estimate")
    daemon = Daemon(config)
    daemon.start()
    thread = threading.Thread(target=daemon.run, name="salusd-loop", daemon=True)
    thread.start()
    try:
        yield daemon, f"unix://{config.socket_path}"
    finally:
        daemon.request_stop()
        thread.join(timeout=90)
        assert not thread.is_alive(), "the daemon did not stop"


def submit(daemon: Daemon, path: Path, function: str, iterations: int) -> JobRecord:
    """A batch job submitted on the daemon's loop thread."""
    me = pwd.getpwuid(os.getuid())
    made: list[JobRecord] = []
    daemon.loop.call_soon_threadsafe(lambda: made.append(daemon.engine.submit_batch(
        Owner(me.pw_name, me.pw_uid, me.pw_gid), function, iterations, str(path), function)))
    wait_until(lambda: made, 120, "the batch job to be submitted")
    return made[0]


@pytest.mark.slow
def test_what_a_real_daemon_and_its_executors_say_decodes_and_encodes_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wire = Wire()
    monkeypatch.setattr(supervisor_module, "json_frame", wire.json_frame)
    monkeypatch.setattr(pool_module, "json_frame", wire.json_frame)  # `Become`
    monkeypatch.setattr(supervisor_module, "decode_reply", wire.decode_reply)
    script = tmp_path / "client.py"
    script.write_text(CLIENT)
    batch = tmp_path / "jobs" / "batch.py"
    batch.parent.mkdir()
    batch.write_text(BATCH)
    with running(tmp_path) as (daemon, address):
        env = {**os.environ, "SALUS_ADDRESS": address, "OMP_NUM_THREADS": "1"}
        clients = [subprocess.Popen([sys.executable, str(script), name, str(devices)], env=env,
                                    text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE)
                   for name, devices in (("single", 1), ("gang", 2))]
        try:
            single, gang = (c.stdout.readline().strip() for c in clients)  # type: ignore[union-attr]
            assert single and gang, [c.communicate(timeout=60) for c in clients]
            with Control(address) as ctl:
                ctl.suspend(single, swap=True)
                wait_until(lambda: any(d["op"] == "swap_out" for d in wire.requests), 120,
                           "the job to be swapped out")
                ctl.resume(single)
            jobs = [submit(daemon, batch, "make_job", 4),
                    submit(daemon, batch, "make_failing", 4)]
            wait_until(lambda: all(j.life.end_state for j in jobs), 120, "the batch jobs to end")
            assert [j.life.end_state for j in jobs] == ["finished", "failed"], [
                j.life.reason for j in jobs]
            _, err = clients[1].communicate("\n", timeout=120)
            assert clients[1].returncode == 0, err
        except BaseException:
            for client in clients:
                client.kill()
                client.wait()
            raise
    clients[0].kill()  # after salusd stopped: the job stays live, to be restored
    clients[0].wait()
    # A restart brings the single job back from the checkpoint taken when it was suspended.
    before = len(wire.replies)
    with running(tmp_path):
        wait_until(lambda: any(r.get("iteration") == 6 and "persistent_bytes" in r
                               for r in wire.replies[before:]), 120, "the job to be restored")

    sent = [decode_request(d) for d in wire.requests]
    for d, msg in zip(wire.requests, sent, strict=True):
        assert encode(msg) == d, (d, msg)
    answered = [decode_reply(d) for d in wire.replies]
    for d, reply in zip(wire.replies, answered, strict=True):
        assert encode(reply) == d, (d, reply)
    assert {type(m) for m in sent} >= {
        Become, Host, Attach, Define, DirectChannel, Estimate, Run, Step, Lease, Place, Load,
        Restore, Checkpoint, SwapOut, Pull, Exit}
    assert {type(r) for r in answered} >= {
        Ack, Attached, Estimated, EstimateFailed, Loaded, Checkpointed, CallDone, StepDone,
        Ready, Ran}
    assert any(isinstance(r, StepDone) and not r.ok and r.traceback for r in answered)
    assert any(isinstance(r, Ready) and r.estimate is not None for r in answered)
    assert any(isinstance(r, CallDone) and r.forward and r.counted for r in answered)  # a gang's
    assert any(isinstance(m, Attach) and m.gang is not None for m in sent)
