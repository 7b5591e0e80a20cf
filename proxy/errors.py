"""The one error hierarchy of tool-proxy.

Every error a caller can see is a ``ProxyError``; ``problems.py`` turns it into an
RFC 9457 ``application/problem+json`` response, and nothing else does. Foreign
exceptions (aiohttp, redis, sqlite3, psycopg) are translated into these at the module that
talks to the foreign library, with ``raise ... from exc``.

    ProxyError
    ├── BadRequest                          400
    │   ├── InvalidPath                     400  path escapes the route or is not origin-form
    │   ├── InvalidHeader                   400  a header the proxy reads repeated with another
    │   │                                        value (a key's header: at all), or a header
    │   │                                        value that is not UTF-8
    │   ├── MissingIdempotencyKey           400
    │   ├── InvalidIdempotencyKey           400
    │   ├── InvalidJSONBody                 400  does not parse, or nests beyond max_json_depth
    │   ├── DuplicateJSONMember             400  an object repeats a member name (not I-JSON)
    │   ├── BodyNotCanonicalizable          400
    │   ├── InvalidField                    400  a parameter of a /_proxy/ endpoint, named
    │   └── ResourceKeyMissing              400  the lock or version key is not in the request
    │       └── BodyKeyUnreadable           400  a json: key the body holds unreadably (not
    │           │                                Unicode); nothing sent, key released
    │           ├── BodyKeyInvalidJSON      400  invalid-json-body: nested too deep
    │           └── BodyKeyDuplicateMember  400  duplicate-json-member
    ├── Unauthorized                        401  no valid caller token (WWW-Authenticate)
    │   └── ReauthenticationRequired        401  the IdP refused a downstream token
    ├── Forbidden                           403  an operator's JWT lacks the admin role
    ├── OriginNotAllowed                    403  Origin not in server.allowed_origins
    ├── RouteNotFound                       404
    ├── PlanNotFound                        404  no record of this plan session for the caller
    ├── RecordNotFound                      404  no record under this id (admin)
    ├── OperationNotFound                   404  no operation under this id for the caller
    ├── RequestInProgress                   409
    ├── RecordNotFailed                     409  only a FAILED record can be resolved (admin)
    ├── OperationConflict                   409  e.g. DELETE of a running operation
    ├── ResourceLocked                      409  the resource's lock was not had within wait
    ├── ResponseNotStored                   410  the call ran; its response was not kept
    ├── PreconditionFailed                  412  If-Match/If-None-Match is not the version
    ├── RequestTimeout                      408  a head or body that stops arriving
    ├── RequestTooLarge                     413
    ├── MisdirectedRequest                  421  Host not in server.allowed_hosts
    ├── RateLimited                         429  a route limit, or the tool's own pause
    ├── HeaderFieldsTooLarge                431  the request head is above max_header_bytes
    ├── PreconditionRequired                428  a versioned write without If-Match
    ├── CallerLeft                          499  the caller left before its body was read
    ├── UnprocessableKey                    422
    │   ├── ArgsHashMismatch                422  composite key whose args_hash is not the body's
    │   └── KeyReusedWithOtherBody          422  a key sent again with another request
    ├── MethodNotImplemented                501  CONNECT and TRACE: never forwarded
    ├── TransferCodingNotImplemented        501  a transfer coding but chunked alone
    ├── UpstreamUnreachable                 502  nothing was sent; the key is released
    │   ├── McpRefused                      4xx  an MCP server refused a tools/call at the
    │   │                                        HTTP level (its answer is sent on): released
    │   └── LeaseLost                       502  the call's lease lapsed or was taken over
    │                                            before the send: not sent, key released
    ├── OutcomeUnknown                      502/504  the request may have run, no answer
    ├── NotExecuted                         502/504  the tool says it did not run: released
    ├── StoredResponseUnavailable           502  an offloaded body is missing or corrupt
    ├── StoredRequestUnreadable             503  a job's sealed credentials: another key
    ├── OffloadUnavailable                  503  the object store failed (internal)
    ├── StoreUnavailable                    503  the store cannot be reached
    │   ├── StoreRefused                    503  it answered, refusing the write (no retry helps)
    │   ├── LimitsUnavailable               503  a route's limits cannot be read: fails closed
    │   └── LocksUnavailable                503  a resource lock or version cannot be read
    ├── IdentityProviderUnavailable         503  no signing keys or downstream token
    └── StoreError                          500  the store answered something it should not

    ConfigError                             not an HTTP error: bad configuration, for the CLI
"""

from __future__ import annotations

from typing import Any

PROBLEM_BASE = "urn:tool-proxy:problem:"
# Retry-After (seconds) on a 503 while the store is unreachable.
STORE_RETRY_AFTER = "1"


