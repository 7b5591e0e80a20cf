"""Lease renewal: one timer per route renews every claim the process holds."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from proxy.forwarding import UpstreamResponse
from proxy.idempotency import Outcome
from proxy.operation import Operation
from proxy.outcome import StoredResponse
from proxy.store import RecordKey, State
from proxy.store.memory import MemoryStore
from tests.guards import OP, EventLog, make_guard, run

pytestmark = pytest.mark.anyio

LOCK_TTL = 0.3  # renewed every 0.1 s


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def claim(store: MemoryStore, n: int) -> Operation:
    op = Operation(RecordKey(f"tool||plan|{n}", "f" * 64), f"plan:{n}", "f" * 64)
    claimed = await store.claim(op.key, op.fingerprint, f"owner{n}", LOCK_TTL, 60)
    assert claimed.record is None
    return op


async def test_held_claims_outlive_their_lock_ttl_and_stopped_ones_expire() -> None:
    store, log = MemoryStore(), EventLog()
    guard = make_guard(store, log, lock_ttl=LOCK_TTL)
    ops = [await claim(store, n) for n in range(3)]
    leases = [guard._leases.hold(op, f"owner{n}") for n, op in enumerate(ops)]
    leases[2].stop()
    await asyncio.sleep(LOCK_TTL * 2.5)  # several lock_ttl: only renewals keep them
    for op in ops[:2]:
        record = await store.get(op.key)
        assert record is not None and record.state is State.IN_PROGRESS and record.ttl > 0
    lapsed = await store.get(ops[2].key)
    assert lapsed is not None and lapsed.ttl == 0  # not renewed: its lease lapsed
    for lease in leases[:2]:
        lease.stop()
    assert log.events == []


async def test_a_lease_taken_over_is_reported_and_no_longer_renewed() -> None:
    store, log = MemoryStore(), EventLog()
    guard = make_guard(store, log, lock_ttl=LOCK_TTL)
    op = await claim(store, 1)
    lease = guard._leases.hold(op, "someone-else")  # the store knows another owner
    await asyncio.sleep(LOCK_TTL / 3 * 1.5)  # one tick
    assert log.events == ["lease_lost"]
    await asyncio.sleep(LOCK_TTL / 3 * 2)  # more ticks: reported once
    assert log.events == ["lease_lost"]
    lease.stop()


class Answer(UpstreamResponse):
    """The tool's answer, already read (no connection behind it)."""

    def __init__(self) -> None:
        super().__init__(200, [(b"content-type", b"application/json")], 2)

    async def read(self) -> bytes:
        return b"{}"


async def forward() -> UpstreamResponse:
    return Answer()


async def test_an_answer_the_proxy_fails_to_keep_is_recorded_as_not_stored(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A failure of the proxy's own after the tool answered: the caller gets the answer,
    the record says the call ran (410 on retries), and it is never run again."""
    store, log = MemoryStore(), EventLog()
    guard = make_guard(store, log, lock_ttl=LOCK_TTL)

    def broken(*args: Any) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(guard, "_inline", broken)
    op = OP
    response, outcome = await run(guard, op, forward)
    assert (response.status_code, outcome) == (200, Outcome.EXECUTED)
    record = await store.get(op.key)
    assert record is not None and record.state is State.COMPLETED
    assert StoredResponse.decode(record.payload).status == 410
    assert "response_not_stored" in log.events
    assert not guard._leases._held


async def test_a_recording_that_fails_unexpectedly_stops_the_renewals(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The tool answered: the caller gets its answer, the small "not kept" record is
    tried, and when even that fails the loss is a critical event; the lease is not
    renewed for ever (the key would answer 409 for the life of the process)."""
    store, log = MemoryStore(), EventLog()
    guard = make_guard(store, log, lock_ttl=LOCK_TTL)
    attempts: list[bytes] = []

    async def broken(*args: Any) -> bool:
        attempts.append(args[4])
        raise RuntimeError("a bug")

    monkeypatch.setattr(store, "complete", broken)
    op = OP
    response, outcome = await run(guard, op, forward)
    assert (response.status_code, outcome) == (200, Outcome.EXECUTED)
    assert [StoredResponse.decode(p).status for p in attempts] == [200, 410]
    assert log.events[-1] == "outcome_not_recorded"
    assert not guard._leases._held
    await asyncio.sleep(LOCK_TTL * 2)
    lapsed = await store.get(op.key)
    assert lapsed is not None and lapsed.ttl == 0  # not renewed: the lease ran out


async def test_a_failure_of_the_proxys_own_in_flight_is_recorded_as_outcome_unknown() -> None:
    """The request may have reached the tool: the call is FAILED (replayed), not re-run."""
    store, log = MemoryStore(), EventLog()
    guard = make_guard(store, log, lock_ttl=LOCK_TTL)

    async def broken() -> UpstreamResponse:
        raise RuntimeError("a bug")

    op = OP
    response, outcome = await run(guard, op, broken)
    assert (response.status_code, outcome) == (502, Outcome.FAILED)
    record = await store.get(op.key)
    assert record is not None and record.state is State.FAILED
    assert "failed_in_flight" in log.events
    assert not guard._leases._held


async def test_a_call_cancelled_in_flight_is_recorded_as_outcome_unknown() -> None:
    """uvicorn cancels requests a graceful shutdown stopped waiting for: the request may
    have reached the tool, so the call is FAILED (replayed), not left to run again."""
    store, log = MemoryStore(), EventLog()
    guard = make_guard(store, log, lock_ttl=LOCK_TTL)
    sent = asyncio.Event()

    async def slow() -> UpstreamResponse:
        sent.set()
        await asyncio.sleep(30)
        raise AssertionError("not cancelled")

    op = OP
    call = asyncio.ensure_future(run(guard, op, slow))
    await sent.wait()
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    record = await store.get(op.key)
    assert record is not None and record.state is State.FAILED
    assert "cancelled_in_flight" in log.events
    assert not guard._leases._held
