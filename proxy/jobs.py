"""Long calls: answered ``202 Accepted`` at once, run durably by the route's workers.

A guarded call of an ``async`` route that asks for it (``Prefer: respond-async``, the
route's ``mode: always``, or a caller still waiting past ``after``) becomes a *job*:

    submit: claim the record (owner ``job.<id>``, a lease of max_queued) ─▶ keep the
            request in the queue (before any answer) ─▶ 202 + Location, or the answer
            itself if the call ends within the caller's ``wait``
    worker: take ─▶ sent before? ─yes─▶ FAILED (outcome unknown: never sent twice)
                        └─no─▶ RUNNING (sent) ─▶ the guard's one way to conclude:
                               executed ─▶ COMPLETED │ unknown ─▶ FAILED
                               nothing ran (no connection, release_on_status, a
                               policy's refusal) ─▶ QUEUED again after a backoff,
                               or DEAD once ``attempts`` are spent (the key released)

The job concludes the same idempotency record as a live call would, through the same
``Guard``, so a retry of the key gets the same 202 while the job runs and the recorded
answer once it is done. The worker sends the stored request through the same tokens,
policies and upstream as a live request (``app.Proxy.forwarder``).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import math
import random
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.responses import Response, StreamingResponse
from starlette.types import Scope

from proxy import numbers
from proxy.asgi import Incoming, RawHeaders, Reply
from proxy.auth.sealing import Sealer
from proxy.background import TaskSet
from proxy.config import AsyncConfig, AsyncMode, RouteConfig
from proxy.errors import (
    NOT_SENT,
    OffloadUnavailable,
    OutcomeUnknown,
    PreconditionFailed,
    PreconditionRequired,
    ProxyError,
    ResourceKeyMissing,
    StoredRequestUnreadable,
    StoreUnavailable,
    Unauthorized,
)
from proxy.fence import Fence
from proxy.idempotency import (
    OWNERS,
    RECORD_PERSIST_SECONDS,
    Guard,
    Lease,
    Outcome,
    job_record_ttl,
)
from proxy.job_events import Hub
from proxy.offload import ObjectRef, Offload
from proxy.operation import Operation
from proxy.outcome import StoredResponse
from proxy.problems import problem_body
from proxy.records import iso
from proxy.replay import reply
from proxy.store import Job, JobState, Queue, Record, RecordKey, State, Store
from proxy.store.queue import new_job_id
from proxy.tracing import note

if TYPE_CHECKING:
    from proxy.otel import Tracing

OPERATIONS_PATH = "/_proxy/operations/"
JOB_OWNER = "job."
# How often an idle worker looks for a job another process queued (its own are at once).
IDLE_POLL_SECONDS = 0.25
# Pause after the queue could not be read.
QUEUE_RETRY_SECONDS = 1.0
# How often a job's claim that its submitter could neither queue nor release is asked to
# be released again (in the background, while the store is out of reach).
UNCLAIM_RETRY_SECONDS = 1.0
# Refusals no retry changes (the request itself is refused): the job ends DEAD at once.
FINAL = (PreconditionFailed, PreconditionRequired, ResourceKeyMissing, Unauthorized)
QUEUED = frozenset({JobState.QUEUED})
RUNNING = frozenset({JobState.RUNNING})
DEAD = frozenset({JobState.DEAD})
NEVER_RAN = frozenset({JobState.CANCELLED, JobState.DEAD})

Forwarder = Callable[[Incoming, RouteConfig, bytes, str, str, Fence], Callable[[], Awaitable[Any]]]
"""``(request, route, body, principal, identity, fence) -> forward``: the live path's send,
with its tokens and policies (``app.Proxy.forwarder``)."""


@dataclass(frozen=True, slots=True)
class Asked:
    """What a caller gets: its answer if the call ends within ``wait`` seconds, else 202."""

    wait: float
    preferred: bool
    """It sent ``Prefer: respond-async`` (the 202 says ``Preference-Applied``)."""


def preferences(header: str | None) -> tuple[bool, float | None]:
    """``respond-async`` and ``wait`` from a ``Prefer`` header (RFC 7240); others ignored."""
    asynchronous, wait = False, None
    for part in (header or "").split(","):
        token, _, value = part.split(";", 1)[0].strip().partition("=")
        token = token.strip().lower()
        if token == "respond-async":
            asynchronous = True
        elif token == "wait" and (seconds := numbers.whole(value.strip().strip('"'))) is not None:
            wait = float(seconds)
    return asynchronous, wait


def prefer(scope: Scope) -> str | None:
    """The request's ``Prefer`` preferences, its lines joined (RFC 7240 allows several)."""
    lines = [value.decode("latin-1") for name, value in scope["headers"] if name == b"prefer"]
    return ", ".join(lines) if lines else None


