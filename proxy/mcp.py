"""The MCP (JSON-RPC over Streamable HTTP) view of a request and its answer.

A ``protocol: mcp`` route serves one MCP endpoint. Only a JSON-RPC request with method
``tools/call`` for a guarded tool (``mcp.guard``) goes through the state machine
(``idempotency.py``), as an ``Operation`` built from the tool's name and its
``params.arguments`` (the envelope's ``id`` changes on every retry, the arguments do not):

- the key comes from the ``Idempotency-Key`` header or ``params._meta.<key_meta>``;
- a composite key's ``args_hash`` is the SHA-256 of the RFC 8785 form of the arguments;
- the fingerprint is the tool's name with that digest;
- its ``MCP-Protocol-Version`` must be one of ``PROTOCOL_VERSIONS`` (absent: 2025-03-26),
  else 400 and nothing is sent.

The tool server's answer is recorded as its JSON-RPC response (from an SSE stream, the
final response, read as it arrives within ``mcp.max_answer_bytes``: past it the call is
recorded executed, its result not kept). The first caller gets the stream's other
messages (progress, the server's requests) as they arrive when it takes SSE
(``Progress``), then the result; a retry gets the result alone, with its own ``id``, as
JSON or as a one-event SSE stream, whichever its Accept prefers (on a tie, the form the
tool server used), and ``Idempotent-Replayed: true``. The proxy's refusals (in progress,
key missing or reused, outcome unknown, a policy's refusal, ...) are JSON-RPC errors for
the request's ``id``, their ``error.data`` the RFC 9457 document of the HTTP routes.

Everything else (``initialize``, ``tools/list``, notifications, responses, GET streams,
session DELETE) passes through unchanged; ``guard: annotated`` learns tool annotations
from the ``tools/list`` answers on the way back. On a route that guards calls, a
``notifications/cancelled`` is answered here (202) and not forwarded: the call completes
and is recorded, and the retry gets its result.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hashlib
import json
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol

from mcp import types
from pydantic import ValidationError
from starlette.responses import Response, StreamingResponse

from proxy.asgi import SSE, Incoming, KeyRepeated, RawHeaders, Reply
from proxy.config import (
    DEFAULT_MAX_ANSWER_BYTES,
    CachedTools,
    IdempotencyConfig,
    McpConfig,
    McpGuard,
    RouteConfig,
)
from proxy.errors import (
    ArgsHashMismatch,
    BadRequest,
    DuplicateJSONMember,
    InvalidIdempotencyKey,
    InvalidJSONBody,
    KeyReusedWithOtherBody,
    McpRefused,
    MissingIdempotencyKey,
    OutcomeUnknown,
    ProxyError,
    RequestInProgress,
    ResponseNotStored,
)
from proxy.fence import Fence
from proxy.forwarding import UpstreamResponse
from proxy.idempotency import Forward, Guard, Outcome
from proxy.keys import (
    Canonicalization,
    KeyKind,
    canonical_json,
    parse_composite,
    parse_json,
    parse_opaque,
    unquote,
)
from proxy.mcp_tools import MAX_TTL_SECONDS, MIN_TTL_SECONDS, TOOLS_TTL_SECONDS, SharedTools
from proxy.operation import Operation
from proxy.outcome import StoredResponse
from proxy.policies import Call
from proxy.problems import MEDIA_TYPE, problem_body
from proxy.reconcile import Lookup
from proxy.replay import REPLAYED_HEADER
from proxy.store import RecordKey

JSON = "application/json"
# The JSON-RPC error codes of the proxy's refusals (the server range, -32000..-32099).
IN_PROGRESS = -32010
ARGS_HASH_MISMATCH = -32011
KEY_REUSED = -32012
KEY_MISSING = -32013
KEY_INVALID = -32014
OUTCOME_UNKNOWN = -32015
RESULT_NOT_KEPT = -32016
REFUSED = -32019
"""Any other refusal of the proxy (store unavailable, rate limited, ...): see error.data."""
# The MCP revisions whose tools/call the proxy guards (MCP-Protocol-Version). 2025-03-26
# is what the transport spec has a server assume when the header is absent.
PROTOCOL_VERSIONS = ("2025-03-26", "2025-06-18", "2025-11-25", "2026-07-28")
TASKS_REVISIONS = frozenset({"2025-11-25"})
"""The revisions whose tools say ``execution.taskSupport`` (2026-07-28 moved tasks to the
extension ``io.modelcontextprotocol/tasks``, advertised in ``server/discover``)."""
DEFAULT_PROTOCOL_VERSION = "2025-03-26"
# Where a 2026-07-28 request states its revision itself (it must match the header).
VERSION_META = "io.modelcontextprotocol/protocolVersion"
# The spec's codes (2026-07-28) for a request whose headers disagree with its body, and
# for a revision the receiver does not serve (data: {supported, requested}); HTTP 400.
HEADER_MISMATCH = -32020
UNSUPPORTED_PROTOCOL_VERSION = -32022
_SUPPORTED = frozenset(PROTOCOL_VERSIONS)
# A GET stream (the server's own messages) is cut after this long, not the route's
# timeout (a call's bound); the client opens it again.
STREAM_SECONDS = 3600.0
# Tools whose annotations are remembered per route (guard: annotated), at most.
MAX_KNOWN_TOOLS = 10_000
# A recorded answer's form (json or sse) as the tool server sent it; never sent on.
_FORM_HEADER = b"tool-proxy-mcp-form"
_SESSION = b"mcp-session-id"
_VERSION = b"mcp-protocol-version"
_METHOD = b"mcp-method"
_NAME = b"mcp-name"
_PROBLEM = MEDIA_TYPE.encode()

RequestId = str | int | None
"""A JSON-RPC id; None when the message has none that can be read."""


class Exchange(Protocol):
    """The proxy's side of one request on an MCP route (tokens, policies, the upstream)."""

    identity: str
    """The caller's identity digest (downstream tokens), "" without ``auth``."""

    def read(self) -> Awaitable[bytes]:
        """The whole request body (within limits.max_body_bytes)."""

    def forward(
        self,
        body: bytes,
        *,
        fence: Fence | None = None,
        policies: bool = False,
        call: Call | None = None,
    ) -> Awaitable[UpstreamResponse]:
        """Send the request with ``body``; ``fence``: a guarded call's, checked right
        before it is sent (never sent twice); ``policies``: a ``tools/call``, which the
        route's policies (limits, locks) apply to; ``call``: one the route's cache may
        answer."""

    def relay(self, upstream: UpstreamResponse) -> Awaitable[Response]:
        """The upstream's answer, unchanged."""

    async def pass_through(self, route: RouteConfig) -> Response:
        """Forward the request (body streamed) as one of ``route`` and relay the answer."""

    def lookup(self) -> Lookup | None:
        """The route's reconcile look-up for this caller, if it has one."""


