"""The exceptions of tool-proxy-client: one per problem type the proxy answers.

A proxy problem (``application/problem+json`` with a ``urn:tool-proxy:problem:`` type, or
an MCP route's JSON-RPC error ``-32010``..``-32019`` whose ``data`` is that document) is
raised as the class of its type; a type this version does not know is a ``ProxyProblem``.
The tool's own answers, errors included, are never raised: they are the call's answer.

    ToolProxyError
    ├── InvalidKey                      the key cannot be made (not JSON, integer beyond 2^53)
    ├── TransportError                  no answer from the proxy (connection, timeout)
    ├── StillRunning                    an operation followed past the client's follow_timeout
    └── ProxyProblem                    any problem document of the proxy
        ├── Executed                    the call ran (or may have): never run again under this key
        │   ├── OutcomeUnknown          502/504 may have run, answer lost; .record names it
        │   ├── ResponseNotStored       410 ran once, its answer was not kept
        │   └── StoredResponseUnavailable  502 an offloaded answer is missing or corrupt
        ├── NotSent                     nothing ran; the same call may be sent again later
        │   ├── RequestInProgress       409 the same key is running now
        │   ├── ResourceLocked          409 another call holds the resource
        │   ├── RateLimited             429 a limit, or the tool's pause
        │   ├── UpstreamUnreachable     502 no connection to the tool
        │   ├── LeaseLost               502 the lease lapsed before the send
        │   ├── NotExecuted             502/504 the tool says it did not run
        │   ├── StoreUnavailable        503 the store cannot be reached
        │   ├── StoreRefused            503 the store refused the claim
        │   ├── LimitsUnavailable       503 a route's limits cannot be read
        │   ├── LocksUnavailable        503 a lock or version cannot be read
        │   └── IdentityProviderUnavailable  503 no signing keys or downstream token
        ├── KeyRefused                  the key or body does not fit: fix the call
        │   ├── IdempotencyKeyMissing   400
        │   ├── IdempotencyKeyInvalid   400
        │   ├── ArgsHashMismatch        422 args_hash is not the digest of the body
        │   ├── IdempotencyKeyReused    422 the key came back with another request
        │   ├── InvalidJsonBody         400
        │   ├── DuplicateJsonMember     400
        │   └── BodyNotCanonicalizable  400
        ├── RequestRefused              the proxy refused the request itself
        │   ├── InvalidPath, InvalidHeader, BadRequest, InvalidField, ResourceKeyMissing  400
        │   ├── RouteNotFound, NotFound, MethodNotAllowed, MethodNotImplemented  404/405/501
        │   ├── RequestTooLarge, HeaderFieldsTooLarge  413/431
        │   └── PreconditionFailed, PreconditionRequired  412/428
        ├── AuthProblem                 401/403
        │   ├── InvalidToken, ReauthRequired, Forbidden
        ├── OperationProblem            a long call (202 operation)
        │   ├── OperationNotFound       404 unknown, expired or someone else's
        │   ├── OperationState          409 e.g. cancel of a running one
        │   ├── OperationCancelled      the operation was cancelled: never sent
        │   └── OperationDead           nothing ran and no more attempts: .document["error"]
        ├── RecordsProblem              PlanNotFound, RecordNotFound, RecordNotFailed
        └── ProxyFailure                500 InternalError, StoreError
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard

PROBLEM_BASE = "urn:tool-proxy:problem:"


class ToolProxyError(Exception):
    """Base class of every exception of this package."""


class InvalidKey(ToolProxyError, ValueError):
    """The key cannot be made: arguments that are not JSON, or that RFC 8785 has no form for."""


class TransportError(ToolProxyError):
    """The proxy could not be reached, or did not answer in time (nothing is known of the call)."""


class StillRunning(ToolProxyError):
    """An operation still ran when the client stopped following it (``follow_timeout``):
    follow ``operation`` again later, it goes on."""

    def __init__(self, operation: Any) -> None:
        super().__init__(f"operation {operation.id} still runs")
        self.operation = operation


@dataclass(frozen=True, slots=True)
class RecordIdentity:
    """What names a guarded call's record, for the operator who resolves it
    (`tool-proxy records list --plan P --state failed`, then `records resolve ID`)."""

    key: str
    """The Idempotency-Key sent."""
    method: str
    target: str
    """The URL (HTTP) or the MCP endpoint with the tool's name."""
    operation: str | None = None
    """The operation id, for a long call."""

    @property
    def plan(self) -> str:
        """The key's plan_session_id (for a composite key)."""
        return self.key.split(":")[0]

    @property
    def step(self) -> str:
        """The key's step_index (for a composite key)."""
        parts = self.key.split(":")
        return parts[1] if len(parts) == 3 else ""

    @property
    def args_hash(self) -> str:
        """The key's args_hash (for a composite key)."""
        parts = self.key.split(":")
        return parts[2] if len(parts) == 3 else ""


