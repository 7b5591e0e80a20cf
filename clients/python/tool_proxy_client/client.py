"""HTTP calls through tool-proxy, sync (:class:`ToolProxy`) and async (:class:`AsyncToolProxy`).

A call of a plan step sends the step's key, waits out ``409`` and the other "nothing ran,
try later" answers (``Retry-After``, bounded by :class:`Waits`), follows a ``202``
operation to its result (SSE with ``Last-Event-ID``, or polling), and returns the tool's
:class:`Answer`, or raises the exception of the proxy's problem. The two classes share
everything but their I/O loops.
"""

from __future__ import annotations

import asyncio
import json as jsonlib
import time
from collections.abc import Callable, Mapping
from typing import Any, Literal

import httpx

from tool_proxy_client.answers import (
    TERMINAL,
    Answer,
    EventParser,
    Operation,
    Waits,
    ended,
    operation_of,
    problem_from,
    problem_of,
    retry_after,
)
from tool_proxy_client.errors import (
    ProxyProblem,
    RecordIdentity,
    StillRunning,
    TransportError,
)
from tool_proxy_client.session import Step

Follow = Literal["sse", "poll"]
"""How an operation is followed: its event stream (reconnecting with Last-Event-ID), or polls."""
StatusCallback = Callable[[dict[str, Any]], None]
"""Called with each status document of an operation as it is seen."""

_SSE = {"accept": "text/event-stream"}


class _Request:
    """One guarded call: what is sent, the same on every retry."""

    def __init__(
        self,
        method: str,
        url: str,
        step: Step | None,
        json: Any,
        content: bytes | None,
        headers: Mapping[str, str] | None,
        key: str | None,
        respond_async: bool | float,
    ) -> None:
        self.method = method.upper()
        self.url = url
        self.headers = dict(headers or {})
        if json is not None:
            self.content: bytes | None = jsonlib.dumps(json, separators=(",", ":")).encode()
            self.headers.setdefault("content-type", "application/json")
        else:
            self.content = content
        self.key = key or _step_key(step, json, content, self.headers)
        if self.key is not None:
            self.headers["idempotency-key"] = self.key
        if respond_async is not False:
            wait = "" if respond_async is True else f", wait={int(respond_async)}"
            self.headers["prefer"] = f"respond-async{wait}"

    @property
    def record(self) -> RecordIdentity | None:
        return RecordIdentity(self.key, self.method, self.url) if self.key else None


def _step_key(
    step: Step | None, json: Any, content: bytes | None, headers: Mapping[str, str]
) -> str | None:
    if step is None:
        return None
    if json is not None:
        return step.key(json)
    content_type = {k.lower(): v for k, v in headers.items()}.get("content-type")
    return step.key_for_body(content or b"", content_type)


def _read(response: httpx.Response, request: _Request) -> Answer | Operation | ProxyProblem:
    """What one answer of the proxy is: the tool's answer, an operation, or a problem."""
    document = problem_of(response)
    if document is not None:
        return problem_from(response, document, request.record)
    operation = operation_of(response, request.key, request.record)
    return operation if operation is not None else Answer(response, request.key)


def _result(response: httpx.Response, operation: Operation) -> Answer:
    """An operation's result (its recorded answer), or the problem recorded for it."""
    document = problem_of(response)
    if document is not None:
        raise problem_from(response, document, operation.record)
    return Answer(response, operation.key, operation.id)


def _status(response: httpx.Response, operation: Operation) -> dict[str, Any] | None:
    """An operation's status document (None: it completed, 303 to its result)."""
    if response.status_code == 303:
        return None
    document = problem_of(response)
    if document is not None:
        raise problem_from(response, document, operation.record)
    status: dict[str, Any] = response.json()
    return status


