"""Work that outlives the request that started it.

Guarded calls run in their request's own task, not here. A ``TaskSet`` holds the
recordings that go on after their request has answered (an offloaded body streamed to
the caller while it is spooled and recorded) and the lease renewals. The app owns one;
shutdown waits for it, so those outcomes are recorded.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class TaskSet:
    """Strong references to running tasks, and a way to wait for all of them."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: whoever awaited it has seen it, or it was logged

    def __len__(self) -> int:
        return len(self._tasks)

    async def drain(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for every task; True if all finished."""
        if not self._tasks:
            return True
        _, pending = await asyncio.wait(set(self._tasks), timeout=seconds)
        return not pending