class ProxyProblem(ToolProxyError):
    """A problem document of the proxy (RFC 9457); ``document`` holds it whole."""

    slug = ""

    def __init__(
        self,
        document: Mapping[str, Any],
        *,
        status: int | None = None,
        retry_after: float | None = None,
        record: RecordIdentity | None = None,
    ) -> None:
        self.document = dict(document)
        self.status = status if status is not None else _int(document.get("status"))
        self.retry_after = retry_after
        self.record = record
        super().__init__(f"{self.type} ({self.status}): {self.detail}")

    @property
    def type(self) -> str:
        """The problem type, ``urn:tool-proxy:problem:<name>``."""
        return str(self.document.get("type", ""))

    @property
    def title(self) -> str:
        """The problem's title."""
        return str(self.document.get("title", ""))

    @property
    def detail(self) -> str:
        """What happened, and what to do."""
        return str(self.document.get("detail", ""))


class Executed(ProxyProblem):
    """The call ran, or may have: it is never run again under this key."""


class OutcomeUnknown(Executed):
    """The call may have run but its answer is lost; ``record`` names the FAILED record."""

    slug = "outcome-unknown"


class ResponseNotStored(Executed):
    """The call ran once, and its answer was not kept: it cannot be sent again."""

    slug = "response-not-stored"


class StoredResponseUnavailable(Executed):
    """The call ran; its offloaded answer is missing or does not match its digest."""

    slug = "stored-response-unavailable"


class NotSent(ProxyProblem):
    """Nothing ran: the same call, with the same key, may be sent again (``retry_after``)."""


class RequestInProgress(NotSent):
    """The same key is executing now; its answer comes to a retry once it ends."""

    slug = "request-in-progress"


class ResourceLocked(NotSent):
    """Another call holds the resource's lock."""

    slug = "resource-locked"


class RateLimited(NotSent):
    """A route limit has no room, or the tool asked for a pause."""

    slug = "rate-limited"


class UpstreamUnreachable(NotSent):
    """No connection to the tool could be made: nothing was sent."""

    slug = "upstream-unreachable"


class LeaseLost(NotSent):
    """The call's lease lapsed before it was sent: nothing was sent."""

    slug = "lease-lost"


class NotExecuted(NotSent):
    """The call failed and the tool's reconcile look-up says it did not run."""

    slug = "not-executed"


class StoreUnavailable(NotSent):
    """The proxy's store cannot be reached (it fails closed)."""

    slug = "store-unavailable"


class StoreRefused(NotSent):
    """The store answered but refused the claim."""

    slug = "store-refused"


class LimitsUnavailable(NotSent):
    """A route's limits cannot be read: it fails closed."""

    slug = "limits-unavailable"


class LocksUnavailable(NotSent):
    """A resource lock or version cannot be read."""

    slug = "locks-unavailable"


class IdentityProviderUnavailable(NotSent):
    """The issuer's keys or the token endpoint cannot be reached."""

    slug = "identity-provider-unavailable"


class KeyRefused(ProxyProblem):
    """The key or the body does not fit the route: fix the call, nothing ran."""


class IdempotencyKeyMissing(KeyRefused):
    """The route requires a key."""

    slug = "idempotency-key-missing"


class IdempotencyKeyInvalid(KeyRefused):
    """The key is not of the route's format (or was sent twice)."""

    slug = "idempotency-key-invalid"


class ArgsHashMismatch(KeyRefused):
    """The composite key's args_hash is not the digest of the body."""

    slug = "args-hash-mismatch"


class IdempotencyKeyReused(KeyRefused):
    """The key came back with another method, path, query, tool or body."""

    slug = "idempotency-key-reused"


class InvalidJsonBody(KeyRefused):
    """A JSON body that does not parse or nests too deep."""

    slug = "invalid-json-body"


class DuplicateJsonMember(KeyRefused):
    """A JSON object repeats a member name."""

    slug = "duplicate-json-member"


class BodyNotCanonicalizable(KeyRefused):
    """RFC 8785 has no form for the body (an integer beyond 2^53)."""

    slug = "body-not-canonicalizable"


class RequestRefused(ProxyProblem):
    """The proxy refused the request itself; nothing ran."""


class InvalidPath(RequestRefused):
    """The path escapes the route or is not origin-form."""

    slug = "invalid-path"