class Tasks(Protocol):
    """The tasks the proxy itself makes on a route with ``async`` (``mcp_tasks.py``)."""

    async def call(
        self, request: Incoming, exchange: Exchange, principal: str, call: ToolCall, body: bytes
    ) -> Handled | None:
        """A guarded ``tools/call`` run on the route's workers; None: a live call."""

    async def answer(
        self, request: Incoming, message: types.JSONRPCRequest, principal: str
    ) -> Handled | None:
        """A ``tasks/*`` request about one of the proxy's tasks; None: the server's."""

    async def initialized(self, exchange: Exchange, body: bytes) -> Response:
        """An ``initialize`` (or 2026-07-28 ``server/discover``) forwarded, its answer
        saying the server (the proxy) makes tasks of ``tools/call``."""


class Messages(Protocol):
    """What is given the messages of an SSE answer other than its result (``Progress``)."""

    def start(self) -> None:
        """The answer is an SSE stream."""

    def event(self, data: bytes) -> None:
        """One message of the server that is not the call's result."""


@dataclass(slots=True)
class Handled:
    """An MCP request's answer and what the request log says of it."""

    response: Response
    outcome: Outcome
    key: str | None = None


class JsonRpcRefusal(Exception):
    """A body the proxy had to read is not the JSON-RPC it can guard (-32700, -32600,
    -32602): answered as a JSON-RPC error, nothing forwarded."""

    def __init__(self, code: int, message: str, id: RequestId = None, data: Any = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.id = id
        self.data = data


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A ``tools/call`` request as read from its body."""

    id: str | int
    name: str
    arguments: dict[str, Any]
    meta: dict[str, Any]
    plain: bool = True
    """True if its params hold nothing but ``name``, ``arguments`` and ``_meta`` (no
    ``task``, no 2026-07-28 ``inputResponses`` or ``requestState``): what it asks is its
    tool and arguments alone."""


@dataclass(slots=True)
class ReadAnswer(UpstreamResponse):
    """The tool server's answer read whole, reduced to its JSON-RPC response."""

    body: bytes = b""

    async def read(self) -> bytes:
        return self.body

    async def stream(self) -> AsyncIterator[bytes]:
        yield self.body


# HTTP statuses with which a Streamable HTTP server refuses a POST before any tool runs:
# malformed, unauthenticated, forbidden, unknown session, wrong method, Accept or body type.
TRANSPORT_REFUSALS = frozenset({400, 401, 403, 404, 405, 406, 415})


class McpView:
    """The MCP view of one route: which calls are guarded, and what tools it knows."""

    def __init__(
        self, route: RouteConfig, guard: Guard | None, shared: SharedTools | None = None
    ) -> None:
        self.route = route
        self.config = route.mcp or McpConfig()
        self.guard = guard
        self.policy: IdempotencyConfig | None = route.idempotency
        self.streams = route.model_copy(update={"timeout": STREAM_SECONDS})
        """The route as GET streams are sent: bounded by STREAM_SECONDS."""
        self.annotated = self.config.guard is McpGuard.ANNOTATED
        self.named = frozenset(() if isinstance(self.config.guard, McpGuard) else self.config.guard)
        self.cached = None if route.cache is None else route.cache.cached_tools()
        """The tools whose calls the route's cache answers: annotated, or by name."""
        self.learns = self.annotated or self.cached is CachedTools.ANNOTATED
        """True if the tools' annotations are read from the ``tools/list`` answers."""
        self.hints: dict[str, Hints] = {}
        """Tool name → what its annotations say (when ``learns``)."""
        self.shared = shared if self.learns else None
        """The annotations every replica learnt, in the store (``mcp_tools.py``)."""
        idempotency = route.idempotency
        self.canonicalization = (
            Canonicalization.JCS if idempotency is None else idempotency.canonicalization
        )
        release = self.policy.release_on_status if self.policy is not None else ()
        self.not_run = TRANSPORT_REFUSALS | frozenset(release)
        """HTTP statuses of a tools/call answer that say the tool was not called."""
        self.answer_bound = answer_bound(self.config, guard)
        """The most of a guarded call's answer held while it is read whole."""
        self.tasks: Tasks | None = None
        """The proxy's own tasks, on a route with ``async`` (set once its jobs exist)."""

    def guards(self, tool: str) -> bool:
        """True if ``tools/call`` of ``tool`` is guarded on this route."""
        if self.guard is None:
            return False
        if self.annotated:
            hints = self.hints.get(tool)
            return hints is None or not (hints.read_only or hints.idempotent)  # unknown: guarded
        return not self.named or tool in self.named

    def caching(self, request: Incoming, call: ToolCall) -> CachedCall | None:
        """The call as the route's cache sees it, if the cache may answer it: its tool is
        cached (``annotated``: says ``readOnlyHint``; an unknown tool is not) and it asks
        nothing but its arguments."""
        if self.cached is None or not call.plain:
            return None
        if isinstance(self.cached, CachedTools):
            hints = self.hints.get(call.name)
            if hints is None or not hints.read_only:
                return None
        elif call.name not in self.cached:
            return None
        try:
            canonical = canonical_json(call.arguments, self.canonicalization)
        except BadRequest:  # no canonical form (an integer past 2**53, NaN): not cached
            return None
        digest = hashlib.sha256(canonical).hexdigest()
        accept, session = _header(request, b"accept"), _header(request, _SESSION)
        return CachedCall(call, revision(request, call), digest, accept, session)

    async def handle(self, request: Incoming, exchange: Exchange, principal: str) -> Handled:
        """Pass through, answer a cancellation, or guard a ``tools/call``."""
        if request.method != "POST":
            route = self.streams if request.method == "GET" else self.route
            return Handled(await exchange.pass_through(route), Outcome.PASSED)
        repeated = request if isinstance(request, KeyRepeated) else None
        if repeated is not None:  # refused below, for the message's id (read in the body)
            repeated.jsonrpc = True
        body = await exchange.read()
        try:
            message = parse(body)
            if self.guard is not None:  # what it must read to guard: a request, with an id
                _check_request(message)
            call = tool_call(message) if _is_request(message, "tools/call") else None
        except JsonRpcRefusal as exc:  # the JSON-RPC spec's codes; 400 if it is not JSON-RPC
            status = 200 if exc.code == types.INVALID_PARAMS else 400
            reply = error_reply(exc.id, exc.code, exc.message, status=status, data=exc.data)
            return Handled(reply, Outcome.REJECTED)
        if repeated is not None:  # nothing is forwarded: the server could read either key
            return Handled(_key_repeated(message), Outcome.REJECTED)
        session = _header(request, _SESSION)
        if call is not None and self.shared is not None and call.name not in self.hints:
            self._known(await self.shared.recall())  # another replica may have listed it
        if call is not None and self.guards(call.name):
            unsupported = unsupported_version(request, call) or header_mismatch(request, call)
            if unsupported is not None:  # the transport spec's 400; nothing claimed or sent
                return Handled(unsupported, Outcome.REJECTED)
            if self.tasks is not None:  # a task, or a call run on the route's workers
                handled = await self.tasks.call(request, exchange, principal, call, body)
                if handled is not None:
                    return handled
            return await self._guarded(request, exchange, principal, session, call, body)
        if self.tasks is not None and _is_task_request(message):  # the proxy's, or the server's
            assert isinstance(message, types.JSONRPCRequest)
            handled = await self.tasks.answer(request, message, principal)
            if handled is not None:
                return handled
        if isinstance(message, types.JSONRPCNotification) and self._cancels(message):
            return Handled(Reply(202, [(b"content-length", b"0")], b""), Outcome.PASSED)
        if self.tasks is not None and (
            _is_request(message, "initialize") or _is_request(message, "server/discover")
        ):  # tasks: the proxy's
            return Handled(await self.tasks.initialized(exchange, body), Outcome.PASSED)
        if (self.learns or self.tasks is not None) and _is_request(message, "tools/list"):
            offer = self.tasks is not None and _header(request, _VERSION) in TASKS_REVISIONS
            return Handled(await self._listed(exchange, body, offer), Outcome.PASSED)
        if call is not None:  # unguarded: the route's policies still apply, as JSON-RPC
            return await self._unguarded(request, exchange, call, body)
        upstream = await exchange.forward(body)
        return Handled(await exchange.relay(upstream), Outcome.PASSED)

    async def _unguarded(
        self, request: Incoming, exchange: Exchange, call: ToolCall, body: bytes
    ) -> Handled:
        """A ``tools/call`` sent on unguarded (or answered by the cache); a policy's refusal
        (rate limited, resource locked, ...) is the call's JSON-RPC error."""
        cached = self.caching(request, call)
        try:
            upstream = await exchange.forward(body, policies=True, call=cached)
        except ProxyError as exc:
            return Handled(refusal(call.id, exc), Outcome.REJECTED)
        return Handled(await exchange.relay(upstream), Outcome.PASSED)

    def _cancels(self, note: types.JSONRPCNotification) -> bool:
        """True if ``note`` is a cancellation on a route that guards calls: it is not
        forwarded (it may name a guarded call running here or on another replica)."""
        return self.guard is not None and note.method == "notifications/cancelled"

    async def _listed(self, exchange: Exchange, body: bytes, offer: bool) -> Response:
        """Forward a ``tools/list``: learn the annotations of the tools in its answer (when
        ``learns``), and, ``offer``: mark the guarded tools as taking the proxy's tasks
        (``execution.taskSupport: optional``)."""
        upstream = await exchange.forward(body)
        raw = await upstream.read()
        form = content_type(upstream.headers)
        answer = final_response(raw, form) if upstream.status == 200 else None
        if not isinstance(answer, types.JSONRPCResponse):
            headers = [*upstream.headers, (b"content-length", str(len(raw)).encode())]
            return Reply(upstream.status, headers, raw)
        if self.learns and self._learn(answer.result):
            await self._share(listed_ttl(answer.result))
        if not offer or not offer_tasks(answer.result, self.guards):
            headers = [*upstream.headers, (b"content-length", str(len(raw)).encode())]
            return Reply(upstream.status, headers, raw)
        kept = [(k, v) for k, v in upstream.headers if k.lower() != b"content-type"]
        payload = answer.model_dump_json(by_alias=True, exclude_none=True).encode()
        return framed(payload, form == SSE, kept)

    def _learn(self, result: dict[str, Any]) -> bool:
        try:
            listed = types.ListToolsResult.model_validate(result)
        except ValidationError:
            return False
        for tool in listed.tools:
            if tool.name in self.hints or len(self.hints) < MAX_KNOWN_TOOLS:
                self.hints[tool.name] = Hints.of(tool.annotations)
        return True

    async def _share(self, ttl: float) -> None:
        """Tell the other replicas (through the store) what this one learnt, for ``ttl``
        seconds."""
        if self.shared is not None:
            hints = {n: (h.read_only, h.idempotent) for n, h in self.hints.items()}
            await self.shared.remember(hints, ttl)

    def _known(self, shared: dict[str, tuple[bool, bool]]) -> None:
        """Learn what other replicas learnt, for the tools this one has not seen listed."""
        for name, (read_only, idempotent) in shared.items():
            if name not in self.hints and len(self.hints) < MAX_KNOWN_TOOLS:
                self.hints[name] = Hints(read_only, idempotent)

    async def _guarded(
        self,
        request: Incoming,
        exchange: Exchange,
        principal: str,
        session: str,
        call: ToolCall,
        body: bytes,
    ) -> Handled:
        assert self.guard is not None and self.policy is not None
        accept = _header(request, b"accept")
        try:
            op = identify_call(self.route.name, self.policy, self.config, request, call, principal)
        except ProxyError as exc:
            return Handled(refusal(call.id, exc), Outcome.REJECTED)
        if op is None:  # no key, and the route does not require one
            return await self._unguarded(request, exchange, call, body)

        progress = Progress() if wants_sse(accept, True) else None

        cached = self.caching(request, call)

        fence = Fence()

        async def forward() -> UpstreamResponse:
            sent = await exchange.forward(body, fence=fence, policies=True, call=cached)
            return await read_answer(sent, call.id, self.not_run, self.answer_bound, progress)

        attempt = self._attempt(op, forward, fence, exchange.lookup())
        if progress is None:  # JSON only: the answer once it is had whole
            return await _concluded(await attempt, call.id, accept, session, op.label)
        # The call runs in a task of its own: its SSE answer may start (progress) before it
        # ends; it goes on, and is recorded, if the caller leaves (the shutdown waits).
        run = self.guard.tasks.spawn(attempt)
        run.add_done_callback(progress.ended)
        await asyncio.wait((run, progress.started), return_when=asyncio.FIRST_COMPLETED)
        if not progress.started.done():  # a replay, a refusal, or a JSON answer
            return await _concluded(run.result(), call.id, accept, session, op.label)
        return Handled(
            progress.response(run, call.id, accept, session, op.label), Outcome.EXECUTED, op.label
        )

    async def _attempt(
        self, op: Operation, forward: Forward, fence: Fence, lookup: Lookup | None
    ) -> Attempt:
        """The state machine's answer, or its refusal as a value."""
        assert self.guard is not None
        try:
            return await self.guard.run(op, forward, fence, lookup)
        except ProxyError as exc:
            return exc


def listed_ttl(result: dict[str, Any]) -> float:
    """How long a ``tools/list`` answer's annotations are shared: its ``ttlMs`` (2026-07-28),
    within ``mcp_tools.MIN_TTL_SECONDS`` and ``MAX_TTL_SECONDS``; else ``TOOLS_TTL_SECONDS``."""
    ttl_ms = result.get("ttlMs")
    if isinstance(ttl_ms, bool) or not isinstance(ttl_ms, int | float) or ttl_ms < 0:
        return TOOLS_TTL_SECONDS
    return min(max(ttl_ms / 1000, MIN_TTL_SECONDS), MAX_TTL_SECONDS)


def offer_tasks(result: dict[str, Any], guards: Callable[[str], bool]) -> bool:
    """Mark each guarded tool of a ``tools/list`` result ``execution.taskSupport:
    optional`` (the proxy makes its tasks; a tool the server says ``required`` of is left
    so); False if the result holds no tools to mark."""
    tools = result.get("tools")
    marked = False
    for tool in tools if isinstance(tools, list) else ():
        name = tool.get("name") if isinstance(tool, dict) else None
        if not isinstance(name, str) or not guards(name):
            continue
        execution = tool.setdefault("execution", {})
        if isinstance(execution, dict) and execution.get("taskSupport") != "required":
            execution["taskSupport"] = "optional"
            marked = True
    return marked


@dataclass(frozen=True, slots=True)
class Hints:
    """What a tool's ``tools/list`` annotations say (an absent hint: False)."""

    read_only: bool
    idempotent: bool

    @classmethod
    def of(cls, annotations: types.ToolAnnotations | None) -> Hints:
        if annotations is None:
            return cls(False, False)
        return cls(bool(annotations.readOnlyHint), bool(annotations.idempotentHint))


@dataclass(frozen=True, slots=True)
class CachedCall:
    """A ``tools/call`` as the response cache sees it (``policies.Call``): known by its
    tool, its arguments' digest and the revision it speaks, not by its envelope; its
    answer kept as the result alone (progress dropped), and served with this call's
    ``id``, as JSON or SSE by its Accept (on a tie, the form the tool server used)."""

    call: ToolCall
    revision: str
    digest: str
    accept: str
    session: str

    def material(self) -> bytes:
        parts = ("tools/call", self.call.name, self.revision, self.digest)
        return "\n".join(parts).encode()

    def kept(self, headers: RawHeaders, body: bytes) -> tuple[RawHeaders, bytes] | None:
        """The answer's final response, if it is a result to reuse: not a JSON-RPC error,
        nor an ``isError`` result, a task or an input request; and not from a stream on
        which the server asked the client something (elicitation, sampling, roots): that
        result depends on the caller's answer, not only on the arguments."""
        sse = content_type(headers) == SSE
        if sse and any(_asks(data) for data in sse_data(body)):
            return None
        answer = final_response(body, SSE if sse else JSON, self.call.id)
        if not isinstance(answer, types.JSONRPCResponse) or not _reusable(answer.result):
            return None
        kept: RawHeaders = [(b"content-type", JSON.encode())]
        if sse:
            kept.append((_FORM_HEADER, b"sse"))
        return kept, answer.model_dump_json(by_alias=True, exclude_none=True).encode()

    def served(self, headers: RawHeaders, body: bytes) -> tuple[RawHeaders, bytes]:
        answered_sse = (_FORM_HEADER, b"sse") in headers
        extra: RawHeaders = [(_SESSION, self.session.encode())] if self.session else []
        sse = wants_sse(self.accept, answered_sse)
        reply = framed(_with_id(body, self.call.id), sse, extra)
        kept = [(k, v) for k, v in reply.raw_headers if k != b"content-length"]
        return kept, bytes(reply.body)


def _asks(data: bytes) -> bool:
    """True if an SSE event's data is a JSON-RPC request of the server to the client."""
    if b'"method"' not in data or b'"id"' not in data:  # a notification: not parsed
        return False
    try:
        message = types.JSONRPCMessage.model_validate_json(data).root
    except ValidationError:
        return False
    return isinstance(message, types.JSONRPCRequest)


def _reusable(result: dict[str, Any]) -> bool:
    """True for a tool's result that a cache may give again: not ``isError``, not a
    ``CreateTaskResult`` (a task is one call's), not an ``InputRequiredResult``."""
    complete = result.get("resultType", "complete") == "complete"
    return complete and result.get("isError") is not True and "task" not in result


Attempt = tuple[Response, Outcome] | ProxyError
"""What the state machine made of a guarded call: its answer, or its refusal."""


async def _concluded(
    attempt: Attempt, id: str | int, accept: str, session: str, label: str
) -> Handled:
    """A guarded call's answer to its caller, in MCP form."""
    if isinstance(attempt, McpRefused):  # the server refused it at the HTTP level: as is
        stored = attempt.answer
        headers = [*stored.headers, (b"content-length", str(len(stored.body)).encode())]
        return Handled(Reply(stored.status, headers, stored.body), Outcome.RELEASED, label)
    if isinstance(attempt, ProxyError):
        conflict = isinstance(attempt, RequestInProgress)
        return Handled(refusal(id, attempt), _refused(attempt, conflict), label)
    response, outcome = attempt
    replayed = outcome is Outcome.REPLAYED
    rendered = await render(response, id, accept, session, replayed=replayed)
    return Handled(rendered, outcome, label)


# Messages of the server held for a slow first caller: past MAX_HELD_EVENTS, progress
# notifications are dropped; past MAX_HELD_MESSAGES or MAX_HELD_BYTES, any other message
# (a request of the server, a log line) cuts the caller's stream off: what is held is
# dropped, and the stream ends with -32010 (the call goes on and is recorded; the same
# call under the same key gets its result).
MAX_HELD_EVENTS = 256
MAX_HELD_MESSAGES = 1024
MAX_HELD_BYTES = 8 * 1024 * 1024


class Progress:
    """The first caller's view of a guarded call answered over SSE: the server's messages
    before the result (progress, its requests) are passed on as they arrive, then the
    result as the state machine recorded it. The reading of the answer never waits for
    the caller: what a slow caller has not taken yet is held, within bounds
    (``MAX_HELD_EVENTS``, ``MAX_HELD_MESSAGES``, ``MAX_HELD_BYTES``)."""

    def __init__(self) -> None:
        self.started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        """Done when the server's answer turned out to be an SSE stream."""
        self._held: deque[bytes] = deque()
        self._held_bytes = 0
        self._wake = asyncio.Event()
        self._gone = False
        self._cut = False
        """True once the caller fell too far behind: its stream ends, without the result."""

    def start(self) -> None:
        if not self.started.done():
            self.started.set_result(None)

    def event(self, data: bytes) -> None:
        """A message of the server on the call's stream that is not its result."""
        if self._gone:
            return
        over = self._held_bytes + len(data) > MAX_HELD_BYTES
        if b'"notifications/progress"' in data and (over or len(self._held) >= MAX_HELD_EVENTS):
            return
        if over or len(self._held) >= MAX_HELD_MESSAGES:
            self._cut_off()
            return
        self._held.append(data)
        self._held_bytes += len(data)
        self._wake.set()

    @property
    def held(self) -> int:
        """How many messages are held for the caller now."""
        return len(self._held)

    def _cut_off(self) -> None:
        self._gone = self._cut = True
        self._held.clear()
        self._held_bytes = 0
        self._wake.set()

    def ended(self, run: asyncio.Task[Attempt]) -> None:
        self._wake.set()

    def response(
        self, run: asyncio.Task[Attempt], id: str | int, accept: str, session: str, label: str
    ) -> Response:
        """The SSE stream to the first caller."""
        response = StreamingResponse(self._frames(run, id, accept, session, label), 200)
        extra: RawHeaders = [(_SESSION, session.encode())] if session else []
        response.raw_headers = [
            (b"content-type", SSE.encode()),
            (b"cache-control", b"no-cache"),
            *extra,
        ]
        return response

    async def _frames(
        self, run: asyncio.Task[Attempt], id: str | int, accept: str, session: str, label: str
    ) -> AsyncIterator[bytes]:
        try:
            while not self._cut:
                while self._held:
                    data = self._held.popleft()
                    self._held_bytes -= len(data)
                    yield sse_event(data)
                if run.done():
                    break
                self._wake.clear()
                await self._wake.wait()
        finally:  # also when the caller goes away: the call goes on without it
            self._gone = True
            self._held.clear()
        if self._cut:
            yield sse_event(await body_of(refusal(id, _fell_behind())))
            return
        handled = await _concluded(run.result(), id, accept, session, label)
        final = await body_of(handled.response)
        if content_type(handled.response.raw_headers) != SSE:
            final = sse_event(final)
        yield final


def _fell_behind() -> RequestInProgress:
    return RequestInProgress(
        "this stream fell too far behind the tool server's messages and was cut off; the "
        "call goes on and is recorded",
        headers={"Retry-After": "1"},
    )


def sse_event(data: bytes) -> bytes:
    return b"event: message\ndata: " + data + b"\n\n"


def _is_task_request(message: object) -> bool:
    return isinstance(message, types.JSONRPCRequest) and message.method.startswith("tasks/")


def _is_request(message: object, method: str) -> bool:
    return isinstance(message, types.JSONRPCRequest) and message.method == method


def _refused(exc: ProxyError, conflict: bool) -> Outcome:
    if conflict:
        return Outcome.CONFLICT
    return Outcome.FAILED if isinstance(exc, OutcomeUnknown) else Outcome.REJECTED


# -- reading requests -----------------------------------------------------------------


def parse(body: bytes) -> types.JSONRPCRequest | types.JSONRPCNotification | None:
    """The request or notification in ``body``; None for a response, or a batch with no
    ``tools/call``. ``JsonRpcRefusal``: not JSON (-32700), not JSON-RPC, or a batch with a
    ``tools/call`` in it (-32600)."""
    if body.lstrip()[:1] == b"[":
        _check_batch(body)
        return None
    _check_unique(body)
    try:
        message = types.JSONRPCMessage.model_validate_json(body).root
    except ValidationError as exc:
        if any(e["type"] == "json_invalid" for e in exc.errors()):
            raise JsonRpcRefusal(types.PARSE_ERROR, "Parse error: the body is not JSON") from None
        raise JsonRpcRefusal(
            types.INVALID_REQUEST,
            "Invalid Request: the body is not a JSON-RPC 2.0 request, notification or response",
            _id_of(body),
        ) from None
    if isinstance(message, types.JSONRPCRequest | types.JSONRPCNotification):
        return message
    return None


def _check_unique(body: bytes) -> None:
    """-32600 for a message whose objects repeat a member name: the proxy would read one
    (the last), a server perhaps the other (``{"method": "tools/call", ..., "method":
    "ping"}`` guarded as a ping, run as a call). ``error.data`` is the HTTP routes'
    ``duplicate-json-member`` problem."""
    try:
        parse_json(body)
    except DuplicateJSONMember as exc:
        id = _id_of(body) if body.count(b'"id"') == 1 else None  # an id read one way only
        raise _duplicate(exc, id) from None
    except InvalidJSONBody:
        return  # -32700, from the JSON-RPC parse


def _duplicate(exc: DuplicateJSONMember, id: RequestId) -> JsonRpcRefusal:
    data = json.loads(problem_body(exc))
    return JsonRpcRefusal(types.INVALID_REQUEST, f"Invalid Request: {exc.detail}", id, data)


def _check_request(message: types.JSONRPCRequest | types.JSONRPCNotification | None) -> None:
    """-32600 for a "notification" that is a request whose ``id`` is not a string or an
    integer (a float, a bool, null: JSON-RPC lets a server take them), or a ``tools/call``
    without an id: forwarded, it would run unguarded, every retry again."""
    if not isinstance(message, types.JSONRPCNotification):
        return
    extra = message.model_extra or {}
    if "id" in extra or message.method == "tools/call":
        raise JsonRpcRefusal(
            types.INVALID_REQUEST,
            "Invalid Request: a request's id must be a string or an integer (tools/call is "
            "a request: it needs one); nothing was sent",
        )


def _check_batch(body: bytes) -> None:
    """A JSON-RPC batch passes through unless it holds a ``tools/call``, which is refused:
    MCP dropped batches in 2025-06-18, and one record per call needs one call per POST."""
    try:
        messages = parse_json(body)
    except DuplicateJSONMember as exc:
        raise _duplicate(exc, None) from None
    except InvalidJSONBody:
        raise JsonRpcRefusal(types.PARSE_ERROR, "Parse error: the body is not JSON") from None
    if not isinstance(messages, list) or not messages:
        raise JsonRpcRefusal(types.INVALID_REQUEST, "Invalid Request: an empty batch")
    if any(isinstance(m, dict) and m.get("method") == "tools/call" for m in messages):
        raise JsonRpcRefusal(
            types.INVALID_REQUEST,
            "Invalid Request: tool-proxy does not accept a tools/call inside a JSON-RPC batch; "
            "send each tools/call in its own POST (MCP 2025-06-18 and later have no batches)",
        )


def _id_of(body: bytes) -> RequestId:
    """The id of a message that is JSON but not valid JSON-RPC, if it has a usable one."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    found = value.get("id") if isinstance(value, dict) else None
    return found if isinstance(found, str | int) and not isinstance(found, bool) else None


def tool_call(message: types.JSONRPCRequest | types.JSONRPCNotification | None) -> ToolCall:
    """The tool, arguments and ``_meta`` of a ``tools/call``; -32602 if its params are not
    those of a ``CallToolRequest``."""
    assert isinstance(message, types.JSONRPCRequest)
    try:
        request = types.CallToolRequest.model_validate(
            {"method": message.method, "params": message.params}
        )
    except ValidationError:
        raise JsonRpcRefusal(
            types.INVALID_PARAMS,
            "Invalid params: tools/call needs params.name (a string) and params.arguments "
            "(an object, if present)",
            message.id,
        ) from None
    params = message.params or {}
    meta = params.get("_meta")
    meta = meta if isinstance(meta, dict) else {}
    plain = params.keys() <= _PLAIN_PARAMS
    return ToolCall(message.id, request.params.name, request.params.arguments or {}, meta, plain)


_PLAIN_PARAMS = frozenset({"name", "arguments", "_meta"})


def identify_call(
    route: str,
    policy: IdempotencyConfig,
    config: McpConfig,
    request: Incoming,
    call: ToolCall,
    principal: str,
) -> Operation | None:
    """The operation of a guarded ``tools/call`` (as ``operation.identify`` for HTTP):
    None if it carries no key and the route does not require one."""
    key = _key(request, call, config.key_meta)
    if key is None:
        if policy.required:
            raise MissingIdempotencyKey(
                f"route {route} requires an idempotency key for tools/call: send it in "
                f"params._meta.{config.key_meta} or in the Idempotency-Key header"
            )
        return None
    digest = hashlib.sha256(canonical_json(call.arguments, policy.canonicalization)).hexdigest()
    target = f"tools/call {call.name}\n{digest}".encode()
    fingerprint = hashlib.sha256(target).hexdigest()
    scope = f"{route}|{principal}"
    if policy.key is KeyKind.COMPOSITE:
        parsed = parse_composite(key)
        if parsed.args_hash != digest:
            raise ArgsHashMismatch(
                "args_hash must be the SHA-256 of the canonical JSON "
                f"({policy.canonicalization.value}) of params.arguments; they hash to {digest}"
            )
        record = RecordKey(f"{scope}|{parsed.plan}|{parsed.step}", digest)
        return Operation(record, str(parsed), fingerprint)
    opaque = parse_opaque(key)
    slot = hashlib.sha256(opaque.encode()).hexdigest()[:40]
    return Operation(RecordKey(f"{scope}|{slot}|-", "-"), opaque, fingerprint)


def _key(request: Incoming, call: ToolCall, key_meta: str) -> str | None:
    header = request.header(b"idempotency-key")
    meta = call.meta.get(key_meta)
    if meta is not None and not isinstance(meta, str):
        raise InvalidIdempotencyKey(f"params._meta.{key_meta} must be a string")
    # one key as the key's parser reads it (an RFC 8941 sf-string or bare), not as spelt
    if header is not None and meta is not None and unquote(header) != unquote(meta):
        raise InvalidIdempotencyKey(
            f"the Idempotency-Key header and params._meta.{key_meta} differ; send one key"
        )
    return header if header is not None else meta


def _key_repeated(message: types.JSONRPCRequest | types.JSONRPCNotification | None) -> Reply:
    """The refusal (-32014) of a message sent with more than one Idempotency-Key line:
    a request's is its JSON-RPC error (HTTP 200, as a guarded call's refusals); a
    notification, response or batch, with no id to answer, gets a 400 with ``id: null``."""
    exc = InvalidIdempotencyKey(
        "Idempotency-Key must be sent once (one RFC 8941 Item); nothing was sent"
    )
    if isinstance(message, types.JSONRPCRequest):
        return refusal(message.id, exc)
    problem = json.loads(problem_body(exc))
    return error_reply(None, KEY_INVALID, problem_message(problem), status=400, data=problem)


def _header(request: Incoming, name: bytes) -> str:
    for key, value in request.scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return ""


def revision(request: Incoming, call: ToolCall) -> str:
    """The MCP revision a (supported) call speaks: its own (2026-07-28 ``_meta``), its
    ``MCP-Protocol-Version`` header's, or the transport spec's assumption."""
    declared = call.meta.get(VERSION_META)
    if isinstance(declared, str):
        return declared
    return _header(request, _VERSION) or DEFAULT_PROTOCOL_VERSION


def unsupported_version(request: Incoming, call: ToolCall) -> Reply | None:
    """The 400 answer to a guarded call of a revision the proxy does not guard calls of;
    None for a supported one. The revision is the ``MCP-Protocol-Version`` header's and,
    from 2026-07-28, the request's own (``params._meta``, which must agree); neither:
    the transport spec's assumption, 2025-03-26 (whose ``tools/call`` is the same)."""
    versions = {v.decode("latin-1") for k, v in request.scope["headers"] if k == _VERSION}
    declared = call.meta.get(VERSION_META)
    if isinstance(declared, str) and versions and versions != {declared}:
        return error_reply(
            call.id,
            HEADER_MISMATCH,
            "Bad Request: the MCP-Protocol-Version header does not match the request's "
            f"params._meta[{VERSION_META!r}]; the call was not sent",
            status=400,
        )
    if declared is not None:
        versions = {declared if isinstance(declared, str) else json.dumps(declared)}
    if len(versions or {DEFAULT_PROTOCOL_VERSION}) == 1 and versions <= _SUPPORTED:
        return None
    version = ", ".join(sorted(versions))  # two different ones: neither is the session's
    shown = version if len(version) <= 40 and version.isprintable() else version[:40] + "..."
    data = {"supported": list(PROTOCOL_VERSIONS), "requested": shown}
    return error_reply(
        call.id,
        UNSUPPORTED_PROTOCOL_VERSION,
        f"Unsupported protocol version {shown!r}: tool-proxy guards tools/call of the "
        f"revisions {', '.join(PROTOCOL_VERSIONS)}; the call was not sent",
        status=400,
        data=data,
    )


