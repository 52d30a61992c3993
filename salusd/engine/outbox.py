"""The engine's executors: the job each serves, and how messages reach them.

Every message sent to an executor gets exactly one reply, in order. What an executor owes is
kept once, by the port (`ports.ExecutorPort.send`), which hands each `Sent` back with its reply
or with the executor's death. A message to a gang goes to every replica, and their replies
merge into one (`GangReply`).
"""

from __future__ import annotations

from salus.daemon.engine.gang import GangReply
from salus.daemon.engine.ports import ExecutorPort, LaneKey, OnDone, Sent
from salus.daemon.engine.registry import Answer, JobRecord
from salus.daemon.wire.executor_ops import Request
from salus.daemon.wire.frames import RawFrame


class Outbox:
    """Executors by identity and the job each serves."""

    def __init__(self, port: ExecutorPort) -> None:
        self.port = port
        self._by_executor: dict[int, JobRecord] = {}

    def acquire(self, record: JobRecord, count: int) -> None:
        """`count` executors for the job (its replicas), known from now on."""
        record.replicas = [self.port.acquire(record, record.cwd, replica=r)
                           for r in range(count)]
        for executor in record.replicas:
            self._by_executor[id(executor)] = record

    def job_of(self, executor: object) -> JobRecord | None:
        return self._by_executor.get(id(executor))

    def alive(self, executor: object) -> bool:
        """Whether `executor` is known and has not died."""
        return id(executor) in self._by_executor

    def forget(self, executor: object) -> JobRecord | None:
        """`executor` is gone: its job (None: it served none any longer)."""
        return self._by_executor.pop(id(executor), None)

    def drop_replicas(self, record: JobRecord) -> None:
        """The job's state did not load: retire its executors (it may attach again)."""
        for replica in record.replicas:
            self._by_executor.pop(id(replica), None)
            self.port.retire(replica)
        record.replicas = []

    def kill_all(self, record: JobRecord) -> None:
        """Kill every executor of the job that is still running."""
        for executor in record.replicas:
            if self.alive(executor):
                self.port.kill(executor)

    def signal(self, executor: object, signum: int) -> None:
        """Send `signum` to `executor` if it is still running."""
        if self.alive(executor):
            self.port.send_signal(executor, signum)

    def retire(self, executor: object, code: str, message: str) -> None:
        """Let `executor` go once it answered what it was sent (if it is still running)."""
        if self.alive(executor):
            self.port.retire(executor, code, message)

    def retire_all(self, record: JobRecord, code: str, message: str) -> None:
        for executor in record.replicas:
            self.retire(executor, code, message)

    def send_to(self, executor: object, msg: Request, frame: RawFrame | None = None, *,
                answer: Answer | None = None, lane: LaneKey | None = None,
                on_done: OnDone | None = None) -> None:
        """Send one message to `executor`; its reply goes to `answer` (the client's frame)
        and `on_done`."""
        self._queue(executor, Sent(msg, answer, lane, on_done), frame)

    def _queue(self, executor: object, sent: Sent, frame: RawFrame | None) -> None:
        self.port.send(executor, sent, frame)

    def send(self, record: JobRecord, msg: Request, frame: RawFrame | None = None, *,
             answer: Answer | None = None, lane: LaneKey | None = None,
             on_done: OnDone | None = None) -> None:
        """Send one message to the job's executor (a gang's replica 0)."""
        self.send_to(record.executor, msg, frame, answer=answer, lane=lane, on_done=on_done)

    def send_all(self, record: JobRecord, msgs: list[Request], *,
                 lanes: list[LaneKey] | None = None, on_done: OnDone | None = None,
                 answer: Answer | None = None, frame: RawFrame | None = None) -> None:
        """Send `msgs[r]` (and the client's `frame`, to each) to replica r of the job; their
        replies come back as one (replica 0's `Sent` with the merged reply; replica 0's reply
        frame goes to `answer`). A job of one replica gets a plain `send`."""
        if record.gang == 1:
            self.send(record, msgs[0], frame, answer=answer, lane=lanes[0] if lanes else None,
                      on_done=on_done)
            return
        frames = [frame, *(frame.duplicate() for _ in msgs[1:])] if frame is not None else (
            [None] * record.gang)
        gang = GangReply(record.gang, list(lanes or []))
        for replica, (executor, msg) in enumerate(zip(record.replicas, msgs, strict=True)):
            sent = Sent(msg, answer if replica == 0 else None,
                        lanes[replica] if lanes else None, on_done if replica == 0 else None,
                        gang, replica)
            if replica == 0:
                gang.head = sent
            self._queue(executor, sent, frames[replica])
