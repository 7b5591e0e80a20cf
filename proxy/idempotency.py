"""The state machine of a guarded call: claim, forward, renew, then one way to conclude.

    claim ──claimed──▶ forward ──answer──▶ body ──▶ COMPLETED (replayed for result_ttl)
      │                  │                   ├────▶ released (release_on_status: a retry runs)
      │                  │                   └────▶ COMPLETED, response not kept (410 on replay)
      │                  ├─nothing sent─────────▶ released (502, 401, 503)
      │                  └─timeout, broken, the proxy failed or was cancelled
      │                                          ─▶ FAILED (outcome unknown: replayed, never re-run)
      ├─IN_PROGRESS──▶ wait up to conflict_wait, then 409 + Retry-After
      └─COMPLETED / FAILED──▶ replay with Idempotent-Replayed: true

Every path after a claim ends in ``_conclude`` with a ``Verdict``: release the key, or
record an outcome. It is the same path whether the body was read whole (small, of known
length) or streamed to the caller while it is spooled (``Tee``), and it never raises: a
store that refuses an outcome (too large, out of memory, no replicas) gets the small
"executed, response not kept" record instead; a store out of reach is retried in the
background while the lease lasts; what cannot be recorded at all is a ``critical`` log
line and the ``not_recorded`` metric.

If the caller goes away, the call still finishes and its outcome is recorded. The call
runs in the request's own task: uvicorn does not cancel it when its caller leaves, and at
a graceful shutdown it waits for it (``app.shutdown_seconds``); a call cancelled after
that is recorded FAILED. ``TaskSet`` counts the calls from claim to conclusion, and the
shutdown closes the store only once every one of them is concluded.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import os
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from enum import StrEnum
from typing import Any, NamedTuple

from starlette.responses import Response, StreamingResponse

from proxy.background import TaskSet
from proxy.config import DEFAULT_OFFLOAD_THRESHOLD, IdempotencyConfig, LapsedLease, RouteConfig
from proxy.errors import (
    NOT_SENT,
    KeyReusedWithOtherBody,
    LeaseLost,
    NotExecuted,
    OffloadUnavailable,
    OutcomeUnknown,
    ProxyError,
    RequestInProgress,
    ResponseNotStored,
    StoreRefused,
    StoreUnavailable,
)
from proxy.fence import Fence
from proxy.forwarding import UpstreamResponse
from proxy.journal import Entry, Journal
from proxy.metrics import Metrics
from proxy.offload import STREAM_CHUNK_BYTES, Offload, Spool
from proxy.operation import Operation
from proxy.outcome import StoredResponse
from proxy.reconcile import Finding, Lookup, Reconciler
from proxy.replay import Replayer, answer, reply
from proxy.store import Record, State, Store
from proxy.tracing import note

Forward = Callable[[], Awaitable[UpstreamResponse]]

# Polling interval while a duplicate waits (conflict_wait) for the first call.
CONFLICT_POLL_SECONDS = 0.05
# Pause between attempts to record an outcome while the store is unreachable.
RECORD_RETRY_SECONDS = 0.5
# The longest an outcome the store refused or could not be reached for is asked for again
# while its lease is still renewed (at least lock_ttl): retries get 409 meanwhile.
RECORD_PERSIST_SECONDS = 60.0
# The share of lock_ttl, counted from when a claim or renewal was sent, during which this
# process takes its lease to be alive; past it, a call not yet sent is not sent at all.
LEASE_SAFETY = 0.9


class Outcome(StrEnum):
    """What happened to a request, as logged."""

    EXECUTED = "executed"
    REPLAYED = "replayed"
    CONFLICT = "conflict"
    RELEASED = "released"
    FAILED = "failed"
    PASSED = "passed"
    ACCEPTED = "accepted"
    """Answered 202: a job runs the call (``jobs.py``)."""
    REJECTED = "rejected"
    CACHED = "cached"
    """A guarded call answered from the response cache (a hit, or collapsed onto an
    identical call): recorded as its key's outcome, the tool not called for it."""


class _Owners:
    """Owner tokens: only the holder of a claim may renew, record or release it, so tokens
    never repeat, across processes and replicas: a random prefix per process and a counter
    (they need not be unpredictable: they are never shown). The prefix is drawn again in
    a forked child, so workers forked from one parent never share it."""

    def __init__(self) -> None:
        self._draw()
        os.register_at_fork(after_in_child=self._draw)

    def _draw(self) -> None:
        self.prefix = secrets.token_urlsafe(12) + "."
        self._counter = itertools.count()

    def new(self) -> str:
        return f"{self.prefix}{next(self._counter)}"