def header_mismatch(request: Incoming, call: ToolCall) -> Reply | None:
    """The 400 answer (-32020) to a guarded call whose 2026-07-28 routing headers, where
    sent, disagree with its body: ``Mcp-Method`` is not ``tools/call``, or ``Mcp-Name``
    (decoded from its ``=?base64?...?=`` form) is not the tool's name. The proxy keys,
    limits and locks by the body; a server routing by the headers would run another
    tool. None if they agree (or are absent: the server's to require)."""
    methods = {v.decode("latin-1") for k, v in request.scope["headers"] if k == _METHOD}
    names = {_decoded(v.decode("latin-1")) for k, v in request.scope["headers"] if k == _NAME}
    if methods <= {"tools/call"} and names <= {call.name}:
        return None
    header = "Mcp-Method" if not methods <= {"tools/call"} else "Mcp-Name"
    return error_reply(
        call.id,
        HEADER_MISMATCH,
        f"Bad Request: the {header} header does not match the request body (tools/call "
        f"of {call.name!r}); the call was not sent",
        status=400,
    )


def _decoded(value: str) -> str | None:
    """A 2026-07-28 header value: as sent, or UTF-8 from its ``=?base64?...?=`` form (None
    if that form is malformed: it matches nothing)."""
    if not (value.startswith("=?base64?") and value.endswith("?=")):
        return value
    payload = value[len("=?base64?") : -2]
    try:
        decoded = base64.b64decode(payload, validate=True)
        if base64.b64encode(decoded).decode("ascii") != payload:
            return None
        return decoded.decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return None


