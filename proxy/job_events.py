"""The events of jobs as this process's readers follow them: one store read per job.

Many readers of one operation (SSE streams, callers waiting for their answer within
``wait``) share one ``Watch``: it reads the job's new events from the store when the
queue's change feed names the job (``Queue.changes``: one subscription per process),
or every ``POLL_SECONDS`` at the latest (a change the feed missed, or one made by
another process of a SQLite store), and hands them to every reader. A reader that
comes late, or reconnects with ``Last-Event-ID``, starts from the events kept in the
store: nothing is lost with a dropped connection.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from proxy.errors import ProxyError
from proxy.store import Job, Queue

# The longest a watched job goes without its events being read from the store.
POLL_SECONDS = 1.0
# Pause before subscribing again to a change feed that failed.
RESUBSCRIBE_SECONDS = 1.0


class Watch:
    """One job's events, read from the store for every reader in this process."""

    def __init__(self, hub: Hub, id: str) -> None:
        self.id = id
        self.events: list[Job] = []
        self.readers = 0
        self._hub = hub
        self._poked = asyncio.Event()
        self._grown = asyncio.Event()
        self._closed = False
        self._gone = False
        self._task = asyncio.create_task(self._read_forever())

    @property
    def ended(self) -> bool:
        """The job ended, or is gone from the store (it expired, e.g. while queued): its
        readers' streams end."""
        return self._closed or self._gone or (bool(self.events) and self.events[-1].state.terminal)

    def poke(self) -> None:
        """The job changed: read its events now."""
        self._poked.set()

    async def _read_forever(self) -> None:
        while not self.ended:
            self._poked.clear()
            after = self.events[-1].seq if self.events else 0
            try:
                new = await self._hub.queue.events(self.id, after)
            except ProxyError as exc:  # the store is away, or answered nonsense: poll again
                self._hub.log.warning("job_events_unreadable", job=self.id, error=exc.detail)
                new = []
            if new is None:  # expired: nothing more will ever come
                self._gone = True
                self._grown.set()
                return
            if new:
                self.events.extend(new)
                grown, self._grown = self._grown, asyncio.Event()
                grown.set()
            if self.ended:
                return
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(POLL_SECONDS):
                    await self._poked.wait()

    async def follow(self, after: int) -> AsyncIterator[Job]:
        """The events after ``after``, as they come, up to the job's end."""
        index = 0
        while True:
            while index < len(self.events):
                event = self.events[index]
                index += 1
                if event.seq > after:
                    yield event
            if self.ended:
                return
            await self._grown.wait()

    def close(self) -> None:
        """No more reading: the readers' streams end (at shutdown)."""
        self._closed = True
        self._task.cancel()
        self._grown.set()


class Hub:
    """The watches of this process, and its one subscription to the queue's changes."""

    def __init__(self, queue: Queue, log: Any) -> None:
        self.queue = queue
        self.log = log
        self._watches: dict[str, Watch] = {}
        self._feed: asyncio.Task[None] | None = None

    @contextlib.asynccontextmanager
    async def watch(self, id: str) -> AsyncIterator[Watch]:
        """The shared watch of job ``id`` while the caller reads it."""
        watch = self._watches.get(id)
        if watch is None:
            watch = self._watches[id] = Watch(self, id)
            self._subscribe()
        watch.readers += 1
        try:
            yield watch
        finally:
            watch.readers -= 1
            if not watch.readers:
                if self._watches.get(id) is watch:
                    del self._watches[id]
                watch.close()

    async def follow(self, id: str, after: int) -> AsyncIterator[Job]:
        """Job ``id``'s events after ``after`` until it ends."""
        async with self.watch(id) as watch:
            async for event in watch.follow(after):
                yield event

    async def ended(self, id: str, seconds: float) -> Job | None:
        """The job once it has ended, if it ends within ``seconds``; else None."""
        if seconds <= 0:
            return None
        async with self.watch(id) as watch:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(seconds):
                    async for event in watch.follow(0):
                        if event.state.terminal:
                            return event
        return None

    def poke(self, id: str) -> None:
        """A change made in this process: the watch need not wait for the feed."""
        watch = self._watches.get(id)
        if watch is not None:
            watch.poke()

    def _subscribe(self) -> None:
        if self._feed is None or self._feed.done():
            self._feed = asyncio.create_task(self._read_feed())

    async def _read_feed(self) -> None:
        """Poke the watches of the jobs the change feed names, while any is watched."""
        while self._watches:
            changes = self.queue.changes()
            try:
                async for id in changes:
                    self.poke(id)
                    if not self._watches:
                        return
            except ProxyError as exc:
                self.log.warning("job_feed_lost", error=exc.detail)
            finally:
                await changes.aclose()  # type: ignore[attr-defined]
            await asyncio.sleep(RESUBSCRIBE_SECONDS)

    def close(self) -> None:
        for watch in self._watches.values():
            watch.close()
        self._watches.clear()
        if self._feed is not None:
            self._feed.cancel()