OWNERS = _Owners()


class Verdict(NamedTuple):
    """How a call's record ends: released (``stored`` is None), or recorded as ``state``
    (a tuple: built once per call, at half the cost of a frozen dataclass)."""

    stored: StoredResponse | None
    state: State = State.COMPLETED

    @property
    def outcome(self) -> Outcome:
        if self.stored is None:
            return Outcome.RELEASED
        return Outcome.FAILED if self.state is State.FAILED else Outcome.EXECUTED


RELEASE = Verdict(None)
# A FAILED record a reconcile look-up could not settle: replay it as it is.
UNSETTLED = Verdict(None, State.FAILED)
# What a retry gets for a call whose lease lapsed with nothing recorded.
LAPSED = StoredResponse.of_problem(
    OutcomeUnknown(
        "the proxy executing this call stopped renewing its lease (it stopped, or lost the "
        "store) before recording an outcome; the call may have been executed",
        status=502,
    )
)


class ResponseCutShort(Exception):
    """The first caller's streamed response ends early: its recording failed."""


class Tee:
    """The first caller's side of a body that is spooled and recorded as it arrives.

    The recording never waits for the caller: it appends to the spool, and the caller
    reads the spool at its own pace, from its own offset (a slow caller cannot make the
    upstream exchange run out of time). What is spooled is readable at once, except the
    last chunk, which waits for the outcome to be concluded: the caller never gets a
    complete response that a retry would not get too.
    """

    def __init__(self, spool: Spool) -> None:
        spool.hold()
        self._spool = spool
        self._readable = 0
        self._ended = False
        self._error: BaseException | None = None
        self._changed = asyncio.Event()

    def readable(self, upto: int) -> None:
        """The first ``upto`` bytes of the spool may be sent."""
        self._readable = upto
        self._changed.set()

    def end(self) -> None:
        """Concluded: the whole body may be sent."""
        self._ended = True
        self.readable(self._spool.size)

    def fail(self, exc: BaseException) -> None:
        """The response is cut short with ``exc``."""
        self._error = exc
        self._changed.set()

    async def chunks(self) -> AsyncIterator[bytes]:
        offset = 0
        try:
            while True:
                if self._error is not None:
                    raise ResponseCutShort("the response was cut short") from self._error
                if offset < self._readable:
                    size = min(STREAM_CHUNK_BYTES, self._readable - offset)
                    chunk = self._spool.read(offset, size)
                    offset += len(chunk)
                    yield chunk
                elif self._ended:
                    return
                else:
                    self._changed.clear()
                    await self._changed.wait()
        finally:
            self._spool.close()


class Lease:
    """One claim held by a call in this process; ``stop`` ends its renewals."""

    __slots__ = (
        "_clock",
        "_leases",
        "lookup",
        "lost",
        "op",
        "owner",
        "released",
        "retain",
        "stopped",
        "valid_until",
    )

    def __init__(
        self, leases: Leases, op: Operation, owner: str, clock: Callable[[], float]
    ) -> None:
        self._leases = leases
        self._clock = clock
        """The loop's clock (``loop.time``), kept: on CPython 3.11 every
        ``asyncio.get_running_loop()`` is a ``getpid`` system call, and the fence reads it
        on every send."""
        self.op = op
        self.owner = owner
        self.stopped = False
        self.retain = False
        """A job's lease (``jobs.py``): a verdict to release keeps the record claimed
        (``released`` is set), for the job's next attempt."""
        self.released = False
        self.lookup: Lookup | None = None
        self.valid_until = math.inf
        """Until when this process may take the lease to be its own (the loop's clock)."""
        self.lost = False
        """Set by a renewal that found the record no longer this lease's."""

    def check(self) -> float:
        """Raise ``LeaseLost`` unless the call may still be sent under this lease (the
        fence, ``fence.py``): not if a renewal found it taken over, nor once it may have
        lapsed (this process stalled, or could not renew it, for most of lock_ttl); else
        how long it lasts yet, as far as this process knows (seconds)."""
        if self.lost:
            self._leases.lapsed(self, "taken_over")
            raise LeaseLost(
                "this call's key was taken over by another attempt while the call waited "
                "to be sent (its lease lapsed): it was not sent; a retry replays the other "
                "attempt's outcome"
            )
        left = self.valid_until - self._clock()
        if left <= 0:
            self._leases.lapsed(self, "lapsed")
            raise LeaseLost(
                "this call waited to be sent (a lock, a limit, a token, a stall) longer "
                "than its lease could be kept (lock_ttl): it was not sent; retry it"
            )
        return left

    def stop(self) -> None:
        """No more renewals."""
        self.stopped = True
        self._leases.drop(self)


