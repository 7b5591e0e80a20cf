"""Idempotency keys: the composite ``plan:step:args_hash`` form, opaque keys, fingerprints.

An agent computes its key with :func:`composite_key`; the proxy recomputes the
fingerprint of the body it received with :func:`fingerprint` and compares.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import rfc8785

from proxy.errors import (
    BodyNotCanonicalizable,
    InvalidIdempotencyKey,
    InvalidJSONBody,
)

MAX_KEY_LENGTH = 255
_PART = r"[A-Za-z0-9._-]{1,128}"
_COMPOSITE = re.compile(rf"({_PART}):({_PART}):([0-9a-fA-F]{{64}})")
_OPAQUE = re.compile(r"[\x21-\x7e]{1,255}")
_OPAQUE_QUOTED = re.compile(r"[\x20-\x7e]{1,255}")  # an sf-string may hold spaces


class Canonicalization(StrEnum):
    """How a JSON body is turned into the bytes that are hashed."""

    JCS = "jcs"
    PYTHON_JSON = "python-json"


class KeyKind(StrEnum):
    """The key format a route accepts."""

    COMPOSITE = "composite"
    OPAQUE = "opaque"


@dataclass(frozen=True, slots=True)
class CompositeKey:
    """A parsed ``<plan_session_id>:<step_index>:<args_hash>`` key."""

    plan: str
    step: str
    args_hash: str

    def __str__(self) -> str:
        return f"{self.plan}:{self.step}:{self.args_hash}"


def is_key_part(value: str) -> bool:
    """True if ``value`` may be a plan_session_id or step_index."""
    return re.fullmatch(_PART, value) is not None


def canonical_json(value: Any, canonicalization: Canonicalization) -> bytes:
    """The canonical bytes of a parsed JSON value."""
    if canonicalization is Canonicalization.JCS:
        try:
            return bytes(rfc8785.dumps(value))
        except rfc8785.CanonicalizationError as exc:
            raise BodyNotCanonicalizable(f"RFC 8785 cannot canonicalize the body: {exc}") from exc
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


# RFC 8785 and ``json.dumps(sort_keys=True, separators=(",", ":"), ensure_ascii=False)``
# write the same bytes for a UTF-8 JSON text with no number in fraction or exponent form,
# no integer beyond ±(2**53 - 1) and no character beyond the BMP (raw or as surrogate
# escapes): the same escapes (the seven short ones, ``\u00xx`` for other control
# characters, nothing else), and there key order by UTF-16 code units is key order by
# code points. Such bodies, most tool arguments, take the stdlib's C decoder and encoder
# (1.5-2x cheaper than the rfc8785 library, more for larger bodies); any other body
# takes rfc8785. tests/test_keys.py checks that the two agree on generated values.
_JCS_INT_LIMIT = 2**53 - 1
_BEYOND_BMP = re.compile(rb"[\xf0-\xf7]|\\u[dD][89a-fA-F]")


class _NotPlain(Exception):
    """The body holds a value the stdlib encoder would write otherwise than RFC 8785."""


def _refuse(text: str) -> Any:
    raise _NotPlain


def _plain_int(text: str) -> int:
    value = int(text)
    if -_JCS_INT_LIMIT <= value <= _JCS_INT_LIMIT:
        return value
    raise _NotPlain


# One decoder and one encoder for the fast path (json.loads/dumps with options build new
# ones on every call).
_PLAIN_DECODER = json.JSONDecoder(parse_float=_refuse, parse_int=_plain_int, parse_constant=_refuse)
_JCS_ENCODER = json.JSONEncoder(ensure_ascii=False, sort_keys=True, separators=(",", ":"))


def _jcs_by_stdlib(body: bytes) -> bytes | None:
    """The RFC 8785 form of a plain UTF-8 body, or None if the stdlib cannot make it."""
    if b"\x00" in body or _BEYOND_BMP.search(body):  # NUL: UTF-16/32, not UTF-8
        return None
    try:
        value = _PLAIN_DECODER.decode(body.decode())
    except (_NotPlain, ValueError):  # an error is reported by the full path
        return None
    return _JCS_ENCODER.encode(value).encode()


def canonical_body(body: bytes, canonicalization: Canonicalization) -> bytes:
    """The canonical bytes of a JSON body (``InvalidJSONBody`` if it does not parse)."""
    if canonicalization is Canonicalization.JCS:
        fast = _jcs_by_stdlib(body)
        if fast is not None:
            return fast
    return canonical_json(_parse_json(body), canonicalization)


def is_json_media_type(content_type: str | None) -> bool:
    """True for ``application/json`` and any ``+json`` structured syntax suffix."""
    if not content_type:
        return False
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or media.endswith("+json")


def fingerprint(body: bytes, content_type: str | None, canonicalization: Canonicalization) -> str:
    """SHA-256 (hex) of what the body means.

    - empty body: the hash of the empty string;
    - JSON media type: the canonical JSON (a body that does not parse is a 400);
    - no media type: canonical JSON if the body parses as JSON, else the raw bytes;
    - any other media type: the raw bytes.
    """
    return hashlib.sha256(hashed_bytes(body, content_type, canonicalization)).hexdigest()


def hashed_bytes(
    body: bytes, content_type: str | None, canonicalization: Canonicalization
) -> bytes:
    """The bytes :func:`fingerprint` hashes."""
    if not body:
        return b""
    if is_json_media_type(content_type):
        return canonical_body(body, canonicalization)
    if content_type:
        return body
    try:
        return canonical_body(body, canonicalization)
    except InvalidJSONBody:
        return body


def _parse_json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidJSONBody(f"the body is declared JSON but does not parse: {exc}") from exc


def composite_key(
    plan: str,
    step: int | str,
    body: bytes | Any,
    canonicalization: Canonicalization | str = Canonicalization.JCS,
) -> str:
    """The key an agent sends for ``body`` at ``step`` of plan ``plan``.

    ``body`` is either the raw request bytes or a JSON-compatible value.
    """
    mode = Canonicalization(canonicalization)
    raw = body if isinstance(body, bytes) else canonical_json(body, mode)
    key = f"{plan}:{step}:{fingerprint(raw, None, mode)}"
    parse_composite(key)
    return key


def unquote(header: str) -> str:
    """Accept the RFC 8941 sf-string form (``"..."`` with ``\\"`` and ``\\\\`` escapes)."""
    value = header.strip()
    if len(value) >= 2 and value[0] == value[-1] == '"':
        inner = value[1:-1]
        return re.sub(r"\\([\\\"])", r"\1", inner)
    return value


def parse_composite(header: str) -> CompositeKey:
    """Parse a composite key or raise ``InvalidIdempotencyKey`` (400)."""
    value = unquote(header)
    match = _COMPOSITE.fullmatch(value)
    if match is None or len(value) > MAX_KEY_LENGTH:
        raise InvalidIdempotencyKey(
            "Idempotency-Key must be <plan_session_id>:<step_index>:<args_hash>: ids of 1..128 "
            "characters of [A-Za-z0-9._-], args_hash 64 hex digits, at most 255 characters"
        )
    plan, step, args_hash = match.groups()
    return CompositeKey(plan, step, args_hash.lower())


def parse_opaque(header: str) -> str:
    """Parse an opaque (IETF draft) key: 1..255 visible ASCII characters (or an sf-string)."""
    value = unquote(header)
    pattern = _OPAQUE_QUOTED if value != header.strip() else _OPAQUE
    if pattern.fullmatch(value) is None:
        raise InvalidIdempotencyKey("Idempotency-Key must be 1..255 visible ASCII characters")
    return value
