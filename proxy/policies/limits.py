"""Shared limits: rates (GCRA) and concurrency slots across replicas, in requests or
tokens, and pauses when the tool itself says "slow down".

Per call, around the send (after a successful claim on a guarded route)::

    take (one store round trip: the caller's pause, every rate, every slot)
      ├─ refused ──▶ wait in line (limit_wait, FIFO per bucket in this process) or 429
      └─ allowed ──▶ forward ──▶ the tool's answer ──▶ 429/503 with a reset: pause the
                        │                         │   caller (or the route: pause_scope),
                        │                         │   at most pause_max
                        │                         └─▶ body read: true up the token cost,
                        │                             free the slots (one round trip)
                        └─ nothing sent: give the reservation back, free the slots

A route with only request rates (no response cost, no slot) costs the one ``take``.
The store being down: ``limits_on_store_down`` closed (503, nothing sent) or open
(forward without limits, logged and counted).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import math
import re
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any

import jsonpointer

from proxy.background import TaskSet
from proxy.config import LimitConfig, PauseScope, RouteConfig, StoreDown
from proxy.errors import (
    NOT_SENT,
    BodyKeyDuplicateMember,
    BodyKeyInvalidJSON,
    BodyKeyUnreadable,
    DuplicateJSONMember,
    InvalidHeader,
    InvalidJSONBody,
    LimitsUnavailable,
    RateLimited,
    StoreUnavailable,
)
from proxy.forwarding import UpstreamResponse
from proxy.keys import is_json_media_type, is_text, read_json
from proxy.metrics import Metrics
from proxy.numbers import whole
from proxy.policies import UNREAD, Context, Forward
from proxy.store.buckets import Admission, Buckets, Rate, Slots

# Statuses of the tool whose reset headers pause the caller (or the route) on every replica.
PAUSE_STATUSES = frozenset({429, 503})
# How often a caller waiting (limit_wait) for a full slot asks again.
SLOT_POLL_SECONDS = 0.05
# Retry-After of a 429 refused by a full slot: when one frees is not known.
SLOT_RETRY_AFTER = 1
# Response bodies read for a token true-up at most (larger ones keep the estimate).
MAX_TRUE_UP_BYTES = 1024 * 1024
# Raised by ``forward`` when nothing reached the tool: the reservation is given back.
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|h|m|s)")


@dataclass(frozen=True, slots=True)
class _Limit:
    """A configured limit, prepared once at start-up."""

    config: LimitConfig
    interval: float
    tolerance: float
    policy: str
    """Its RateLimit-Policy item, e.g. ``"rpm";q=60;w=60``."""
    burst: float = 0.0
    """The most a call may cost, as configured (``tolerance / interval`` can fall short
    of it by a rounding: 1,001 a minute)."""

    @classmethod
    def of(cls, config: LimitConfig) -> _Limit:
        name = f'"{config.name}"'
        if config.max_in_flight is not None:
            return cls(
                config, 0.0, 0.0, f'{name};q={config.max_in_flight};qu="concurrent-requests"'
            )
        quota, period = config.quota_period()
        interval = period / quota
        burst = config.burst if config.burst is not None else quota
        policy = f"{name};q={quota:g};w={period:g}"
        return cls(config, interval, interval * burst, policy, float(burst))

    @property
    def name(self) -> str:
        return self.config.name


class _Line:
    """Callers of one bucket waiting in this process, first come first served."""

    __slots__ = ("lock", "waiting")

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.waiting = 0


class _Call:
    """What one admitted call holds: its reservation and its slots."""

    __slots__ = ("admission", "owner", "rates", "renewal", "scope", "slots")

    def __init__(self, rates: list[Rate], slots: list[Slots], owner: str, scope: str) -> None:
        self.rates = rates
        self.slots = slots
        self.owner = owner
        self.scope = scope
        """The pause this call is stopped by, and sets when the tool asks for one."""
        self.renewal: asyncio.Task[None] | None = None
        self.admission: Admission | None = None


class Limits:
    """The limits policy of one route."""

    def __init__(
        self,
        route: RouteConfig,
        buckets: Buckets,
        metrics: Metrics,
        tasks: TaskSet,
        log: Any,
        *,
        max_json_depth: int | None = None,
    ) -> None:
        self.route = route.name
        self.max_depth = max_json_depth
        self.buckets = buckets
        self.metrics = metrics
        self.tasks = tasks
        self.log = log
        limits = [_Limit.of(limit) for limit in route.limits or ()]
        self.rates = [limit for limit in limits if limit.config.rate is not None]
        self.slots = [limit for limit in limits if limit.config.max_in_flight is not None]
        self.wait = route.limit_wait
        self.fail_open = route.limits_on_store_down is StoreDown.OPEN
        self.slot_ttl = min((s.config.slot_ttl for s in self.slots), default=0.0)
        self.call_seconds = route.timeout
        self.per_caller = route.pause_scope is PauseScope.CALLER
        self.pause_max = route.pause_max
        self.policy_header = ", ".join(limit.policy for limit in [*self.rates, *self.slots])
        self._trues_up = any(r.config.cost and r.config.cost.response for r in self.rates)
        self._lines: dict[tuple[str, ...], _Line] = {}
        self._owners = (f"{id(self):x}.{n}" for n in range(1 << 62))
        self._prefix = hashlib.sha256(str(time.time_ns()).encode()).hexdigest()[:12]

    def wrap(self, context: Context, forward: Forward) -> Forward:
        async def limited() -> UpstreamResponse:
            call = await self._admit(context)
            if call is None:  # the store is down and the route fails open
                return await forward()
            return await self._forward(context, call, forward)

        return limited

    # -- admission ------------------------------------------------------------------------

    async def _admit(self, context: Context) -> _Call | None:
        call = self._call(context)
        try:
            admission = await self._take_in_line(call)
        except StoreUnavailable as exc:
            self._store_down(exc)  # raises, unless the route fails open
            return None
        call.admission = admission
        if not admission.allowed:
            self._count_refusal(admission)
            raise self._refusal(admission)
        for limit in [*self.rates, *self.slots]:
            self.metrics.limit_decision(self.route, limit.name, "allowed")
        context.headers += self._headers(admission)
        if call.slots:
            call.renewal = asyncio.get_running_loop().create_task(self._renew(call))
        return call

    def _call(self, context: Context) -> _Call:
        rates = [
            Rate(
                self._key(limit, context),
                limit.interval,
                limit.tolerance,
                self._cost(limit, context),
            )
            for limit in self.rates
        ]
        for limit, rate in zip(self.rates, rates, strict=True):
            if rate.cost > limit.burst:
                self.metrics.limit_decision(self.route, limit.name, "limited")
                raise RateLimited(
                    f"this call costs {rate.cost:g} of limit {limit.name} of route {self.route}, "
                    f"above its burst of {limit.burst:g}: it can never pass",
                    headers={"RateLimit-Policy": self.policy_header},
                )
        slots = [Slots(self._key(s, context), s.config.max_in_flight or 0) for s in self.slots]
        owner = f"{self._prefix}.{next(self._owners)}"
        return _Call(rates, slots, owner, self._scope(context, rates, slots))

    def _scope(self, context: Context, rates: list[Rate], slots: list[Slots]) -> str:
        """The pause of this call: the route's (``pause_scope: route``: ""), or its caller's,
        the principal and the values of the route's limit keys (hashed)."""
        if not self.per_caller:
            return ""
        parts = [context.principal, *(r.key for r in rates), *(s.key for s in slots)]
        return hashlib.sha256("\x1f".join(parts).encode()).hexdigest()[:32]

    def _key(self, limit: _Limit, context: Context) -> str:
        kind = limit.config.key
        if kind == "route":
            value = ""
        elif kind == "principal":
            value = context.principal
        elif kind == "client_ip":
            value = context.client_ip
        elif kind.startswith("header:"):
            value = header_value(context, kind[7:].encode())
        else:
            pointer = kind[5:]
            value = key_text(body_json(context, self.max_depth), pointer, context, plain=False)
        if not value:
            return limit.name
        return f"{limit.name}|{hashlib.sha256(value.encode()).hexdigest()[:32]}"

    def _cost(self, limit: _Limit, context: Context) -> float:
        cost = limit.config.cost
        if cost is None:
            return 1.0
        if not isinstance(cost.request, str):
            return float(cost.request)
        document = body_json(context, self.max_depth)
        found = _number(_resolve(document, cost.request[5:]))
        if found is None:
            self.log.warning(
                "limit_cost_unreadable", route=self.route, limit=limit.name, note="cost 1"
            )
            return 1.0
        return found

    async def _take_in_line(self, call: _Call) -> Admission:
        """Take now; or, with limit_wait, wait behind the callers already waiting for the
        same buckets, until there is room or the wait would end past limit_wait."""
        line_key = tuple(r.key for r in call.rates) + tuple(s.key for s in call.slots)
        if self.wait <= 0 or line_key not in self._lines:
            admission = await self._take(call)
            if admission.allowed or not self._worth_waiting(admission, self.wait):
                return admission
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait
        line = self._lines.setdefault(line_key, _Line())
        line.waiting += 1
        self.metrics.limit_waiting(self.route, 1)
        try:
            try:
                await asyncio.wait_for(line.lock.acquire(), self.wait)
            except TimeoutError:
                return await self._take(call)
            try:
                return await self._wait_for_room(call, deadline, loop)
            finally:
                line.lock.release()
        finally:
            line.waiting -= 1
            self.metrics.limit_waiting(self.route, -1)
            if not line.waiting:
                self._lines.pop(line_key, None)

    async def _wait_for_room(
        self, call: _Call, deadline: float, loop: asyncio.AbstractEventLoop
    ) -> Admission:
        while True:
            admission = await self._take(call)
            left = deadline - loop.time()
            if admission.allowed or not self._worth_waiting(admission, left):
                return admission
            self._count_refusal(admission, "waited")
            await asyncio.sleep(_delay(admission))

    async def _take(self, call: _Call) -> Admission:
        return await self.buckets.take(
            self.route, call.rates, call.slots, call.owner, self.slot_ttl, call.scope
        )

    @staticmethod
    def _worth_waiting(admission: Admission, left: float) -> bool:
        return left > 0 and _delay(admission) <= left

    def _store_down(self, exc: StoreUnavailable) -> None:
        if not self.fail_open:
            raise LimitsUnavailable(
                f"the store that keeps the limits of route {self.route} is unreachable: "
                "nothing was sent"
            ) from exc
        self.metrics.limit_decision(self.route, "", "store_down_open")
        self.log.warning("limits_store_unavailable_open", route=self.route, error=exc.detail)

    def _count_refusal(self, admission: Admission, decision: str = "limited") -> None:
        if admission.paused > 0:
            self.metrics.limit_decision(self.route, "", "paused")
            return
        for limit, state in zip(self.rates, admission.rates, strict=False):
            if state.limited:
                self.metrics.limit_decision(self.route, limit.name, decision)
        for limit, free in zip(self.slots, admission.free, strict=False):
            if free < 0:
                self.metrics.limit_decision(self.route, limit.name, decision)

    def _refusal(self, admission: Admission) -> RateLimited:
        if admission.paused > 0:
            seconds = max(math.ceil(admission.paused), 1)
            whom = "this caller on route" if self.per_caller else "route"
            return RateLimited(
                f"the tool asked to pause {whom} {self.route}: retry after {seconds} s",
                headers={"Retry-After": str(seconds), **self._headers(admission, as_dict=True)},
            )
        seconds = max(math.ceil(admission.retry_after), 1) if admission.retry_after else 0
        full = [s.name for s, free in zip(self.slots, admission.free, strict=False) if free < 0]
        names = [r.name for r, st in zip(self.rates, admission.rates, strict=False) if st.limited]
        if full and not seconds:
            seconds = SLOT_RETRY_AFTER
        return RateLimited(
            f"limit {', '.join(names + full)} of route {self.route} has no room for this call; "
            f"retry after {seconds} s",
            headers={"Retry-After": str(seconds), **self._headers(admission, as_dict=True)},
        )

    def _headers(self, admission: Admission, *, as_dict: bool = False) -> Any:
        items = []
        for limit, state in zip(self.rates, admission.rates, strict=False):
            items.append(f'"{limit.name}";r={state.remaining};t={math.ceil(state.reset)}')
        for limit, free in zip(self.slots, admission.free, strict=False):
            items.append(f'"{limit.name}";r={max(free, 0)}')
        fields = {"RateLimit-Policy": self.policy_header}
        if items:
            fields["RateLimit"] = ", ".join(items)
        if as_dict:
            return fields
        return [(k.encode(), v.encode()) for k, v in fields.items()]

    # -- the call -------------------------------------------------------------------------

    async def _forward(self, context: Context, call: _Call, forward: Forward) -> UpstreamResponse:
        try:
            upstream = await forward()
        except NOT_SENT:
            self._finish(call, [(rate, -rate.cost) for rate in call.rates])
            raise
        except BaseException:  # perhaps executed: the reservation stands
            self._finish(call, [])
            raise
        if upstream.status in PAUSE_STATUSES:
            await self._pause(upstream, call.scope)
        if not call.slots and not self._trues_up:
            return upstream
        return Settled(upstream, lambda body, whole: self._settle(call, body))

    def _settle(self, call: _Call, body: bytes | None) -> None:
        """The answer is read (``body`` None: not kept, or not had whole)."""
        changes = []
        for limit, rate in zip(self.rates, call.rates, strict=True):
            cost = limit.config.cost
            if cost is None or cost.response is None:
                continue
            real = None if body is None else _number(pointed(body, cost.response[5:]))
            if real is None:
                self.log.warning(
                    "limit_true_up_unreadable",
                    route=self.route,
                    limit=limit.name,
                    note="the estimate stands",
                )
                continue
            if real != rate.cost:
                changes.append((rate, real - rate.cost))
        self._finish(call, changes)

    def _finish(self, call: _Call, changes: list[tuple[Rate, float]]) -> None:
        if call.renewal is not None:
            call.renewal.cancel()
        if changes or call.slots:
            self.tasks.spawn(self._finish_now(call, changes))

    async def _finish_now(self, call: _Call, changes: list[tuple[Rate, float]]) -> None:
        try:
            await self.buckets.finish(self.route, changes, [s.key for s in call.slots], call.owner)
        except StoreUnavailable as exc:
            self.log.warning("limits_finish_failed", route=self.route, error=exc.detail)

    async def _renew(self, call: _Call) -> None:
        """Renew the call's slots every third of their lease while the call runs (at most
        the route's timeout: a body nobody reads cannot hold a slot for ever)."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self.call_seconds + self.slot_ttl
        keys = [s.key for s in call.slots]
        while loop.time() < give_up:
            await asyncio.sleep(self.slot_ttl / 3)
            try:
                if not await self.buckets.renew(self.route, keys, call.owner, self.slot_ttl):
                    self.log.warning("limit_slot_lost", route=self.route)
            except StoreUnavailable as exc:
                self.log.warning("limit_slot_renewal_failed", route=self.route, error=exc.detail)

    async def _pause(self, upstream: UpstreamResponse, scope: str) -> None:
        seconds = pause_seconds(upstream.headers, time.time())
        if seconds is None:
            return
        seconds = min(seconds, self.pause_max)
        self.log.warning(
            "route_paused_by_tool",
            route=self.route,
            status=upstream.status,
            seconds=round(seconds, 3),
            scope="caller" if scope else "route",
        )
        self.metrics.limit_decision(self.route, "", "pause_set")
        try:
            await self.buckets.pause(self.route, seconds, scope)
        except StoreUnavailable as exc:
            self.log.warning("route_pause_failed", route=self.route, error=exc.detail)


Done = Callable[[bytes | None, bool], None]
"""Called once a body has been read: the body (None if not kept) and whether it was read
to its end (False: the exchange broke or timed out, the tool may still be working)."""


class Settled(UpstreamResponse):
    """An answer that tells the policies when its body has been read (whole, or streamed
    to its end): then the token cost is trued up, slots and locks are freed."""

    def __init__(self, upstream: UpstreamResponse, done: Done) -> None:
        super().__init__(upstream.status, upstream.headers, upstream.length)
        self._upstream = upstream
        self._done: Done | None = done

    def _end(self, body: bytes | None, whole: bool) -> None:
        done, self._done = self._done, None
        if done is not None:
            done(body, whole)

    async def read(self) -> bytes:
        body, whole = None, False
        try:
            body = await self._upstream.read()
            whole = True
            return body
        finally:
            self._end(body, whole)

    async def stream(self) -> AsyncIterator[bytes]:
        kept: list[bytes] | None = []
        size, whole = 0, False
        try:
            async for chunk in self._upstream.stream():
                if kept is not None:
                    size += len(chunk)
                    if size <= MAX_TRUE_UP_BYTES:
                        kept.append(chunk)
                    else:
                        kept = None
                yield chunk
            whole = True
        except BaseException:
            kept = None
            raise
        finally:
            self._end(None if kept is None else b"".join(kept), whole)


def header_value(context: Context, name: bytes) -> str:
    """The value of header ``name`` (lower case), "" if absent; ``InvalidHeader`` if it
    comes on more than one line: the proxy would key by one, the tool perhaps join them
    (RFC 9110 5.3), and two requests for one resource would hold two locks."""
    return header_field(context, name) or ""


def header_field(context: Context, name: bytes) -> str | None:
    """As ``header_value``, but None if absent ("" if present and empty)."""
    found: bytes | None = None
    for key, value in context.request.scope["headers"]:
        if key == name:
            if found is not None:
                field = name.decode("latin-1")
                raise InvalidHeader(
                    f"{field} is sent more than once; route {context.route.name} keys by it"
                )
            found = value
    return None if found is None else found.decode("latin-1")


def body_json(context: Context, max_depth: int | None) -> Any:
    """The request body's JSON value, read once per request as a hashed body is (the
    policies' ``json:`` keys and costs share it); None if the body is not JSON.
    ``BodyKeyDuplicateMember`` if it repeats a member name, ``BodyKeyInvalidJSON`` if it
    nests deeper than ``max_depth`` and says it is JSON (its media type): 400, nothing
    sent. Declared otherwise, or not at all, a body too deep to read is not JSON, as
    for its hash (``keys.fingerprint``): its members are absent."""
    document = context.document
    if document is UNREAD:
        try:
            document = read_json(context.body, max_depth)
        except DuplicateJSONMember as exc:
            raise BodyKeyDuplicateMember(
                f"route {context.route.name} keys by members of the body: {exc.detail}"
            ) from exc
        except InvalidJSONBody as exc:
            if not is_json_media_type(context.request.header(b"content-type")):
                document = None
            else:
                raise BodyKeyInvalidJSON(
                    f"route {context.route.name} keys by members of the body: {exc.detail}"
                ) from exc
        context.document = document
    return document


def key_text(document: Any, pointer: str, context: Context, *, plain: bool) -> str:
    """The text of the member ``pointer`` names in ``document`` that a key is made of:
    "" if absent; ``plain``: a string is its own text, else every member is its JSON
    text. ``BodyKeyUnreadable`` if a string in it is not Unicode (a lone surrogate: the
    tool may read it as U+FFFD, so two such keys could be one resource to it)."""
    found = _resolve(document, pointer)
    if found is None:
        return ""
    if plain and isinstance(found, str):
        text = found
        unicode = text
    else:
        text = json.dumps(found, sort_keys=True)
        unicode = json.dumps(found, ensure_ascii=False) if "\\ud" in text else ""
    if not is_text(unicode):
        raise BodyKeyUnreadable(
            f"route {context.route.name} needs JSON member {pointer} of the body as its key; "
            "it holds a string that is not Unicode (a lone surrogate escape)"
        )
    return text


def _resolve(document: Any, pointer: str) -> Any:
    """What ``pointer`` (RFC 6901, via jsonpointer) names in a JSON value; None if absent."""
    try:
        return jsonpointer.resolve_pointer(document, pointer, None)
    except jsonpointer.JsonPointerException:
        return None


def pointed(body: bytes, pointer: str) -> Any:
    """What ``pointer`` names in a JSON body (the tool's answer, e.g. its token cost); None
    if absent, or if the body does not parse (too deep: a RecursionError)."""
    try:
        document = json.loads(body)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return None
    return _resolve(document, pointer)


def _number(value: Any) -> float | None:
    """A cost read from a body: a finite number, zero or more (Python's JSON reader takes
    ``NaN`` and reads ``1e400`` as infinity); None for anything else (unreadable)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:  # an int too large for a float
        return None
    return number if math.isfinite(number) and number >= 0 else None


def _delay(admission: Admission) -> float:
    if admission.paused > 0:
        return admission.paused
    return admission.retry_after if admission.retry_after > 0 else SLOT_POLL_SECONDS


def pause_seconds(headers: Sequence[tuple[bytes, bytes]], now: float) -> float | None:
    """How long the tool asks callers to wait, from its answer's headers: Retry-After
    (seconds or an HTTP date) first; else the provider headers of the limits it says are
    exhausted (``x-ratelimit-reset-requests``/``-tokens``: ``1s``, ``6m0s``, ``20ms``;
    ``anthropic-ratelimit-*-reset``: an RFC 3339 time), the longest of them."""
    fields = {name.lower().decode("latin-1"): value.decode("latin-1") for name, value in headers}
    if "retry-after" in fields:
        return _retry_after(fields["retry-after"], now)
    resets = []
    for name, value in fields.items():
        if name.startswith("x-ratelimit-reset-"):
            remaining = fields.get("x-ratelimit-remaining-" + name[len("x-ratelimit-reset-") :])
            seconds = _provider_duration(value)
        elif name.startswith("anthropic-ratelimit-") and name.endswith("-reset"):
            remaining = fields.get(name[: -len("-reset")] + "-remaining")
            seconds = _timestamp(value, now)
        else:
            continue
        if seconds is not None and remaining in (None, "0"):
            resets.append(seconds)
    return max(resets) if resets else None


def _retry_after(value: str, now: float) -> float | None:
    value = value.strip()
    if (seconds := whole(value)) is not None:
        return float(seconds)
    with contextlib.suppress(TypeError, ValueError, IndexError):
        return max(parsedate_to_datetime(value).timestamp() - now, 0.0)
    return None


def _provider_duration(value: str) -> float | None:
    value = value.strip()
    with contextlib.suppress(ValueError):
        return float(value)
    parts = _DURATION_PART.findall(value)
    if not parts or "".join(n + u for n, u in parts) != value:
        return None
    units = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
    return sum(float(n) * units[u] for n, u in parts)


def _timestamp(value: str, now: float) -> float | None:
    try:
        moment = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
    except ValueError:
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return max(moment.timestamp() - now, 0.0)
