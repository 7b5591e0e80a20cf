"""Idempotency records as operators and agents see them, and what an operator may do to them.

One place for both faces of the records (``admin.py`` over HTTP, ``tool-proxy records`` in
``cli.py``): the record id, the JSON view of a record (and of one plan step), the list
filters and their pages, and the changes (resolve as completed, release, delete), each
logged as an audit event at warning level naming the operator and the reason.

Listing reads bounded pages of ``Store.scan`` (at most ``SCAN_CALLS`` of ``SCAN_COUNT``
records per request, never Redis ``KEYS``), or one ``Store.records`` call when route,
principal and plan are all given. A page may therefore hold fewer records than its limit
(none, even) while a next cursor is given: keep paging until the cursor is empty.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from proxy import numbers
from proxy.config import DEFAULT_RESULT_TTL, RouteConfig, parse_duration
from proxy.errors import (
    PROBLEM_BASE,
    InvalidField,
    RecordNotFailed,
    RecordNotFound,
    RequestTooLarge,
    ResponseNotStored,
    StoreError,
)
from proxy.keys import is_text
from proxy.outcome import StoredResponse
from proxy.problems import MEDIA_TYPE
from proxy.store import Record, RecordKey, State, Store

# Records asked of the store per scan call while listing, and scan calls per listing
# request: the work one page costs, however many records the store holds.
SCAN_COUNT = 200
SCAN_CALLS = 10
# Records per page when the caller gives no limit, and the largest limit accepted.
DEFAULT_LIMIT = 50
MAX_LIMIT = 500
# The longest reason an operator may give for a change.
MAX_REASON_CHARS = 1000
# The step and name of an opaque key's record (``operation.py``).
OPAQUE = "-"

_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,256}")
_HEADER_VALUE = re.compile(r"[\t\x20-\x7e\x80-\xff]*")
_SECONDS = re.compile(r"[0-9]{1,18}(?:\.[0-9]{1,9})?")
_NOT_STORED = PROBLEM_BASE + ResponseNotStored.slug
FILTERS = ("route", "plan", "state", "principal", "older_than", "newer_than")

Flag = Callable[[str], str]
"""How a field is named to the user: as is (HTTP), or as a ``--flag`` (CLI)."""


def _as_is(name: str) -> str:
    return name


# -- ids and addresses -------------------------------------------------------------------


def record_id(key: RecordKey) -> str:
    """The opaque id of a record: base64url (unpadded) of slot, NUL, name."""
    raw = f"{key.slot}\x00{key.name}".encode()
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def parse_id(value: str, field: str = "id") -> RecordKey:
    """The key an id names; ``InvalidField`` if it is not one."""
    try:
        raw = base64.urlsafe_b64decode(value + "=" * (-len(value) % 4)).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        raise InvalidField(field, "not a record id") from None
    slot, sep, name = raw.partition("\x00")
    if not sep or slot.count("|") != 3 or not name:
        raise InvalidField(field, "not a record id")
    return RecordKey(slot, name)


@dataclass(frozen=True, slots=True)
class Address:
    """What a record's key says: route, principal, and (composite keys) plan, step, hash."""

    route: str
    principal: str
    plan: str | None
    step: str | None
    args_hash: str | None

    @classmethod
    def of(cls, key: RecordKey) -> Address:
        route, principal, plan, step = [*key.slot.split("|"), "", "", ""][:4]
        if key.name == OPAQUE:
            return cls(route, principal, None, None, None)
        return cls(route, principal, plan, step, key.name)


# -- views -------------------------------------------------------------------------------


def iso(seconds: float) -> str | None:
    """A store time as ISO 8601 UTC with milliseconds (``2025-01-31T12:00:00.000Z``)."""
    if not seconds:
        return None
    stamp = datetime.fromtimestamp(seconds, UTC).isoformat(timespec="milliseconds")
    return stamp.replace("+00:00", "Z")


def stored(record: Record) -> StoredResponse | None:
    """The recorded outcome; None while IN_PROGRESS, for a lapsed lease, or if malformed."""
    if record.state is State.IN_PROGRESS or not record.payload:
        return None
    try:
        return StoredResponse.decode(record.payload)
    except StoreError:
        return None


