"""``routes[].limits``: shared rate and concurrency limits, token costs, the tool's own pauses."""

from __future__ import annotations

import math
import re
from enum import StrEnum

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from proxy.config.fields import (
    HEADER_NAME,
    Duration,
    Strict,
    check_json_source,
    check_name,
    parse_duration,
)

# The longest a tool's own 429/503 reset pauses calls (routes[].pause_max): a wrong or
# hostile Retry-After cannot stop a caller, or a route, for longer.
DEFAULT_PAUSE_MAX = 60.0

# A concurrency slot's lease (routes[].limits[].slot_ttl): renewed every third of it while
# the call runs; the slots of a replica that dies are free again at most this long after.
DEFAULT_SLOT_TTL = 10.0

_QUOTA = re.compile(r"\d+(?:\.\d+)?")


class StoreDown(StrEnum):
    """What a route with limits does while the store cannot be reached."""

    CLOSED = "closed"
    """Refuse (503 store-unavailable): no limit is ever exceeded."""
    OPEN = "open"
    """Forward without limits (logged and counted): the tool stays reachable."""


class PauseScope(StrEnum):
    """Whom a tool's own 429/503 with a reset pauses (``routes[].pause_scope``)."""

    CALLER = "caller"
    """The calls of the caller that got it: the same principal and the same values of the
    route's limit keys (a quota one caller exhausts at the tool stops only that caller)."""
    ROUTE = "route"
    """Every call of the route, on every replica (a quota the tool keeps for all callers)."""


class CostConfig(Strict):
    """What one call costs a rate limit: reserved before, trued up after."""

    request: float | str = 1
    """A number, or ``json:<JSON pointer>`` into the request body."""
    response: str | None = None
    """``json:<JSON pointer>`` into the tool's answer: the real cost."""

    @field_validator("request")
    @classmethod
    def _request(cls, value: float | str) -> float | str:
        if isinstance(value, str):
            return check_json_source(value)
        if not math.isfinite(value):
            raise ValueError("a cost must be a finite number")
        if value <= 0:
            raise ValueError("a cost must be positive")
        return value

    def least(self) -> float | None:
        """The least a call costs: ``request`` as a number; None for one read from the
        request body (any number, 0 included)."""
        return None if isinstance(self.request, str) else float(self.request)

    @field_validator("response")
    @classmethod
    def _response(cls, value: str | None) -> str | None:
        return None if value is None else check_json_source(value)


class LimitConfig(Strict):
    """One rate or concurrency limit of a route."""

    name: str
    key: str = "route"
    rate: str | None = None
    burst: int | None = Field(default=None, ge=1)
    cost: CostConfig | None = None
    max_in_flight: int | None = Field(default=None, ge=1)
    slot_ttl: Duration = DEFAULT_SLOT_TTL

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        return check_name(name, "limit")

    @field_validator("key")
    @classmethod
    def _key(cls, key: str) -> str:
        if key in ("route", "principal", "client_ip"):
            return key
        if key.startswith("header:") and HEADER_NAME.fullmatch(key[7:]):
            return "header:" + key[7:].lower()
        if key.startswith("json:"):
            return check_json_source(key)
        raise ValueError("must be route, principal, client_ip, header:<name> or json:<pointer>")

    @field_validator("rate")
    @classmethod
    def _rate(cls, rate: str | None) -> str | None:
        if rate is not None:
            parse_rate(rate)
        return rate

    @model_validator(mode="after")
    def _one_kind(self) -> LimitConfig:
        if (self.rate is None) == (self.max_in_flight is None):
            raise ValueError("set exactly one of rate and max_in_flight")
        if self.rate is None and (self.burst is not None or self.cost is not None):
            raise ValueError("burst and cost go with a rate, not with max_in_flight")
        quota = self.quota_period()[0]
        if self.burst is not None and self.burst > quota:
            raise ValueError(f"burst must be at most the rate's quota ({quota:g})")
        self._a_call_fits()
        return self

    def _a_call_fits(self) -> None:
        """ValueError if the rate's burst is below what every call costs: none could pass."""
        if self.rate is None:
            return
        cost = 1.0 if self.cost is None else self.cost.least()
        if cost is None:
            return
        quota, period = self.quota_period()
        if self.burst is not None and self.burst < cost:
            raise ValueError(
                f"burst ({self.burst}) is below the {cost:g} a call costs: no call could ever pass"
            )
        if self.burst is None and quota < cost:
            hint = f" (write {quota:g}/{period:g}s as 1/{period / quota:g}s)" if quota < 1 else ""
            raise ValueError(
                f"the rate's quota ({quota:g}), its burst, is below the {cost:g} a call "
                f"costs: no call could ever pass{hint}"
            )

    def quota_period(self) -> tuple[float, float]:
        """The rate as (units, seconds); (0, 0) for a concurrency limit."""
        return (0.0, 0.0) if self.rate is None else parse_rate(self.rate)


def parse_rate(rate: str) -> tuple[float, float]:
    """``N/<duration>`` (``60/1m``, ``90000/1m``, ``5/250ms``) as (N, seconds)."""
    count, slash, period = rate.partition("/")
    if not slash or not _QUOTA.fullmatch(count.strip()):
        raise ValueError(f"not a rate: {rate!r} (use N/<duration>, e.g. 60/1m)")
    quota = float(count)
    if not math.isfinite(quota):
        raise ValueError("a rate's quota must be a finite number")
    if quota <= 0:
        raise ValueError("a rate's quota must be positive")
    seconds = parse_duration(period.strip())
    if seconds / quota <= 0:
        raise ValueError(f"the period is too short for a quota of {quota:g}")
    return quota, seconds