class Leases:
    """The claims one route holds in this process, renewed together every lock_ttl/3.

    One timer per route rather than one per call: most calls end before any renewal,
    and then a lease costs a set insertion and removal. A claim made just after a tick
    waits one interval for its first renewal, one made just before is renewed early:
    either way, well before its lock_ttl ends. The renewals of one tick ride one Redis
    round trip (see ``RedisStore``).
    """

    def __init__(self, guard: Guard) -> None:
        self._guard = guard
        self._interval = guard.policy.lock_ttl / 3
        self._held: set[Lease] = set()
        self._timer: asyncio.TimerHandle | None = None

    def hold(
        self,
        op: Operation,
        owner: str,
        claimed_at: float | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> Lease:
        """A lease on a claim sent at ``claimed_at`` (the loop's clock; default now), on
        ``loop`` (default: the running one)."""
        if loop is None:
            loop = asyncio.get_running_loop()
        lease = Lease(self, op, owner, loop.time)
        sent = loop.time() if claimed_at is None else claimed_at
        lease.valid_until = sent + self._guard.policy.lock_ttl * LEASE_SAFETY
        self._held.add(lease)
        if self._timer is None:
            self._timer = loop.call_later(self._interval, self._tick)
        return lease

    def drop(self, lease: Lease) -> None:
        self._held.discard(lease)

    def lapsed(self, lease: Lease, how: str) -> None:
        """Log a call refused by its fence (``how``: lapsed, taken_over)."""
        guard = self._guard
        guard.log.error(
            "lease_lost_before_sending", route=guard.route.name, key=lease.op.label, how=how
        )

    def _tick(self) -> None:
        self._timer = None
        if not self._held:
            return
        self._guard.tasks.spawn(self._renew_all(list(self._held)))
        self._timer = asyncio.get_running_loop().call_later(self._interval, self._tick)

    async def _renew_all(self, leases: list[Lease]) -> None:
        await asyncio.gather(*(self._renew(lease) for lease in leases))

    async def _renew(self, lease: Lease) -> None:
        guard, op = self._guard, lease.op
        try:
            policy = guard.policy
            sent = asyncio.get_running_loop().time()
            held = await guard.store.renew(op.key, lease.owner, policy.lock_ttl, guard._record_ttl)
        except StoreUnavailable as exc:  # keep trying: the store may be back in time
            guard.log.warning(
                "lease_renewal_failed", route=guard.route.name, key=op.label, error=exc.detail
            )
            return
        if held:
            lease.valid_until = sent + guard.policy.lock_ttl * LEASE_SAFETY
        if not held and not lease.stopped:  # stopped: recorded or released meanwhile
            lease.lost = True  # the fence refuses to send it now
            self.drop(lease)
            guard.log.warning("lease_lost", route=guard.route.name, key=op.label)


class Guard:
    """Idempotency for one route."""

    def __init__(
        self,
        route: RouteConfig,
        policy: IdempotencyConfig,
        store: Store,
        tasks: TaskSet,
        log: Any,
        offload: Offload | None = None,
        metrics: Metrics | None = None,
        journal: Journal | None = None,
    ) -> None:
        self.route = route
        self.journal = journal
        self.reconciler = (
            None
            if route.reconcile is None
            else Reconciler(route.name, route.reconcile, log, metrics or Metrics())
        )
        self.policy = policy
        self.store = store
        self.tasks = tasks
        self.log = log
        self.offload = offload
        self.metrics = metrics or Metrics()
        self.replayer = Replayer(route.name, offload, log)
        self._warned_large = False
        self._methods = frozenset(policy.methods)
        self._release_on = frozenset(policy.release_on_status)
        self._reexecute_lapsed = policy.on_lapsed_lease is LapsedLease.REEXECUTE
        # An IN_PROGRESS record lives result_ttl past the end of its lease, so a lapsed
        # lease is always seen (FAILED), never mistaken for a free key.
        self._record_ttl = policy.result_ttl + policy.lock_ttl
        # Bodies up to this size (of a known length) are read whole; others stream to the
        # caller while they are spooled, so memory stays bounded whatever the tool sends.
        self._read_whole = offload.threshold if offload else DEFAULT_OFFLOAD_THRESHOLD
        self._leases = Leases(self)
        # The largest outcome recorded with its body (above it: "executed, not kept").
        self._stored_limit = store.max_payload_bytes
        if policy.max_stored_bytes is not None:
            self._stored_limit = min(self._stored_limit, policy.max_stored_bytes)

    def guards(self, method: str) -> bool:
        return method in self._methods

    async def run(
        self, op: Operation, forward: Forward, fence: Fence, lookup: Lookup | None = None
    ) -> tuple[Response, Outcome]:
        """Execute once, replay, or refuse as a conflict. ``forward`` checks ``fence``
        right before it sends (``fence.py``); ``lookup`` sends the route's reconcile
        look-up (with the caller's credentials), when it has one."""
        claimed = await self.claim(op, lookup)
        if isinstance(claimed, Lease):
            return await self.execute(claimed, forward, fence)
        return claimed, Outcome.REPLAYED

    async def claim(self, op: Operation, lookup: Lookup | None = None) -> Lease | Response:
        """Claim ``op``'s key: its lease, to ``execute`` the call under right away (the
        app builds its send only then: a replay needs none); or the replay of the
        outcome recorded; or refuse as a conflict (409 once conflict_wait is over)."""
        owner = OWNERS.new()
        policy = self.policy
        loop = asyncio.get_running_loop()
        deadline = loop.time() + policy.conflict_wait
        while True:
            started = loop.time()
            claim = await self.store.claim(
                op.key,
                op.fingerprint,
                owner,
                policy.lock_ttl,
                self._record_ttl,
                reexecute_lapsed=self._reexecute_lapsed,
            )
            if claim.record is None:
                break
            stored = self._existing(claim.record, op, deadline - loop.time())
            if stored is None:
                await asyncio.sleep(min(CONFLICT_POLL_SECONDS, max(deadline - loop.time(), 0)))
                continue
            if claim.record.state is State.FAILED and lookup is not None:
                settled = await self._reconcile_failed(op, lookup, claim.record)
                if settled is RELEASE:
                    continue  # the tool says it did not run: claim it and execute
                stored = settled.stored or stored
            if stored.ref is None:  # the body is at hand (no object store round trip)
                return reply(stored, replayed=True)
            return await self.replayer.response(op.label, stored)
        if claim.previous is not None:
            self.log.info(
                "replanned", route=self.route.name, key=op.label, previous_args_hash=claim.previous
            )
        lease = self._leases.hold(op, owner, started, loop)
        lease.lookup = lookup
        return lease

    # -- jobs (``jobs.py``): the same record, claimed at submission, concluded by a worker

    async def claim_job(self, op: Operation, owner: str, queued_ttl: float) -> Record | None:
        """Claim ``op`` for a job (a lease of ``queued_ttl``, the longest a job waits in its
        queue); None once claimed, else the record found (422 if it is another call's)."""
        claim = await self.store.claim(  # a finished record found is replayed by ``run``:
            op.key,  # counted there, not here
            op.fingerprint,
            owner,
            queued_ttl,
            self.job_record_ttl(queued_ttl),
            replay=False,
        )
        if claim.record is not None:
            self._check_fingerprint(claim.record, op)
        return claim.record

    def job_record_ttl(self, queued_ttl: float) -> float:
        return job_record_ttl(self.policy, queued_ttl)

    def job_lease(self, op: Operation, owner: str, renewed_at: float) -> Lease:
        """A lease for a job's attempt, its record renewed at ``renewed_at`` (loop clock):
        renewed while the call runs; a verdict to release keeps the record (``retain``)."""
        lease = self._leases.hold(op, owner, renewed_at)
        lease.retain = True
        return lease

    async def execute(
        self, lease: Lease, forward: Forward, fence: Fence | None = None
    ) -> tuple[Response, Outcome]:
        """Forward a call under ``lease`` (a claim's, or a job's attempt's) and conclude
        its record. ``forward`` checks the lease right before it sends: itself (a send
        built after the claim), or through ``fence``, armed with it now."""
        if fence is not None:
            fence.arm(lease)
        self.tasks.enter()
        try:
            try:
                upstream = await forward()  # the fence is checked at the send, after every wait
            except NOT_SENT:
                await self._conclude(lease, RELEASE)
                raise
            except OutcomeUnknown as exc:
                return await self._unknown(lease, exc)
            except Exception as exc:  # the proxy's own failure, the request perhaps sent
                return await self._unknown(lease, self._lost(lease, "failed", repr(exc)))
            except asyncio.CancelledError:  # a shutdown that gave up waiting for the call
                await self._unknown(lease, self._lost(lease, "cancelled", "shut down"), ask=False)
                raise
            except BaseException:
                lease.stop()
                raise
            # Bodies small and of a known length are read whole; others stream to the
            # caller while they are spooled (memory up to the threshold, then a file).
            if upstream.length is None or upstream.length > self._read_whole:
                return self._tee(lease, upstream)
            return await self._read_whole_and_conclude(lease, upstream)
        finally:
            self.tasks.leave()

    async def conclude_unknown(self, lease: Lease, exc: OutcomeUnknown, successor: str) -> bool:
        """Record ``exc``: the outcome of a job's call is unknown (never sent again); but
        never over an outcome its worker recorded meanwhile: False then. The record is
        ``successor``'s from then on, so the attempt taken over can no longer write it. A
        store out of reach raises ``StoreUnavailable`` (the job's next taker concludes it)."""
        lease.stop()
        op, payload = lease.op, StoredResponse.of_problem(exc).encode()
        return await self.store.complete(
            op.key,
            lease.owner,
            op.fingerprint,
            State.FAILED,
            payload,
            self.policy.result_ttl,
            replace_outcome=False,
            successor=successor,
        )

    def _check_fingerprint(self, record: Record, op: Operation) -> None:
        if record.fingerprint != op.fingerprint:
            raise KeyReusedWithOtherBody(
                "this Idempotency-Key was first used with a different request "
                "(method, path, query or body)"
            )

    def _existing(self, record: Record, op: Operation, wait_left: float) -> StoredResponse | None:
        """The outcome to replay, or None to wait more; raises 422 or 409."""
        self._check_fingerprint(record, op)
        if record.lapsed:
            return LAPSED
        if record.state is not State.IN_PROGRESS:
            return StoredResponse.decode(record.payload)
        if wait_left > 0:
            return None
        retry_after = max(1, math.ceil(min(self.policy.retry_after, record.ttl)))
        note("tool_proxy.lease.owner", record.owner.rpartition(".")[0])  # its replica (or job)
        raise RequestInProgress(
            "a request with this Idempotency-Key is being executed; retry later",
            headers={"Retry-After": str(retry_after)},
        )

    async def _read_whole_and_conclude(
        self, lease: Lease, upstream: UpstreamResponse
    ) -> tuple[Response, Outcome]:
        try:
            body = await upstream.read()
        except Exception as exc:
            verdict = self._verdict_cut(lease, upstream, exc)
            await self._conclude(lease, verdict)
            problem = exc if isinstance(exc, ProxyError) else self._lost(lease, "failed", repr(exc))
            failure = verdict.stored or StoredResponse.of_problem(problem)
            return reply(failure, replayed=False), verdict.outcome
        except asyncio.CancelledError:
            await self._unknown(lease, self._lost(lease, "cancelled", "shut down"), ask=False)
            raise
        try:
            verdict = await self._verdict(lease, upstream, body)
        except asyncio.CancelledError:  # uploading it: the answer is at hand, keep it
            self.tasks.spawn(self._verdict_and_conclude(lease, upstream, body))
            raise
        await self._conclude(lease, verdict)
        return answer(upstream.status, upstream.headers, body), verdict.outcome

    async def _verdict_and_conclude(
        self, lease: Lease, upstream: UpstreamResponse, body: bytes | Spool
    ) -> None:
        """Finish, in the background, a conclusion whose request was cancelled."""
        try:
            await self._conclude(lease, await self._verdict(lease, upstream, body))
        finally:
            if isinstance(body, Spool):
                body.close()

    def _lost(self, lease: Lease, how: str, why: str) -> OutcomeUnknown:
        """The proxy itself ``how`` (failed, cancelled) while the call was in flight: the
        request may have reached the tool, so the outcome is unknown."""
        self.log.error(f"{how}_in_flight", route=self.route.name, key=lease.op.label, error=why)
        return OutcomeUnknown(
            f"the proxy {how} ({why}) while this call was in flight; it may have been executed",
            status=502,
        )

    async def _unknown(
        self, lease: Lease, exc: OutcomeUnknown, *, ask: bool = True
    ) -> tuple[Response, Outcome]:
        """Record that the outcome is unknown (replayed, never run again), unless the
        route's reconcile look-up says the call ran (its answer is recorded) or did not
        (the key is released)."""
        failure = StoredResponse.of_problem(exc)
        if ask and self.reconciler is not None and lease.lookup is not None:
            try:
                finding, found = await self.reconciler.ask(lease.op, lease.lookup, "at_failure")
            except asyncio.CancelledError:
                self.tasks.spawn(self._conclude(lease, Verdict(failure, State.FAILED)))
                raise
            if finding is Finding.FOUND and found is not None:
                await self._conclude(lease, Verdict(found))
                return reply(found, replayed=False), Outcome.EXECUTED
            if finding is Finding.NOT_FOUND:
                await self._conclude(lease, RELEASE)
                not_run = NotExecuted(
                    f"{exc.detail}; the tool says it did not run it: a retry executes it",
                    status=exc.status,
                )
                return reply(StoredResponse.of_problem(not_run), replayed=False), Outcome.RELEASED
        await self._conclude(lease, Verdict(failure, State.FAILED))
        return reply(failure, replayed=False), Outcome.FAILED

    async def _reconcile_failed(self, op: Operation, lookup: Lookup, record: Record) -> Verdict:
        """A retry met a FAILED record: ask the tool again (bounded) and settle the record
        with what it says. The verdict's response (None: keep replaying the failure), or
        RELEASE once the record is released."""
        assert self.reconciler is not None
        if not self.reconciler.may_ask_again(op.key):
            return UNSETTLED
        finding, found = await self.reconciler.ask(op, lookup, "on_retry")
        if finding is Finding.UNKNOWN or (finding is Finding.FOUND and found is None):
            return UNSETTLED
        payload = b"" if found is None else found.encode()
        state = None if found is None else State.COMPLETED
        try:
            settled = await self.store.settle(
                op.key, state, payload, self.policy.result_ttl, owner=record.owner
            )  # only the failure it asked about: never a newer one of another call
        except StoreUnavailable as exc:
            self.log.warning("reconcile_not_settled", route=self.route.name, error=exc.detail)
            return Verdict(found) if found is not None else UNSETTLED
        if not settled:  # someone else settled it meanwhile: replay what is there
            return UNSETTLED
        return RELEASE if found is None else Verdict(found)

    async def _verdict(
        self, lease: Lease, upstream: UpstreamResponse, body: bytes | Spool
    ) -> Verdict:
        """The verdict on a call whose tool answered in full."""
        if upstream.status in self._release_on:
            return RELEASE
        try:
            stored = self._inline(upstream, body)
            return Verdict(stored or await self._offloaded(upstream, body))
        except Exception as exc:  # the proxy's own failure: the tool did answer
            return Verdict(self._not_kept(lease, exc))

    def _verdict_cut(self, lease: Lease, upstream: UpstreamResponse, exc: Exception) -> Verdict:
        """The verdict on a call whose tool answered but whose body was not had whole: the
        connection broke or timed out (FAILED), or the proxy could not keep it (its spool
        failed, a bug: executed, not kept). A release status still releases."""
        if upstream.status in self._release_on:
            return RELEASE
        if isinstance(exc, OutcomeUnknown):
            self.log.error(
                "outcome_unknown_mid_body",
                route=self.route.name,
                key=lease.op.label,
                error=exc.detail,
            )
            return Verdict(StoredResponse.of_problem(exc), State.FAILED)
        return Verdict(self._not_kept(lease, exc))

    def _tee(self, lease: Lease, upstream: UpstreamResponse) -> tuple[Response, Outcome]:
        """Stream the body to the caller while it is spooled and recorded in the background."""
        threshold = self.offload.threshold if self.offload else DEFAULT_OFFLOAD_THRESHOLD
        spool = Spool(threshold)
        tee = Tee(spool)
        self.tasks.spawn(self._spool_and_conclude(lease, upstream, spool, tee))
        response = StreamingResponse(tee.chunks(), upstream.status)
        length = (
            [] if upstream.length is None else [(b"content-length", str(upstream.length).encode())]
        )
        response.raw_headers = [*upstream.headers, *length]
        released = upstream.status in self._release_on
        return response, Outcome.RELEASED if released else Outcome.EXECUTED

    async def _spool_and_conclude(
        self, lease: Lease, upstream: UpstreamResponse, spool: Spool, tee: Tee
    ) -> None:
        try:
            try:
                async for chunk in upstream.stream():
                    tee.readable(spool.size)  # all but this chunk
                    spool.write(chunk)
            except Exception as exc:
                await self._conclude(lease, self._verdict_cut(lease, upstream, exc))
                tee.fail(exc)
                return
            except asyncio.CancelledError:
                await self._unknown(lease, self._lost(lease, "cancelled", "shut down"), ask=False)
                raise
            try:
                verdict = await self._verdict(lease, upstream, spool)
            except asyncio.CancelledError:  # uploading it: the answer is at hand, keep it
                spool.hold()
                self.tasks.spawn(self._verdict_and_conclude(lease, upstream, spool))
                raise
            await self._conclude(lease, verdict)
            tee.end()
        except BaseException as exc:
            lease.stop()
            tee.fail(exc)
            raise
        finally:
            spool.close()

    def _inline(self, upstream: UpstreamResponse, body: bytes | Spool) -> StoredResponse | None:
        """The outcome to record when it stays in the store; None when the body goes to
        object storage. One above max_stored_bytes, or above what the store can hold, is
        replaced by a problem (the call is never re-run)."""
        size = body.size if isinstance(body, Spool) else len(body)
        offload = self.offload
        if offload is not None and offload.wants(size):
            return None
        limit = self._stored_limit
        if size > limit:
            self.log.warning("response_not_stored", route=self.route.name, bytes=size)
            return StoredResponse.of_problem(
                ResponseNotStored(
                    f"the call was executed once; its {size}-byte response was above this "
                    f"route's limit on stored responses ({limit} bytes) and cannot be replayed"
                )
            )
        if size > DEFAULT_OFFLOAD_THRESHOLD:
            self._warn_if_large(size)
        return StoredResponse.of(upstream.status, upstream.headers, _bytes(body))

    async def _offloaded(self, upstream: UpstreamResponse, body: bytes | Spool) -> StoredResponse:
        """The outcome with its body in object storage (or inline, if the object store
        fails and the body fits the store)."""
        assert self.offload is not None
        size = body.size if isinstance(body, Spool) else len(body)
        try:
            ref = await self.offload.put(self.route.name, body, keep_for=self.policy.result_ttl)
        except OffloadUnavailable as exc:
            self.log.warning(
                "offload_failed_stored_inline", route=self.route.name, bytes=size, error=exc.detail
            )
            if size > self._stored_limit:
                raise
            return StoredResponse.of(upstream.status, upstream.headers, _bytes(body))
        return StoredResponse.of(upstream.status, upstream.headers, b"").offloaded(ref)

    def _warn_if_large(self, size: int) -> None:
        if self.offload is None and not self._warned_large:
            self._warned_large = True
            self.log.warning(
                "large_response_stored_inline",
                route=self.route.name,
                bytes=size,
                note="configure offload to keep the store small",
            )

    def _not_kept(self, lease: Lease, exc: Exception) -> StoredResponse:
        """What is recorded when the tool answered but the proxy could not keep the answer
        (its spool failed, the store refused it, a bug): the call is never run again."""
        reason = _reason(exc)
        self.log.error(
            "response_not_stored", route=self.route.name, key=lease.op.label, error=reason
        )
        return StoredResponse.of_problem(
            ResponseNotStored(
                "the call was executed once; its response could not be kept by the proxy "
                f"({reason}) and cannot be replayed"
            )
        )

    # -- the one way a claim ends ---------------------------------------------------------

    async def _conclude(self, lease: Lease, verdict: Verdict) -> None:
        """Release the key or record the outcome. Never raises but CancelledError, and then
        finishes in the background (the shutdown waits for it)."""
        try:
            if verdict.stored is None:
                await self._release(lease)
            else:
                await self._record(lease, verdict.state, verdict.stored)
        except asyncio.CancelledError:
            self.tasks.spawn(self._conclude(lease, verdict))  # each step is idempotent
            raise
        except Exception as exc:
            lease.stop()
            self._not_recorded(lease, _reason(exc))

    async def _release(self, lease: Lease) -> None:
        lease.stop()
        if lease.retain:  # a job: its next attempt (or its end) decides
            lease.released = True
            return
        try:
            await self.store.release(lease.op.key, lease.owner)
        except StoreUnavailable as exc:
            self._event(lease, "release_failed")
            self.log.warning(
                "release_failed",
                route=self.route.name,
                key=lease.op.label,
                error=exc.detail,
                note="journaled: the key is released when the store is back",
            )
            if not await self._journal(lease, None, b""):
                self.log.error("release_lost", route=self.route.name, key=lease.op.label)

    async def _record(self, lease: Lease, state: State, stored: StoredResponse) -> None:
        """Record the outcome; a refused one as "not kept"; if the store is out of reach,
        keep trying in the background while the lease lasts."""
        payload = stored.encode()
        try:
            await self._complete(lease, state, payload)
        except StoreRefused as exc:
            await self._record_refused(lease, state, payload, exc)
            return
        except StoreUnavailable as exc:
            await self._keep_for_later(lease, state, payload, exc)
            return
        except Exception as exc:  # a bug, or a store that broke its contract
            await self._record_refused(lease, state, payload, exc)
            return
        lease.stop()

    async def _record_refused(
        self, lease: Lease, state: State, payload: bytes, exc: Exception
    ) -> None:
        """The store refused the outcome (or failed on it): record the small "executed,
        not kept" outcome instead (a FAILED one is small already). A store that refuses
        even that (out of memory: the refused command's own buffers count against its
        limit) is asked again in the background while the lease is ours: retries get 409
        meanwhile, then 410, never "unknown" for a call the proxy knows ran."""
        self._event(lease, "refused")
        self.log.error(
            "outcome_refused", route=self.route.name, key=lease.op.label, error=_reason(exc)
        )
        if state is not State.FAILED:
            state, payload = State.COMPLETED, self._not_kept(lease, exc).encode()
        try:
            await self._complete(lease, state, payload)
        except StoreRefused:
            self.tasks.spawn(self._record_later(lease, state, payload))
            return
        except StoreUnavailable as again:
            await self._keep_for_later(lease, state, payload, again)
            return
        lease.stop()

    async def _complete(self, lease: Lease, state: State, payload: bytes) -> None:
        op = lease.op
        done = await self.store.complete(
            op.key, lease.owner, op.fingerprint, state, payload, self.policy.result_ttl
        )
        if not done:
            self.log.error(
                "lease_lost_before_recording",
                route=self.route.name,
                key=op.label,
                note="another owner took the key over; its outcome is kept",
            )

    async def _keep_for_later(
        self, lease: Lease, state: State, payload: bytes, exc: StoreUnavailable
    ) -> None:
        """The store is out of reach: the outcome goes to the journal (on disk before the
        caller gets the end of its answer), or, failing that, is retried from memory."""
        self.log.error(
            "outcome_not_recorded_yet",
            route=self.route.name,
            key=lease.op.label,
            error=exc.detail,
            note="kept in the journal until the store answers",
        )
        if not await self._journal(lease, state, payload):
            self.tasks.spawn(self._record_later(lease, state, payload))

    async def _journal(self, lease: Lease, state: State | None, payload: bytes) -> bool:
        """Keep the outcome (``state`` None: the release) in the journal; False if there is
        no journal or it cannot be written. The lease goes on until the store has it."""
        if self.journal is None:
            return False
        op = lease.op
        entry = Entry(
            self.route.name,
            op.key.slot,
            op.key.name,
            lease.owner,
            op.fingerprint,
            None if state is None else state.value,
            self.policy.result_ttl,
            payload,
            op.label,
        )
        try:
            await self.journal.keep(entry, lease.stop)
        except OSError as exc:
            self.log.error(
                "journal_failed", route=self.route.name, key=op.label, error=_reason(exc)
            )
            return False
        self._event(lease, "journaled")
        return True

    async def _record_later(self, lease: Lease, state: State, payload: bytes) -> None:
        """Ask the store again, every RECORD_RETRY_SECONDS, while the lease lasts: for
        lock_ttl, and longer while renewals keep it (RECORD_PERSIST_SECONDS at most), not
        once a renewal found it taken over. A refused outcome is asked for in its small
        form."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            while not lease.lost and loop.time() < min(
                max(started + self.policy.lock_ttl, lease.valid_until),
                started + RECORD_PERSIST_SECONDS,
            ):
                await asyncio.sleep(RECORD_RETRY_SECONDS)
                try:
                    await self._complete(lease, state, payload)
                except StoreRefused as exc:
                    if state is State.COMPLETED and not payload.startswith(b"v2 410"):
                        payload = self._not_kept(lease, exc).encode()  # in its small form
                    continue
                except StoreUnavailable:
                    continue
                self._event(lease, "recorded_late")
                self.log.info("outcome_recorded_late", route=self.route.name, key=lease.op.label)
                return
            self._not_recorded(lease, "the store did not take it while the lease was ours")
        except Exception as exc:
            self._not_recorded(lease, _reason(exc))
        finally:
            lease.stop()

    def _not_recorded(self, lease: Lease, why: str) -> None:
        self._event(lease, "not_recorded")
        self.log.critical(
            "outcome_not_recorded",
            route=self.route.name,
            key=lease.op.label,
            error=why,
            note="the record stays IN_PROGRESS until its lease ends",
        )

    def _event(self, lease: Lease, event: str) -> None:
        self.metrics.outcome_event(self.route.name, event)


def job_record_ttl(policy: IdempotencyConfig, queued_ttl: float) -> float:
    """A job's record lives result_ttl past the longest its lease can last."""
    return policy.result_ttl + max(queued_ttl, policy.lock_ttl)


def _bytes(body: bytes | Spool) -> bytes:
    """The body as bytes (a spool is read whole)."""
    return body.whole() if isinstance(body, Spool) else body


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ProxyError):
        return exc.detail
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return repr(exc)
