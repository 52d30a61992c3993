"""Any message of the executor protocol: a request (`requests.py`) or a reply (`replies.py`).
A new message is its type, in the union and `__all__` of its module there."""

from salus.daemon.wire.executor_ops.replies import Reply
from salus.daemon.wire.executor_ops.requests import Request

Message = Request | Reply

__all__ = ["Message"]
