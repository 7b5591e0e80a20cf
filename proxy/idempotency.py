"""The state machine of a guarded call: claim, forward, renew, record or release, replay.

    claim ──claimed──▶ forward ──answer──────────▶ COMPLETED (replayed for result_ttl)
      │                  │   └─release_on_status──▶ released (the next call executes)
      │                  ├─no connection──────────▶ released, 502
      │                  └─timeout / broken───────▶ FAILED, 504/502 (replayed, never re-run)
      ├─IN_PROGRESS──▶ wait up to conflict_wait, then 409 + Retry-After
      └─COMPLETED / FAILED──▶ replay with Idempotent-Replayed: true

If the caller goes away, the call still finishes and its outcome is recorded, so the
caller's retry gets a replay. The call runs in the request's own task: uvicorn never
cancels that task when its caller leaves (it tells the app through ``receive()``, which
the proxy does not wait on then), and at a graceful shutdown it waits for requests in
flight for the longest route timeout plus 5 s; a call still running then is cancelled
and recorded FAILED (outcome unknown), never left to run again. A task and a shield of
its own per call cost about 18 µs per first execution (measured with bench/hot_path.py).
Bodies streamed while they are recorded (offload) are recorded by a task of their own
(see ``Tee``).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import math
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from starlette.responses import Response, StreamingResponse

from proxy.background import TaskSet
from proxy.config import DEFAULT_OFFLOAD_THRESHOLD, IdempotencyConfig, RouteConfig
from proxy.errors import (
    ArgsHashMismatch,
    IdentityProviderUnavailable,
    KeyReusedWithOtherBody,
    MissingIdempotencyKey,
    OffloadUnavailable,
    OutcomeUnknown,
    RequestInProgress,
    ResponseNotStored,
    StoredResponseUnavailable,
    StoreUnavailable,
    Unauthorized,
    UpstreamUnreachable,
)
from proxy.forwarding import UpstreamResponse
from proxy.keys import KeyKind, fingerprint, parse_composite, parse_opaque
from proxy.offload import STREAM_CHUNK_BYTES, ObjectRef, Offload, Spool
from proxy.outcome import StoredResponse
from proxy.store import Record, RecordKey, State, Store

Forward = Callable[[], Awaitable[UpstreamResponse]]

# Polling interval while a duplicate waits (conflict_wait) for the first call.
CONFLICT_POLL_SECONDS = 0.05
# Pause between attempts to record an outcome while the store is unreachable.
RECORD_RETRY_SECONDS = 0.5


class Outcome(StrEnum):
    """What happened to a request, as logged."""

    EXECUTED = "executed"
    REPLAYED = "replayed"
    CONFLICT = "conflict"
    RELEASED = "released"
    FAILED = "failed"
    PASSED = "passed"
    REJECTED = "rejected"


@dataclass(frozen=True, slots=True)
class Operation:
    """A guarded request: where its record lives and what its body means."""

    key: RecordKey
    label: str
    fingerprint: str


def _bytes(body: bytes | Spool) -> bytes:
    """The body as bytes (a spool is read whole)."""
    return body.whole() if isinstance(body, Spool) else body


class ResponseCutShort(Exception):
    """The first caller's streamed response ends early: its recording failed."""