def problem_type(response: StoredResponse) -> str | None:
    """The ``type`` of a problem document the proxy recorded (e.g. outcome-unknown)."""
    content_type = dict(response.headers).get(b"content-type", b"")
    if content_type.decode("latin-1") != MEDIA_TYPE or response.ref is not None:
        return None
    try:
        kind = json.loads(response.body).get("type")
    except (ValueError, AttributeError):
        return None
    return kind if isinstance(kind, str) and kind.startswith(PROBLEM_BASE) else None


def replayable(record: Record, response: StoredResponse | None) -> bool:
    """COMPLETED, and its answer was kept (not a 410 response-not-stored)."""
    if record.state is not State.COMPLETED or response is None:
        return False
    return problem_type(response) != _NOT_STORED


def step_view(record: Record) -> dict[str, Any]:
    """One step of a plan session, as the agent that ran it sees it."""
    assert record.key is not None
    address = Address.of(record.key)
    response = stored(record)
    return {
        "step": address.step,
        "route": address.route,
        "args_hash": address.args_hash,
        "state": record.state.value,
        "status": None if response is None else response.status,
        "problem": None if response is None else problem_type(response),
        "created_at": iso(record.created_at),
        "updated_at": iso(record.updated_at),
        "replayable": replayable(record, response),
        "replays": record.replays,
        "lapsed": record.lapsed,
    }


def record_view(record: Record, body: bool = False) -> dict[str, Any]:
    """A record as an operator sees it; with ``body``, the recorded response too."""
    assert record.key is not None
    address = Address.of(record.key)
    view = {
        "id": record_id(record.key),
        "key": "opaque" if address.plan is None else "composite",
        "principal": address.principal,
        "plan": address.plan,
        **step_view(record),
        "ttl_seconds": round(record.ttl, 3),
    }
    if body:
        response = stored(record)
        view["response"] = None if response is None else response_view(response)
    return view


def response_view(response: StoredResponse) -> dict[str, Any]:
    """Status, headers and body (text when it is UTF-8, else base64) of an outcome."""
    view: dict[str, Any] = {
        "status": response.status,
        "headers": [[k.decode("latin-1"), v.decode("latin-1")] for k, v in response.headers],
    }
    if response.ref is not None:
        ref = response.ref
        view["body_offloaded"] = {"path": ref.path, "size": ref.size, "sha256": ref.sha256}
        return view
    try:
        view.update(body=response.body.decode("utf-8"), body_encoding="utf-8")
    except UnicodeDecodeError:
        view.update(body=base64.b64encode(response.body).decode(), body_encoding="base64")
    return view


# -- filters and pages -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Filter:
    """Which records a listing shows; None matches anything."""

    route: str | None = None
    plan: str | None = None
    state: State | None = None
    principal: str | None = None
    older_than: float | None = None
    """Created at least this many seconds ago."""
    newer_than: float | None = None
    """Created less than this many seconds ago."""

    @property
    def scope(self) -> str | None:
        """The one plan session the filter names, if route, principal and plan are all set."""
        if self.route is None or self.principal is None or self.plan is None:
            return None
        return f"{self.route}|{self.principal}|{self.plan}"

    def matches(self, record: Record, now: float) -> bool:
        assert record.key is not None
        address = Address.of(record.key)
        age = now - record.created_at
        return (
            (self.route is None or address.route == self.route)
            and (self.plan is None or address.plan == self.plan)
            and (self.state is None or record.state is self.state)
            and (self.principal is None or address.principal == self.principal)
            and (self.older_than is None or age >= self.older_than)
            and (self.newer_than is None or age < self.newer_than)
        )


def parse_filter(raw: Mapping[str, str | None], flag: Flag = _as_is) -> Filter:
    """A filter from text (query parameters or CLI flags); ``InvalidField`` names the field."""
    state = raw.get("state")
    try:
        parsed_state = None if state is None else State(state)
    except ValueError:
        choices = ", ".join(s.value for s in State)
        raise InvalidField(flag("state"), f"must be one of {choices}") from None
    return Filter(
        route=raw.get("route"),
        plan=raw.get("plan"),
        state=parsed_state,
        principal=raw.get("principal"),
        older_than=_duration(raw.get("older_than"), flag("older_than")),
        newer_than=_duration(raw.get("newer_than"), flag("newer_than")),
    )


