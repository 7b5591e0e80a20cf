"""The one way a claim ends: refusals by the store, failures of the proxy's own, the lease.

The Guard runs against real stores (SQLite, a real redis-server); the tool's answer is
an object already read, so each test sets up exactly the failure it is about.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from proxy.app import create_app
from proxy.background import TaskSet
from proxy.config import parse_config
from proxy.errors import OutcomeUnknown
from proxy.forwarding import UpstreamResponse
from proxy.idempotency import OWNERS, Guard, Outcome
from proxy.metrics import Metrics
from proxy.outcome import StoredResponse
from proxy.store import RecordKey, State
from proxy.store.memory import MemoryStore
from proxy.store.sqlite import SQLiteStore
from tests.conftest import new_key, route
from tests.guards import OP, EventLog, make_guard, run
from tests.servers import CountingTool, RedisServer, ThreadServer

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Answer(UpstreamResponse):
    """A tool's 200 answer whose body is at hand (no connection behind it)."""

    def __init__(self, body: bytes, *, streamed: bool = False) -> None:
        length = None if streamed else len(body)
        headers = [(b"content-type", b"application/octet-stream")]
        super().__init__(200, headers, length)
        self.body = body

    async def read(self) -> bytes:
        return self.body

    async def stream(self) -> AsyncIterator[bytes]:
        for start in range(0, len(self.body), 65536):
            yield self.body[start : start + 65536]


def answering(body: bytes, *, streamed: bool = False) -> Any:
    async def forward() -> UpstreamResponse:
        return Answer(body, streamed=streamed)

    return forward


async def body_of(response: Any) -> bytes:
    if hasattr(response, "body_iterator"):
        return b"".join([chunk async for chunk in response.body_iterator])
    return bytes(response.body)


def events(metrics: Metrics, event: str) -> float:
    value = metrics.registry.get_sample_value(
        "tool_proxy_outcome_events_total", {"route": "tool", "event": event}
    )
    return value or 0.0


@pytest.mark.parametrize("streamed", [False, True], ids=["read-whole", "streamed"])
async def test_an_outcome_sqlite_refuses_is_recorded_as_executed_not_kept(
    tmp_path: Path, streamed: bool
) -> None:
    """SQLite refuses a value above its length limit (SQLITE_TOOBIG): retrying cannot
    help, so the small "executed, response not kept" record is written at once."""
    store = SQLiteStore(f"sqlite://{tmp_path}/state.db")
    await store.open()
    limit = 150_000

    def lower_the_limit() -> None:
        store._conn().setlimit(sqlite3.SQLITE_LIMIT_LENGTH, limit)

    await store._run(lower_the_limit)
    log, metrics = EventLog(), Metrics()
    guard = make_guard(store, log, metrics)
    body = os.urandom(limit + 1000) if not streamed else os.urandom(3 * limit)
    try:
        response, outcome = await run(guard, OP, answering(body, streamed=streamed))
        assert (response.status_code, outcome) == (200, Outcome.EXECUTED)
        assert await body_of(response) == body  # the caller gets the tool's answer
        await guard.tasks.drain(5)
        record = await store.get(OP.key)
        assert record is not None and record.state is State.COMPLETED
        assert StoredResponse.decode(record.payload).status == 410
        assert "outcome_refused" in log.events
        assert events(metrics, "refused") == 1
        assert not guard._leases._held
    finally:
        await store.close()


