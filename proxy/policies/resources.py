"""What the resource policies (``lock``, ``versioning``) share: the resource key a request
names, and taking a store lock within a wait.

Taking a lock, per key::

    wait in line in this process (FIFO, one asyncio lock per key)
      └─▶ ask the store (``Locks.acquire``), again with a short backoff, until the wait ends
            ├─ granted ──▶ renewed every ttl/3 while the call runs
            └─ not within the wait ──▶ 409 resource-locked, Retry-After; nothing sent

Only the first caller of a key in a process asks the store; the others wait behind it.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import secrets
from dataclasses import dataclass
from typing import Any

from proxy.background import TaskSet
from proxy.config import LockConfig, RouteConfig, VersioningConfig
from proxy.errors import (
    LocksUnavailable,
    ResourceKeyMissing,
    ResourceLocked,
    StoreUnavailable,
)
from proxy.metrics import Metrics
from proxy.policies import Context
from proxy.policies.limits import body_json, header_value, key_text
from proxy.store.locks import Locks

# The first pause between two asks of a held lock, doubled up to the longest one.
FIRST_POLL_SECONDS = 0.005
MAX_POLL_SECONDS = 0.05


def resource_value(
    kind: str, context: Context, *, plain: bool = False, max_depth: int | None = None
) -> str:
    """The resource a request names (``json:``, ``header:``, ``path:``, ``principal``);
    ``ResourceKeyMissing`` naming what is absent. ``plain``: a JSON string member is its
    text (``json:/account`` and ``path:0`` then name ``acc-42`` alike: a named resource's
    routes may take it from different places); else every member is its JSON text. A
    ``json:`` key of a body nested deeper than ``max_depth``, repeating a member name, or
    holding a string that is not Unicode: ``errors.BodyKeyUnreadable`` (400), never
    taken for an absent key."""
    if kind == "principal":
        value = context.principal
    elif kind.startswith("header:"):
        value = header_value(context, kind[7:].encode())
    elif kind.startswith("path:"):
        value = _segment(context, int(kind[5:]))
    else:
        value = key_text(body_json(context, max_depth), kind[5:], context, plain=plain)
    if not value:
        raise ResourceKeyMissing(f"route {context.route.name} needs {_named(kind)} in the request")
    return value


def resource_key(kind: str, context: Context, max_depth: int | None = None) -> str:
    """``<route>|<digest of the resource value>``: the store key of a request's resource
    on a route without ``routes[].resource`` (``Resource.key`` otherwise)."""
    value = resource_value(kind, context, max_depth=max_depth)
    digest = hashlib.sha256(value.encode()).hexdigest()[:32]
    return f"{context.route.name}|{digest}"


@dataclass(frozen=True, slots=True)
class Resource:
    """What a route's requests are about, as one policy (lock, versioning, cache) names it:
    the key form, and the scope its state is kept in (``RouteConfig.resource_scope``)."""

    kind: str
    scope: str
    named: bool
    """True for ``routes[].resource``: shared by the routes that name it."""
    max_depth: int | None = None
    """``limits.max_json_depth``: a ``json:`` key's body nested deeper is a 400."""

    @classmethod
    def of(
        cls,
        route: RouteConfig,
        part: LockConfig | VersioningConfig | None = None,
        *,
        max_depth: int | None = None,
    ) -> Resource:
        named = route.resource is not None
        return cls(route.resource_key(part), route.resource_scope(), named, max_depth)

    def key(self, context: Context) -> str:
        """The store key of the request's resource; ``ResourceKeyMissing`` if it names none
        (``errors.BodyKeyUnreadable`` if its ``json:`` key cannot be read: a 400 too)."""
        if not self.named:
            return resource_key(self.kind, context, self.max_depth)
        value = resource_value(self.kind, context, plain=True, max_depth=self.max_depth)
        return f"{self.scope}|{hashlib.sha256(value.encode()).hexdigest()[:32]}"


def _segment(context: Context, index: int) -> str:
    path: str = context.request.scope["path"]
    prefix = context.route.path_prefix
    rest = path[len(prefix) :] if prefix != "/" else path
    segments = [s for s in rest.split("/") if s]
    return segments[index] if index < len(segments) else ""


def _named(kind: str) -> str:
    if kind == "principal":
        return "an authenticated caller (principal)"
    if kind.startswith("header:"):
        return f"header {kind[7:]}"
    if kind.startswith("path:"):
        return f"path segment {kind[5:]} (counted from 0 after the route's prefix)"
    return f"JSON member {kind[5:]} in the body"


class _Line:
    """Callers of one lock key waiting in this process, first come first served."""

    __slots__ = ("lock", "users")

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.users = 0


@dataclass(slots=True)
class Held:
    """A lock one call holds: its key, owner, fencing token and renewal."""

    key: str
    owner: str
    token: int
    line: _Line
    renewal: asyncio.TimerHandle | asyncio.Task[None] | None = None
    """A timer until the first renewal (most calls end before it), then a task."""


