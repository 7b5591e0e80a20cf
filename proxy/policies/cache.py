"""The response cache: a tool whose answer depends only on the request (inference, code
analysis, look-ups) answers each distinct request once; the same request again gets the
stored answer, without calling the tool.

Per call of a cached method, the outermost policy around the send (a hit takes no lock
and no quota; on a guarded route it runs after the claim, so a duplicate's 409 or replay
comes first, and a hit is recorded as the outcome of its own key)::

    Cache-Control: no-store on the request ──▶ forward; nothing read, nothing stored
    no-cache or max-age=0 on the request ──▶ forward (no read, no wait); stored if it can be
    the key: method, path, query, media type, the body's RFC 8785 digest, the principal
      └─▶ the entry (``max-age=N`` on the request: too old for it); a mark "private":
          the same under the key of the caller's identity (issuer and subject)
            ├─ fresh, same Vary (digests) ──▶ hit: its answer, Age, Cache-Status: tool-proxy; hit
            ├─ a mark "the last call was not cacheable" ──▶ forward (no waiting)
            └─ none ──▶ take the key's fill lock in the store (one call across replicas)
                  ├─ taken ──▶ forward ──▶ cacheable: stored once its body is read,
                  │                        then the lock freed; else a mark, then freed
                  └─ held ──▶ poll the entry (5 ms to 50 ms) up to cache.wait:
                        the answer (fwd=miss; collapsed); a mark or the lock free: as
                        above; past the wait: call the tool itself (fwd=miss)

The cache fails open: a store that cannot be reached, an entry that cannot be read, an
offloaded body that is gone: the call is forwarded (the tool answers as it would have).
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import re
import secrets
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from proxy.asgi import SSE, RawHeaders
from proxy.background import TaskSet
from proxy.config import DEFAULT_OFFLOAD_THRESHOLD, CacheScope, RouteConfig, RouteProtocol
from proxy.errors import (
    BadRequest,
    OffloadUnavailable,
    OutcomeUnknown,
    ResourceKeyMissing,
    StoredResponseUnavailable,
    StoreError,
    StoreUnavailable,
)
from proxy.forwarding import UpstreamResponse
from proxy.keys import Canonicalization, fingerprint
from proxy.metrics import Metrics
from proxy.offload import Offload, Spool
from proxy.outcome import StoredResponse
from proxy.policies import Call, Context, Forward
from proxy.policies.resources import Resource
from proxy.policies.versioning import entity_tags, etag
from proxy.store import Store, make_locks

# The fill lock outlives the longest call of the route by this (the answer is stored
# before the lock is freed); a replica that dies filling frees it when it lapses.
FILL_MARGIN_SECONDS = 5.0
# How long a "not cacheable" mark lets identical misses call the tool without waiting
# (the waiters of the call that made it go at once).
MARK_SECONDS = 5.0
# Delta-seconds with more digits than this count as this many 9s (RFC 9111 1.2.2: a cache
# may take a value it cannot represent as "very large"; int() refuses 4300+ digits).
MAX_SECONDS_DIGITS = 10
_DIGITS = re.compile(r"[0-9]+")
# The first pause between two reads of an entry being filled, doubled up to the longest.
FIRST_POLL_SECONDS = 0.005
MAX_POLL_SECONDS = 0.05

HEADER = b"cache-status"
HIT = b"tool-proxy; hit"
_MARK = b"uncacheable"
# Under a principal's key that several identities share (``auth.principal: [tid]``): the
# answer was private, each caller's is under its own key (``private_key``).
_PRIVATE = b"private"
_PRIVATE_PREFIX = "cache-private|"
_VERSION = b"c2"  # c1 kept the Vary'd values themselves: read as malformed, a miss
# Never kept with a cached answer: it gets its own Age.
_NOT_KEPT = frozenset({b"age"})
# What a 304 keeps of the answer it stands for (RFC 9110 15.4.5; the ETag is the proxy's).
_NOT_MODIFIED_KEPT = frozenset(
    {b"cache-control", b"content-location", b"date", b"expires", b"vary"}
)


def _field(headers: RawHeaders, name: bytes) -> str:
    """Every value of ``name`` (lower case) in ``headers``, joined by commas."""
    return ",".join(v.decode("latin-1") for k, v in headers if k.lower() == name)


def directives(field: str) -> dict[str, str]:
    """A Cache-Control field as ``{directive: argument}`` (names lower case)."""
    out: dict[str, str] = {}
    for part in field.split(","):
        name, _, value = part.partition("=")
        name = name.strip().lower()
        if name:
            out.setdefault(name, value.strip().strip('"'))
    return out


def seconds(value: str) -> int:
    """A delta-seconds argument (ASCII digits only); an invalid one counts as 0 (RFC 9111
    1.2.2: stale), one of more than MAX_SECONDS_DIGITS digits as very large."""
    if not _DIGITS.fullmatch(value):
        return 0
    if len(value) > MAX_SECONDS_DIGITS:
        return int("9" * MAX_SECONDS_DIGITS)
    return int(value)


def status(fwd: bytes, *params: bytes) -> bytes:
    """A Cache-Status member of this cache (RFC 9211)."""
    return b"; ".join((b"tool-proxy", b"fwd=" + fwd, *params))


def vary_digest(headers: RawHeaders, name: bytes) -> bytes:
    """The SHA-256 (hex) of the request's ``name`` field: what an entry keeps of a field its
    answer varies on (``Vary: Authorization`` must not put a bearer token in the store)."""
    return hashlib.sha256(_field(headers, name).encode("latin-1")).hexdigest().encode()


def encode_entry(
    stored_at: float, vary: RawHeaders, stored: StoredResponse, version: int | None = None
) -> bytes:
    """``c2 <stored at>`` (and `` <version>``: the resource's version the answer was read
    at, on a route with ``resource``), the request's Vary fields (``name: <vary_digest>``)
    as lines, a blank line, the answer (``StoredResponse.encode``)."""
    first = b"%s %.3f" % (_VERSION, stored_at)
    if version is not None:
        first += b" %d" % version
    lines = [first, *(k + b": " + v for k, v in vary)]
    return b"\r\n".join(lines) + b"\r\n\r\n" + stored.encode()


def decode_entry(value: bytes) -> tuple[float, RawHeaders, StoredResponse]:
    """``StoreError`` if the value is not an entry."""
    head, _, payload = value.partition(b"\r\n\r\n")
    first, *lines = head.split(b"\r\n")
    version, _, at = first.partition(b" ")
    if version != _VERSION:
        raise StoreError("a cached answer is malformed")
    try:
        stored_at = float(at.partition(b" ")[0])
    except ValueError as exc:
        raise StoreError("a cached answer is malformed") from exc
    vary = [(name, value) for name, _, value in (line.partition(b": ") for line in lines)]
    return stored_at, vary, StoredResponse.decode(payload)


def entry_version(value: bytes) -> int | None:
    """The resource version an entry was read at; None if it has none (or is a mark)."""
    first = value[: value.find(b"\r\n")] if b"\r\n" in value else value
    parts = first.split(b" ")
    if len(parts) != 3 or parts[0] != _VERSION or not parts[2].isdigit():
        return None
    return int(parts[2])


class Cached(UpstreamResponse):
    """A stored answer, served as if the tool had just sent it."""

    def __init__(self, stored: StoredResponse, body: bytes | AsyncIterator[bytes]) -> None:
        headers = [(k, v) for k, v in stored.headers if k.lower() not in _NOT_KEPT]
        size = len(body) if isinstance(body, bytes) else (stored.ref.size if stored.ref else None)
        super().__init__(stored.status, headers, size)
        self._body = body

    async def read(self) -> bytes:
        if isinstance(self._body, bytes):
            return self._body
        return b"".join([chunk async for chunk in self._body])

    async def stream(self) -> AsyncIterator[bytes]:
        if isinstance(self._body, bytes):
            yield self._body
            return
        async for chunk in self._body:
            yield chunk


Kept = Callable[[bytes | Spool | None], asyncio.Task[None] | None]
"""Called once the answer's body has been read: the body (None: not whole, or too large);
gives the task that stores it, if any."""


class Filling(UpstreamResponse):
    """A cacheable answer on its way to the caller, kept (up to ``limit`` bytes, in a
    spool: memory, then a file) as it is read. Its end (the last chunk) reaches the caller
    once it is stored: the same request sent right after it is a hit. Not with
    ``hold=False`` (an MCP stream, whose server may send a request and wait for the
    client's answer: every chunk goes on at once; a repeat right after it waits for the
    store, holding the fill lock, instead).

    Streamed, it is read by a task of its own (``tasks``), the caller taking the chunks as
    they come: a caller that leaves mid-stream does not discard a good answer, which is
    read to its end and stored without it (a slow caller still slows the reading: at most
    ``_AHEAD`` chunks wait for it)."""

    _AHEAD = 2

    def __init__(
        self,
        upstream: UpstreamResponse,
        limit: int,
        spool: int,
        kept: Kept,
        tasks: TaskSet,
        *,
        hold: bool = True,
    ) -> None:
        super().__init__(upstream.status, upstream.headers, upstream.length)
        self._upstream = upstream
        self._hold = hold
        self._limit = limit
        self._spool = spool
        self._kept: Kept | None = kept
        self._tasks = tasks
        self._left = False
        self._room = asyncio.Event()

    def _end(self, body: bytes | Spool | None) -> asyncio.Task[None] | None:
        kept, self._kept = self._kept, None
        if kept is not None:
            return kept(body)
        if isinstance(body, Spool):
            body.close()
        return None

    async def read(self) -> bytes:
        body = None
        try:
            body = await self._upstream.read()
        finally:
            storing = self._end(body if body is not None and len(body) <= self._limit else None)
        if storing is not None:
            await asyncio.wait({storing})  # its errors are its own; it outlives a cancel
        return body

    async def stream(self) -> AsyncIterator[bytes]:
        chunks: asyncio.Queue[bytes | BaseException | None] = asyncio.Queue()
        self._tasks.spawn(self._read(chunks))
        held: bytes | None = None
        whole = False
        try:
            while (item := await chunks.get()) is not None:
                self._room.set()
                if isinstance(item, BaseException):
                    raise item
                if not self._hold:
                    yield item
                    continue
                if held is not None:
                    yield held
                held = item
            whole = True
        finally:
            if not whole:  # the caller left: the reading goes on without it
                self._left = True
                self._room.set()
        if held is not None:
            yield held

    async def _read(self, chunks: asyncio.Queue[bytes | BaseException | None]) -> None:
        """The upstream body into the spool and to the caller (while it is there); stored
        once whole, and then the end sent (None), or the error that cut it short."""
        spool: Spool | None = Spool(self._spool)
        whole = False
        try:
            async for chunk in self._upstream.stream():
                if spool is not None:
                    spool = self._write(spool, chunk)
                if self._left and spool is None:  # nobody to send it to, nothing to keep
                    break
                await self._hand(chunks, chunk)
            else:
                whole = True
        except Exception as exc:  # the tool's answer broke: the caller's, not this task's
            chunks.put_nowait(exc)
        except BaseException:  # a shutdown: the caller's answer ends cut short
            chunks.put_nowait(OutcomeUnknown("the answer's reading was cancelled"))
            raise
        finally:
            if spool is not None and not whole:
                spool.close()
                spool = None
            storing = self._end(spool)
        if storing is not None:
            await asyncio.wait({storing})
        if whole:
            chunks.put_nowait(None)

    async def _hand(
        self, chunks: asyncio.Queue[bytes | BaseException | None], chunk: bytes
    ) -> None:
        """Give ``chunk`` to the caller, if it is still there; wait while it is behind."""
        if self._left:
            return
        chunks.put_nowait(chunk)
        while chunks.qsize() > self._AHEAD and not self._left:
            self._room.clear()
            await self._room.wait()

    def _write(self, spool: Spool, chunk: bytes) -> Spool | None:
        """The spool with ``chunk``; None (closed) once it is too large or fails."""
        if spool.size + len(chunk) <= self._limit:
            try:
                spool.write(chunk)
                return spool
            except OSError:
                pass
        spool.close()
        return None


class Cache:
    """The response cache of one route."""

    def __init__(
        self,
        route: RouteConfig,
        store: Store,
        metrics: Metrics,
        tasks: TaskSet,
        log: Any,
        *,
        offload: Offload | None = None,
        max_json_depth: int | None = None,
        etags: bool = False,
        clock: Callable[[], float] = time.time,
    ) -> None:
        assert route.cache is not None
        config = route.cache
        self.route = route.name
        self.store = store
        self.metrics = metrics
        self.tasks = tasks
        self.log = log
        self.offload = offload
        self.clock = clock
        self.methods = route.cached_methods()
        self.mcp = route.protocol is RouteProtocol.MCP
        self.resource = (
            None if route.resource is None else Resource.of(route, max_depth=max_json_depth)
        )
        """The resource a read is about: its entries are fenced by its version."""
        self.locks = None if self.resource is None else make_locks(store)
        self.version_ttl = route.version_ttl()
        self.etags = etags and not self.mcp
        """Reads carry the resource's ETag (some route versions it), and If-None-Match of
        the current one is answered 304 from a fresh entry."""
        self.statuses = frozenset((200,) if self.mcp else config.statuses)  # a result: 200
        self.ttl = config.ttl
        self.per_principal = config.scope is CacheScope.PRINCIPAL
        self.wait = route.cache_wait()
        self.max_bytes = min(config.max_bytes, store.max_payload_bytes)
        self.fill_ttl = fill_seconds(route)
        self.max_depth = max_json_depth
        idempotency = route.idempotency
        self.canonicalization = (
            Canonicalization.JCS if idempotency is None else idempotency.canonicalization
        )
        self._spool = offload.threshold if offload else DEFAULT_OFFLOAD_THRESHOLD
        self._owners = (f"{secrets.token_hex(8)}.{n}" for n in range(1 << 62))

    def wrap(self, context: Context, forward: Forward) -> Forward:
        if self.mcp:  # only the tools/call the MCP view says are cached
            if context.call is None:
                return forward
        elif context.request.method not in self.methods:
            return forward

        async def cached() -> UpstreamResponse:
            sent = False

            async def send() -> UpstreamResponse:
                nonlocal sent
                sent = True
                return await forward()

            try:
                answer = await self._cached(context, send)
            except Exception as exc:
                if sent:  # the tool's (or the send's) own error: the Guard's to judge
                    raise
                return await self._failed(context, forward, exc)
            if not sent and context.fence is not None:  # a hit, after a wait perhaps:
                context.fence.check()  # a key taken over meanwhile replays another answer
            return answer

        return cached

    async def _cached(self, context: Context, forward: Forward) -> UpstreamResponse:
        asked = directives(_field(context.request.scope["headers"], b"cache-control"))
        if "no-store" in asked:
            return await self._bypass(context, forward, b"request", b"detail=no-store")
        try:
            key = self.key(context)
        except BadRequest:  # a body that has no digest: never cached, passed on
            return await self._bypass(context, forward, b"bypass", b"detail=body")
        if self.resource is not None:
            refused = await self._versioned(context)
            if refused is not None:
                return await self._bypass(context, forward, *refused)
        max_age = seconds(asked["max-age"]) if "max-age" in asked else None
        if "no-cache" in asked or max_age == 0:  # fresh: nothing to read or wait for
            return await self._forward(context, key, forward, b"request")
        return await self._lookup(context, key, forward, max_age)

    async def _versioned(self, context: Context) -> tuple[bytes, bytes] | None:
        """Read the version of the request's resource into the context (and its ETag into
        the answer); or why the cache stays out of it: the request names no resource (it
        could show any), a write of it is in flight or may have happened (its mark), or the
        store cannot say (the call is forwarded; versioning, if any, asks again)."""
        assert self.resource is not None and self.locks is not None
        try:
            key = self.resource.key(context)
        except ResourceKeyMissing:
            return b"bypass", b"detail=no-resource"
        try:
            version = await self.locks.version(self.resource.scope, key, self.version_ttl)
        except StoreUnavailable as exc:
            self.log.warning("cache_store_unavailable", route=self.route, error=exc.detail)
            return b"miss", b"detail=store-unavailable"
        context.version = version
        if self.etags:
            context.headers.append((b"etag", etag(version.number).encode()))
        if version.writing:
            return b"bypass", b"detail=writing"
        return None

    async def _failed(self, context: Context, forward: Forward, exc: Exception) -> UpstreamResponse:
        """The cache itself failed before the send (a bug, an entry it cannot read): it
        fails open, so the call is forwarded as if the route had no cache. Never an error
        of its own, which a guarded route would record as "may have been executed"."""
        self.metrics.cache_decision(self.route, "error")
        self.log.warning("cache_failed", route=self.route, error=repr(exc))
        context.headers[:] = [(k, v) for k, v in context.headers if k not in (HEADER, b"age")]
        context.headers.append((HEADER, status(b"miss", b"detail=error")))
        return await forward()

    def key(self, context: Context) -> str:
        """``cache|<route>|<digest>`` of the method, path, query, the body's media type
        (the same bytes as JSON and as text are two requests) and canonical digest, and the
        principal for ``scope: principal``; of an MCP call, the endpoint (path, query) and
        what the call asks (``Call.material``) in place of the body."""
        who = context.principal.encode() if self.per_principal else b"*"
        scope = context.request.scope
        path: bytes = scope.get("raw_path") or scope["path"].encode()
        if context.call is not None:  # the endpoint (path, query), then what the call asks
            material = b"\n".join(
                (who, b"MCP", path, scope["query_string"], context.call.material())
            )
            return f"cache|{self.route}|{hashlib.sha256(material).hexdigest()[:40]}"
        content_type = context.request.header(b"content-type")
        body = fingerprint(context.body, content_type, self.canonicalization, self.max_depth)
        media = (content_type or "").split(";", 1)[0].strip().lower()
        method = context.request.method.encode()
        parts = (who, method, path, scope["query_string"], media.encode(), body.encode())
        material = b"\n".join(parts)
        return f"cache|{self.route}|{hashlib.sha256(material).hexdigest()[:40]}"

    async def _bypass(
        self, context: Context, forward: Forward, fwd: bytes, detail: bytes
    ) -> UpstreamResponse:
        self.metrics.cache_decision(self.route, "bypass")
        context.headers.append((HEADER, status(fwd, detail)))
        return await forward()

    async def _lookup(
        self, context: Context, key: str, forward: Forward, max_age: int | None
    ) -> UpstreamResponse:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait
        pause = FIRST_POLL_SECONDS
        owner = next(self._owners)
        waited = False
        current = None if context.version is None else context.version.number
        while True:
            try:
                value, filling = await self._read(key, owner, current)
            except StoreUnavailable as exc:
                return await self._store_down(context, forward, exc)
            if value == _PRIVATE and context.identity and not is_private(key):
                key = private_key(key, context.identity)  # this caller's own, looked up
                continue
            if filling:  # fwd=stale: an entry of an earlier version, superseded by a write
                fwd = b"miss" if value is None else b"stale"
                return await self._fill(context, key, forward, owner, fwd)
            if value is not None and _usable(value, current):
                return await self._answer(context, key, forward, value, max_age, waited)
            left = deadline - loop.time()
            if left <= 0:
                self.metrics.cache_decision(self.route, "waited_out")
                self.log.warning("cache_wait_ended", route=self.route, waited=self.wait)
                return await self._forward(context, key, forward, b"miss")
            waited = True
            await asyncio.sleep(min(pause, left))
            pause = min(pause * 2, MAX_POLL_SECONDS)

    async def _read(self, key: str, owner: str, current: int | None) -> tuple[bytes | None, bool]:
        """The entry (or mark); else None (or an entry of a resource version other than
        ``current``), and True if this call now holds the fill lock (False: another call
        holds it, on some replica)."""
        value = await self.store.get_value(key)
        if value is not None and _usable(value, current):
            return value, False
        if not await self.store.acquire(key, owner, self.fill_ttl):
            return value, False
        try:
            value = await self.store.get_value(key)  # filled between the first read and the lock?
        except BaseException:  # not this call's to fill: its waiters must not wait for it
            self._unlock(key, owner)
            raise
        if value is None or not _usable(value, current):
            return value, True
        self._unlock(key, owner)
        return value, False

    async def _answer(
        self,
        context: Context,
        key: str,
        forward: Forward,
        value: bytes,
        max_age: int | None,
        waited: bool,
    ) -> UpstreamResponse:
        """The stored answer; or, for a mark or an entry this request cannot take, a call."""
        if value in (_MARK, _PRIVATE):  # _PRIVATE: an anonymous caller has no entry of its own
            return await self._forward(context, key, forward, b"miss")
        found = await self._hit(context, key, value, max_age, waited)
        if isinstance(found, UpstreamResponse):
            return found
        return await self._forward(context, key, forward, found)

    async def _hit(
        self, context: Context, key: str, value: bytes, max_age: int | None, collapsed: bool
    ) -> UpstreamResponse | bytes:
        """The stored answer as a response; else the RFC 9211 fwd value of why not."""
        try:
            stored_at, vary, stored = decode_entry(value)
        except StoreError:
            self.log.warning("cached_answer_malformed", route=self.route)
            return b"miss"
        age = max(0, math.floor(self.clock() - stored_at))
        if max_age is not None and age > max_age:
            return b"request"
        headers = context.request.scope["headers"]
        if any(vary_digest(headers, name) != wanted for name, wanted in vary):
            return b"vary-miss"
        if self.etags and stored.status == 200 and _none_match(context):
            return self._not_modified(context, stored, age)
        call = context.call
        body = await self._body(key, value, stored, whole=call is not None)
        if body is None:
            return b"miss"
        if call is not None:  # re-addressed to this call (its id, the form it takes)
            assert isinstance(body, bytes)
            try:
                headers, body = call.served(stored.headers, body)
            except ValueError:  # not a JSON-RPC response: a miss, its answer stored anew
                self.log.warning("cached_answer_malformed", route=self.route)
                return b"miss"
            stored = StoredResponse(stored.status, headers, b"")
        if collapsed:
            self.metrics.cache_decision(self.route, "collapsed")
            context.headers.append((HEADER, status(b"miss", b"collapsed")))
        else:
            self.metrics.cache_decision(self.route, "hit")
            context.headers.append((HEADER, HIT))
        context.headers.append((b"age", str(age).encode()))  # the caller's, never recorded
        answer = Cached(stored, body)
        context.cached = True
        return answer

    def _not_modified(self, context: Context, stored: StoredResponse, age: int) -> Cached:
        """``304``: the caller holds the current version of a fresh entry (RFC 9110 15.4.5:
        with the fields a 200 would carry about its caching; the ETag is the context's)."""
        self.metrics.cache_decision(self.route, "hit")
        context.headers.append((HEADER, HIT))
        context.headers.append((b"age", str(age).encode()))
        kept = [(k, v) for k, v in stored.headers if k.lower() in _NOT_MODIFIED_KEPT]
        context.cached = True
        return Cached(StoredResponse(304, kept, b""), b"")

    async def _body(
        self, key: str, value: bytes, stored: StoredResponse, *, whole: bool
    ) -> bytes | AsyncIterator[bytes] | None:
        """The entry's body, from object storage if it was offloaded (streamed, unless
        ``whole``); None if it cannot be had (the request is then a miss)."""
        if stored.ref is None:
            return stored.body
        try:
            if self.offload is None:
                raise StoredResponseUnavailable("no object store is configured now")
            body = await self.offload.get(stored.ref)
            if isinstance(body, bytes):
                return body
            checked = self._checked(key, value, body)  # checked as it streams: at its end
            return b"".join([chunk async for chunk in checked]) if whole else checked
        except StoredResponseUnavailable as exc:
            self.log.warning("cached_body_unavailable", route=self.route, error=exc.detail)
            return None

    async def _checked(
        self, key: str, value: bytes, body: AsyncIterator[bytes]
    ) -> AsyncIterator[bytes]:
        """A large offloaded body; one found altered (or unreadable) mid-stream is cut short
        (never a wrong whole body) and its entry dropped, so the next request is a miss."""
        try:
            async for chunk in body:
                yield chunk
        except StoredResponseUnavailable as exc:
            self.log.warning("cached_body_unavailable", route=self.route, error=exc.detail)
            self.tasks.spawn(self._drop(key, value))
            raise

    async def _drop(self, key: str, value: bytes) -> None:
        """Replace the entry ``value`` (not a newer one) by a mark: the store has no delete
        for shared values; the next request calls the tool and stores its answer."""
        try:
            if await self.store.get_value(key) == value:
                await self.store.put_value(key, _MARK, MARK_SECONDS)
        except StoreUnavailable as exc:
            self.log.warning("cache_mark_failed", route=self.route, error=exc.detail)

    async def _store_down(
        self, context: Context, forward: Forward, exc: StoreUnavailable
    ) -> UpstreamResponse:
        self.metrics.cache_decision(self.route, "store_down")
        self.log.warning("cache_store_unavailable", route=self.route, error=exc.detail)
        context.headers.append((HEADER, status(b"miss", b"detail=store-unavailable")))
        return await forward()

    async def _fill(
        self, context: Context, key: str, forward: Forward, owner: str, fwd: bytes
    ) -> UpstreamResponse:
        """The one call of identical misses: its waiters read its answer from the store."""
        try:
            upstream = await forward()
        except BaseException:
            self._give_up(key, owner)
            raise
        return self._keep(context, key, upstream, fwd, owner)

    async def _forward(
        self, context: Context, key: str, forward: Forward, fwd: bytes
    ) -> UpstreamResponse:
        """A call of its own (no fill lock): its answer is stored if it can be."""
        return self._keep(context, key, await forward(), fwd, "")

    def _keep(
        self, context: Context, key: str, upstream: UpstreamResponse, fwd: bytes, owner: str
    ) -> UpstreamResponse:
        """``upstream``, stored once read if it is cacheable (then ``stored``, sent before
        the body: it may still fail to be kept, counted ``not_kept``). Never
        raises: the tool has answered, its answer goes to the caller whatever happens here."""
        added = len(context.headers)
        try:
            return self._filling(context, key, upstream, fwd, owner)
        except Exception as exc:
            del context.headers[added:]
            self.metrics.cache_decision(self.route, "error")
            self.log.warning("cache_failed", route=self.route, error=repr(exc))
            if owner:
                self._give_up(key, owner)
            return upstream

    def _filling(
        self, context: Context, key: str, upstream: UpstreamResponse, fwd: bytes, owner: str
    ) -> UpstreamResponse:
        ttl, why = self._freshness(upstream, context.principal)
        if why:
            self.metrics.cache_decision(self.route, "uncacheable")
            context.headers.append((HEADER, status(fwd, b"detail=" + why)))
            if owner:
                self._give_up(key, owner)
            return upstream
        if context.call is None:
            self.metrics.cache_decision(self.route, "stored")
            context.headers.append((HEADER, status(fwd, b"stored")))
        else:  # told once the answer is read (``_told``): a result is stored, an error not
            context.headers.append((HEADER, status(fwd)))
        headers = context.request.scope["headers"]
        vary = [(name, vary_digest(headers, name)) for name in _vary(upstream.headers)]
        entry = self._entry(context, key, upstream)
        return Filling(
            upstream,
            self.max_bytes,
            self._spool,
            lambda body: self._kept(key, entry, owner, context, fwd, upstream, vary, ttl, body),
            self.tasks,
            hold=context.call is None,
        )

    @staticmethod
    def _entry(context: Context, key: str, upstream: UpstreamResponse) -> str:
        """Where a cacheable answer is kept: under ``key``; a private one, under the key of
        the caller's identity if its principal is not one (several users may share it)."""
        if context.principal == context.identity or is_private(key):
            return key
        if "private" not in directives(_field(upstream.headers, b"cache-control")):
            return key
        return private_key(key, context.identity)

    def _freshness(self, upstream: UpstreamResponse, principal: str) -> tuple[float, bytes]:
        """How long the answer may be served, and b"" ; or (0, why it is not stored).
        ``private`` is stored only in a cache of one caller: never for ``scope: route``,
        nor for the anonymous callers (principal "") that share one under ``principal``."""
        if upstream.status not in self.statuses:
            return 0.0, b"status"
        told = directives(_field(upstream.headers, b"cache-control"))
        if self.mcp and _field(upstream.headers, b"content-type").startswith(SSE):
            told.pop("no-cache", None)  # the stream's, which every MCP server sends
        for directive in ("no-store", "no-cache"):
            if directive in told:
                return 0.0, directive.encode()
        if "private" in told and not (self.per_principal and principal):
            return 0.0, b"private"
        if b"*" in _vary(upstream.headers):
            return 0.0, b"vary"
        if upstream.length is not None and upstream.length > self.max_bytes:
            return 0.0, b"too-large"
        ttl = self.ttl
        for directive in ("s-maxage", "max-age"):  # a shared cache: s-maxage first
            if directive in told:
                ttl = min(ttl, seconds(told[directive]))
                break
        return (ttl, b"") if ttl > 0 else (0.0, b"max-age")

    def _kept(
        self,
        key: str,
        entry: str,
        owner: str,
        context: Context,
        fwd: bytes,
        upstream: UpstreamResponse,
        vary: RawHeaders,
        ttl: float,
        body: bytes | Spool | None,
    ) -> asyncio.Task[None] | None:
        stored = StoredResponse.of(upstream.status, upstream.headers, b"")
        if body is not None and context.call is not None:
            stored, body = self._result(context.call, stored, body)
            self._told(context, fwd, kept=body is not None)
        elif body is None:  # not read whole, or too large
            self.metrics.cache_decision(self.route, "not_kept")
        if body is None:
            if owner:
                self._give_up(key, owner)
            return None
        version = None if context.version is None else context.version.number
        return self.tasks.spawn(self._put(key, owner, stored, vary, ttl, body, entry, version))

    def _told(self, context: Context, fwd: bytes, *, kept: bool) -> None:
        """An MCP call's decision, once its answer is read: its Cache-Status member says
        so if its headers are not sent yet (a JSON answer; an SSE one has them sent)."""
        self.metrics.cache_decision(self.route, "stored" if kept else "uncacheable")
        member = status(fwd, b"stored") if kept else status(fwd, b"detail=result")
        context.headers[:] = [(k, member if k == HEADER else v) for k, v in context.headers]

    def _result(
        self, call: Call, stored: StoredResponse, body: bytes | Spool
    ) -> tuple[StoredResponse, bytes | None]:
        """What is kept of an MCP call's answer: its result, or None (an error, ...)."""
        try:
            whole = body.whole() if isinstance(body, Spool) else body
            kept = call.kept(stored.headers, whole)
        except Exception as exc:  # never the caller's error: the answer is not kept
            self.log.warning("cache_failed", route=self.route, error=repr(exc))
            kept = None
        finally:
            if isinstance(body, Spool):
                body.close()
        if kept is None:
            return stored, None
        headers, result = kept
        return StoredResponse(stored.status, headers, b""), result

    async def _put(
        self,
        key: str,
        owner: str,
        stored: StoredResponse,
        vary: RawHeaders,
        ttl: float,
        body: bytes | Spool,
        entry: str,
        version: int | None,
    ) -> None:
        """Store the answer (``stored``, with ``body``: in object storage when large) as
        ``entry`` (``key``, or the caller's own key with a mark "private" under ``key``),
        then free the lock."""
        try:
            size = body.size if isinstance(body, Spool) else len(body)
            if self.offload is not None and self.offload.wants(size):
                stored = stored.offloaded(await self.offload.put(self.route, body, keep_for=ttl))
            else:
                stored = stored.with_body(body.whole() if isinstance(body, Spool) else body)
            value = encode_entry(self.clock(), vary, stored, version)
            await self.store.put_value(entry, value, ttl)
            if entry != key:  # the callers of key look under their own key from now on
                await self.store.put_value(key, _PRIVATE, ttl)
        except (StoreUnavailable, OffloadUnavailable, OSError) as exc:
            error = str(getattr(exc, "detail", exc))
            self.metrics.cache_decision(self.route, "not_kept")
            self.log.warning("cache_not_stored", route=self.route, error=error)
            if owner:
                await self._mark(key)
        finally:
            if isinstance(body, Spool):
                body.close()
            if owner:  # its waiters read the entry: the caller need not wait for this
                self._unlock(key, owner)

    def _give_up(self, key: str, owner: str) -> None:
        """The fill ends without an answer to store: mark it, so that its waiters call the
        tool themselves at once, and free the lock (in the background)."""
        self.tasks.spawn(self._mark_and_free(key, owner))

    async def _mark_and_free(self, key: str, owner: str) -> None:
        await self._mark(key)
        await self._free(key, owner)

    async def _mark(self, key: str) -> None:
        """The mark, only where there is no entry: a waiter past its wait may have stored
        its own answer meanwhile. The store has no put-if-absent for shared values, so an
        entry stored between the read and the write is replaced (the window of one store
        round trip): its callers then miss, and call the tool, for MARK_SECONDS."""
        try:
            if await self.store.get_value(key) is None:
                await self.store.put_value(key, _MARK, MARK_SECONDS)
        except StoreUnavailable as exc:
            self.log.warning("cache_mark_failed", route=self.route, error=exc.detail)

    def _unlock(self, key: str, owner: str) -> None:
        self.tasks.spawn(self._free(key, owner))

    async def _free(self, key: str, owner: str) -> None:
        try:
            await self.store.unlock(key, owner)
        except StoreUnavailable as exc:  # it lapses after fill_ttl
            self.log.warning("cache_unlock_failed", route=self.route, error=exc.detail)


def private_key(key: str, identity: str) -> str:
    """The key of the private answers to ``identity`` (a caller's issuer and subject) of
    the shared ``key`` (a principal's, which may be a tenant's)."""
    return f"{_PRIVATE_PREFIX}{key}|{identity}"


def is_private(key: str) -> bool:
    return key.startswith(_PRIVATE_PREFIX)


def fill_seconds(route: RouteConfig) -> float:
    """The fill lock's lease: the longest the one call can take (``send_seconds``: its
    sends, token fetches, the waits of the policies inside the cache), and
    FILL_MARGIN_SECONDS to store it. The default ``cache.wait`` is that call's bound."""
    return route.send_seconds() + FILL_MARGIN_SECONDS


def _usable(value: bytes, current: int | None) -> bool:
    """True unless ``value`` is an entry read at a version other than ``current`` (a
    write of its resource superseded it); a mark serves every version."""
    if current is None or value in (_MARK, _PRIVATE):
        return True
    return entry_version(value) == current


def _none_match(context: Context) -> bool:
    """True if the request's If-None-Match names the version the cache read (weak
    comparison, RFC 9110 13.1.2: ``W/"5"`` is ``"5"``), or is ``*``."""
    field = _field(context.request.scope["headers"], b"if-none-match")
    if not field or context.version is None:
        return False
    tags = entity_tags(field, weak=True)  # a malformed field matches nothing: the answer
    return tags is not None and ("*" in tags or str(context.version.number) in tags)


def _vary(headers: RawHeaders) -> list[bytes]:
    """The request fields a response varies on (lower case), ``*`` included."""
    field = _field(headers, b"vary")
    return [name.strip().lower().encode("latin-1") for name in field.split(",") if name.strip()]