def _duration(value: str | None, field: str) -> float | None:
    """A duration such as ``10m``, or a plain number of seconds (``600``)."""
    if value is None:
        return None
    try:
        return parse_duration(float(value) if _SECONDS.fullmatch(value) else value)
    except ValueError as exc:
        raise InvalidField(field, str(exc)) from None


def parse_limit(value: str | None, field: str = "limit") -> int:
    """A page size: 1..MAX_LIMIT, DEFAULT_LIMIT when not given."""
    return numbers.parse_limit(value, field, MAX_LIMIT, DEFAULT_LIMIT)


@dataclass(frozen=True, slots=True)
class Page:
    """One page of a listing and the cursor of the next ("" at the end)."""

    records: list[Record]
    cursor: str


def _encode_cursor(state: dict[str, Any]) -> str:
    return base64.urlsafe_b64encode(json.dumps(state).encode()).rstrip(b"=").decode()


def _decode_cursor(cursor: str, field: str) -> dict[str, Any]:
    if not cursor:
        return {}
    try:
        state = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
    except (binascii.Error, ValueError, RecursionError):  # deep nesting: not one of ours
        state = None
    if not isinstance(state, dict):
        raise InvalidField(field, "not a cursor of this listing")
    return state


async def list_records(
    store: Store, where: Filter, limit: int, cursor: str = "", field: str = "cursor"
) -> Page:
    """A page of the records ``where`` matches, from ``cursor`` ("" for the first page)."""
    state = _decode_cursor(cursor, field)
    now = time.time()
    if where.scope is not None:
        offset = state.get("o", 0)
        if not isinstance(offset, int) or offset < 0 or set(state) - {"o"}:
            raise InvalidField(field, "not a cursor of this listing")
        found = [r for r in await store.records(where.scope) if where.matches(r, now)]
        following = _encode_cursor({"o": offset + limit}) if offset + limit < len(found) else ""
        return Page(found[offset : offset + limit], following)
    position, after = state.get("s", ""), state.get("a", "")
    if not isinstance(position, str) or not isinstance(after, str) or set(state) - {"s", "a"}:
        raise InvalidField(field, "not a cursor of this listing")
    if not (is_text(position) and is_text(after)):  # a lone surrogate: no store takes it
        raise InvalidField(field, "not a cursor of this listing")
    return await _scan_page(store, where, limit, position, after, now)


async def _scan_page(
    store: Store, where: Filter, limit: int, position: str, after: str, now: float
) -> Page:
    """Up to ``limit`` matches from ``SCAN_CALLS`` scan calls at most. A page that ends
    inside a store page resumes there, after the last record it returned."""
    found: list[Record] = []
    for _ in range(SCAN_CALLS):
        following, batch = await store.scan(position, SCAN_COUNT)
        batch = _after(batch, after)
        for i, record in enumerate(batch):
            if not where.matches(record, now):
                continue
            found.append(record)
            if len(found) == limit:
                assert record.key is not None
                if i + 1 < len(batch):
                    return Page(found, _encode_cursor({"s": position, "a": record_id(record.key)}))
                return Page(found, _encode_cursor({"s": following, "a": ""}) if following else "")
        if not following:
            return Page(found, "")
        position, after = following, ""
    return Page(found, _encode_cursor({"s": position, "a": ""}))


def _after(batch: list[Record], after: str) -> list[Record]:
    """The records of a store page that follow the one named ``after`` (all if absent)."""
    ids = [record_id(r.key) for r in batch if r.key is not None]
    return batch[ids.index(after) + 1 :] if after in ids else batch


# -- changes -----------------------------------------------------------------------------


def check_reason(value: Any, field: str = "reason") -> str:
    """A change's reason: non-empty text of at most MAX_REASON_CHARS characters."""
    if not isinstance(value, str) or not value.strip():
        raise InvalidField(field, "required: say why (it goes to the audit log)")
    if len(value) > MAX_REASON_CHARS:
        raise InvalidField(field, f"at most {MAX_REASON_CHARS} characters")
    if not is_text(value):  # a lone surrogate escape: JSON reads it, no store keeps it
        raise InvalidField(field, "not Unicode text")
    return value.strip()