# -- reading answers ------------------------------------------------------------------


def answer_bound(config: McpConfig, guard: Guard | None) -> int:
    """The most of a guarded call's answer held while it is read: ``mcp.max_answer_bytes``;
    without offload, also no more than the route can record (``max_stored_bytes``, the
    store's own limit), since a larger answer could not be kept anyway."""
    bound = config.max_answer_bytes
    if guard is None or guard.offload is not None:
        return bound
    bound = min(bound, guard.store.max_payload_bytes)
    stored = guard.policy.max_stored_bytes
    return bound if stored is None else min(bound, stored)


class AnswerTooLarge(Exception):
    """A guarded call's answer passed the bound while it was read (the part read is
    dropped, the connection closed)."""


async def read_answer(
    upstream: UpstreamResponse,
    id: str | int,
    not_run: frozenset[int] = frozenset(),
    bound: int = DEFAULT_MAX_ANSWER_BYTES,
    progress: Messages | None = None,
) -> UpstreamResponse:
    """The tool server's answer to a guarded call, as it is recorded: its final JSON-RPC
    response as JSON. ``McpRefused`` (the key is released) for an HTTP status that says the
    tool was not called (``not_run``: the transport's refusals, and the route's
    ``release_on_status``); ``OutcomeUnknown`` (recorded FAILED) for any other status that
    is not 200, or a 200 answer that holds no response to ``id``. An answer that holds
    more than ``bound`` bytes at once is not kept: the answer returned says so when it is
    read (``NotKept``), and the call is recorded as executed, its result not kept.
    ``progress`` is given the other messages of an SSE answer as they arrive."""
    if upstream.status != 200:
        await _not_answered(upstream, not_run, bound)
    sse = content_type(upstream.headers) == SSE
    raw: bytes | None
    try:
        if sse and progress is not None:
            progress.start()
        raw = await (
            _final_event(upstream, id, bound, progress) if sse else _read_bounded(upstream, bound)
        )
    except AnswerTooLarge:
        return NotKept(
            200,
            [(b"content-type", JSON.encode())],
            0,
            f"the MCP server's answer passed {bound} bytes, the most this route keeps of it "
            "(mcp.max_answer_bytes, or what the store takes without offload)",
        )
    answer = None if raw is None else final_response(raw, JSON, id)
    if answer is None:
        raise OutcomeUnknown(
            "the MCP server's answer ended without the result of this call; the tool may have run",
            status=502,
        )
    body = answer.model_dump_json(by_alias=True, exclude_none=True).encode()
    headers: RawHeaders = [(b"content-type", JSON.encode())]
    if _input_required(answer):  # not the call's outcome: the client sends it again
        raise McpRefused(
            "the MCP server needs input before the call can complete (2026-07-28 "
            "InputRequiredResult): the key is free for the call that brings it",
            StoredResponse.of(200, headers, body),
        )
    if sse:
        headers.append((_FORM_HEADER, b"sse"))
    return ReadAnswer(upstream.status, headers, len(body), body)