class Locker:
    """Takes, renews and frees the store locks of one route and policy."""

    def __init__(
        self,
        route: str,
        policy: str,
        locks: Locks,
        ttl: float,
        wait: float,
        call_seconds: float,
        metrics: Metrics,
        tasks: TaskSet,
        log: Any,
        *,
        scope: str | None = None,
    ) -> None:
        self.route = route
        self.policy = policy
        # the scope of its fencing tokens: one counter per route (or named resource) and
        # policy
        self.scope = scope or f"{route}|{policy}"
        self.locks = locks
        self.ttl = ttl
        self.wait = wait
        self.call_seconds = call_seconds
        self.metrics = metrics
        self.tasks = tasks
        self.log = log
        self._lines: dict[str, _Line] = {}
        self._owners = (f"{id(self):x}.{n}" for n in range(1 << 62))
        self._prefix = secrets.token_hex(8)  # two processes never share lock owners

    async def take(self, key: str) -> Held:
        """The lock of ``key``, within the wait; ``ResourceLocked`` or ``LocksUnavailable``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait
        line = self._lines.setdefault(key, _Line())
        line.users += 1
        try:
            if line.lock.locked():
                async with asyncio.timeout(self.wait):  # a timer, not a task (wait_for)
                    await line.lock.acquire()
            else:  # had at once
                await line.lock.acquire()
        except TimeoutError:
            self._leave(key, line)
            raise self._locked(key, self.ttl) from None
        except BaseException:
            self._leave(key, line)
            raise
        try:
            held = await self._ask_until(key, line, deadline, loop)
        except BaseException:
            line.lock.release()
            self._leave(key, line)
            raise
        held.renewal = loop.call_later(self.ttl / 3, self._renew_due, held, loop.time())
        return held

    async def _ask_until(
        self, key: str, line: _Line, deadline: float, loop: asyncio.AbstractEventLoop
    ) -> Held:
        owner = f"{self._prefix}.{next(self._owners)}"
        pause = FIRST_POLL_SECONDS
        waited = False
        while True:
            try:
                grant = await self.locks.acquire(self.scope, key, owner, self.ttl)
            except StoreUnavailable as exc:
                self.metrics.resource_decision(self.route, self.policy, "store_down")
                raise LocksUnavailable(
                    f"the store that keeps the {self.policy} of route {self.route} is "
                    "unreachable: nothing was sent"
                ) from exc
            if grant.token is not None:
                self.metrics.resource_decision(
                    self.route, self.policy, "waited" if waited else "acquired"
                )
                return Held(key, owner, grant.token, line)
            left = deadline - loop.time()
            if left <= 0:
                raise self._locked(key, grant.expires_in)
            waited = True
            await asyncio.sleep(min(pause, left))
            pause = min(pause * 2, MAX_POLL_SECONDS)

    def _locked(self, key: str, expires_in: float) -> ResourceLocked:
        self.metrics.resource_decision(self.route, self.policy, "locked")
        seconds = max(math.ceil(expires_in), 1)
        return ResourceLocked(
            f"another call holds this resource of route {self.route} ({self.policy}); "
            f"it was not freed within {self.wait:g} s: retry after {seconds} s",
            headers={"Retry-After": str(seconds)},
        )

    def _leave(self, key: str, line: _Line) -> None:
        line.users -= 1
        if not line.users:
            self._lines.pop(key, None)

    def release(self, held: Held) -> None:
        """Free the lock now (in the background: the caller does not wait for it)."""
        self._stop(held)
        self.tasks.spawn(self._release(held))

    def abandon(self, held: Held) -> None:
        """Stop renewing the lock and leave it to lapse after its ttl: the call may still
        be running at the tool (its outcome is unknown)."""
        self._stop(held)
        self.log.warning("resource_lock_left_to_lapse", route=self.route, policy=self.policy)
        held.line.lock.release()
        self._leave(held.key, held.line)

    def _stop(self, held: Held) -> None:
        if held.renewal is not None:
            held.renewal.cancel()
            held.renewal = None

    async def _release(self, held: Held) -> None:
        try:
            if not await self.locks.release(self.scope, held.key, held.owner):
                self.log.warning("resource_lock_lost", route=self.route, policy=self.policy)
                self.metrics.resource_decision(self.route, self.policy, "lost")
        except StoreUnavailable as exc:
            self.log.warning("resource_lock_release_failed", route=self.route, error=exc.detail)
        finally:
            held.line.lock.release()
            self._leave(held.key, held.line)

    def _renew_due(self, held: Held, taken: float) -> None:
        held.renewal = self.tasks.spawn(self._renew(held, taken))

    async def _renew(self, held: Held, taken: float) -> None:
        """Renew every third of the ttl while the call runs (at most the route's timeout:
        a body nobody reads cannot hold a lock for ever)."""
        loop = asyncio.get_running_loop()
        give_up = taken + self.call_seconds + self.ttl
        while loop.time() < give_up:
            try:
                if not await self.locks.renew(self.scope, held.key, held.owner, self.ttl):
                    self.log.warning("resource_lock_lost", route=self.route, policy=self.policy)
                    self.metrics.resource_decision(self.route, self.policy, "lost")
                    return
            except StoreUnavailable as exc:
                self.log.warning("resource_lock_renewal_failed", route=self.route, error=exc.detail)
            await asyncio.sleep(self.ttl / 3)