def answer(
    status: Any,
    headers: Sequence[tuple[str, str]],
    body: bytes,
    flag: Flag = _as_is,
) -> StoredResponse:
    """The response an operator records for a call that ran; ``InvalidField`` names the field."""
    if isinstance(status, bool) or not isinstance(status, int) or not 200 <= status <= 599:
        raise InvalidField(flag("status"), "must be an HTTP status from 200 to 599")
    raw = []
    for name, value in headers:
        if not _HEADER_NAME.fullmatch(name):
            raise InvalidField(flag("headers"), f"{name!r} is not a header name")
        if not _HEADER_VALUE.fullmatch(value):
            problem = (
                "is not Latin-1 text (a header value is bytes; ASCII is safest)"
                if max(value) > "\xff"
                else "holds control characters"
            )
            raise InvalidField(flag("headers"), f"the value of {name!r} {problem}")
        raw.append((name.lower().encode(), value.encode("latin-1")))
    return StoredResponse.of(status, raw, body)


class Records:
    """The changes an operator makes to records, each an audit event (warning level)."""

    def __init__(self, store: Store, routes: Sequence[RouteConfig], log: Any) -> None:
        self.store = store
        self.log = log
        self._ttls = {r.name: r.idempotency.result_ttl for r in routes if r.idempotency}

    async def get(self, key: RecordKey) -> Record:
        """The record under ``key``; ``RecordNotFound`` (404) if there is none."""
        record = await self.store.get(key)
        if record is None:
            raise RecordNotFound(f"no record {record_id(key)} (never, expired, or deleted)")
        return record

    async def resolve(
        self, key: RecordKey, response: StoredResponse, reason: str, admin: str
    ) -> Record:
        """Record a FAILED call as COMPLETED with ``response``: the tool did run it, and
        every retry now gets this answer as a replay. 409 unless the record is FAILED."""
        record = await self._failed(key)
        payload = response.encode()
        if len(payload) > self.store.max_payload_bytes:
            limit = self.store.max_payload_bytes
            raise RequestTooLarge(f"the response is above the store's limit of {limit} bytes")
        ttl = self._ttls.get(Address.of(key).route, DEFAULT_RESULT_TTL)
        if not await self.store.settle(key, State.COMPLETED, payload, ttl):
            raise RecordNotFailed(f"record {record_id(key)} changed meanwhile; look again")
        self._audit("admin_record_resolved", key, record, reason, admin, status=response.status)
        return await self.get(key)

    async def release(self, key: RecordKey, reason: str, admin: str) -> None:
        """Delete a FAILED record: the tool did not run the call, the next retry executes it."""
        record = await self._failed(key)
        if not await self.store.settle(key, None, b"", 0.0):
            raise RecordNotFailed(f"record {record_id(key)} changed meanwhile; look again")
        self._audit("admin_record_released", key, record, reason, admin)

    async def delete(self, key: RecordKey, reason: str, admin: str) -> Record:
        """Delete a record whatever its state (an IN_PROGRESS one lets a duplicate run)."""
        record = await self.get(key)
        if not await self.store.delete(key):
            raise RecordNotFound(f"no record {record_id(key)} (deleted meanwhile)")
        self._audit("admin_record_deleted", key, record, reason, admin)
        return record

    async def _failed(self, key: RecordKey) -> Record:
        record = await self.get(key)
        if record.state is not State.FAILED:
            raise RecordNotFailed(
                f"record {record_id(key)} is {record.state.value}: only a failed record "
                "(outcome unknown) can be resolved"
            )
        return record

    def _audit(
        self, event: str, key: RecordKey, record: Record, reason: str, admin: str, **extra: Any
    ) -> None:
        address = Address.of(key)
        self.log.warning(
            event,
            admin=admin,
            reason=reason,
            record=record_id(key),
            route=address.route,
            principal=address.principal,
            plan=address.plan,
            step=address.step,
            args_hash=address.args_hash,
            previous_state=record.state.value,
            lapsed=record.lapsed,
            **extra,
        )