class _Base:
    def __init__(self, base_url: str, waits: Waits | None, follow: Follow, timeout: float) -> None:
        self.base_url = base_url.rstrip("/")
        self.waits = waits or Waits()
        self.follow_mode: Follow = follow
        self.follow_timeout = timeout

    def _url(self, path: str) -> str:
        return path if "://" in path else self.base_url + "/" + path.lstrip("/")

    def _retrying(self, problem: ProxyProblem, attempt: int, spent: float) -> float | None:
        """Seconds to wait before sending again, or None to raise ``problem``."""
        if problem.type.rsplit(":", 1)[-1] not in self.waits.retried:
            return None
        return self._budget(self.waits.delay(attempt, problem.retry_after), spent)

    def _budget(self, delay: float, spent: float) -> float | None:
        return delay if spent + delay <= self.waits.total else None


class ToolProxy(_Base):
    """A synchronous client of tool-proxy (on an ``httpx.Client``: pass yours for auth,
    TLS, timeouts)."""

    def __init__(
        self,
        base_url: str,
        *,
        http: httpx.Client | None = None,
        waits: Waits | None = None,
        follow: Follow = "sse",
        follow_timeout: float = 3600.0,
    ) -> None:
        super().__init__(base_url, waits, follow, follow_timeout)
        self.http = http or httpx.Client(timeout=httpx.Timeout(30.0, read=300.0))

    def __enter__(self) -> ToolProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the HTTP client."""
        self.http.close()

    def call(
        self,
        step: Step | None,
        path: str,
        json: Any = None,
        *,
        method: str = "POST",
        content: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        key: str | None = None,
        respond_async: bool | float = False,
        on_status: StatusCallback | None = None,
    ) -> Answer:
        """Call the tool at ``path`` as ``step`` of its plan (the key from ``json`` or
        ``content``; or an explicit ``key``); a 202 is followed to its result."""
        request = _Request(
            method, self._url(path), step, json, content, headers, key, respond_async
        )
        got = self._send(request)
        return self.follow(got, on_status) if isinstance(got, Operation) else got

    def submit(
        self,
        step: Step | None,
        path: str,
        json: Any = None,
        *,
        wait: float | None = None,
        method: str = "POST",
        content: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        key: str | None = None,
    ) -> Answer | Operation:
        """Send a long call asking for ``202`` (``Prefer: respond-async``, ``wait=N``):
        the :class:`Operation`, or the answer itself if the call ended within ``wait``."""
        respond = True if wait is None else wait
        url = self._url(path)
        return self._send(_Request(method, url, step, json, content, headers, key, respond))

    def _send(self, request: _Request) -> Answer | Operation:
        started, attempt = time.monotonic(), 0
        while True:
            try:
                response = self.http.request(
                    request.method, request.url, content=request.content, headers=request.headers
                )
            except httpx.TransportError as exc:
                delay = self._lost(exc, attempt, time.monotonic() - started)
            else:
                got = _read(response, request)
                if not isinstance(got, ProxyProblem):
                    return got
                retry = self._retrying(got, attempt, time.monotonic() - started)
                if retry is None:
                    raise got
                delay = retry
            time.sleep(delay)
            attempt += 1

    def _lost(self, exc: httpx.TransportError, attempt: int, spent: float) -> float:
        delay = (
            self._budget(self.waits.delay(attempt, None), spent) if self.waits.transport else None
        )
        if delay is None:
            raise TransportError(f"no answer from the proxy: {exc!r}") from exc
        return delay

    def follow(self, operation: Operation, on_status: StatusCallback | None = None) -> Answer:
        """Wait for ``operation`` to end: its answer, or the exception of how it ended
        (``OutcomeUnknown`` for failed, ``OperationDead``, ``OperationCancelled``)."""
        deadline = time.monotonic() + self.follow_timeout
        if self.follow_mode == "sse":
            self._stream(operation, deadline, on_status)
        else:
            self._poll(operation, deadline, on_status)
        return self._fetch_result(operation)

    def _poll(self, op: Operation, deadline: float, on_status: StatusCallback | None) -> None:
        while True:
            response = self._get(op.location)
            document = _status(response, op)
            if document is None:
                return
            _seen(op, document, on_status)
            if document.get("state") in TERMINAL:
                return
            _still(op, deadline)
            time.sleep(min(retry_after(response) or 1.0, self.waits.cap))

    def _stream(self, op: Operation, deadline: float, on_status: StatusCallback | None) -> None:
        parser = EventParser()
        while True:
            _still(op, deadline)
            headers = dict(_SSE)
            if parser.last_id is not None:
                headers["last-event-id"] = parser.last_id
            try:
                with self.http.stream("GET", self._url(op.location), headers=headers) as response:
                    if response.status_code != 200 or "event-stream" not in response.headers.get(
                        "content-type", ""
                    ):
                        response.read()
                        if _ended(response, op, on_status):
                            return
                        time.sleep(1.0)
                        continue
                    for line in response.iter_lines():
                        for event in parser.feed(line):
                            if _terminal(op, event.data, on_status):
                                return
            except httpx.TransportError:
                time.sleep(self.waits.delay(0, None))  # the stream broke: reconnect

    def _fetch_result(self, op: Operation) -> Answer:
        return _result(self._get(op.location + "/result"), op)

    def status(self, operation: Operation) -> dict[str, Any]:
        """The operation's status document now."""
        document = _status(self._get(operation.location), operation)
        return document if document is not None else {**operation.document, "state": "completed"}

    def cancel(self, operation: Operation) -> dict[str, Any]:
        """Cancel a queued operation (its key is released: nothing was sent). A running
        one cannot be cancelled: ``OperationState``."""
        try:
            response = self.http.delete(self._url(operation.location))
        except httpx.TransportError as exc:
            raise TransportError(f"no answer from the proxy: {exc!r}") from exc
        document: dict[str, Any] = _status(response, operation) or {}
        return document

    def steps(self, plan: str) -> list[dict[str, Any]]:
        """The recorded steps of a plan session (``GET /_proxy/sessions/{plan}/steps``)."""
        response = self._get(f"/_proxy/sessions/{plan}/steps")
        document = problem_of(response)
        if document is not None:
            raise problem_from(response, document, None)
        steps: list[dict[str, Any]] = response.json()["steps"]
        return steps

    def _get(self, path: str) -> httpx.Response:
        try:
            return self.http.get(self._url(path))
        except httpx.TransportError as exc:
            raise TransportError(f"no answer from the proxy: {exc!r}") from exc