def _input_required(answer: types.JSONRPCResponse | types.JSONRPCError) -> bool:
    """True for a 2026-07-28 ``InputRequiredResult``: the server asks the client for input
    (elicitation, sampling) and to send the call again with it (``inputResponses``,
    ``requestState``); the call has not completed."""
    return isinstance(answer, types.JSONRPCResponse) and (
        answer.result.get("resultType") == "input_required"
    )


async def _not_answered(
    upstream: UpstreamResponse, not_run: frozenset[int], bound: int
) -> NoReturn:
    """An answer that is not 200: the server refused the call (``not_run``), or may have
    run it."""
    try:
        raw = await _read_bounded(upstream, bound)
    except AnswerTooLarge:
        raw = b""
    if upstream.status not in not_run:
        raise OutcomeUnknown(
            f"the MCP server answered HTTP {upstream.status} to this call; the tool may have run",
            status=502,
        )
    raise McpRefused(
        f"the MCP server answered HTTP {upstream.status}: the tool was not called",
        StoredResponse.of(upstream.status, upstream.headers, raw),
    )


@dataclass(slots=True)
class NotKept(UpstreamResponse):
    """An answer too large to keep: the guard reads it "whole" (length 0), and the read
    raises ``ResponseNotStored``, so the call is recorded as executed, result not kept."""

    detail: str = ""

    async def read(self) -> bytes:
        raise ResponseNotStored(self.detail)

    async def stream(self) -> AsyncIterator[bytes]:
        raise ResponseNotStored(self.detail)
        yield b""  # pragma: no cover


