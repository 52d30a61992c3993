"""The executor protocol's messages on the wire: each is its `op` and its fields, in the one
typed codec (`salusd/wire/typed.py`); a request is told from another, and a reply from another,
by its op."""

from __future__ import annotations

import typing
from typing import Any

from salus.daemon.wire.executor_ops.messages import Message
from salus.daemon.wire.executor_ops.replies import REPLIES, HandedOver, Reply
from salus.daemon.wire.executor_ops.requests import REQUESTS, Request, Wire
from salus.daemon.wire.typed import from_wire, to_wire

__all__ = ["client_frame_follows", "decode_reply", "decode_request", "encode", "frames_after"]

_BY_OP_REQUEST = {cls.op: cls for cls in REQUESTS}
_BY_OP_REPLY = {cls.op: cls for cls in REPLIES}


def encode(msg: Message) -> Wire:
    """The wire dict of `msg`."""
    return to_wire(msg)


def _decode(d: object, by_op: dict[str, type], side: str) -> Any:
    if type(d) is not dict:
        raise ValueError(f"an executor {side} is a JSON object, not {type(d).__name__}")
    op = d.get("op")
    cls = by_op.get(op) if type(op) is str else None
    if cls is None:
        raise ValueError(f"unknown executor {side} {op!r}")
    return from_wire(cls, d, f"executor message {op!r}")


def decode_request(d: object) -> Request:
    """The request the daemon sent as `d`; ValueError names what is wrong."""
    return typing.cast(Request, _decode(d, _BY_OP_REQUEST, "request"))


def decode_reply(d: object) -> Reply:
    """The reply (or unsolicited message) the executor sent as `d`; ValueError names what is
    wrong."""
    return typing.cast(Reply, _decode(d, _BY_OP_REPLY, "reply"))


def frames_after(reply: Reply) -> int:
    """How many frames follow `reply` on the executor's link: the client's answer where it is
    `forward`; a job's bundle, its channel's socket and its pool after a `HandedOver`."""
    if isinstance(reply, HandedOver):
        return int(reply.ok) + int(reply.channel) + int(reply.pool)
    return int(getattr(reply, "forward", False))


# The requests followed by the client's frame (unless their `frame` field says not), as
# their types declare it.
_FRAME_OPS = frozenset(cls.op for cls in REQUESTS if getattr(cls, "client_frame", False))


def client_frame_follows(meta: object) -> bool:
    """Whether the client's frame follows the request meta `meta`, as received (the frame is
    read even when the meta does not decode, so the stream stays in step)."""
    if not isinstance(meta, dict):
        return False
    op = meta.get("op")
    return type(op) is str and op in _FRAME_OPS and bool(meta.get("frame", True))