class AsyncToolProxy(_Base):
    """An asynchronous client of tool-proxy (on an ``httpx.AsyncClient``)."""

    def __init__(
        self,
        base_url: str,
        *,
        http: httpx.AsyncClient | None = None,
        waits: Waits | None = None,
        follow: Follow = "sse",
        follow_timeout: float = 3600.0,
    ) -> None:
        super().__init__(base_url, waits, follow, follow_timeout)
        self.http = http or httpx.AsyncClient(timeout=httpx.Timeout(30.0, read=300.0))

    async def __aenter__(self) -> AsyncToolProxy:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the HTTP client."""
        await self.http.aclose()

    async def call(
        self,
        step: Step | None,
        path: str,
        json: Any = None,
        *,
        method: str = "POST",
        content: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        key: str | None = None,
        respond_async: bool | float = False,
        on_status: StatusCallback | None = None,
    ) -> Answer:
        """As :meth:`ToolProxy.call`."""
        request = _Request(
            method, self._url(path), step, json, content, headers, key, respond_async
        )
        got = await self._send(request)
        return await self.follow(got, on_status) if isinstance(got, Operation) else got

    async def submit(
        self,
        step: Step | None,
        path: str,
        json: Any = None,
        *,
        wait: float | None = None,
        method: str = "POST",
        content: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        key: str | None = None,
    ) -> Answer | Operation:
        """As :meth:`ToolProxy.submit`."""
        respond = True if wait is None else wait
        url = self._url(path)
        return await self._send(_Request(method, url, step, json, content, headers, key, respond))

    async def _send(self, request: _Request) -> Answer | Operation:
        started, attempt = time.monotonic(), 0
        while True:
            try:
                response = await self.http.request(
                    request.method, request.url, content=request.content, headers=request.headers
                )
            except httpx.TransportError as exc:
                delay = self._lost(exc, attempt, time.monotonic() - started)
            else:
                got = _read(response, request)
                if not isinstance(got, ProxyProblem):
                    return got
                retry = self._retrying(got, attempt, time.monotonic() - started)
                if retry is None:
                    raise got
                delay = retry
            await asyncio.sleep(delay)
            attempt += 1

    def _lost(self, exc: httpx.TransportError, attempt: int, spent: float) -> float:
        delay = (
            self._budget(self.waits.delay(attempt, None), spent) if self.waits.transport else None
        )
        if delay is None:
            raise TransportError(f"no answer from the proxy: {exc!r}") from exc
        return delay

    async def follow(self, operation: Operation, on_status: StatusCallback | None = None) -> Answer:
        """As :meth:`ToolProxy.follow`."""
        deadline = time.monotonic() + self.follow_timeout
        if self.follow_mode == "sse":
            await self._stream(operation, deadline, on_status)
        else:
            await self._poll(operation, deadline, on_status)
        return _result(await self._get(operation.location + "/result"), operation)

    async def _poll(self, op: Operation, deadline: float, on_status: StatusCallback | None) -> None:
        while True:
            response = await self._get(op.location)
            document = _status(response, op)
            if document is None:
                return
            _seen(op, document, on_status)
            if document.get("state") in TERMINAL:
                return
            _still(op, deadline)
            await asyncio.sleep(min(retry_after(response) or 1.0, self.waits.cap))

    async def _stream(
        self, op: Operation, deadline: float, on_status: StatusCallback | None
    ) -> None:
        parser = EventParser()
        while True:
            _still(op, deadline)
            headers = dict(_SSE)
            if parser.last_id is not None:
                headers["last-event-id"] = parser.last_id
            try:
                async with self.http.stream(
                    "GET", self._url(op.location), headers=headers
                ) as response:
                    if response.status_code != 200 or "event-stream" not in response.headers.get(
                        "content-type", ""
                    ):
                        await response.aread()
                        if _ended(response, op, on_status):
                            return
                        await asyncio.sleep(1.0)
                        continue
                    async for line in response.aiter_lines():
                        for event in parser.feed(line):
                            if _terminal(op, event.data, on_status):
                                return
            except httpx.TransportError:
                await asyncio.sleep(self.waits.delay(0, None))

    async def status(self, operation: Operation) -> dict[str, Any]:
        """As :meth:`ToolProxy.status`."""
        document = _status(await self._get(operation.location), operation)
        return document if document is not None else {**operation.document, "state": "completed"}

    async def cancel(self, operation: Operation) -> dict[str, Any]:
        """As :meth:`ToolProxy.cancel`."""
        try:
            response = await self.http.delete(self._url(operation.location))
        except httpx.TransportError as exc:
            raise TransportError(f"no answer from the proxy: {exc!r}") from exc
        document: dict[str, Any] = _status(response, operation) or {}
        return document

    async def steps(self, plan: str) -> list[dict[str, Any]]:
        """As :meth:`ToolProxy.steps`."""
        response = await self._get(f"/_proxy/sessions/{plan}/steps")
        document = problem_of(response)
        if document is not None:
            raise problem_from(response, document, None)
        steps: list[dict[str, Any]] = response.json()["steps"]
        return steps

    async def _get(self, path: str) -> httpx.Response:
        try:
            return await self.http.get(self._url(path))
        except httpx.TransportError as exc:
            raise TransportError(f"no answer from the proxy: {exc!r}") from exc


def _seen(op: Operation, document: dict[str, Any], on_status: StatusCallback | None) -> None:
    if on_status is not None:
        on_status(document)
    problem = ended(op, document)
    if problem is not None:
        raise problem


def _ended(response: httpx.Response, op: Operation, on_status: StatusCallback | None) -> bool:
    """A status answer instead of a stream: True if the operation ended."""
    document = _status(response, op)
    if document is None:
        return True
    _seen(op, document, on_status)
    return document.get("state") in TERMINAL


def _terminal(op: Operation, data: str, on_status: StatusCallback | None) -> bool:
    """Handle one ``state`` event: True once the operation ended with an answer to fetch."""
    try:
        document = jsonlib.loads(data)
    except ValueError:
        return False
    if not isinstance(document, dict):
        return False
    _seen(op, document, on_status)
    return document.get("state") in TERMINAL


def _still(op: Operation, deadline: float) -> None:
    if time.monotonic() > deadline:
        raise StillRunning(op)
