"""Idempotency keys: ``<plan_session_id>:<step_index>:<args_hash>``, as tool-proxy computes them.

``args_hash`` is the SHA-256 (hex) of the RFC 8785 (JCS) form of the arguments. The
canonical form is written here (no dependency): clients/test-vectors/keys.json holds the
digests that the proxy, this package and the TypeScript client all check.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from typing import Any

from tool_proxy_client.errors import InvalidKey

_PART = re.compile(r"[A-Za-z0-9._-]{1,128}")
MAX_KEY_LENGTH = 255
# RFC 8785 has no form for integers beyond what an IEEE double holds exactly.
_INT_LIMIT = 2**53 - 1
_STRINGS = json.JSONEncoder(ensure_ascii=False)


def is_key_part(value: str) -> bool:
    """True if ``value`` may be a plan_session_id or a step_index."""
    return _PART.fullmatch(value) is not None


def canonical_json(value: Any) -> bytes:
    """The RFC 8785 (JCS) bytes of a JSON-compatible value."""
    return _jcs(value).encode("utf-8", "strict")


def args_hash(arguments: Any) -> str:
    """SHA-256 (hex) of the canonical form of ``arguments`` (a JSON-compatible value)."""
    return hashlib.sha256(canonical_json(arguments)).hexdigest()


def body_hash(body: bytes, content_type: str | None = None) -> str:
    """SHA-256 (hex) of a raw request body, hashed as the proxy hashes it: empty, the
    canonical JSON (a JSON media type, or none and the body parses), or the bytes."""
    if not body:
        return hashlib.sha256(b"").hexdigest()
    if content_type and not _is_json_media_type(content_type):
        return hashlib.sha256(body).hexdigest()
    try:
        value = json.loads(body, object_pairs_hook=_unique_members)
    except (json.JSONDecodeError, UnicodeDecodeError):
        if content_type:
            raise InvalidKey(f"the body is declared {content_type} but does not parse") from None
        return hashlib.sha256(body).hexdigest()
    return args_hash(value)


def composite_key(plan: str, step: int | str, arguments: Any) -> str:
    """The key for ``arguments`` at ``step`` of plan ``plan``."""
    return key_of(plan, step, args_hash(arguments))


def key_of(plan: str, step: int | str, digest: str) -> str:
    """``plan:step:digest``, checked as the proxy checks it."""
    key = f"{plan}:{step}:{digest}"
    if not (is_key_part(plan) and is_key_part(str(step))) or len(key) > MAX_KEY_LENGTH:
        raise InvalidKey(
            "plan_session_id and step_index must be 1..128 characters of [A-Za-z0-9._-], "
            "the key at most 255 characters"
        )
    return key


def _jcs(value: Any) -> str:
    if value is None or value is True or value is False:
        return json.dumps(value)
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, int):
        if abs(value) > _INT_LIMIT:
            raise InvalidKey(f"RFC 8785 has no form for the integer {value} (beyond ±2^53)")
        return str(value)
    if isinstance(value, float):
        return _number(value)
    if isinstance(value, dict):
        return _object(value)
    if isinstance(value, list | tuple):
        return "[" + ",".join(_jcs(item) for item in value) + "]"
    raise InvalidKey(f"not a JSON value: {type(value).__name__}")


def _object(value: dict[Any, Any]) -> str:
    if not all(isinstance(name, str) for name in value):
        raise InvalidKey("JSON object member names must be strings")
    names = sorted(value, key=lambda name: name.encode("utf-16-be", "surrogatepass"))
    return "{" + ",".join(_string(name) + ":" + _jcs(value[name]) for name in names) + "}"


def _string(value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidKey("a string holds a lone surrogate: not I-JSON") from None
    return _STRINGS.encode(value)


def _number(value: float) -> str:
    """ECMAScript's Number::toString, which RFC 8785 prescribes."""
    if not math.isfinite(value):
        raise InvalidKey(f"RFC 8785 has no form for {value}")
    if value == 0:
        return "0"
    sign = "-" if value < 0 else ""
    mantissa, _, exponent = repr(abs(value)).partition("e")
    whole, _, fraction = mantissa.partition(".")
    digits = whole + fraction
    point = len(whole) + int(exponent or 0)  # where the decimal point is, in ``digits``
    significant = digits.lstrip("0")
    point -= len(digits) - len(significant)
    return sign + _es_digits(significant.rstrip("0"), point)


def _es_digits(digits: str, point: int) -> str:
    count = len(digits)
    if count <= point <= 21:
        return digits + "0" * (point - count)
    if 0 < point <= 21:
        return digits[:point] + "." + digits[point:]
    if -6 < point <= 0:
        return "0." + "0" * -point + digits
    exponent = point - 1
    sign = "+" if exponent >= 0 else "-"
    head = digits[0] + ("." + digits[1:] if count > 1 else "")
    return f"{head}e{sign}{abs(exponent)}"


def _is_json_media_type(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or media.endswith("+json")


def _unique_members(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    members = dict(pairs)
    if len(members) != len(pairs):
        raise InvalidKey("an object repeats a member name: not I-JSON, the proxy refuses it")
    return members