def asked(config: AsyncConfig, prefer: str | None) -> Asked | None:
    """How a guarded call of an async route is answered; None: as a live call."""
    asynchronous, wait = preferences(prefer)
    if config.mode is AsyncMode.NEVER:
        return None
    if config.mode is AsyncMode.ALWAYS or asynchronous:
        return Asked(wait or 0.0, asynchronous)
    if config.after is not None:
        return Asked(config.after, False)
    return None


@dataclass(frozen=True, slots=True)
class StoredRequest:
    """What a job sends: the caller's request as the proxy received it."""

    scope: dict[str, Any]
    body: bytes
    fingerprint: str
    identity: str
    ref: ObjectRef | None = None
    """Where a large body is, in object storage (``body`` is empty then)."""
    sealed: bytes | None = None
    """The caller's credentials, sealed, as read from the store (``unsealed`` puts them
    back among the headers)."""


# The caller's credentials: sealed in a stored request (``routes[].async.credentials``).
CREDENTIALS = frozenset({"authorization", "cookie", "proxy-authorization"})


def _text(raw: bytes) -> str:
    return raw.decode("latin-1")


def encode_request(request: StoredRequest, sealer: Sealer | None = None, name: str = "") -> bytes:
    """One line of JSON (the request's head), a newline, the body. With ``sealer`` the
    caller's credentials (``CREDENTIALS``) are sealed, bound to ``name`` (the job's id)."""
    scope = request.scope
    client = scope.get("client")
    headers = [[_text(k), _text(v)] for k, v in scope["headers"]]
    secret = [pair for pair in headers if pair[0] in CREDENTIALS] if sealer else []
    head = {
        "method": scope["method"],
        "path": scope["path"],
        "raw_path": _text(scope.get("raw_path") or scope["path"].encode()),
        "query": _text(scope["query_string"]),
        "headers": [pair for pair in headers if pair not in secret],
        "client": list(client) if client else None,
        "scheme": scope["scheme"],
        "fingerprint": request.fingerprint,
        "identity": request.identity,
        "ref": None if request.ref is None else dataclasses.asdict(request.ref),
    }
    if sealer is not None and secret:
        head["sealed"] = base64.b64encode(sealer.seal(name, {"headers": secret})).decode()
    return json.dumps(head, separators=(",", ":")).encode() + b"\n" + request.body


def decode_request(blob: bytes) -> StoredRequest:
    line, _, body = blob.partition(b"\n")
    head = json.loads(line)
    scope = {
        "type": "http",
        "http_version": "1.1",
        "method": head["method"],
        "path": head["path"],
        "raw_path": head["raw_path"].encode("latin-1"),
        "query_string": head["query"].encode("latin-1"),
        "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in head["headers"]],
        "client": tuple(head["client"]) if head["client"] else None,
        "scheme": head["scheme"],
        "extensions": {},
    }
    ref = None if head["ref"] is None else ObjectRef(**head["ref"])
    sealed = base64.b64decode(head["sealed"]) if "sealed" in head else None
    return StoredRequest(scope, body, head["fingerprint"], head["identity"], ref, sealed)


def unsealed(request: StoredRequest, sealer: Sealer | None, name: str) -> StoredRequest:
    """``request`` with its sealed credentials back among its headers;
    ``StoredRequestUnreadable`` if this replica's key cannot open them."""
    if request.sealed is None:
        return request
    document = None if sealer is None else sealer.open(name, request.sealed)
    if document is None:
        raise StoredRequestUnreadable(
            "the stored request's credentials were sealed with another key than this "
            "replica's sealing key (store.sealing_key_env): nothing was sent"
        )
    scope = dict(request.scope)
    credentials = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in document["headers"]]
    scope["headers"] = [*scope["headers"], *credentials]
    return dataclasses.replace(request, scope=scope, sealed=None)


def location(job_id: str) -> str:
    return OPERATIONS_PATH + job_id