async def test_redis_refusing_every_write_is_a_critical_event_not_a_500(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOREPLICAS refuses the outcome and its small form alike: the caller still gets
    the tool's answer; the small form is asked for again while the lease lasts, then the
    loss is a critical log line and a metric, and the lease is not renewed for ever."""
    import proxy.idempotency as idempotency
    from proxy.store.redis import RedisStore

    monkeypatch.setattr(idempotency, "RECORD_RETRY_SECONDS", 0.05)
    server = RedisServer().start()
    store = RedisStore(server.url)
    admin = redis.Redis.from_url(server.url)
    log, metrics = EventLog(), Metrics()
    guard = make_guard(store, log, metrics, lock_ttl=0.6)

    async def forward() -> UpstreamResponse:
        admin.config_set("min-replicas-to-write", 1)  # while the tool works
        return Answer(b'{"charged": 42}')

    try:
        response, outcome = await run(guard, OP, forward)
        assert (response.status_code, outcome) == (200, Outcome.EXECUTED)
        assert bytes(response.body) == b'{"charged": 42}'
        assert await guard.tasks.drain(10)
        ending = [e for e in log.events if e != "lease_renewal_failed"][-3:]
        assert ending == ["outcome_refused", "response_not_stored", "outcome_not_recorded"]
        assert events(metrics, "not_recorded") == 1
        assert not guard._leases._held
    finally:
        await store.close()
        admin.close()
        server.stop()


async def test_an_unexpected_failure_while_streaming_is_recorded_not_lost(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bug after the tool answered a streamed body: recorded as executed, not kept."""
    store, log = MemoryStore(), EventLog()
    guard = make_guard(store, log)

    def broken(*args: Any) -> StoredResponse:
        raise RuntimeError("a bug")

    monkeypatch.setattr(guard, "_inline", broken)
    body = os.urandom(300_000)
    response, outcome = await run(guard, OP, answering(body, streamed=True))
    assert (response.status_code, outcome) == (200, Outcome.EXECUTED)
    assert await body_of(response) == body
    await guard.tasks.drain(5)
    record = await store.get(OP.key)
    assert record is not None and record.state is State.COMPLETED
    assert StoredResponse.decode(record.payload).status == 410


async def test_a_failed_recording_of_an_unknown_outcome_stops_the_renewals(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The FAILED path: recording raises something unexpected; the lease is not renewed
    for ever (the key would answer 409 until a restart)."""
    store, log = MemoryStore(), EventLog()
    guard = make_guard(store, log, lock_ttl=0.3)

    async def broken(*args: Any) -> bool:
        raise RuntimeError("a bug")

    async def times_out() -> UpstreamResponse:
        raise OutcomeUnknown("no answer in time", status=504)

    monkeypatch.setattr(store, "complete", broken)
    response, outcome = await run(guard, OP, times_out)
    assert (response.status_code, outcome) == (504, Outcome.FAILED)
    assert "outcome_not_recorded" in log.events
    assert not guard._leases._held


async def test_a_cut_body_with_a_release_status_still_releases() -> None:
    store, log = MemoryStore(), EventLog()
    guard = make_guard(store, log)

    class Cut(Answer):
        async def read(self) -> bytes:
            raise OutcomeUnknown("the connection broke mid-body")

    async def forward() -> UpstreamResponse:
        answer = Cut(b"")
        answer.status = 503
        return answer

    response, outcome = await run(guard, OP, forward)
    assert (response.status_code, outcome) == (502, Outcome.RELEASED)
    assert await store.get(OP.key) is None  # a retry executes


def test_owner_tokens_differ_in_a_forked_child() -> None:
    """Workers forked from one parent never share owner tokens (each would take the
    other's claim as its own)."""
    parent = OWNERS.new()
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        os.write(writer, OWNERS.new().encode())
        os._exit(0)
    os.close(writer)
    child = os.read(reader, 200).decode()
    os.close(reader)
    os.waitpid(pid, 0)
    assert child.rsplit(".", 1)[0] != parent.rsplit(".", 1)[0]
    assert OWNERS.new().rsplit(".", 1)[0] == parent.rsplit(".", 1)[0]


def test_a_response_above_what_the_store_holds_streams_through_and_replays_410(
    tool: CountingTool,
) -> None:
    """Without offload, a body the store cannot hold is never read whole into memory:
    it streams to the caller (spooled to a file), and retries get 410."""
    store = MemoryStore()
    store.max_payload_bytes = 200_000
    config = parse_config({"routes": [route(tool.url)]}, env={})
    proxy = ThreadServer(create_app(config, store=store)).start()
    try:
        key = new_key({"a": 1})
        size = 3 * 1024 * 1024
        first = httpx.post(
            f"{proxy.url}/tools/big?size={size}", json={"a": 1}, headers={"Idempotency-Key": key}
        )
        assert first.status_code == 200 and len(first.content) == size
        replay = httpx.post(
            f"{proxy.url}/tools/big?size={size}", json={"a": 1}, headers={"Idempotency-Key": key}
        )
        assert replay.status_code == 410
        assert replay.headers["idempotent-replayed"] == "true"
        assert tool.count(key) == 1
    finally:
        proxy.stop()


async def test_a_failing_background_task_is_logged() -> None:
    log = EventLog()
    tasks = TaskSet(log)

    async def broken() -> None:
        raise RuntimeError("a bug")

    tasks.spawn(broken())
    assert await tasks.drain(1)
    await asyncio.sleep(0)
    assert log.events == ["background_task_failed"]


async def test_a_release_the_store_cannot_take_is_journaled_and_applied_later(
    tmp_path: Path,
) -> None:
    """The tool answered a release status while the store was out of reach: the release
    is kept in the journal (release_failed), and the key is free once it is applied."""
    from proxy.errors import StoreUnavailable
    from proxy.journal import Journal

    class Unreachable(MemoryStore):
        down = True

        async def release(self, key: RecordKey, owner: str) -> bool:
            if self.down:
                raise StoreUnavailable("redis store: connection refused")
            return await super().release(key, owner)

    store, log = Unreachable(), EventLog()
    journal = Journal(tmp_path, store, log)
    journal.open()
    guard = make_guard(store, log)
    guard.journal = journal

    async def busy() -> UpstreamResponse:
        answer = Answer(b"busy")
        answer.status = 503
        return answer

    response, outcome = await run(guard, OP, busy)
    assert (response.status_code, outcome) == (503, Outcome.RELEASED)
    assert "release_failed" in log.events and len(journal) == 1
    record = await store.get(OP.key)
    assert record is not None and record.state is State.IN_PROGRESS  # not free yet
    store.down = False
    await journal.flush()
    assert await store.get(OP.key) is None  # released: a retry executes
    assert "journal_released" in log.events
    journal.close()


async def test_a_call_is_not_sent_when_the_proxy_stalled_past_its_lease() -> None:
    """The claim came back later than lock_ttl (the process stalled): another call may
    have taken the key over or had it released, so this one is not sent at all."""

    class Slow(MemoryStore):
        async def claim(self, *args: Any, **kwargs: Any) -> Any:
            claimed = await super().claim(*args, **kwargs)
            await asyncio.sleep(0.35)  # the stall, after the claim was made
            return claimed

    store, log = Slow(), EventLog()
    guard = make_guard(store, log, lock_ttl=0.3)
    sent: list[int] = []

    async def forward() -> UpstreamResponse:
        sent.append(1)
        return Answer(b"{}")

    from proxy.errors import UpstreamUnreachable

    with pytest.raises(UpstreamUnreachable):
        await run(guard, OP, forward)
    assert sent == []
    assert "lease_lost_before_sending" in log.events
    assert await store.get(OP.key) is None  # released: nothing was sent


async def test_a_refused_late_recording_falls_back_to_the_small_form(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No journal: the outcome is retried from memory; when the store then refuses it,
    the small "not kept" form is recorded instead of retrying the whole one."""
    import proxy.idempotency as idempotency
    from proxy.errors import StoreRefused, StoreUnavailable

    monkeypatch.setattr(idempotency, "RECORD_RETRY_SECONDS", 0.01)
    answers: list[Exception | None] = [StoreUnavailable("down"), StoreRefused("OOM"), None]

    class Flaky(MemoryStore):
        async def complete(self, *args: Any, **kwargs: Any) -> bool:
            failure = answers.pop(0) if answers else None
            if failure is not None:
                raise failure
            return await super().complete(*args, **kwargs)

    store, log = Flaky(), EventLog()
    guard = make_guard(store, log)
    response, outcome = await run(guard, OP, answering(b'{"ok": true}'))
    assert (response.status_code, outcome) == (200, Outcome.EXECUTED)
    assert await guard.tasks.drain(5)
    record = await store.get(OP.key)
    assert record is not None and StoredResponse.decode(record.payload).status == 410
    assert "outcome_recorded_late" in log.events


async def test_a_call_cancelled_during_its_reconcile_lookup_is_still_recorded() -> None:
    store, log = MemoryStore(), EventLog()
    spec = {"name": "tool", "path_prefix": "/t", "upstream": "http://127.0.0.1:9"}
    config = parse_config(
        {"routes": [{**spec, "idempotency": {}, "reconcile": {"path": "/c/{key}"}}]}, env={}
    )
    (route_config,) = config.routes
    assert route_config.idempotency is not None
    guard = Guard(route_config, route_config.idempotency, store, TaskSet(), log)
    asking = asyncio.Event()

    async def times_out() -> UpstreamResponse:
        raise OutcomeUnknown("no answer in time", status=504)

    async def lookup(method: str, target: str, seconds: float) -> UpstreamResponse:
        asking.set()
        await asyncio.sleep(30)
        raise AssertionError("not cancelled")

    call = asyncio.ensure_future(run(guard, OP, times_out, lookup))
    await asking.wait()
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert await guard.tasks.drain(5)
    record = await store.get(OP.key)
    assert record is not None and record.state is State.FAILED
    assert not guard._leases._held


async def test_a_lapsed_lease_is_seen_even_when_result_ttl_equals_lock_ttl() -> None:
    """The record lives result_ttl past the end of its lease: never a free key."""

    class Clock:
        now = 100.0

        def __call__(self) -> float:
            return self.now

    clock = Clock()
    store, log = MemoryStore(clock), EventLog()
    guard = make_guard(store, log, lock_ttl=1.0, result_ttl=1.0)
    seen: list[Any] = []

    async def dies_mid_call() -> UpstreamResponse:
        clock.now += 1.5  # past the lease (and past result_ttl from the claim)
        seen.append(await store.get(OP.key))
        raise RuntimeError("stop here")

    await run(guard, OP, dies_mid_call)
    assert seen[0] is not None and seen[0].state is State.IN_PROGRESS


def test_an_answer_redis_has_no_memory_for_is_recorded_not_kept_not_unknown(
    make_proxy: Any, tool: CountingTool
) -> None:
    """Redis with ``noeviction`` over its limit while the tool answers 8 MB: the answer
    is refused, and so is its small "executed, not kept" form until Redis has memory
    again (the refused command's buffers count against the limit). The small form is
    asked for again while the lease lasts: retries get 409 meanwhile, then 410, never an
    unknown outcome for a call the proxy knows ran."""
    server = RedisServer().start()
    admin = redis.Redis.from_url(server.url)
    try:
        admin.config_set("maxmemory-policy", "noeviction")
        proxy = make_proxy(route(tool.url, lock_ttl="3s"), store=server.url)
        key = new_key({"report": "big"})
        headroom = int(admin.info("memory")["used_memory"]) + 4 * 1024 * 1024

        def tighten() -> None:  # while the tool works: over the limit for a while
            admin.config_set("maxmemory", 1)
            threading.Timer(1.5, admin.config_set, ("maxmemory", headroom)).start()

        tool.before = tighten
        first = httpx.post(
            f"{proxy.url}/tools/x?size=8000000",
            json={"report": "big"},
            headers={"Idempotency-Key": key},
            timeout=30,
        )
        assert first.status_code == 200 and len(first.content) == 8_000_000
        deadline = time.monotonic() + 20
        while True:
            retry = httpx.post(
                f"{proxy.url}/tools/x?size=8000000",
                json={"report": "big"},
                headers={"Idempotency-Key": key},
                timeout=30,
            )
            if retry.status_code != 409 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert retry.status_code == 410, retry.text
        assert retry.json()["type"] == "urn:tool-proxy:problem:response-not-stored"
        assert tool.count(key) == 1
    finally:
        admin.close()
        server.stop()
