"""``routes[].async`` and ``workers``: long calls run as operations."""

from __future__ import annotations

from enum import StrEnum

from pydantic import (
    Field,
    model_validator,
)

from proxy.config.fields import Duration, Strict


class AsyncMode(StrEnum):
    """When a guarded call is answered ``202 Accepted`` and run by the route's workers."""

    NEVER = "never"
    PREFER = "prefer"
    """When the caller sends ``Prefer: respond-async`` (or waits past ``after``)."""
    ALWAYS = "always"


DEFAULT_ASYNC_ATTEMPTS = 5

DEFAULT_ASYNC_BACKOFF = 1.0

DEFAULT_ASYNC_BACKOFF_MAX = 60.0

DEFAULT_ASYNC_VISIBILITY = 30.0

DEFAULT_ASYNC_MAX_QUEUED = 3600.0

DEFAULT_WORKERS = 4


class CredentialsAtRest(StrEnum):
    """How an async job's stored request keeps the caller's credentials."""

    SEAL = "seal"
    """AES-256-GCM with the store's sealing key (``store.sealing_key_env``)."""
    CLEAR = "clear"
    """As they came: anyone who can read the store can read them (opt-in)."""


class AsyncConfig(Strict):
    """Long calls: answered 202 with an operation to follow, run durably by workers."""

    mode: AsyncMode = AsyncMode.PREFER
    after: Duration | None = None
    """A caller still waiting this long gets its 202 while the call goes on."""
    attempts: int = Field(default=DEFAULT_ASYNC_ATTEMPTS, ge=1, le=100)
    backoff: Duration = DEFAULT_ASYNC_BACKOFF
    backoff_max: Duration = DEFAULT_ASYNC_BACKOFF_MAX
    visibility: Duration = DEFAULT_ASYNC_VISIBILITY
    """A worker's hold on its job, renewed while it works; past it, another replica
    takes the job over (and never sends one that may have been sent)."""
    max_queued: Duration = DEFAULT_ASYNC_MAX_QUEUED
    """The longest a job waits in the queue (for a worker, or between attempts)."""
    credentials: CredentialsAtRest = CredentialsAtRest.SEAL
    """How a stored request keeps the caller's Authorization, Cookie and
    Proxy-Authorization: sealed (the store's sealing key), or in clear (an explicit
    opt-in)."""

    @model_validator(mode="after")
    def _backoff_cap(self) -> AsyncConfig:
        if self.backoff_max < self.backoff:
            raise ValueError("backoff_max must be at least backoff")
        return self


class WorkersConfig(Strict):
    """The workers that run a route's jobs, per process."""

    concurrency: int = Field(default=DEFAULT_WORKERS, ge=1, le=1000)