@contextlib.asynccontextmanager
async def _chunks(upstream: UpstreamResponse) -> AsyncIterator[AsyncIterator[bytes]]:
    """The body's chunks, closed on leaving (the connection too, if not read to its end)."""
    chunks = upstream.stream()
    try:
        yield chunks
    finally:
        if isinstance(chunks, AsyncGenerator):
            await chunks.aclose()


async def _read_bounded(upstream: UpstreamResponse, bound: int) -> bytes:
    """The whole body; ``AnswerTooLarge`` as soon as it passes ``bound`` (nothing more is
    read: the connection is closed)."""
    if upstream.length is not None and upstream.length > bound:
        async with _chunks(upstream) as body:
            async for _ in body:  # started, so that closing it frees the connection and
                break  # tells the policies (locks, slots) the answer ended unread
        raise AnswerTooLarge()
    chunks: list[bytes] = []
    size = 0
    async with _chunks(upstream) as body:
        async for chunk in body:
            size += len(chunk)
            if size > bound:
                raise AnswerTooLarge()
            chunks.append(chunk)
    return b"".join(chunks)


async def _final_event(
    upstream: UpstreamResponse, id: RequestId, bound: int, progress: Messages | None = None
) -> bytes | None:
    """The data of the SSE stream's last event that holds the response to ``id``, read as
    the stream arrives: other events (progress, the server's requests) are dropped once
    parsed. ``AnswerTooLarge`` when the kept event and the part not parsed yet pass
    ``bound``."""
    pending = bytearray()  # never holds a whole event: each is parsed once it is complete
    found: bytes | None = None
    carry = b""  # a CR at a chunk's end, perhaps the first half of a CRLF
    async with _chunks(upstream) as body:
        async for chunk in body:
            chunk = carry + chunk
            carry = b"\r" if chunk.endswith(b"\r") else b""
            chunk = (chunk[:-1] if carry else chunk).replace(b"\r\n", b"\n")
            start = max(len(pending) - 1, 0)
            pending += chunk
            end = pending.rfind(b"\n\n", start)
            if end >= 0:
                for data in sse_data(bytes(pending[: end + 2])):
                    if _answers(data, id):
                        found = data
                    elif progress is not None:
                        progress.event(data)
                del pending[: end + 2]
            if len(pending) + (len(found) if found is not None else 0) > bound:
                raise AnswerTooLarge()
    for data in sse_data(bytes(pending) + carry):  # a last event without its blank line
        if _answers(data, id):
            found = data
    return found


