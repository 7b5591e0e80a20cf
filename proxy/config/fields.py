"""What every section's model is made of: strict models, durations, names, statuses."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Annotated, Any

import jsonpointer
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
)

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}

_DURATION = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)\s*")

_ROUTE_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")

METHOD = re.compile(r"[A-Z]{1,20}")

HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,64}")


def check_statuses(statuses: tuple[int, ...]) -> tuple[int, ...]:
    """``statuses`` if each is an HTTP status, else ValueError naming the first that is not."""
    for status in statuses:
        if not 100 <= status <= 599:
            raise ValueError(f"not an HTTP status: {status}")
    return statuses


def check_methods(
    methods: tuple[str, ...], what: str, refused: tuple[str, ...] = (), why: str = ""
) -> tuple[str, ...]:
    """``methods`` in upper case if each is an HTTP method and none is one of ``refused``
    (ValueError saying ``why``), and there is one at least (``what`` is done to them)."""
    upper = tuple(m.upper() for m in methods)
    for method in upper:
        if not METHOD.fullmatch(method):
            raise ValueError(f"not an HTTP method: {method!r}")
        if method in refused:
            raise ValueError(why.format(method=method))
    if not upper:
        raise ValueError(f"at least one method must be {what}")
    return upper


def check_name(name: str, what: str) -> str:
    """``name`` if it may name a route or a limit (in logs and metrics), else ValueError."""
    if not _ROUTE_NAME.fullmatch(name):
        raise ValueError(f"a {what} name is 1..64 characters of [A-Za-z0-9._-]")
    return name


def _seconds(value: Any) -> float:
    """Seconds from a number or a string with a unit, checked finite (not yet for sign)."""
    if isinstance(value, bool):
        raise ValueError("expected a duration such as 5s, 2m, 24h")
    if isinstance(value, int | float):
        try:
            seconds = float(value)
        except OverflowError:  # an int past a float's range (YAML's ints are unbounded)
            raise ValueError("a duration must be a finite number of seconds") from None
    elif isinstance(value, str) and (match := _DURATION.fullmatch(value)):
        seconds = float(match[1]) * _UNITS[match[2]]
    else:
        raise ValueError(f"not a duration: {value!r} (use a number of seconds or 250ms, 5s, 2m)")
    if not math.isfinite(seconds):
        raise ValueError("a duration must be a finite number of seconds")
    return seconds


def parse_duration(value: Any) -> float:
    """Seconds from a number or a string such as ``250ms``, ``5s``, ``2m``, ``24h``, ``7d``."""
    seconds = _seconds(value)
    if seconds <= 0:
        raise ValueError("a duration must be positive")
    return seconds


def parse_wait(value: Any) -> float:
    """Like :func:`parse_duration`, but zero (``0``, ``0s``) is allowed: no waiting."""
    seconds = _seconds(value)
    if seconds < 0:
        raise ValueError("a wait must be zero or more (0: no waiting)")
    return seconds + 0.0  # -0.0 is 0.0


Duration = Annotated[float, BeforeValidator(parse_duration)]

Wait = Annotated[float, BeforeValidator(parse_wait)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def check_entries(entries: tuple[str, ...], check: Callable[[str], str]) -> tuple[str, ...]:
    if not entries:
        raise ValueError("at least one entry (or leave it out for the default)")
    return tuple(check(entry) for entry in entries)


def check_json_source(value: str) -> str:
    """``json:<JSON pointer>`` (RFC 6901), checked with the jsonpointer library."""
    if not value.startswith("json:"):
        raise ValueError("must be json:<JSON pointer>, e.g. json:/usage/total_tokens")
    try:
        jsonpointer.JsonPointer(value[5:])
    except jsonpointer.JsonPointerException as exc:
        raise ValueError(f"not a JSON pointer: {value[5:]!r} ({exc})") from None
    return value
