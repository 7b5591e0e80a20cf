"""Versioned writes: optimistic concurrency for tools without it; and the writes that
invalidate a resource's cached reads.

The proxy keeps a version per resource key: a number drawn from the resource's counter
(the route's, or a named resource's: ``routes[].resource``), fresh (and unwritten) for a
resource it has no entry of, kept ``versioning.ttl`` after its last use. Per call, around
the send::

    a read (a method not in versioning.methods, e.g. GET): the version, then forward
        (a read without the key, e.g. a listing, is forwarded without an ETag; a cached
        read's version the cache read already: ``Context.version``);
        the answer carries ETag: "<version>" (read before the tool answers: a write in
        between makes the ETag older than the data, so a write from it gets 412, never
        a lost update)
    a write: no key: 400; no If-Match / If-None-Match ──▶ 428 when versioning.required
      └─▶ reserve the resource (a store lock: one write of it at a time, across replicas)
            └─▶ mark the write, read the version ──▶ the precondition fails: 412, ETag
                   └─▶ forward ──▶ 2xx: bump the version, the mark cleared; ETag; free
                          ├─ nothing sent, or a refusal (4xx, 503): clear the mark; free
                          └─ outcome unknown: bump (a write may have happened: writers
                             of the old version get 412, not a lost update); free

Two writes with the same If-Match never both reach the tool: the second one reads the
version only after the first one's bump. If that bump fails (the store, or this proxy,
died after the send), the mark stays: the next write that finds it takes the write as
done and draws a fresh version, so its If-Match fails too, whenever it comes.

A write of a resource whose reads some route caches (``invalidates``) takes the same
path, with no precondition unless its method is versioned: its bump supersedes every
cached read of the resource (the cache keeps each answer with the version it was read
at, and serves it only while that is still the version, with no write's mark on it), on
every replica, before its answer reaches the caller. A write that names no resource (a
method of ``resource.writes`` without the key) is forwarded and invalidates nothing.
"""

from __future__ import annotations

import re
from typing import Any

from proxy.background import TaskSet
from proxy.config import RouteConfig, RouteProtocol
from proxy.errors import (
    NOT_SENT,
    BodyKeyUnreadable,
    InvalidHeader,
    LocksUnavailable,
    PreconditionFailed,
    PreconditionRequired,
    ResourceKeyMissing,
    StoreUnavailable,
)
from proxy.forwarding import UpstreamResponse
from proxy.metrics import Metrics
from proxy.policies import Context, Forward
from proxy.policies.limits import Settled, header_field
from proxy.policies.resources import Held, Locker, Resource
from proxy.store.locks import Locks, Version

# The lease of a write's reservation, renewed every third of it while the call runs.
RESERVATION_TTL_SECONDS = 10.0


# RFC 9110 8.8.3: entity-tag = [ W/ ] DQUOTE *etagc DQUOTE; a field is ``*`` or a list
# of them (empty elements allowed: 5.6.1). etagc holds commas: a tag is read whole.
_ETAGC = r"[\x21\x23-\x7e\x80-\xff]*"
_TAG = re.compile(rf'(W/)?"({_ETAGC})"')
_TAG_LIST = re.compile(rf'[ \t,]*(?:W/)?"{_ETAGC}"(?:[ \t]*,[ \t,]*(?:W/)?"{_ETAGC}")*[ \t,]*')


def _tags(context: Context, name: bytes, *, weak: bool) -> set[str] | None:
    """The entity tags of an If-Match/If-None-Match field, without their quotes: {"*"}
    for ``*``; weak ones only with ``weak`` (If-None-Match compares weakly, If-Match
    strongly: a weak tag never matches); None if the field is absent. A field present
    but empty, or not ``*`` nor a list of entity tags (``"1`` unterminated, a bare
    ``1``): ``InvalidHeader`` (400), never read as no precondition, nor cut to a tag."""
    field = header_field(context, name)
    if field is None:
        return None
    tags = entity_tags(field, weak=weak)
    if tags is None:
        value = field.strip(" \t")
        header = name.decode("latin-1")
        problem = "is empty" if not value else "is not * nor a list of entity tags"
        raise InvalidHeader(
            f'{header} {problem}: send {header}: "<version>" (the ETag of a read), or * '
            "(RFC 9110 13.1)"
        )
    return tags


