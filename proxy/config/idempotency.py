"""``routes[].idempotency`` and ``routes[].reconcile``: the at-most-once guard of a route."""

from __future__ import annotations

import re
from enum import StrEnum

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from proxy.config.fields import METHOD, Duration, Strict, Wait, check_methods, check_statuses
from proxy.keys import Canonicalization, KeyKind

# Guarded by default: the non-idempotent methods.
DEFAULT_METHODS = ("POST", "PATCH")

# The IN_PROGRESS lease; renewed every lock_ttl/3 while the upstream works.
DEFAULT_LOCK_TTL = 120.0

# The shortest lease: renewed every ~33 ms and taken as lost after 90 ms, a store round
# trip or an event-loop pause of that order already lets it lapse.
MIN_LOCK_TTL = 0.1

# How long COMPLETED and FAILED outcomes are replayed.
DEFAULT_RESULT_TTL = 24 * 3600.0

# Retry-After sent with a 409 (capped by the time left on the lease).
DEFAULT_RETRY_AFTER = 5.0

# Upstream statuses that are passed on but release the key, so a retry executes: only
# those that mean "not run". 502 and 504 are opt-in: behind an ingress, a mesh or a load
# balancer they come after the tool may have run the call.
DEFAULT_RELEASE_ON_STATUS = (408, 425, 429, 503)

# The methods a reconcile look-up may use: it is a read, sent again on retries by every
# proxy process, with no body.
LOOKUP_METHODS = ("GET", "HEAD")

# How long a reconcile look-up may take, and how often a proxy asks again about one FAILED
# record when retries meet it (at least RECONCILE_INTERVAL apart).
DEFAULT_RECONCILE_TIMEOUT = 5.0

DEFAULT_RECONCILE_RETRIES = 3

DEFAULT_RECONCILE_INTERVAL = 5.0


class LapsedLease(StrEnum):
    """What a claim makes of an IN_PROGRESS record whose lease lapsed (its proxy died, or
    lost the store, with the call perhaps sent)."""

    FAIL = "fail"
    """FAILED: outcome unknown, replayed, never re-executed (unless reconciled)."""
    REEXECUTE = "reexecute"
    """Claim it: the call runs again (a crashed proxy never blocks a key for long)."""


class IdempotencyConfig(Strict):
    """How a route guards its calls."""

    methods: tuple[str, ...] = DEFAULT_METHODS
    required: bool = True
    key: KeyKind = KeyKind.COMPOSITE
    canonicalization: Canonicalization = Canonicalization.JCS
    lock_ttl: Duration = DEFAULT_LOCK_TTL
    result_ttl: Duration = DEFAULT_RESULT_TTL
    retry_after: Duration = DEFAULT_RETRY_AFTER
    conflict_wait: Wait = 0.0
    release_on_status: tuple[int, ...] = DEFAULT_RELEASE_ON_STATUS
    max_stored_bytes: int | None = Field(default=None, ge=0)
    on_lapsed_lease: LapsedLease = LapsedLease.FAIL

    @field_validator("methods")
    @classmethod
    def _upper_methods(cls, methods: tuple[str, ...]) -> tuple[str, ...]:
        return check_methods(methods, "guarded")

    @field_validator("release_on_status")
    @classmethod
    def _statuses(cls, statuses: tuple[int, ...]) -> tuple[int, ...]:
        for status in check_statuses(statuses):
            if status < 200:
                raise ValueError(f"{status} is informational: a tool's answer is never one")
            if status < 300:
                raise ValueError(
                    f"{status} means the call ran: releasing its key would let the retry "
                    "run it a second time"
                )
        return statuses

    @field_validator("lock_ttl")
    @classmethod
    def _lease(cls, lock_ttl: float) -> float:
        if lock_ttl < MIN_LOCK_TTL:
            raise ValueError(
                f"at least {MIN_LOCK_TTL * 1000:g}ms (the lease is renewed every third of it, "
                "and a store round trip must fit in that)"
            )
        return lock_ttl

    @model_validator(mode="after")
    def _result_outlives_lease(self) -> IdempotencyConfig:
        if self.result_ttl < self.lock_ttl:
            raise ValueError("result_ttl must be at least lock_ttl")
        return self


_RECONCILE_FIELDS = frozenset({"key", "plan", "step", "args_hash"})

_PLACEHOLDER = re.compile(r"\{([^{}]*)\}")


class ReconcileConfig(Strict):
    """How to ask the tool whether a call whose outcome is unknown ran."""

    method: str = "GET"
    path: str
    found: tuple[int, ...] = (200,)
    not_found: tuple[int, ...] = (404,)
    timeout: Duration = DEFAULT_RECONCILE_TIMEOUT
    retries: int = Field(default=DEFAULT_RECONCILE_RETRIES, ge=0, le=100)
    interval: Duration = DEFAULT_RECONCILE_INTERVAL

    @field_validator("method")
    @classmethod
    def _method(cls, method: str) -> str:
        if not METHOD.fullmatch(method.upper()):
            raise ValueError(f"not an HTTP method: {method!r}")
        if method.upper() not in LOOKUP_METHODS:
            raise ValueError(
                f"{method.upper()} is not a read: the look-up is asked again on retries, by "
                "every replica, and must change nothing (use GET or HEAD)"
            )
        return method.upper()

    @field_validator("path")
    @classmethod
    def _path(cls, path: str) -> str:
        if not path.startswith("/") or "//" in path.split("?", 1)[0]:
            raise ValueError("must start with '/' (a path and query on the route's upstream)")
        unknown = set(_PLACEHOLDER.findall(path)) - _RECONCILE_FIELDS
        if unknown:
            names = ", ".join("{" + n + "}" for n in sorted(_RECONCILE_FIELDS))
            raise ValueError(f"unknown placeholder {sorted(unknown)[0]!r}: use {names}")
        return path

    @field_validator("found", "not_found")
    @classmethod
    def _statuses(cls, statuses: tuple[int, ...]) -> tuple[int, ...]:
        return check_statuses(statuses)

    @model_validator(mode="after")
    def _disjoint(self) -> ReconcileConfig:
        if both := set(self.found) & set(self.not_found):
            raise ValueError(f"status {min(both)} cannot be both found and not_found")
        return self

    def placeholders(self) -> set[str]:
        return set(_PLACEHOLDER.findall(self.path))
