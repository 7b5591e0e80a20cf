"""What identifies a guarded call: where its record lives, its label, its fingerprint.

Built once per request, before the state machine (``idempotency.py``) sees the call,
from the route's policy, the ``Idempotency-Key`` header, the body and the target:

- a composite key ``<plan>:<step>:<args_hash>`` lives in the slot of its step (route,
  principal, plan, step) under the name ``args_hash``, which must be the body's hash;
- an opaque key lives in a scope and slot of its own (route, principal, a digest of the
  key; step ``-``);
- the fingerprint covers the method, path and query with the body's digest, so a key
  sent again with another request is refused (422) instead of replaying another answer.
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple

from proxy.config import IdempotencyConfig
from proxy.errors import ArgsHashMismatch, MissingIdempotencyKey
from proxy.keys import KeyKind, fingerprint, parse_composite, parse_opaque
from proxy.store import RecordKey


class Operation(NamedTuple):
    """A guarded request: where its record lives and what it asks for (a tuple: built
    once per guarded request, at half the cost of a frozen dataclass)."""

    key: RecordKey
    label: str
    """The key as the caller sent it, for logs."""
    fingerprint: str
    """SHA-256 of the target (method, path, query) and the body's digest."""


def identify(
    route: str,
    policy: IdempotencyConfig,
    header: str | None,
    body: bytes,
    content_type: str | None,
    principal: str = "",
    target: bytes = b"",
    *,
    max_depth: int | None = None,
) -> Operation | None:
    """The operation of a request to a guarded method; None if it carries no key and the
    route does not require one. Raises 400 (missing or malformed key, bad body) or 422
    (``args_hash`` is not the body's). ``max_depth`` is ``limits.max_json_depth``."""
    if header is None:
        if policy.required:
            methods = ", ".join(sorted(policy.methods))
            raise MissingIdempotencyKey(f"route {route} requires an Idempotency-Key for {methods}")
        return None
    digest = fingerprint(body, content_type, policy.canonicalization, max_depth)
    request = hashlib.sha256(b"%s\n%s" % (target, digest.encode())).hexdigest()
    scope = f"{route}|{principal}"
    if policy.key is KeyKind.COMPOSITE:
        key = parse_composite(header)
        if key.args_hash != digest:
            raise ArgsHashMismatch(
                "args_hash must be the SHA-256 of the body's canonical JSON "
                f"({policy.canonicalization.value}); the body hashes to {digest}"
            )
        return Operation(RecordKey(f"{scope}|{key.plan}|{key.step}", digest), str(key), request)
    opaque = parse_opaque(header)
    slot = hashlib.sha256(opaque.encode()).hexdigest()[:40]
    return Operation(RecordKey(f"{scope}|{slot}|-", "-"), opaque, request)
