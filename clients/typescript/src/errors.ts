/**
 * The errors of tool-proxy-client: one class per problem type the proxy answers, as in
 * the Python client (tool_proxy_client/errors.py), grouped the same way:
 *
 *   ToolProxyError
 *   ├── InvalidKey            the key cannot be made (not JSON, a number the proxy refuses)
 *   ├── TransportError        no answer from the proxy
 *   ├── StillRunning          an operation followed past followTimeoutMs
 *   └── ProxyProblem          any problem document of the proxy (.document, .status, .retryAfter, .record)
 *       ├── Executed          OutcomeUnknown, ResponseNotStored, StoredResponseUnavailable
 *       ├── NotSent           RequestInProgress, ResourceLocked, RateLimited, UpstreamUnreachable,
 *       │                     LeaseLost, NotExecuted, StoreUnavailable, StoreRefused, ...
 *       ├── KeyRefused        ArgsHashMismatch, IdempotencyKeyReused, IdempotencyKeyMissing, ...
 *       ├── RequestRefused    RouteNotFound, InvalidPath, PreconditionFailed, ...
 *       ├── AuthProblem       InvalidToken, ReauthRequired, Forbidden
 *       ├── OperationProblem  OperationNotFound, OperationState, OperationCancelled, OperationDead
 *       ├── RecordsProblem    PlanNotFound, RecordNotFound, RecordNotFailed
 *       └── ProxyFailure      InternalError, StoreError
 */

export const PROBLEM_BASE = "urn:tool-proxy:problem:";

export type ProblemDocument = { type?: string; title?: string; status?: number; detail?: string; [name: string]: unknown };

/** What names a guarded call's record, for the operator who resolves it. */
export class RecordIdentity {
  constructor(
    readonly key: string,
    readonly method: string,
    readonly target: string,
    readonly operation?: string,
  ) {}

  get plan(): string {
    return this.key.split(":")[0] ?? "";
  }

  get step(): string {
    return this.key.split(":")[1] ?? "";
  }

  get argsHash(): string {
    return this.key.split(":")[2] ?? "";
  }
}

export class ToolProxyError extends Error {
  override name = "ToolProxyError";
}

/** The key cannot be made: not JSON, or a value the proxy would refuse to hash. */
export class InvalidKey extends ToolProxyError {
  override name = "InvalidKey";
}

/** No answer from the proxy (connection refused, reset, timed out). */
export class TransportError extends ToolProxyError {
  override name = "TransportError";
}

/** An operation still ran when the client stopped following it: follow it again later. */
export class StillRunning extends ToolProxyError {
  override name = "StillRunning";
  constructor(readonly operationId: string) {
    super(`operation ${operationId} still runs`);
  }
}

export type ProblemOptions = { status?: number; retryAfter?: number; record?: RecordIdentity };

/** A problem document of the proxy (RFC 9457). */
export class ProxyProblem extends ToolProxyError {
  static slug = "";
  override name = "ProxyProblem";
  readonly status: number | undefined;
  readonly retryAfter: number | undefined;
  readonly record: RecordIdentity | undefined;

  constructor(readonly document: ProblemDocument, options: ProblemOptions = {}) {
    super(`${document.type ?? ""} (${options.status ?? document.status}): ${document.detail ?? ""}`);
    this.status = options.status ?? document.status;
    this.retryAfter = options.retryAfter;
    this.record = options.record;
  }

  get type(): string {
    return this.document.type ?? "";
  }

  get detail(): string {
    return this.document.detail ?? "";
  }
}

/** The call ran, or may have: never run again under this key. */
export class Executed extends ProxyProblem {}
/** Nothing ran: the same call may be sent again with the same key. */
export class NotSent extends ProxyProblem {}
/** The key or the body does not fit the route: fix the call. */
export class KeyRefused extends ProxyProblem {}
/** The proxy refused the request itself. */
export class RequestRefused extends ProxyProblem {}
/** Not (or no longer) authenticated, or not allowed. */
export class AuthProblem extends ProxyProblem {}
/** A long call cannot be followed or changed as asked, or ended without an answer. */
export class OperationProblem extends ProxyProblem {}
/** The records endpoints. */
export class RecordsProblem extends ProxyProblem {}
/** A bug of the proxy, or a malformed record. */
export class ProxyFailure extends ProxyProblem {}