def entity_tags(field: str, *, weak: bool) -> set[str] | None:
    """The entity tags of an If-Match/If-None-Match field's value, without their quotes:
    {"*"} for ``*``; weak ones only with ``weak``; None if it is not ``*`` nor a list of
    entity tags (RFC 9110 13.1: empty, ``"1`` unterminated, a bare ``1``)."""
    value = field.strip(" \t")
    if value == "*":
        return {"*"}
    if _TAG_LIST.fullmatch(value) is None:
        return None
    # a quoted "*" is a tag, not the wildcard (and no version's number)
    return {tag for is_weak, tag in _TAG.findall(value) if (weak or not is_weak) and tag != "*"}


def _matches(version: Version, tags: set[str]) -> bool:
    """``*`` matches a resource written through the proxy; a tag matches its number."""
    return ("*" in tags and version.written) or str(version.number) in tags


def _holds(version: Version, if_match: set[str] | None, if_none_match: set[str] | None) -> bool:
    if if_match is not None and not _matches(version, if_match):
        return False
    return if_none_match is None or not _matches(version, if_none_match)


def etag(number: int) -> str:
    return f'"{number}"'


class Versioning:
    """The versioning policy of one route; with ``invalidates``, also the writes of a
    resource some route caches (``resource.writes``), unchecked unless versioned."""

    def __init__(
        self,
        route: RouteConfig,
        locks: Locks,
        metrics: Metrics,
        tasks: TaskSet,
        log: Any,
        *,
        invalidates: bool = False,
        max_json_depth: int | None = None,
    ) -> None:
        config = route.versioning
        self.route = route.name
        self.resource = Resource.of(route, config, max_depth=max_json_depth)
        self.scope = self.resource.scope
        self.checked = frozenset(() if config is None else config.methods)
        """The writes whose preconditions are checked, and whose answers carry the ETag."""
        self.writes = route.write_methods() if invalidates else self.checked
        self.mcp = route.protocol is RouteProtocol.MCP
        self.etags = config is not None
        self.required = config is not None and config.required
        self.ttl = route.version_ttl()
        self.locks = locks
        self.metrics = metrics
        self.tasks = tasks
        self.log = log
        self.locker = Locker(
            route.name,
            "versioning",
            locks,
            RESERVATION_TTL_SECONDS,
            route.reservation_wait(),
            route.timeout,
            metrics,
            tasks,
            log,
            scope=route.resource_scope("versioning"),
        )

    def wrap(self, context: Context, forward: Forward) -> Forward:
        async def versioned() -> UpstreamResponse:
            if self._writes(context):
                return await self._write(context, forward)
            if not self.etags or context.version is not None:  # the cache read it
                return await forward()
            try:
                key = self.resource.key(context)
            except BodyKeyUnreadable:  # a key there, but unreadable: 400
                raise
            except ResourceKeyMissing:  # a read of no one resource (e.g. a listing)
                return await forward()
            version = await self._version(key)
            upstream = await forward()
            context.headers.append((b"etag", etag(version.number).encode()))
            return upstream

        return versioned

    def _writes(self, context: Context) -> bool:
        """True for a write: a method of ``writes``; on an MCP route, a ``tools/call`` the
        cache does not answer (every one is a POST)."""
        if self.mcp and context.call is not None:  # a read-only tool's, cached
            return False
        return context.request.method in self.writes

    async def _write(self, context: Context, forward: Forward) -> UpstreamResponse:
        checked = self.etags and context.request.method in self.checked
        try:
            key = self.resource.key(context)
        except ResourceKeyMissing as exc:
            if checked or isinstance(exc, BodyKeyUnreadable):
                raise
            return await forward()  # a write of no one resource: nothing to invalidate
        if not checked:
            return await self._reserved(context, key, forward, False, None, None)
        if_match = _tags(context, b"if-match", weak=False)
        if_none_match = _tags(context, b"if-none-match", weak=True)
        if if_match is None and if_none_match is None and self.required:
            self.metrics.resource_decision(self.route, "versioning", "precondition_required")
            raise PreconditionRequired(
                f"writes of route {self.route} must say which version they change: "
                'send If-Match: "<version>" (the ETag of a read), or If-None-Match: * '
                "for the first write"
            )
        return await self._reserved(context, key, forward, True, if_match, if_none_match)

    async def _reserved(
        self,
        context: Context,
        key: str,
        forward: Forward,
        checked: bool,
        if_match: set[str] | None,
        if_none_match: set[str] | None,
    ) -> UpstreamResponse:
        """The write, holding the resource's reservation: marked, checked against its
        preconditions, sent, bumped; its answer carries the ETag if ``checked``."""
        held = await self.locker.take("v|" + key)
        try:
            version = await self._begin(key, held)
            if not _holds(version, if_match, if_none_match):
                self.metrics.resource_decision(self.route, "versioning", "precondition_failed")
                raise PreconditionFailed(
                    f"the resource is at version {version.number}; the request's "
                    "precondition does not hold: read it again, then retry with its ETag",
                    headers={"ETag": etag(version.number)},
                )
            upstream = await forward()
        except NOT_SENT:
            self._unwritten(key, held)
            raise
        except BaseException:
            if await self._bump(key, held) is not None:
                self.locker.release(held)
            raise
        self.metrics.resource_decision(self.route, "versioning", "forwarded")
        if not _may_have_written(upstream.status):
            if checked:
                context.headers.append((b"etag", etag(version.number).encode()))
            return Settled(upstream, lambda body, whole: self._refused(key, held, whole))
        bumped = await self._bump(key, held)
        if bumped is None:  # the reservation is left to lapse: nothing more to free
            return upstream
        if checked:
            context.headers.append((b"etag", etag(bumped).encode()))
        # the reservation is held until the answer has been read: no other write of this
        # resource reaches the tool while this one may still be at work
        return Settled(upstream, lambda body, whole: self._settled(held, whole))

    def _settled(self, held: Held, whole: bool) -> None:
        if whole:
            self.locker.release(held)
        else:
            self.locker.abandon(held)

    def _refused(self, key: str, held: Held, whole: bool) -> None:
        """The tool refused the write: clear its mark, free the reservation; if the answer
        broke, it is left to lapse and the mark stays (the next write draws a fresh
        version: a 412 too many, never a lost update)."""
        if whole:
            self._unwritten(key, held)
        else:
            self.locker.abandon(held)

    def _unwritten(self, key: str, held: Held) -> None:
        """Clear the write's mark, then free the reservation (in the background)."""
        self.tasks.spawn(self._clear(key, held))

    async def _clear(self, key: str, held: Held) -> None:
        try:
            await self.locks.settle(self.scope, key, held.owner, False, self.ttl)
        except StoreUnavailable as exc:  # the mark stays: the next write draws a fresh one
            self.log.warning("version_mark_not_cleared", route=self.route, error=exc.detail)
        finally:
            self.locker.release(held)

    async def _version(self, key: str) -> Version:
        try:
            return await self.locks.version(self.scope, key, self.ttl)
        except StoreUnavailable as exc:
            raise self._unavailable() from exc

    async def _begin(self, key: str, held: Held) -> Version:
        try:
            return await self.locks.begin(self.scope, key, held.owner, self.ttl)
        except StoreUnavailable as exc:
            raise self._unavailable() from exc

    def _unavailable(self) -> LocksUnavailable:
        self.metrics.resource_decision(self.route, "versioning", "store_down")
        return LocksUnavailable(
            f"the store that keeps the versions of route {self.route} is unreachable: "
            "nothing was sent"
        )

    async def _bump(self, key: str, held: Held) -> int | None:
        """The new version; None if the store failed or the mark is gone (then the
        reservation is left to lapse, and a mark left behind makes the next write draw a
        fresh version: its If-Match fails)."""
        try:
            number = await self.locks.settle(self.scope, key, held.owner, True, self.ttl)
        except StoreUnavailable as exc:
            self.log.error("version_bump_failed", route=self.route, error=exc.detail)
            number = None
        if number is None:
            self.locker.abandon(held)
            return None
        self.metrics.resource_decision(self.route, "versioning", "bumped")
        return number


def _may_have_written(status: int) -> bool:
    """True unless the status says the tool did not write: a 4xx refusal, or 503 (busy).
    A 2xx wrote; a 5xx may have written part of it: either way the version moves on, so a
    writer that read the version before it gets 412, never a lost update."""
    return not (400 <= status < 500 or status == 503)