class ProxyError(Exception):
    """Base class: an error with an HTTP status and a stable problem type."""

    status = 500
    slug = "internal-error"
    title = "Internal error"

    def __init__(self, detail: str, *, headers: dict[str, str] | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        self.headers = headers or {}

    @property
    def type(self) -> str:
        return PROBLEM_BASE + self.slug


class BadRequest(ProxyError):
    """The request is malformed."""

    status = 400
    slug = "bad-request"
    title = "Bad request"


class InvalidPath(BadRequest):
    """The request target is not a plain path under a route (absolute-form, '..', encoded '/')."""

    slug = "invalid-path"
    title = "Invalid request path"


class InvalidHeader(BadRequest):
    """A header that cannot be passed on as it is meant: Content-Type, Content-Length or
    Authorization repeated with another value, or a value that is not UTF-8."""

    slug = "invalid-header"
    title = "Invalid request header"


class MissingIdempotencyKey(BadRequest):
    """A guarded route requires an Idempotency-Key and none was sent."""

    slug = "idempotency-key-missing"
    title = "Idempotency-Key required"


class InvalidIdempotencyKey(BadRequest):
    """The Idempotency-Key header is not of the route's key format."""

    slug = "idempotency-key-invalid"
    title = "Invalid Idempotency-Key"


class InvalidJSONBody(BadRequest):
    """The body is declared JSON but does not parse."""

    slug = "invalid-json-body"
    title = "Body is not valid JSON"


class DuplicateJSONMember(BadRequest):
    """A JSON object in the body names a member twice: I-JSON (RFC 7493 2.3), the input of
    RFC 8785, forbids it, and the tool and the hash could read different values."""

    slug = "duplicate-json-member"
    title = "Body repeats a JSON member name"


class BodyNotCanonicalizable(BadRequest):
    """The JSON body has no canonical form (e.g. an integer beyond 2**53 under RFC 8785)."""

    slug = "body-not-canonicalizable"
    title = "Body has no canonical JSON form"


class InvalidField(BadRequest):
    """A query parameter, path parameter or JSON field of a ``/_proxy/`` endpoint is invalid;
    the detail starts with its name."""

    slug = "invalid-field"
    title = "Invalid field"

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field


class Unauthorized(ProxyError):
    """No valid caller token on a route that requires one (RFC 6750 error in the header)."""

    status = 401
    slug = "invalid-token"
    title = "A valid bearer token is required"

    def __init__(self, detail: str, *, error: str = "invalid_token") -> None:
        challenge = f'Bearer error="{error}"' if error else "Bearer"
        super().__init__(detail, headers={"WWW-Authenticate": challenge})


class ReauthenticationRequired(Unauthorized):
    """The identity provider refused to issue a downstream token (invalid_grant,
    interaction_required, ...): the user must sign in again. Nothing was forwarded."""

    slug = "reauth-required"
    title = "The identity provider requires the user to authenticate again"


class IdentityProviderUnavailable(ProxyError):
    """The issuer's signing keys, or a downstream token from the token endpoint, cannot
    be fetched: nothing is forwarded."""

    status = 503
    slug = "identity-provider-unavailable"
    title = "Identity provider unavailable"

    def __init__(self, detail: str) -> None:
        super().__init__(detail, headers={"Retry-After": STORE_RETRY_AFTER})


class Forbidden(ProxyError):
    """The operator's token is valid but does not carry the admin role."""

    status = 403
    slug = "forbidden"
    title = "Not allowed"

    def __init__(self, detail: str) -> None:
        super().__init__(detail, headers={"WWW-Authenticate": 'Bearer error="insufficient_scope"'})


class OriginNotAllowed(ProxyError):
    """The request comes from a browser Origin the listener does not allow."""

    status = 403
    slug = "origin-not-allowed"
    title = "Origin not allowed"


class MisdirectedRequest(ProxyError):
    """The request names a Host the listener does not answer for (DNS rebinding)."""

    status = 421
    slug = "misdirected-request"
    title = "Misdirected request"


class RouteNotFound(ProxyError):
    """No route's path_prefix matches the request path."""

    status = 404
    slug = "route-not-found"
    title = "No route for this path"


class PlanNotFound(ProxyError):
    """The store holds no record of this plan session for this caller."""

    status = 404
    slug = "plan-not-found"
    title = "No record of this plan session"


class RecordNotFound(ProxyError):
    """No live record under this id."""

    status = 404
    slug = "record-not-found"
    title = "No such record"


class OperationNotFound(ProxyError):
    """No operation under this id for this caller (or it has expired)."""

    status = 404
    slug = "operation-not-found"
    title = "No such operation"


class OperationConflict(ProxyError):
    """The operation's state does not allow this: a running one cannot be cancelled (its
    call may have been sent), an ended one has nothing to cancel, only a dead one can be
    queued again, only a completed or failed one has a result."""

    status = 409
    slug = "operation-state"
    title = "The operation's state does not allow this"


class RecordNotFailed(ProxyError):
    """Only a FAILED record (outcome unknown) can be resolved as completed or released."""

    status = 409
    slug = "record-not-failed"
    title = "The record is not FAILED"


class RequestInProgress(ProxyError):
    """The same key is being executed right now (by this or another replica)."""

    status = 409
    slug = "request-in-progress"
    title = "A request with this Idempotency-Key is in progress"


class ResponseNotStored(ProxyError):
    """The call executed, but its response was larger than max_stored_bytes, or could not
    be kept (its spool failed): not replayable."""

    status = 410
    slug = "response-not-stored"
    title = "The response of this call was not stored"


class RequestTooLarge(ProxyError):
    """The request body is larger than limits.max_body_bytes."""

    status = 413
    slug = "request-too-large"
    title = "Request body too large"


class TransferCodingNotImplemented(ProxyError):
    """A request body sent in a transfer coding other than ``chunked`` alone (RFC 9112
    6.1: 501): the HTTP parser undoes the chunked framing only, and the rest of the
    coding (``gzip, chunked``) would be forwarded and hashed as the body."""

    status = 501
    slug = "transfer-coding-not-implemented"
    title = "Transfer coding not implemented"


class RateLimited(ProxyError):
    """A limit of the route has no room for the call, or the tool asked all replicas to
    pause (429/503 with Retry-After): nothing was sent, and the key is released."""

    status = 429
    slug = "rate-limited"
    title = "Rate limited"


class ResourceKeyMissing(BadRequest):
    """The route locks or versions by a resource key that this request does not carry
    (the JSON pointer, header or path segment is absent): nothing was sent."""

    slug = "resource-key-missing"
    title = "The request does not name its resource"


class BodyKeyUnreadable(ResourceKeyMissing):
    """A ``json:`` key (of a limit, a lock, versioning) that the body holds in a form the
    proxy cannot key by as the tool reads it: a string that is not Unicode (a lone
    surrogate escape), or, in the subclasses, a body nested too deep or naming a member
    twice. Nothing was sent (a ``ResourceKeyMissing``: ``errors.NOT_SENT``, so a guarded
    call's key is released); unlike an absent key, never forwarded without one."""


class BodyKeyInvalidJSON(InvalidJSONBody, BodyKeyUnreadable):
    """``invalid-json-body``: the body nests deeper than ``limits.max_json_depth``."""


class BodyKeyDuplicateMember(DuplicateJSONMember, BodyKeyUnreadable):
    """``duplicate-json-member``: an object of the body repeats a member name (the tool
    may read the first value, the proxy would key by the last: another resource)."""


class ResourceLocked(ProxyError):
    """Another call holds the resource's lock (or is writing it) and it was not freed
    within the route's wait: nothing was sent, and the key is released (Retry-After)."""

    status = 409
    slug = "resource-locked"
    title = "The resource is locked by another call"


class PreconditionFailed(ProxyError):
    """A versioned write whose If-Match (or If-None-Match: *) does not hold for the
    resource's current version (in the ETag of the answer): nothing was sent."""

    status = 412
    slug = "precondition-failed"
    title = "Precondition failed"


class PreconditionRequired(ProxyError):
    """A write of a route with ``versioning.required`` came without If-Match or
    If-None-Match: nothing was sent."""

    status = 428
    slug = "precondition-required"
    title = "Precondition required"


class RequestTimeout(ProxyError):
    """The request head did not arrive whole within limits.header_timeout, or its body
    went limits.body_timeout without a byte: the connection is closed."""

    status = 408
    slug = "request-timeout"
    title = "Request timeout"


class HeaderFieldsTooLarge(ProxyError):
    """The request line and header fields are larger than limits.max_header_bytes."""

    status = 431
    slug = "request-header-fields-too-large"
    title = "Request header fields too large"


class CallerLeft(ProxyError):
    """The caller closed the connection before its request body was read: nothing was
    forwarded. Nobody receives the answer; 499 (nginx's "client closed request") is what
    the request log and the metrics record."""

    status = 499
    slug = "caller-left"
    title = "The caller closed the connection"


class UnprocessableKey(ProxyError):
    """The key is well-formed but does not belong to this request."""

    status = 422
    slug = "idempotency-key-mismatch"
    title = "Idempotency-Key does not match the request"


class ArgsHashMismatch(UnprocessableKey):
    """The composite key's args_hash is not the SHA-256 of the body's canonical JSON."""

    slug = "args-hash-mismatch"
    title = "args_hash does not match the body"


class KeyReusedWithOtherBody(UnprocessableKey):
    """A key came back with another request (method, path, query or body) than the one
    first recorded."""

    slug = "idempotency-key-reused"
    title = "Idempotency-Key was used with a different request"


class MethodNotImplemented(ProxyError):
    """CONNECT and TRACE: the proxy is not a tunnel, and a TRACE would echo its own
    headers (and the ones it adds) back; they are never forwarded."""

    status = 501
    slug = "method-not-implemented"
    title = "Method not implemented"


class UpstreamUnreachable(ProxyError):
    """No connection to the upstream could be made: nothing was sent, the key is released."""

    status = 502
    slug = "upstream-unreachable"
    title = "Upstream unreachable"


class McpRefused(UpstreamUnreachable):
    """An MCP server answered a guarded ``tools/call`` with an HTTP error status (unknown
    session, bad headers): the tool was not called, the key is released, and the caller
    gets the server's answer as it was (``answer``, a ``StoredResponse``)."""

    slug = "mcp-refused"
    title = "The MCP server refused the request"

    def __init__(self, detail: str, answer: Any) -> None:
        super().__init__(detail)
        self.answer = answer


class LeaseLost(UpstreamUnreachable):
    """A guarded call's lease lapsed, or was taken over by another attempt, while the call
    waited to be sent (a resource lock, a limit, a token fetch, a stall of this process):
    it was not sent, and nothing is recorded over the record's new owner."""

    slug = "lease-lost"
    title = "Not sent: the call's lease was lost"


class OutcomeUnknown(ProxyError):
    """The request may have been executed but its answer is lost (a timeout, a broken
    connection, or the proxy's own failure or shutdown while the call was in flight).

    The key is recorded FAILED and retries get this problem replayed, never a second
    execution, until result_ttl ends the record.
    """

    status = 502
    slug = "outcome-unknown"
    title = "Upstream outcome unknown"

    def __init__(
        self, detail: str, *, status: int = 502, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(detail, headers=headers)
        self.status = status


class NotExecuted(ProxyError):
    """The call failed (timeout, broken connection) and the tool's reconcile look-up says
    it did not run: the key is released, and a retry executes it."""

    status = 502
    slug = "not-executed"
    title = "The call was not executed"

    def __init__(self, detail: str, *, status: int = 502) -> None:
        super().__init__(detail)
        self.status = status


class StoredResponseUnavailable(ProxyError):
    """An offloaded response body is missing or does not match its digest."""

    status = 502
    slug = "stored-response-unavailable"
    title = "Stored response unavailable"


class StoredRequestUnreadable(ProxyError):
    """An async job's stored request holds credentials sealed with another key than this
    replica's: it is not sent (another replica, or this one with the right key, can)."""

    status = 503
    slug = "stored-request-unreadable"
    title = "The stored request cannot be read"


class OffloadUnavailable(ProxyError):
    """The object store could not take a large body (the proxy then stores it inline), or
    could not be swept; never seen by a caller."""

    status = 503
    slug = "offload-unavailable"
    title = "Object store unavailable"


class StoreUnavailable(ProxyError):
    """The state store cannot be reached: guarded requests fail closed."""

    status = 503
    slug = "store-unavailable"
    title = "Idempotency store unavailable"

    def __init__(self, detail: str, *, headers: dict[str, str] | None = None) -> None:
        super().__init__(detail, headers={"Retry-After": STORE_RETRY_AFTER, **(headers or {})})


class LimitsUnavailable(StoreUnavailable):
    """The store that keeps a route's limits cannot be reached and the route fails closed
    (``limits_on_store_down: closed``): nothing was sent, and the key is released."""


class LocksUnavailable(StoreUnavailable):
    """The store that keeps a route's resource locks or versions cannot be reached:
    nothing was sent, and the key is released."""


class StoreRefused(StoreUnavailable):
    """The store answered but refused a write that retrying will not make pass: a value
    above its size limit, out of memory with eviction off, not enough replicas. A refused
    claim is a 503 like an unreachable store; a refused outcome is recorded in its small
    "executed, response not kept" form instead."""

    slug = "store-refused"
    title = "Idempotency store refused the write"


class StoreError(ProxyError):
    """The store answered something that breaks its contract."""

    status = 500
    slug = "store-error"
    title = "Idempotency store error"


class ConfigError(Exception):
    """The configuration is invalid; ``problems`` lists every problem, each naming its field."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


# Raised before anything reached the tool (no connection, no token, a limit, a lock or a
# precondition refused the call): a guarded call's key is released, a reservation refunded,
# a lock freed at once. One list, so the state machine and the policies never disagree.
NOT_SENT: tuple[type[ProxyError], ...] = (
    UpstreamUnreachable,
    Unauthorized,
    IdentityProviderUnavailable,
    RateLimited,
    LimitsUnavailable,
    LocksUnavailable,
    InvalidHeader,
    ResourceKeyMissing,
    ResourceLocked,
    PreconditionFailed,
    PreconditionRequired,
)