class Tee:
    """The first caller's side of a body that is spooled and recorded as it arrives.

    The recording never waits for the caller: it appends to the spool, and the caller
    reads the spool at its own pace, from its own offset (a slow caller cannot make the
    upstream exchange run out of time). What is spooled is readable at once, except the
    last chunk, which waits for the outcome to be recorded: the caller never gets a
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
        """Recorded: the whole body may be sent."""
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

    __slots__ = ("_leases", "op", "owner", "stopped")

    def __init__(self, leases: Leases, op: Operation, owner: str) -> None:
        self._leases = leases
        self.op = op
        self.owner = owner
        self.stopped = False

    def stop(self) -> None:
        """No more renewals."""
        self.stopped = True
        self._leases.drop(self)


class Leases:
    """The claims one route holds in this process, renewed together every lock_ttl/3.

    One timer per route rather than one per call: most calls end before any renewal,
    and then a lease costs a set insertion and removal (a timer per call cost about
    3 µs). A claim made just after a tick waits one interval for its first renewal, one
    made just before is renewed early: either way, well before its lock_ttl ends. The
    renewals of one tick ride one Redis round trip (see ``RedisStore``).
    """

    def __init__(self, guard: Guard) -> None:
        self._guard = guard
        self._interval = guard.policy.lock_ttl / 3
        self._held: set[Lease] = set()
        self._timer: asyncio.TimerHandle | None = None

    def hold(self, op: Operation, owner: str) -> Lease:
        lease = Lease(self, op, owner)
        self._held.add(lease)
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self._interval, self._tick)
        return lease

    def drop(self, lease: Lease) -> None:
        self._held.discard(lease)

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
            held = await guard.store.renew(op.key, lease.owner, guard.policy.lock_ttl)
        except StoreUnavailable as exc:  # keep trying: the store may be back in time
            guard.log.warning(
                "lease_renewal_failed", route=guard.route.name, key=op.label, error=exc.detail
            )
            return
        if not held and not lease.stopped:  # stopped: recorded or released meanwhile
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
        *,
        max_json_depth: int | None = None,
    ) -> None:
        self.route = route
        self.max_json_depth = max_json_depth  # limits.max_json_depth
        self.offload = offload
        self._warned_large = False
        self.policy = policy
        self.store = store
        self.tasks = tasks
        self.log = log
        self._methods = frozenset(policy.methods)
        self._release_on = frozenset(policy.release_on_status)
        # Owner tokens: only the holder of a claim may renew, record or release it, so
        # tokens must never repeat, across processes and replicas too; they need not be
        # unpredictable (they are never shown). A random prefix per guard and a counter:
        # a tenth of the cost of a random token per call.
        self._owner_prefix = secrets.token_urlsafe(12) + "."
        self._owners = itertools.count()
        self._leases = Leases(self)

    def guards(self, method: str) -> bool:
        return method in self._methods

    def operation(
        self,
        header: str | None,
        body: bytes,
        content_type: str | None,
        principal: str = "",
        target: bytes = b"",
    ) -> Operation | None:
        """Parse the key and fingerprint the request; None for an unguarded request.

        ``target`` is the method, path and query (``POST /tools/x?a=1``): the fingerprint
        covers them with the body, so a key sent again to another tool of the route, or
        with another method or query, is refused (422) instead of replaying an answer
        that was not its own.
        """
        if header is None:
            if self.policy.required:
                methods = ", ".join(sorted(self._methods))
                raise MissingIdempotencyKey(
                    f"route {self.route.name} requires an Idempotency-Key for {methods}"
                )
            return None
        digest = fingerprint(body, content_type, self.policy.canonicalization, self.max_json_depth)
        request = hashlib.sha256(b"%s\n%s" % (target, digest.encode())).hexdigest()
        scope = f"{self.route.name}|{principal}"
        if self.policy.key is KeyKind.COMPOSITE:
            key = parse_composite(header)
            if key.args_hash != digest:
                raise ArgsHashMismatch(
                    "args_hash must be the SHA-256 of the body's canonical JSON "
                    f"({self.policy.canonicalization.value}); the body hashes to {digest}"
                )
            slot = f"{scope}|{key.plan}|{key.step}"
            return Operation(RecordKey(slot, digest), str(key), request)
        opaque = parse_opaque(header)
        slot = hashlib.sha256(opaque.encode()).hexdigest()[:40]
        return Operation(RecordKey(f"{scope}|{slot}", "-"), opaque, request)

    async def run(self, op: Operation, forward: Forward) -> tuple[Response, Outcome]:
        """Execute once, replay, or refuse as a conflict."""
        owner = f"{self._owner_prefix}{next(self._owners)}"
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.policy.conflict_wait
        while True:
            claim = await self.store.claim(
                op.key, op.fingerprint, owner, self.policy.lock_ttl, self.policy.result_ttl
            )
            if claim.record is None:
                break
            stored = self._existing(op, claim.record, deadline - loop.time())
            if stored is not None:
                return await self._replay(op, stored), Outcome.REPLAYED
            await asyncio.sleep(min(CONFLICT_POLL_SECONDS, max(deadline - loop.time(), 0)))
        if claim.previous is not None:
            self.log.info(
                "replanned", route=self.route.name, key=op.label, previous_args_hash=claim.previous
            )
        return await self._execute(op, owner, forward)

    def _existing(self, op: Operation, record: Record, wait_left: float) -> StoredResponse | None:
        """The outcome to replay, or None to wait more; raises 422 or 409."""
        if record.fingerprint != op.fingerprint:
            raise KeyReusedWithOtherBody(
                "this Idempotency-Key was first used with a different request "
                "(method, path, query or body)"
            )
        if record.state is not State.IN_PROGRESS:
            return StoredResponse.decode(record.payload)
        if wait_left > 0:
            return None
        retry_after = max(1, math.ceil(min(self.policy.retry_after, record.ttl)))
        raise RequestInProgress(
            "a request with this Idempotency-Key is being executed; retry later",
            headers={"Retry-After": str(retry_after)},
        )

    async def _replay(self, op: Operation, stored: StoredResponse) -> Response:
        ref = stored.ref
        if ref is None:
            return stored.to_response(replayed=True)
        try:
            if self.offload is None:
                raise StoredResponseUnavailable(
                    "the response body was offloaded, but no object store is configured now"
                )
            body = await self.offload.get(ref)
        except StoredResponseUnavailable as exc:
            self._unavailable(op, ref, exc)
            raise
        location = await self.offload.presigned(ref)
        if location is not None:
            stored = stored.with_header(b"content-location", location.encode())
        if isinstance(body, bytes):
            return stored.with_body(body).to_response(replayed=True)
        response = StreamingResponse(self._watched(op, ref, body), stored.status)
        response.raw_headers = stored.replay_headers(ref.size)
        return response

    async def _watched(
        self, op: Operation, ref: ObjectRef, chunks: AsyncIterator[bytes]
    ) -> AsyncIterator[bytes]:
        try:
            async for chunk in chunks:
                yield chunk
        except StoredResponseUnavailable as exc:
            self._unavailable(op, ref, exc, note="the replay was cut short")
            raise

    def _unavailable(
        self, op: Operation, ref: ObjectRef, exc: StoredResponseUnavailable, note: str = ""
    ) -> None:
        self.log.error(
            "stored_response_unavailable",
            route=self.route.name,
            key=op.label,
            object=ref.path,
            error=exc.detail,
            note=note,
        )

    async def _storable(self, upstream: UpstreamResponse, body: bytes | Spool) -> StoredResponse:
        """The outcome to record: a large body goes to object storage when it can; one
        above max_stored_bytes is replaced by a problem (the call is never re-run)."""
        size = body.size if isinstance(body, Spool) else len(body)
        limit = self.policy.max_stored_bytes
        if limit is not None and size > limit:
            self.log.warning("response_not_stored", route=self.route.name, bytes=size)
            return StoredResponse.of_problem(
                ResponseNotStored(
                    f"the call was executed once; its {size}-byte response was above this "
                    f"route's max_stored_bytes ({limit}) and cannot be replayed"
                )
            )
        if self.offload is None:
            if size > DEFAULT_OFFLOAD_THRESHOLD and not self._warned_large:
                self._warned_large = True
                self.log.warning(
                    "large_response_stored_inline",
                    route=self.route.name,
                    bytes=size,
                    note="configure offload to keep the store small",
                )
            return StoredResponse.of(upstream.status, upstream.headers, _bytes(body))
        if not self.offload.wants(size):
            return StoredResponse.of(upstream.status, upstream.headers, _bytes(body))
        try:
            ref = await self.offload.put(self.route.name, body)
        except OffloadUnavailable as exc:
            self.log.warning(
                "offload_failed_stored_inline", route=self.route.name, bytes=size, error=exc.detail
            )
            return StoredResponse.of(upstream.status, upstream.headers, _bytes(body))
        return StoredResponse.of(upstream.status, upstream.headers, b"").offloaded(ref)

    async def _execute(
        self, op: Operation, owner: str, forward: Forward
    ) -> tuple[Response, Outcome]:
        lease = self._leases.hold(op, owner)
        try:
            upstream = await forward()
            if self._tees(upstream):
                return self._tee(op, owner, upstream, lease)
            body = await upstream.read()
        except (UpstreamUnreachable, Unauthorized, IdentityProviderUnavailable):
            lease.stop()  # nothing was sent (no connection, or no downstream token)
            await self._release(op, owner)
            raise
        except OutcomeUnknown as exc:
            return await self._failed(op, owner, exc, lease)
        except Exception as exc:  # the proxy's own failure, the request perhaps sent
            return await self._lost_in_flight(op, owner, lease, "failed", repr(exc))
        except asyncio.CancelledError:  # a shutdown that gave up waiting for the call
            await self._lost_in_flight(op, owner, lease, "cancelled", "shut down")
            raise
        except BaseException:
            lease.stop()
            raise
        answer = StoredResponse(upstream.status, upstream.headers, body).to_response(replayed=False)
        if upstream.status in self._release_on:
            lease.stop()
            await self._release(op, owner)
            return answer, Outcome.RELEASED
        try:
            stored = await self._storable(upstream, body)
        except Exception as exc:  # the proxy's own failure: the tool did answer
            stored = self._not_kept(op, exc)
        try:
            await self._record(op, owner, State.COMPLETED, stored, lease)
        except BaseException:
            lease.stop()  # no renewals for ever: the key frees itself after lock_ttl
            raise
        return answer, Outcome.EXECUTED

    async def _lost_in_flight(
        self, op: Operation, owner: str, lease: Lease, how: str, why: str
    ) -> tuple[Response, Outcome]:
        """The proxy itself ``how`` (failed, cancelled) while the call was in flight: the
        request may have reached the tool, so the outcome is unknown."""
        self.log.error(f"{how}_in_flight", route=self.route.name, key=op.label, error=why)
        unknown = OutcomeUnknown(
            f"the proxy {how} ({why}) while this call was in flight; it may have been executed",
            status=502,
        )
        return await self._failed(op, owner, unknown, lease)

    async def _failed(
        self, op: Operation, owner: str, exc: OutcomeUnknown, lease: Lease
    ) -> tuple[Response, Outcome]:
        """Record that the outcome is unknown: replayed, never run again."""
        failure = StoredResponse.of_problem(exc)
        await self._record(op, owner, State.FAILED, failure, lease)
        return failure.to_response(replayed=False), Outcome.FAILED

    def _tees(self, upstream: UpstreamResponse) -> bool:
        """True if the body may go to object storage: it then streams as it is recorded."""
        offload = self.offload
        return offload is not None and (upstream.length is None or offload.wants(upstream.length))

    def _tee(
        self, op: Operation, owner: str, upstream: UpstreamResponse, lease: Lease
    ) -> tuple[Response, Outcome]:
        """Stream the body to the caller while it is spooled and recorded in the background."""
        assert self.offload is not None
        spool = Spool(self.offload.threshold)
        tee = Tee(spool)
        self.tasks.spawn(self._spool_and_record(op, owner, upstream, lease, spool, tee))
        response = StreamingResponse(tee.chunks(), upstream.status)
        length = (
            [] if upstream.length is None else [(b"content-length", str(upstream.length).encode())]
        )
        response.raw_headers = [*upstream.headers, *length]
        released = upstream.status in self._release_on
        return response, Outcome.RELEASED if released else Outcome.EXECUTED

    async def _spool_and_record(
        self,
        op: Operation,
        owner: str,
        upstream: UpstreamResponse,
        lease: Lease,
        spool: Spool,
        tee: Tee,
    ) -> None:
        try:
            try:
                async for chunk in upstream.stream():
                    tee.readable(spool.size)  # all but this chunk
                    spool.write(chunk)
            except OutcomeUnknown as exc:
                self.log.error(
                    "outcome_unknown_mid_body",
                    route=self.route.name,
                    key=op.label,
                    error=exc.detail,
                )
                await self._record(op, owner, State.FAILED, StoredResponse.of_problem(exc), lease)
                tee.fail(exc)
                return
            except OSError as exc:  # the spool's (disk full): the tool did answer
                if upstream.status in self._release_on:
                    lease.stop()
                    await self._release(op, owner)
                else:
                    stored = self._not_kept(op, exc)
                    await self._record(op, owner, State.COMPLETED, stored, lease)
                tee.fail(exc)
                return
            if upstream.status in self._release_on:
                lease.stop()
                await self._release(op, owner)
            else:
                try:
                    stored = await self._storable(upstream, spool)
                except Exception as exc:  # the proxy's own failure: the tool did answer
                    stored = self._not_kept(op, exc)
                await self._record(op, owner, State.COMPLETED, stored, lease)
            tee.end()
        except BaseException as exc:
            lease.stop()
            tee.fail(exc)
            raise
        finally:
            spool.close()

    def _not_kept(self, op: Operation, exc: Exception) -> StoredResponse:
        """What is recorded when the tool answered but the proxy could not keep the answer
        (its spool failed, or a bug): the call is never run again."""
        reason = (exc.strerror if isinstance(exc, OSError) else None) or repr(exc)
        self.log.error("response_not_stored", route=self.route.name, key=op.label, error=reason)
        return StoredResponse.of_problem(
            ResponseNotStored(
                "the call was executed once; its response could not be kept by the proxy "
                f"({reason}) and cannot be replayed"
            )
        )

    async def _release(self, op: Operation, owner: str) -> None:
        try:
            await self.store.release(op.key, owner)
        except StoreUnavailable as exc:
            self.log.warning(
                "release_failed",
                route=self.route.name,
                key=op.label,
                error=exc.detail,
                note="the key stays locked until lock_ttl ends",
            )

    async def _record(
        self,
        op: Operation,
        owner: str,
        state: State,
        stored: StoredResponse,
        lease: Lease,
    ) -> None:
        """Record the outcome; if the store is down, keep trying in the background."""
        payload = stored.encode()
        try:
            await self._complete(op, owner, state, payload)
        except StoreUnavailable as exc:
            self.log.error(
                "outcome_not_recorded_yet",
                route=self.route.name,
                key=op.label,
                error=exc.detail,
                note="retrying while the lease lasts",
            )
            self.tasks.spawn(self._record_later(op, owner, state, payload, lease))
            return
        lease.stop()

    async def _complete(self, op: Operation, owner: str, state: State, payload: bytes) -> None:
        done = await self.store.complete(
            op.key, owner, op.fingerprint, state, payload, self.policy.result_ttl
        )
        if not done:
            self.log.error(
                "lease_lost_before_recording",
                route=self.route.name,
                key=op.label,
                note="another owner took the key over; its outcome is kept",
            )

    async def _record_later(
        self, op: Operation, owner: str, state: State, payload: bytes, lease: Lease
    ) -> None:
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self.policy.lock_ttl
        try:
            while loop.time() < give_up:
                await asyncio.sleep(RECORD_RETRY_SECONDS)
                try:
                    await self._complete(op, owner, state, payload)
                except StoreUnavailable:
                    continue
                self.log.info("outcome_recorded_late", route=self.route.name, key=op.label)
                return
            self.log.critical(
                "outcome_not_recorded",
                route=self.route.name,
                key=op.label,
                note="the store stayed unreachable for lock_ttl; a retry may re-execute",
            )
        finally:
            lease.stop()