export class OutcomeUnknown extends Executed { static override slug = "outcome-unknown"; }
export class ResponseNotStored extends Executed { static override slug = "response-not-stored"; }
export class StoredResponseUnavailable extends Executed { static override slug = "stored-response-unavailable"; }
export class RequestInProgress extends NotSent { static override slug = "request-in-progress"; }
export class ResourceLocked extends NotSent { static override slug = "resource-locked"; }
export class RateLimited extends NotSent { static override slug = "rate-limited"; }
export class UpstreamUnreachable extends NotSent { static override slug = "upstream-unreachable"; }
export class LeaseLost extends NotSent { static override slug = "lease-lost"; }
export class NotExecuted extends NotSent { static override slug = "not-executed"; }
export class StoreUnavailable extends NotSent { static override slug = "store-unavailable"; }
export class StoreRefused extends NotSent { static override slug = "store-refused"; }
export class LimitsUnavailable extends NotSent { static override slug = "limits-unavailable"; }
export class LocksUnavailable extends NotSent { static override slug = "locks-unavailable"; }
export class IdentityProviderUnavailable extends NotSent { static override slug = "identity-provider-unavailable"; }
export class IdempotencyKeyMissing extends KeyRefused { static override slug = "idempotency-key-missing"; }
export class IdempotencyKeyInvalid extends KeyRefused { static override slug = "idempotency-key-invalid"; }
export class ArgsHashMismatch extends KeyRefused { static override slug = "args-hash-mismatch"; }
export class IdempotencyKeyReused extends KeyRefused { static override slug = "idempotency-key-reused"; }
export class InvalidJsonBody extends KeyRefused { static override slug = "invalid-json-body"; }
export class DuplicateJsonMember extends KeyRefused { static override slug = "duplicate-json-member"; }
export class BodyNotCanonicalizable extends KeyRefused { static override slug = "body-not-canonicalizable"; }
export class InvalidPath extends RequestRefused { static override slug = "invalid-path"; }
export class InvalidHeader extends RequestRefused { static override slug = "invalid-header"; }
export class BadRequest extends RequestRefused { static override slug = "bad-request"; }
export class InvalidField extends RequestRefused { static override slug = "invalid-field"; }
export class ResourceKeyMissing extends RequestRefused { static override slug = "resource-key-missing"; }
export class RouteNotFound extends RequestRefused { static override slug = "route-not-found"; }
export class NotFound extends RequestRefused { static override slug = "not-found"; }
export class MethodNotAllowed extends RequestRefused { static override slug = "method-not-allowed"; }
export class MethodNotImplemented extends RequestRefused { static override slug = "method-not-implemented"; }
export class RequestTooLarge extends RequestRefused { static override slug = "request-too-large"; }
export class HeaderFieldsTooLarge extends RequestRefused { static override slug = "request-header-fields-too-large"; }
export class PreconditionFailed extends RequestRefused { static override slug = "precondition-failed"; }
export class PreconditionRequired extends RequestRefused { static override slug = "precondition-required"; }
export class InvalidToken extends AuthProblem { static override slug = "invalid-token"; }
export class ReauthRequired extends AuthProblem { static override slug = "reauth-required"; }
export class Forbidden extends AuthProblem { static override slug = "forbidden"; }
export class OperationNotFound extends OperationProblem { static override slug = "operation-not-found"; }
export class OperationState extends OperationProblem { static override slug = "operation-state"; }
export class OperationCancelled extends OperationProblem { static override slug = "operation-cancelled"; }
export class OperationDead extends OperationProblem { static override slug = "operation-dead"; }
export class PlanNotFound extends RecordsProblem { static override slug = "plan-not-found"; }
export class RecordNotFound extends RecordsProblem { static override slug = "record-not-found"; }
export class RecordNotFailed extends RecordsProblem { static override slug = "record-not-failed"; }
export class InternalError extends ProxyFailure { static override slug = "internal-error"; }
export class StoreError extends ProxyFailure { static override slug = "store-error"; }

type ProblemClass = (new (document: ProblemDocument, options?: ProblemOptions) => ProxyProblem) & { slug: string };

const CLASSES: ProblemClass[] = [
  OutcomeUnknown, ResponseNotStored, StoredResponseUnavailable, RequestInProgress, ResourceLocked,
  RateLimited, UpstreamUnreachable, LeaseLost, NotExecuted, StoreUnavailable, StoreRefused,
  LimitsUnavailable, LocksUnavailable, IdentityProviderUnavailable, IdempotencyKeyMissing,
  IdempotencyKeyInvalid, ArgsHashMismatch, IdempotencyKeyReused, InvalidJsonBody, DuplicateJsonMember,
  BodyNotCanonicalizable, InvalidPath, InvalidHeader, BadRequest, InvalidField, ResourceKeyMissing,
  RouteNotFound, NotFound, MethodNotAllowed, MethodNotImplemented, RequestTooLarge, HeaderFieldsTooLarge,
  PreconditionFailed, PreconditionRequired, InvalidToken, ReauthRequired, Forbidden, OperationNotFound,
  OperationState, OperationCancelled, OperationDead, PlanNotFound, RecordNotFound, RecordNotFailed,
  InternalError, StoreError,
];

/** Problem type name -> error class. */
export const PROBLEMS: ReadonlyMap<string, ProblemClass> = new Map(CLASSES.map((c) => [c.slug, c]));

/** True if `document` is a problem document of the proxy. */
export function isProxyProblem(document: unknown): document is ProblemDocument {
  return (
    typeof document === "object" && document !== null &&
    typeof (document as ProblemDocument).type === "string" &&
    ((document as ProblemDocument).type as string).startsWith(PROBLEM_BASE)
  );
}

/** The error for a problem document. */
export function problemError(document: ProblemDocument, options: ProblemOptions = {}): ProxyProblem {
  const cls = PROBLEMS.get((document.type ?? "").slice(PROBLEM_BASE.length)) ?? ProxyProblem;
  const error = new cls(document, options);
  error.name = cls.name;
  return error;
}
