"""What a graceful shutdown must wait for before it closes the store.

Guarded calls run in their requests' own tasks; ``enter`` and ``leave`` count them from
claim to conclusion. Work that outlives a request (the recording of a streamed body,
a retried recording while the store is out of reach, lease renewals) runs in tasks of
the set. ``drain`` waits until both are done, including tasks spawned while it waits
(a call cancelled by the shutdown records its outcome then).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class TaskSet:
    """Strong references to running tasks, a count of calls in flight, and a way to wait
    for all of them."""

    def __init__(self, log: Any = None) -> None:
        self._log = log
        self._tasks: set[asyncio.Task[Any]] = set()
        self._calls = 0
        self._idle: asyncio.Event | None = None

    def spawn(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def enter(self) -> None:
        """A call is in flight until ``leave``."""
        self._calls += 1

    def leave(self) -> None:
        self._calls -= 1
        if self._idle is not None:  # a drain waits
            self._check_idle()

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None and self._log:
            self._log.error("background_task_failed", task=task.get_name(), error=repr(exc))
        self._check_idle()

    def _check_idle(self) -> None:
        if self._idle is not None and not self._tasks and self._calls == 0:
            self._idle.set()

    def __len__(self) -> int:
        return len(self._tasks) + self._calls

    async def drain(self, seconds: float) -> bool:
        """Wait up to ``seconds`` until no call is in flight and no task runs; True if so."""
        self._idle = asyncio.Event()
        self._check_idle()
        try:
            async with asyncio.timeout(seconds):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True