def _answers(data: bytes, id: RequestId) -> bool:
    """True if an SSE event's data is a JSON-RPC response (or error) to ``id``."""
    if b'"result"' not in data and b'"error"' not in data:  # progress: not parsed whole
        return False
    return final_response(data, JSON, id) is not None


def content_type(headers: RawHeaders) -> str:
    for name, value in headers:
        if name.lower() == b"content-type":
            return value.decode("latin-1").split(";", 1)[0].strip().lower()
    return ""


def final_response(
    raw: bytes, form: str, id: RequestId = None
) -> types.JSONRPCResponse | types.JSONRPCError | None:
    """The last JSON-RPC response (to ``id``, when given) in a JSON or SSE body."""
    payloads = list(sse_data(raw)) if form == SSE else [raw]
    found = None
    for payload in payloads:
        try:
            message = types.JSONRPCMessage.model_validate_json(payload).root
        except ValidationError:
            continue
        if isinstance(message, types.JSONRPCResponse | types.JSONRPCError) and (
            id is None or message.id == id
        ):
            found = message
    return found


def sse_data(raw: bytes) -> Iterator[bytes]:
    """The data of each event of an SSE stream (``message`` events only). An event whose
    data is empty is not dispatched (the SSE spec's "dispatch the event"): e.g. the
    priming event that a resumable server opens each stream with (an id, empty data)."""
    for block in raw.replace(b"\r\n", b"\n").split(b"\n\n"):
        event, data = b"message", []
        for line in block.split(b"\n"):
            field, _, value = line.partition(b":")
            value = value.removeprefix(b" ")
            if field == b"data":
                data.append(value)
            elif field == b"event":
                event = value
        joined = b"\n".join(data)
        if joined and event == b"message":
            yield joined