class InvalidHeader(RequestRefused):
    """A header repeated with another value, or not UTF-8."""

    slug = "invalid-header"


class BadRequest(RequestRefused):
    """The HTTP parser refused the request."""

    slug = "bad-request"


class InvalidField(RequestRefused):
    """A bad parameter of a /_proxy/ endpoint."""

    slug = "invalid-field"


class ResourceKeyMissing(RequestRefused):
    """The lock or version key is not in the request."""

    slug = "resource-key-missing"


class RouteNotFound(RequestRefused):
    """No route matches the path."""

    slug = "route-not-found"


class NotFound(RequestRefused):
    """An unknown path under /_proxy/."""

    slug = "not-found"


class MethodNotAllowed(RequestRefused):
    """A method the endpoint does not take."""

    slug = "method-not-allowed"


class MethodNotImplemented(RequestRefused):
    """CONNECT or TRACE."""

    slug = "method-not-implemented"


class RequestTooLarge(RequestRefused):
    """The body is above the proxy's limit."""

    slug = "request-too-large"


class HeaderFieldsTooLarge(RequestRefused):
    """The request head is above the proxy's limit."""

    slug = "request-header-fields-too-large"


class PreconditionFailed(RequestRefused):
    """If-Match / If-None-Match does not hold for the current version."""

    slug = "precondition-failed"


class PreconditionRequired(RequestRefused):
    """A versioned write without If-Match or If-None-Match."""

    slug = "precondition-required"


class AuthProblem(ProxyProblem):
    """The caller is not (or no longer) authenticated, or not allowed."""


class InvalidToken(AuthProblem):
    """The bearer token is missing, expired or not trusted."""

    slug = "invalid-token"


class ReauthRequired(AuthProblem):
    """The identity provider refused the downstream token: sign in again."""

    slug = "reauth-required"


class Forbidden(AuthProblem):
    """The token lacks the admin role."""

    slug = "forbidden"


class OperationProblem(ProxyProblem):
    """A long call (a 202 operation) cannot be followed or changed as asked."""


class OperationNotFound(OperationProblem):
    """No such operation for this caller (unknown, expired, or another principal's)."""

    slug = "operation-not-found"


class OperationState(OperationProblem):
    """The operation is not in a state for this (cancel of a running one, result too early)."""

    slug = "operation-state"


class OperationCancelled(OperationProblem):
    """The operation was cancelled while queued: it was never sent, its key is released."""

    slug = "operation-cancelled"


class OperationDead(OperationProblem):
    """Nothing ran and no more attempts are made; ``document["error"]`` is the last refusal."""

    slug = "operation-dead"


class RecordsProblem(ProxyProblem):
    """The records endpoints (a plan's steps, the admin API)."""


class PlanNotFound(RecordsProblem):
    """No record of this plan session for this caller."""

    slug = "plan-not-found"


class RecordNotFound(RecordsProblem):
    """No record under this id."""

    slug = "record-not-found"


class RecordNotFailed(RecordsProblem):
    """Only a FAILED record can be resolved."""

    slug = "record-not-failed"


class ProxyFailure(ProxyProblem):
    """A bug of the proxy, or a malformed record in its store."""


class InternalError(ProxyFailure):
    """A bug of the proxy (it is logged)."""

    slug = "internal-error"


class StoreError(ProxyFailure):
    """The store answered something it should not."""

    slug = "store-error"


def _subclasses(cls: type[ProxyProblem]) -> list[type[ProxyProblem]]:
    found = [cls]
    for sub in cls.__subclasses__():
        found.extend(_subclasses(sub))
    return found


PROBLEMS: dict[str, type[ProxyProblem]] = {c.slug: c for c in _subclasses(ProxyProblem) if c.slug}
"""Problem type name -> exception class."""


def problem_class(problem_type: str) -> type[ProxyProblem]:
    """The exception class for a problem ``type`` (a URN of the proxy, or its bare name)."""
    return PROBLEMS.get(problem_type.removeprefix(PROBLEM_BASE), ProxyProblem)


def is_proxy_problem(document: Any) -> TypeGuard[dict[str, Any]]:
    """True if ``document`` is a problem document of the proxy."""
    return isinstance(document, dict) and str(document.get("type", "")).startswith(PROBLEM_BASE)


def problem_error(
    document: Mapping[str, Any],
    *,
    status: int | None = None,
    retry_after: float | None = None,
    record: RecordIdentity | None = None,
) -> ProxyProblem:
    """The exception for a problem document (to ``raise``)."""
    cls = problem_class(str(document.get("type", "")))
    return cls(document, status=status, retry_after=retry_after, record=record)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) else None