def document(job: Job) -> dict[str, Any]:
    """The operation's status document."""
    doc: dict[str, Any] = {
        "id": job.id,
        "state": job.state.value,
        "created_at": iso(job.created_at),
        "updated_at": iso(job.updated_at),
        "attempts": job.attempts,
    }
    if job.error and job.state in (JobState.FAILED, JobState.DEAD):
        doc["error"] = json.loads(job.error)
    return doc


def json_body(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode()


def accepted(job: Job, retry_after: float, preferred: bool) -> Response:
    """``202 Accepted``: where to follow the operation, and its status now."""
    body = json_body(document(job))
    headers: RawHeaders = [
        (b"content-type", b"application/json"),
        (b"location", location(job.id).encode()),
        (b"retry-after", str(max(1, math.ceil(retry_after))).encode()),
        (b"content-length", str(len(body)).encode()),
    ]
    if preferred:
        headers.append((b"preference-applied", b"respond-async"))
    return Reply(202, headers, body)


# How long a requeue (or the release of a job that never ran) holds its job's lock, at
# most: a process that dies holding it frees it when it lapses.
REQUEUE_LOCK_SECONDS = 30.0


@contextlib.asynccontextmanager
async def requeue_lock(store: Store, job_id: str) -> AsyncIterator[bool]:
    """The job's requeue lock in the store: True if taken (freed on leaving), False if
    another requeue, or release, of this job holds it. A DEAD job becomes QUEUED only
    under it, so what is read of the job under it stays true (DEAD and CANCELLED end a
    job otherwise)."""
    name, token = f"requeue|{job_id}", secrets.token_hex(8)
    taken = await store.acquire(name, token, REQUEUE_LOCK_SECONDS)
    try:
        yield taken
    finally:
        if taken:
            await store.unlock(name, token)


def job_id_of(owner: str) -> str | None:
    """The job whose record this is, from the record's owner (``job.<id>``, or a taker's
    ``job.<id>.<token>``)."""
    if not owner.startswith(JOB_OWNER):
        return None
    return owner[len(JOB_OWNER) :].partition(".")[0]


def taker_owner(job_id: str) -> str:
    """The owner a job's taker records "unknown" as: the attempt it took over, owner
    ``job.<id>``, can no longer write the record (``Store.complete(successor=)``)."""
    return f"{JOB_OWNER}{job_id}.{OWNERS.new()}"


def _problem(exc: ProxyError) -> bytes:
    return problem_body(exc)


class RouteJobs:
    """The jobs of one route: submission, workers, and what operators do with them."""

    def __init__(
        self,
        route: RouteConfig,
        guard: Guard,
        queue: Queue,
        store: Store,
        hub: Hub,
        forwarder: Forwarder,
        offload: Offload | None,
        tasks: TaskSet,
        log: Any,
        sealer: Sealer | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        assert route.async_ is not None
        self.tracing = tracing
        """Spans for the runs (``otel.py``), each a child of its submitter's; None: off."""
        self.sealer = sealer
        """Seals the credentials of stored requests (None: kept as they came)."""
        self.route = route
        self.config = route.async_
        self.guard = guard
        self.queue = queue
        self.store = store
        self.hub = hub
        self.forwarder = forwarder
        self.offload = offload
        self.tasks = tasks
        self.log = log
        self._keep = guard.policy.result_ttl + self.config.max_queued
        self._wake = asyncio.Event()
        self._polling = asyncio.Lock()
        self._workers: list[asyncio.Task[None]] = []
        self._stopping = False

    # -- submission -------------------------------------------------------------------

    async def submit(
        self,
        op: Operation,
        request: Incoming,
        body: bytes,
        principal: str,
        identity: str,
        how: Asked,
    ) -> Response | None:
        """The 202 (or the answer, within ``how.wait``) of a new job, or of the job that
        already holds this key; None if the key's record is no job's (the caller is
        answered as for a live call: a replay, or a 409)."""
        job = await self.enter(op, request, body, principal, identity)
        return None if job is None else await self._answer(job, op, how)

    async def enter(
        self, op: Operation, request: Incoming, body: bytes, principal: str, identity: str
    ) -> Job | None:
        """A new job for this key (its request kept in the queue), or the job that
        already holds it, not ended; None if the key's record is no job's in progress
        (a live call's, or an ended one)."""
        job_id = new_job_id(self.route.name)
        owner = JOB_OWNER + job_id
        for _ in range(2):
            try:
                record = await self.guard.claim_job(op, owner, self.config.max_queued)
            except StoreUnavailable:  # the claim may be applied, its reply lost
                self.tasks.spawn(self._unclaim_later(op, owner))
                raise
            if record is None:
                break
            existing = job_id_of(record.owner)
            if record.state is not State.IN_PROGRESS or existing is None:
                return None
            job = await self.queue.get(existing)
            if job is None:
                if not await self._release_unqueued(op, record):
                    return None
                continue
            if job.state not in NEVER_RAN:
                return job
            if not await self._release_never_ran(job.id, op.key, record.owner):
                return None
        else:
            return None
        try:
            job = await self._keep_request(job_id, op, request, body, principal, identity)
        except BaseException:
            await self._unclaim(op, owner)
            raise
        self._wake.set()
        self.log.info("job_submitted", route=self.route.name, key=op.label, job=job.id)
        return job

    async def _unclaim(self, op: Operation, owner: str) -> None:
        """Release the key claimed for a job whose queueing failed: nothing was sent (a
        worker that takes the job anyway, its queueing applied but not answered, finds the
        key not its own and sends nothing). With the store out of reach, in the
        background."""
        try:
            await self.store.release(op.key, owner)
        except StoreUnavailable:
            self.tasks.spawn(self._unclaim_later(op, owner))

    async def _unclaim_later(self, op: Operation, owner: str) -> None:
        """Ask the store to release ``owner``'s claim every UNCLAIM_RETRY_SECONDS, until it
        releases it or has answered twice without it (a claim still in flight on a
        dropped connection lands within one of its answers), for RECORD_PERSIST_SECONDS
        at most: then a retry releases it (``_release_unqueued``)."""
        loop = asyncio.get_running_loop()
        until = loop.time() + min(RECORD_PERSIST_SECONDS, self.config.max_queued)
        answered = 0
        while answered < 2 and loop.time() < until:
            await asyncio.sleep(UNCLAIM_RETRY_SECONDS)
            try:
                released = await self.store.release(op.key, owner)
            except StoreUnavailable:
                continue
            if released:
                self.log.warning("job_claim_released_unqueued", route=self.route.name, key=op.label)
                return
            answered += 1

    async def _release_unqueued(self, op: Operation, record: Record) -> bool:
        """Release a key claimed for a job that was never queued (its submitter failed, or
        died, between the claim and the queue): nothing was sent. Only a claim never
        renewed (no worker started it) and older than ``lock_ttl`` (its submitter is not
        still queueing it): False otherwise."""
        age = self.config.max_queued - record.ttl
        if record.updated_at != record.created_at or age < self.guard.policy.lock_ttl:
            return False
        self.log.warning("job_claim_released_unqueued", route=self.route.name, key=op.label)
        return await self.store.release(op.key, record.owner)

    async def _release_never_ran(self, job_id: str, key: RecordKey, owner: str) -> bool:
        """Release the key of a cancelled or dead job whose own release was lost (nothing
        ran), unless a requeue revived it: under its requeue lock. False if it is not
        released (a requeue holds the lock, or revived the job)."""
        async with requeue_lock(self.store, job_id) as taken:
            if not taken:
                return False
            job = await self.queue.get(job_id)
            if job is not None and job.state not in NEVER_RAN:
                return False
            await self.store.release(key, owner)
            return True

    async def _keep_request(
        self,
        job_id: str,
        op: Operation,
        request: Incoming,
        body: bytes,
        principal: str,
        identity: str,
    ) -> Job:
        ref = None
        if self.offload is not None and self.offload.wants(len(body)):
            ref = await self.offload.put(self.route.name, body, keep_for=self._keep)
            body = b""
        scope = dict(request.scope)
        scope["headers"] = _without_async_preferences(scope["headers"])
        if self.tracing is not None:  # the worker's span is the submitting request's child
            scope["headers"] = self.tracing.stamp(scope["headers"])
        stored = StoredRequest(scope, body, op.fingerprint, identity, ref)
        job = Job(
            id=job_id,
            route=self.route.name,
            principal=principal,
            slot=op.key.slot,
            name=op.key.name,
            label=op.label,
            request=encode_request(stored, self.sealer, job_id),
            keep=self._keep,
        )
        return await self.queue.submit(job)

    async def _answer(self, job: Job, op: Operation, how: Asked) -> Response:
        ended = await self.hub.ended(job.id, how.wait)
        if ended is None or ended.state not in (JobState.COMPLETED, JobState.FAILED):
            current = ended or job
            if ended is None and how.wait > 0:  # it moved on while the caller waited
                current = await self.queue.get(job.id) or job
            return accepted(current, self.guard.policy.retry_after, how.preferred)
        return await self.result(ended, first=True) or accepted(
            ended, self.guard.policy.retry_after, how.preferred
        )

    async def result(self, job: Job, *, first: bool = False) -> Response | None:
        """The recorded answer of an ended job, byte for byte, as a replay (or as the
        first answer, ``first``); None if its record is gone."""
        record = await self.store.get(RecordKey(job.slot, job.name))
        if record is None or record.state is State.IN_PROGRESS or record.lapsed:
            return None
        if job_id_of(record.owner) != job.id:  # the key's later call, not this operation's
            return None
        stored = StoredResponse.decode(record.payload)
        if first and stored.ref is None:
            return reply(stored, replayed=False)
        return await self.guard.replayer.response(job.label, stored)

    # -- operators and owners -----------------------------------------------------------

    async def cancel(self, job: Job) -> Job | None:
        """Cancel a QUEUED job (it was never sent; its key is released); None if it is
        neither QUEUED nor CANCELLED (a cancel again releases the key again)."""
        cancelled = await self.queue.move(job.id, QUEUED, JobState.CANCELLED)
        if cancelled is None and job.state is JobState.CANCELLED:
            cancelled = job  # again: its key's release may have failed the first time
        if cancelled is not None:
            await self.store.release(RecordKey(job.slot, job.name), JOB_OWNER + job.id)
            self.log.info("job_cancelled", route=self.route.name, key=job.label, job=job.id)
        return cancelled

    async def requeue(self, job: Job) -> Job | None:
        """Queue a DEAD job again (``requeue``); None if it cannot be."""
        requeued = await requeue(job, self.route, self.store, self.queue)
        if requeued is not None:
            self._wake.set()
        return requeued

    # -- workers -----------------------------------------------------------------------

    def start(self) -> None:
        for slot in range(self.route.workers.concurrency):
            worker = f"{OWNERS.prefix}{self.route.name}.{slot}"
            self._workers.append(asyncio.create_task(self._work_forever(worker)))

    async def stop(self, seconds: float) -> None:
        """Take no more jobs; let running ones finish within ``seconds``, then cancel
        them (their calls are recorded FAILED). Queued jobs stay for other replicas."""
        self._stopping = True
        self._wake.set()
        if not self._workers:
            return
        _, pending = await asyncio.wait(self._workers, timeout=seconds)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    async def _work_forever(self, worker: str) -> None:
        while not self._stopping:
            try:
                job = await self.queue.take(self.route.name, worker, self.config.visibility)
            except StoreUnavailable as exc:
                self.log.warning("job_queue_unreadable", route=self.route.name, error=exc.detail)
                await self._idle(QUEUE_RETRY_SECONDS)
                continue
            except Exception:  # a job it cannot read: the worker goes on (the hold lapses)
                self.log.exception("job_queue_unreadable", route=self.route.name)
                await self._idle(QUEUE_RETRY_SECONDS)
                continue
            if job is None:
                await self._idle(IDLE_POLL_SECONDS)
                continue
            self._wake.set()  # there may be more: the idle workers look too
            try:
                await self._run(job, worker)
            except StoreUnavailable as exc:  # the job stays held until its hold lapses
                self.log.error(
                    "job_not_concluded", route=self.route.name, job=job.id, error=exc.detail
                )
            except Exception:  # a bug: the job's hold lapses, and a taker concludes it
                self.log.exception("job_not_concluded", route=self.route.name, job=job.id)

    async def _idle(self, seconds: float) -> None:
        """Wait for a job: one idle worker polls the queue every ``seconds`` (for jobs of
        other processes), the others wait until it, or a submission here, finds one."""
        self._wake.clear()
        if self._stopping:
            return
        if self._polling.locked():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(seconds * 4):
                    await self._wake.wait()
            return
        async with self._polling:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(seconds):
                    await self._wake.wait()

    async def _run(self, job: Job, worker: str) -> None:
        request = decode_request(job.request)
        op = Operation(RecordKey(job.slot, job.name), job.label, request.fingerprint)
        owner = JOB_OWNER + job.id
        if job.sent or job.state is JobState.RUNNING:
            await self._taken_over_after_sending(job, op, owner, worker)
            return
        try:
            request = unsealed(request, self.sealer, job.id)
            body = await self._body(request)
        except ProxyError as exc:  # the stored request cannot be had now: nothing is sent
            await self._refused(job, op.key, worker, QUEUED, job.attempts + 1, _problem(exc), None)
            return
        visibility = self.config.visibility
        if not await self.queue.hold(job.id, worker, visibility):  # the body took too long
            return  # another worker has it now; nothing was sent
        loop = asyncio.get_running_loop()
        renewed_at = loop.time()
        policy = self.guard.policy
        ttl = self.guard.job_record_ttl(self.config.max_queued)
        if not await self.store.renew(op.key, owner, policy.lock_ttl, ttl):
            await self._expired_in_queue(job, op, owner, worker)
            return
        attempt = job.attempts + 1
        try:
            running = await self.queue.move(
                job.id, QUEUED, JobState.RUNNING, worker=worker, attempts=attempt, sent=True
            )
        except StoreUnavailable:  # its start not confirmed (store.durability): not sent,
            running = None  # back in the queue as the store answered
        if running is None:  # cancelled meanwhile, or the hold was lost: its wait goes on
            await self.store.renew(op.key, owner, self.config.max_queued, ttl)
            return
        self.hub.poke(job.id)
        lease = self.guard.job_lease(op, owner, renewed_at)
        holding = asyncio.create_task(self._hold_while_running(job.id, worker))
        try:
            if self.tracing is None:
                await self._attempt(running, request, body, lease, worker)
            else:
                headers = request.scope["headers"]
                attempt = running.attempts
                with self.tracing.job(self.route, job.id, job.label, attempt, headers):
                    await self._attempt(running, request, body, lease, worker)
        except BaseException:
            lease.stop()  # the record lapses to FAILED unless concluded: never renewed forever
            raise
        finally:
            holding.cancel()

    async def _attempt(
        self, job: Job, request: StoredRequest, body: bytes, lease: Lease, worker: str
    ) -> None:
        incoming = Incoming.of(dict(request.scope), _no_body)
        fence = Fence()
        forward = self.forwarder(incoming, self.route, body, job.principal, request.identity, fence)
        refusal: ProxyError | None = None
        try:
            response, outcome = await self.guard.execute(lease, forward, fence)
        except NOT_SENT as exc:
            refusal, response, outcome = exc, None, Outcome.RELEASED
            note("tool_proxy.problem.type", exc.type)
        note("tool_proxy.outcome", outcome.value)
        error = b""
        if response is not None:
            error = await _drain(response)
        if lease.released:
            await self._not_run(job, lease, worker, refusal, response, error)
            return
        # the record says how it ended (a streamed body is concluded once read whole)
        record = await self.store.get(lease.op.key)
        if _recorded(record, job.id):
            assert record is not None
            await self._ended_as_recorded(job, record.state, record.payload)
            return
        state = JobState.COMPLETED if outcome is Outcome.EXECUTED else JobState.FAILED
        failure = error if state is JobState.FAILED else b""
        await self._end(job, state, failure, worker)

    async def _body(self, request: StoredRequest) -> bytes:
        if request.ref is None:
            return request.body
        if self.offload is None:
            raise OffloadUnavailable("the request body was offloaded; no object store now")
        body = await self.offload.get(request.ref)
        if isinstance(body, bytes):
            return body
        return b"".join([chunk async for chunk in body])

    async def _not_run(
        self,
        job: Job,
        lease: Lease,
        worker: str,
        refusal: ProxyError | None,
        response: Response | None,
        body: bytes,
    ) -> None:
        """Nothing ran: queue the job again after a backoff, or end it DEAD."""
        told = None
        if refusal is not None:
            told = refusal.headers.get("Retry-After")
        elif response is not None:
            told = response.headers.get("retry-after")
        final = isinstance(refusal, FINAL)
        error = _refusal(refusal, response, body)
        await self._refused(job, lease.op.key, worker, RUNNING, job.attempts, error, told, final)

    async def _refused(
        self,
        job: Job,
        key: RecordKey,
        worker: str,
        expect: frozenset[JobState],
        attempts: int,
        error: bytes,
        told: str | int | None,
        final: bool = False,
    ) -> None:
        """An attempt that ran nothing: queue the job again after a backoff (the key stays
        claimed), or, its attempts spent (or refused for good), end it DEAD and release
        its key."""
        owner = JOB_OWNER + job.id
        dead = attempts >= self.config.attempts or final
        delay = 0.0
        if dead:
            ours = await self.store.release(key, owner)
        else:
            delay = self._backoff(attempts, told)
            ttl = self.guard.job_record_ttl(self.config.max_queued)
            ours = await self.store.renew(key, owner, self.config.max_queued, ttl)
        state = JobState.DEAD if dead else JobState.QUEUED
        fields: dict[str, Any] = {"attempts": attempts, "sent": False, "error": error}
        moved = await self.queue.move(job.id, expect, state, worker=worker, **fields, due=delay)
        if moved is None and ours and expect == RUNNING:  # a taker holds it, and waits on
            # the record, still this attempt's: nothing ran, so the job moves on as it says
            await self.queue.move(job.id, expect, state, **fields, due=delay)
        self.hub.poke(job.id)
        if dead:
            self.log.error("job_dead", route=self.route.name, key=job.label, job=job.id)
        else:
            self.log.info(
                "job_retried", route=self.route.name, job=job.id, attempt=attempts, delay=delay
            )

    def _backoff(self, attempts: int, told: str | int | None) -> float:
        """Exponential with jitter (half fixed, half random), or the tool's Retry-After
        (at most half of max_queued: the job must still be due within its lease)."""
        seconds = None if told is None else numbers.whole(str(told).strip())
        if seconds is not None:
            return min(float(seconds), self.config.max_queued / 2)
        ceiling: float = min(self.config.backoff_max, self.config.backoff * 2.0 ** (attempts - 1))
        return ceiling / 2 + random.uniform(0, ceiling / 2)

    async def _hold_while_running(self, job_id: str, worker: str) -> None:
        interval = self.config.visibility / 3
        while True:
            await asyncio.sleep(interval)
            try:
                held = await self.queue.hold(job_id, worker, self.config.visibility)
            except StoreUnavailable as exc:
                self.log.warning("job_hold_failed", route=self.route.name, error=exc.detail)
                continue
            if not held:
                self.log.warning("job_hold_lost", route=self.route.name, job=job_id)
                return

    async def _taken_over_after_sending(
        self, job: Job, op: Operation, owner: str, worker: str
    ) -> None:
        """The worker that ran this job stopped renewing its hold while its call may have
        been in flight. While the record's lease is live, that worker may be alive (its
        hold lapsed, not its lease): nothing is done, and the job is looked at again when
        this hold lapses. Once the lease lapsed, the outcome is recorded as unknown as this
        taker's (the attempt's late answer can no longer replace it), unless the attempt
        recorded one (kept, in one step with the check); the call is never sent again."""
        record = await self.store.get(op.key)
        if _recorded(record, job.id):  # recorded by its worker, which could not say so
            assert record is not None
            await self._ended_as_recorded(job, record.state, record.payload)
            return
        if _leased(record, owner):
            self.log.warning("job_takeover_deferred", route=self.route.name, job=job.id)
            return
        unknown = OutcomeUnknown(
            "the proxy running this operation stopped while its call was in flight; it may "
            "have been executed, so it is not sent again",
            status=502,
        )
        lease = self.guard.job_lease(op, owner, asyncio.get_running_loop().time())
        if not await self.guard.conclude_unknown(lease, unknown, taker_owner(job.id)):
            record = await self.store.get(op.key)
            if _recorded(record, job.id):  # recorded by its worker meanwhile
                assert record is not None
                await self._ended_as_recorded(job, record.state, record.payload)
                return
        self.log.error("job_taken_over_after_sending", route=self.route.name, job=job.id)
        await self.queue.move(
            job.id, RUNNING | QUEUED, JobState.FAILED, worker=worker, error=_problem(unknown)
        )
        self.hub.poke(job.id)

    async def _ended_as_recorded(self, job: Job, state: State, payload: bytes) -> None:
        """Move a job whose record holds its outcome to the state the record says, whoever
        holds it now: no attempt can record another outcome (a taker fences the attempt it
        takes over), so the job follows its record."""
        ended = JobState.COMPLETED if state is State.COMPLETED else JobState.FAILED
        error = b""
        if ended is JobState.FAILED:
            error = StoredResponse.decode(payload).body
        await self._end(job, ended, error, None)

    async def _end(self, job: Job, state: JobState, error: bytes, worker: str | None) -> None:
        moved = await self.queue.move(job.id, RUNNING | QUEUED, state, worker=worker, error=error)
        self.hub.poke(job.id)
        self.log.info(
            "job_ended", route=self.route.name, key=job.label, job=job.id, state=state.value
        )
        if moved is None:
            self.log.warning("job_hold_lost", route=self.route.name, job=job.id)

    async def _expired_in_queue(self, job: Job, op: Operation, owner: str, worker: str) -> None:
        """The job's record lapsed while it waited (past max_queued): not sent; its key is
        released."""
        self.log.error("job_expired_in_queue", route=self.route.name, job=job.id)
        await self.store.release(op.key, owner)
        expired = OutcomeUnknown(
            "the operation waited in the queue longer than max_queued and was not sent; "
            "send the call again",
            status=503,
        )
        await self.queue.move(
            job.id, QUEUED, JobState.FAILED, worker=worker, error=_problem(expired)
        )
        self.hub.poke(job.id)


async def requeue(job: Job, route: RouteConfig, store: Store, queue: Queue) -> Job | None:
    """Queue a DEAD job again, its attempts afresh, if its key was not used since it died
    (it claims the key again); None otherwise: a new call may have run it."""
    assert route.async_ is not None and route.idempotency is not None
    key, owner = RecordKey(job.slot, job.name), JOB_OWNER + job.id
    fingerprint = decode_request(job.request).fingerprint
    queued = route.async_.max_queued
    ttl = job_record_ttl(route.idempotency, queued)
    async with requeue_lock(store, job.id) as taken:
        current = await queue.get(job.id) if taken else None
        if current is None or current.state is not JobState.DEAD:  # e.g. requeued already
            return None
        claim = await store.claim(key, fingerprint, owner, queued, ttl, replay=False)
        if not claim.claimed:
            return None
        moved = await queue.move(job.id, DEAD, JobState.QUEUED, attempts=0, sent=False, error=b"")
        if moved is None:  # it expired meanwhile
            await store.release(key, owner)
        return moved


def listing(job: Job) -> dict[str, Any]:
    """A job as operators list it: its status document, route and key."""
    return {**document(job), "route": job.route, "key": job.label}


def _recorded(record: Record | None, job_id: str) -> bool:
    """An outcome of job ``job_id`` is in ``record`` (COMPLETED, or FAILED with its
    reason), recorded by an attempt or by a taker."""
    return (
        record is not None
        and job_id_of(record.owner) == job_id
        and record.state is not State.IN_PROGRESS
        and not record.lapsed
    )


def _leased(record: Record | None, owner: str) -> bool:
    """``record`` is ``owner``'s, IN_PROGRESS, its lease live: its attempt may go on."""
    return (
        record is not None
        and record.owner == owner
        and record.state is State.IN_PROGRESS
        and record.ttl > 0
    )


def _without_async_preferences(headers: RawHeaders) -> RawHeaders:
    """The headers with ``respond-async`` and ``wait`` taken out of ``Prefer``: the proxy
    applied them; the tool must answer the worker's call itself, not with its own 202."""
    kept: RawHeaders = []
    for name, value in headers:
        if name == b"prefer":
            parts = [p for p in value.split(b",") if not _async_preference(p)]
            if not parts:
                continue
            value = b", ".join(p.strip() for p in parts)
        kept.append((name, value))
    return kept


def _async_preference(part: bytes) -> bool:
    token = part.split(b";", 1)[0].split(b"=", 1)[0].strip().lower()
    return token in (b"respond-async", b"wait")


def _refusal(refusal: ProxyError | None, response: Response | None, body: bytes) -> bytes:
    """Why an attempt did not run, as a problem document."""
    if refusal is not None:
        return _problem(refusal)
    status = 0 if response is None else response.status_code
    detail = body[:512].decode("utf-8", "replace")
    return json_body(
        {
            "type": "urn:tool-proxy:problem:not-executed",
            "title": "The tool did not run the call",
            "status": status,
            "detail": f"the tool answered {status}: {detail}",
        }
    )


async def _drain(response: Response) -> bytes:
    """Read a response the worker does not pass on (its outcome is recorded meanwhile);
    the body of a small one."""
    if isinstance(response, StreamingResponse):
        with contextlib.suppress(Exception):  # cut short: the guard has concluded it
            async for _ in response.body_iterator:
                pass
        return b""
    return bytes(response.body)


async def _no_body() -> dict[str, Any]:
    return {"type": "http.request", "body": b"", "more_body": False}
