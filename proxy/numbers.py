"""Whole numbers as callers and tools send them (headers, query parameters, arguments).

``str.isdigit`` is not the test: it takes ``"²"`` (Latin-1 0xB2, as a header is decoded),
which ``int()`` refuses, and ``int()`` refuses more than 4,300 digits. A number here is
1 to ``MAX_DIGITS`` ASCII digits.
"""

from __future__ import annotations

from proxy.errors import InvalidField

MAX_DIGITS = 18
"""More digits than any count, size or number of seconds the proxy takes."""


def digits(value: str) -> bool:
    """True if ``value`` is ASCII digits only (any number of them, at least one)."""
    return value.isascii() and value.isdigit()


def whole(value: str) -> int | None:
    """The number ``value`` spells (1 to MAX_DIGITS ASCII digits), else None."""
    return int(value) if len(value) <= MAX_DIGITS and digits(value) else None


def parse_limit(value: str | None, field: str, most: int, default: int) -> int:
    """A page size from 1 to ``most`` (``default`` when not given); 400 naming ``field``."""
    if value is None:
        return default
    limit = whole(value)
    if limit is None or not 1 <= limit <= most:
        raise InvalidField(field, f"must be a whole number from 1 to {most}")
    return limit