# -- answering ------------------------------------------------------------------------


async def render(
    response: Response, id: str | int, accept: str, session: str, *, replayed: bool
) -> Response:
    """The state machine's answer (a first execution's, or a replay) in MCP form."""
    body = await body_of(response)
    headers = dict(response.raw_headers)
    if headers.get(b"content-type") == _PROBLEM:  # outcome unknown, not stored, ...
        problem = json.loads(body)
        return error_response(id, problem_code(problem), problem_message(problem), problem)
    if response.status_code != 200:  # a release status (503, ...): the answer as it was
        return response
    try:
        answer = types.JSONRPCMessage.model_validate_json(body).root
    except ValidationError:
        return response
    assert isinstance(answer, types.JSONRPCResponse | types.JSONRPCError)
    payload = _as_answer_to(answer, id)
    extra: RawHeaders = [(_SESSION, session.encode())] if session else []
    if replayed:
        extra.append(REPLAYED_HEADER)
    return framed(payload, wants_sse(accept, headers.get(_FORM_HEADER) == b"sse"), extra)


def _with_id(payload: bytes, id: str | int) -> bytes:
    """A recorded (or cached) JSON-RPC response as the answer to request ``id``;
    ``ValueError`` if it is no response."""
    answer = types.JSONRPCMessage.model_validate_json(payload).root
    if not isinstance(answer, types.JSONRPCResponse | types.JSONRPCError):
        raise ValueError("not a JSON-RPC response")
    return _as_answer_to(answer, id)


def _as_answer_to(answer: types.JSONRPCResponse | types.JSONRPCError, id: str | int) -> bytes:
    readdressed = answer.model_copy(update={"id": id})
    return readdressed.model_dump_json(by_alias=True, exclude_none=True).encode()


async def body_of(response: Response) -> bytes:
    if isinstance(response, StreamingResponse):  # an offloaded body read back
        chunks = [c async for c in response.body_iterator]
        return b"".join(c if isinstance(c, bytes) else str(c).encode() for c in chunks)
    return bytes(response.body)


def wants_sse(accept: str, answered_sse: bool) -> bool:
    """True if the client prefers an SSE stream (by q-value; a tie: the server's form)."""
    weights = {JSON: -1.0, SSE: -1.0}
    for item in accept.split(","):
        kind, *params = (part.strip() for part in item.split(";"))
        q = 1.0
        for param in params:
            if param.startswith("q="):
                try:
                    q = float(param[2:])
                except ValueError:
                    q = 0.0
        kind = kind.lower()
        targets = (JSON, SSE) if kind in ("*/*", "") else (kind,)
        for target in targets:
            if target in weights:
                weights[target] = max(weights[target], q)
    if weights[JSON] == weights[SSE]:
        return answered_sse
    return weights[SSE] > weights[JSON]


def framed(payload: bytes, sse: bool, extra: RawHeaders, status: int = 200) -> Reply:
    if sse:
        payload = b"event: message\ndata: " + payload + b"\n\n"
        kind = SSE.encode()
        extra = [*extra, (b"cache-control", b"no-cache")]
    else:
        kind = JSON.encode()
    length = str(len(payload)).encode()
    return Reply(status, [(b"content-type", kind), (b"content-length", length), *extra], payload)


# What each refusal is, to an agent: the code, and a message that says what to do.
_CODES = {
    RequestInProgress.slug: IN_PROGRESS,
    ArgsHashMismatch.slug: ARGS_HASH_MISMATCH,
    KeyReusedWithOtherBody.slug: KEY_REUSED,
    MissingIdempotencyKey.slug: KEY_MISSING,
    InvalidIdempotencyKey.slug: KEY_INVALID,
    OutcomeUnknown.slug: OUTCOME_UNKNOWN,
    ResponseNotStored.slug: RESULT_NOT_KEPT,
}


def problem_code(problem: dict[str, Any]) -> int:
    slug = str(problem.get("type", "")).rsplit(":", 1)[-1]
    return _CODES.get(slug, REFUSED)


def problem_message(problem: dict[str, Any], retry_after: str | None = None) -> str:
    code, detail = problem_code(problem), problem.get("detail", "")
    if code == IN_PROGRESS:
        wait = f"{retry_after} seconds" if retry_after else "a few seconds"
        return (
            "This tool call is already running (an earlier request with the same idempotency "
            f"key); it was not started again. Wait {wait}, then send the same call with the "
            "same key to get its result."
        )
    if code == OUTCOME_UNKNOWN:
        return (
            f"The tool call may or may not have run: its result was lost ({detail}). It will "
            "not be run again under this key. Check whether its effect happened before "
            "acting on it; to run it anyway, call it again under a new key."
        )
    if code == RESULT_NOT_KEPT:
        return (
            "The tool call was executed once, but its result was not kept, so it cannot be "
            "sent. It will not be run again under this key: check its effect before acting "
            f"on it, or run it again under a new key. ({detail})"
        )
    if code == ARGS_HASH_MISMATCH:
        return f"The idempotency key does not match these arguments: {detail}."
    if code == KEY_REUSED:
        return (
            "This idempotency key was already used for a call with other arguments or another "
            "tool; nothing was run. Use a new key (a new step) for a different call."
        )
    if code in (KEY_MISSING, KEY_INVALID):
        return f"The tool call was not run: {detail}."
    return f"tool-proxy did not run the tool call: {problem.get('title', '')}: {detail}."


def refusal(id: str | int, exc: ProxyError) -> Reply:
    """The proxy's refusal of a guarded call, as the JSON-RPC error of its request."""
    problem = json.loads(problem_body(exc))
    retry_after = exc.headers.get("Retry-After")
    if retry_after is not None:
        problem["retry_after"] = int(retry_after)
    message = problem_message(problem, retry_after)
    reply = error_response(id, problem_code(problem), message, problem)
    reply.raw_headers = [
        *reply.raw_headers,
        *((k.lower().encode(), v.encode()) for k, v in exc.headers.items()),
    ]
    return reply


def error_response(id: str | int, code: int, message: str, data: Any) -> Reply:
    error = types.JSONRPCError(
        jsonrpc="2.0", id=id, error=types.ErrorData(code=code, message=message, data=data)
    )
    return framed(error.model_dump_json(by_alias=True, exclude_none=True).encode(), False, [])


def error_reply(id: RequestId, code: int, message: str, *, status: int, data: Any = None) -> Reply:
    """A JSON-RPC error for a body that is not what the proxy can guard."""
    error = types.ErrorData(code=code, message=message, data=data).model_dump(exclude_none=True)
    payload = json.dumps({"jsonrpc": "2.0", "id": id, "error": error}).encode()
    return framed(payload, False, [], status)
