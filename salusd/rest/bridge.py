"""Runs functions on the daemon's I/O thread for the REST handlers and awaits their results."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import Any, TypeVar

from salus.daemon.loop import Loop
from salus.daemon.wire.errors import SalusError

T = TypeVar("T")


class EngineTimeout(SalusError):
    code = "timeout"


class EngineBridge:
    """`await bridge.run(fn)` runs `fn()` on the engine's thread; `await bridge.later(fn)` runs
    `fn(done)` there and resolves when the engine calls `done(result)` (a checkpoint)."""

    def __init__(self, loop: Loop, *, timeout_s: float = 30.0) -> None:
        self.loop = loop
        self.timeout_s = timeout_s

    async def run(self, fn: Callable[[], T]) -> T:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def job() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting handler
                future.set_exception(exc)

        self.loop.call_soon_threadsafe(job)
        return await self._wait(future, self.timeout_s)

    async def later(self, fn: Callable[[Callable[[Any], None]], None],
                    timeout_s: float) -> Any:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def done(result: Any) -> None:
            if not future.done():
                future.set_result(result)

        def job() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                fn(done)
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting handler
                future.set_exception(exc)

        self.loop.call_soon_threadsafe(job)
        return await self._wait(future, timeout_s)

    @staticmethod
    async def _wait(future: concurrent.futures.Future[T], timeout_s: float) -> T:
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)
        except TimeoutError:
            raise EngineTimeout(f"salusd did not answer within {timeout_s:.0f} s") from None
