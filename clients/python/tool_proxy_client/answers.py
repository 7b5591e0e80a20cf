"""What a call through the proxy comes back as, and how each proxy answer is read.

Pure functions over httpx responses, shared by the sync and the async client: whether an
answer is the tool's, a problem to raise, one to wait out, or a 202 operation.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any

import httpx

from tool_proxy_client.errors import (
    OperationCancelled,
    OperationDead,
    ProxyProblem,
    RecordIdentity,
    is_proxy_problem,
    problem_error,
)

OPERATIONS_PATH = "/_proxy/operations/"
TERMINAL = frozenset({"completed", "failed", "cancelled", "dead"})

DEFAULT_RETRIED = frozenset(
    {
        "request-in-progress",
        "resource-locked",
        "rate-limited",
        "upstream-unreachable",
        "lease-lost",
        "not-executed",
        "store-unavailable",
        "limits-unavailable",
        "locks-unavailable",
        "identity-provider-unavailable",
    }
)
"""Problem types a call waits out and sends again with the same key: nothing ran."""


@dataclass(frozen=True, slots=True)
class Waits:
    """How long a call waits out the proxy's "not now" answers (and lost connections)
    before it raises them. Every wait is bounded: ``total`` for the call, ``cap`` for one."""

    total: float = 60.0
    """Seconds a call may spend waiting, in all; then the last answer is raised."""
    cap: float = 30.0
    """One wait at most this long (a larger ``Retry-After`` is capped)."""
    base: float = 0.25
    """Without ``Retry-After``: ``base * 2**attempt`` (at most ``cap``), half of it random."""
    retried: frozenset[str] = DEFAULT_RETRIED
    """The problem types waited out (names, as in ``urn:tool-proxy:problem:<name>``)."""
    transport: bool = True
    """Send again, with the same key, after a connection error or a timeout."""

    def delay(self, attempt: int, retry_after: float | None) -> float:
        """Seconds to wait before attempt ``attempt + 1``."""
        if retry_after is not None:
            return min(max(retry_after, 0.0), self.cap)
        backoff = min(self.base * 2.0**attempt, self.cap)
        return backoff / 2 + random.uniform(0, backoff / 2)


@dataclass(frozen=True, slots=True)
class Answer:
    """The tool's answer (first or replayed) to one call through the proxy."""

    response: httpx.Response
    key: str | None
    """The Idempotency-Key the call was sent with."""
    operation: str | None = None
    """The operation id, when the answer came through a long call (202)."""

    @property
    def replayed(self) -> bool:
        """True if the proxy replayed a recorded answer (``Idempotent-Replayed: true``);
        a long call's result is always read from its record, so it says True too."""
        return str(self.response.headers.get("idempotent-replayed", "")).lower() == "true"

    @property
    def status_code(self) -> int:
        """The tool's status code."""
        return self.response.status_code

    @property
    def headers(self) -> httpx.Headers:
        """The tool's headers (with the proxy's ``Idempotent-Replayed``)."""
        return self.response.headers

    @property
    def content(self) -> bytes:
        """The tool's body."""
        return self.response.content

    def json(self) -> Any:
        """The tool's body, parsed as JSON."""
        return self.response.json()


@dataclass(frozen=True, slots=True)
class Operation:
    """A long call the proxy answered ``202``: follow it, or cancel it while queued."""

    id: str
    location: str
    """``/_proxy/operations/{id}``."""
    key: str | None
    record: RecordIdentity | None
    document: dict[str, Any] = field(default_factory=dict)
    """The status document of the 202 (``state``, ``attempts``, ...)."""
    retry_after: float | None = None

    @property
    def state(self) -> str:
        """The state the 202 (or the last read) said."""
        return str(self.document.get("state", ""))


@dataclass(slots=True)
class Event:
    """One server-sent event."""

    event: str = "message"
    data: str = ""
    id: str | None = None


class EventParser:
    """Server-sent events from lines of text (the WHATWG parsing rules, minus ``retry``)."""

    def __init__(self) -> None:
        self._event = Event()
        self._data: list[str] = []
        self.last_id: str | None = None

    def feed(self, line: str) -> Iterator[Event]:
        """The event that ``line`` completes, if any."""
        if not line:
            if self._data:
                self._event.data = "\n".join(self._data)
                self._event.id = self.last_id
                yield self._event
            self._event, self._data = Event(), []
            return
        if line.startswith(":"):
            return
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "event":
            self._event.event = value
        elif name == "data":
            self._data.append(value)
        elif name == "id" and "\x00" not in value:
            self.last_id = value


def retry_after(response: httpx.Response, document: Any = None) -> float | None:
    """The answer's ``Retry-After`` in seconds (or the problem's ``retry_after``)."""
    if isinstance(document, dict) and isinstance(document.get("retry_after"), int | float):
        return float(document["retry_after"])
    value = response.headers.get("retry-after")
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        pass
    try:
        return (parsedate_to_datetime(value) - datetime.now(UTC)).total_seconds()
    except (TypeError, ValueError):
        return None


def problem_of(response: httpx.Response) -> dict[str, Any] | None:
    """The proxy's problem document in ``response``, or None (the tool's own answer)."""
    media = response.headers.get("content-type", "").split(";")[0].strip().lower()
    if media != "application/problem+json":
        return None
    try:
        document = json.loads(response.content)
    except ValueError:
        return None
    return document if is_proxy_problem(document) else None


def problem_from(
    response: httpx.Response, document: dict[str, Any], record: RecordIdentity | None
) -> ProxyProblem:
    """The exception for a proxy problem answer."""
    return problem_error(
        document,
        status=response.status_code,
        retry_after=retry_after(response, document),
        record=record,
    )


def operation_of(
    response: httpx.Response, key: str | None, record: RecordIdentity | None
) -> Operation | None:
    """The operation a ``202`` names (``Location: /_proxy/operations/{id}``), else None."""
    location = response.headers.get("location", "")
    if response.status_code != 202 or OPERATIONS_PATH not in location:
        return None
    path = httpx.URL(location).path
    document = _json_or_empty(response)
    op_id = path.rsplit("/", 1)[-1]
    return Operation(
        id=op_id,
        location=path,
        key=key,
        record=_with_operation(record, op_id),
        document=document,
        retry_after=retry_after(response),
    )


def ended(operation: Operation, document: dict[str, Any]) -> ProxyProblem | None:
    """The exception of an operation that ended without an answer (cancelled, dead)."""
    state = document.get("state")
    if state == "cancelled":
        return OperationCancelled(
            _ending(document, "cancelled: never sent"), record=operation.record
        )
    if state == "dead":
        return OperationDead(_ending(document, "dead: nothing ran"), record=operation.record)
    return None


def _ending(document: dict[str, Any], what: str) -> dict[str, Any]:
    error = document.get("error") if isinstance(document.get("error"), dict) else {}
    detail = f"the operation ended {what}" + (f" ({error.get('detail')})" if error else "")
    return {**document, "type": "", "detail": detail}


def _with_operation(record: RecordIdentity | None, op_id: str) -> RecordIdentity | None:
    if record is None:
        return None
    return RecordIdentity(record.key, record.method, record.target, op_id)


def _json_or_empty(response: httpx.Response) -> dict[str, Any]:
    try:
        document = response.json()
    except ValueError:
        return {}
    return document if isinstance(document, dict) else {}
