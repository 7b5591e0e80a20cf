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
from itertools import accumulate
from typing import Any

import rfc8785

from proxy.errors import (
    BodyNotCanonicalizable,
    DuplicateJSONMember,
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


def _unique_members(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object's members; ``DuplicateJSONMember`` if a name comes twice (RFC 7493 2.3:
    I-JSON, the input RFC 8785 takes, has unique names, compared once unescaped)."""
    members = dict(pairs)
    if len(members) == len(pairs):
        return members
    seen: set[str] = set()
    for name, _ in pairs:
        if name in seen:
            break
        seen.add(name)
    raise DuplicateJSONMember(f"the member name {name!r} appears more than once in an object")


# One decoder and one encoder for the fast path (json.loads/dumps with options build new
# ones on every call).
_PLAIN_DECODER = json.JSONDecoder(
    object_pairs_hook=_unique_members,
    parse_float=_refuse,
    parse_int=_plain_int,
    parse_constant=_refuse,
)
_FULL_DECODER = json.JSONDecoder(object_pairs_hook=_unique_members)
_JCS_ENCODER = json.JSONEncoder(ensure_ascii=False, sort_keys=True, separators=(",", ":"))

# The nesting depth of a JSON text is checked before it is parsed (the decoders and the
# rfc8785 encoder recurse once per level). A body of at most twice the limit in bytes,
# or with no more opening brackets than the limit, cannot be deeper: a comparison, or
# two counts at C speed, all most bodies need. Any other body is
# reduced to its brackets outside strings (escaped backslashes and quotes removed, then
# everything but quotes and brackets; what lies between two quotes is then a string),
# whose running depth is summed up: C loops all, no Python code per byte.
_NOT_QUOTES_OR_BRACKETS = bytes(b for b in range(256) if b not in b'"[]{}')
_DEPTH_STEP = [1 if b in b"[{" else -1 for b in range(256)]


def json_depth(body: bytes) -> int:
    """How deep the arrays and objects of a UTF-8 JSON text nest (brackets in strings
    aside); for a text that is not JSON, a number that says nothing."""
    if b"\\" in body:
        body = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    skeleton = body.translate(None, _NOT_QUOTES_OR_BRACKETS)
    brackets = b"".join(skeleton.split(b'"')[::2])
    return max(accumulate(map(_DEPTH_STEP.__getitem__, brackets)), default=0)


def _check_depth(body: bytes, max_depth: int) -> None:
    if body.count(b"[") + body.count(b"{") > max_depth and json_depth(body) > max_depth:
        raise InvalidJSONBody(f"the body nests arrays and objects deeper than {max_depth}")


def _utf8(body: bytes) -> bytes:
    """A UTF-16 or UTF-32 JSON text (RFC 4627 allowed them; json.loads detects them) as
    UTF-8, so that the depth check and the fast path read it."""
    try:
        return body.decode(json.detect_encoding(body), "surrogatepass").encode(
            "utf-8", "surrogatepass"
        )
    except UnicodeError as exc:
        raise InvalidJSONBody(f"the body is declared JSON but does not parse: {exc}") from exc


def _jcs_by_stdlib(body: bytes) -> bytes | None:
    """The RFC 8785 form of a plain UTF-8 body, or None if the stdlib cannot make it."""
    if _BEYOND_BMP.search(body):
        return None
    try:
        value = _PLAIN_DECODER.decode(body.decode())
    except (_NotPlain, ValueError, RecursionError):  # an error is reported by the full path
        return None
    return _JCS_ENCODER.encode(value).encode()


def canonical_body(body: bytes, canonicalization: Canonicalization, max_depth: int | None) -> bytes:
    """The canonical bytes of a JSON body.

    ``InvalidJSONBody`` if it does not parse or nests deeper than ``max_depth`` (None:
    no limit but Python's own), ``DuplicateJSONMember`` if an object repeats a name.
    """
    if body.find(b"\x00") != -1:  # NUL: UTF-16/32, not UTF-8 (find: see routes.check_path)
        body = _utf8(body)
    if max_depth is not None and len(body) > 2 * max_depth:  # shorter: cannot be deeper
        _check_depth(body, max_depth)
    if canonicalization is Canonicalization.JCS:
        fast = _jcs_by_stdlib(body)
        if fast is not None:
            return fast
    return canonical_json(parse_json(body), canonicalization)


def is_json_media_type(content_type: str | None) -> bool:
    """True for ``application/json`` and any ``+json`` structured syntax suffix."""
    if not content_type:
        return False
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or media.endswith("+json")


def fingerprint(
    body: bytes,
    content_type: str | None,
    canonicalization: Canonicalization,
    max_depth: int | None,
) -> str:
    """SHA-256 (hex) of what the body means.

    - empty body: the hash of the empty string;
    - JSON media type: the canonical JSON (a body that does not parse, or nests deeper
      than ``max_depth``, is a 400);
    - no media type: canonical JSON if the body parses as JSON (within ``max_depth``),
      else the raw bytes;
    - any other media type: the raw bytes.

    A JSON body whose objects repeat a member name is a 400 in both JSON cases.
    """
    hashed = hashed_bytes(body, content_type, canonicalization, max_depth)
    return hashlib.sha256(hashed).hexdigest()


def hashed_bytes(
    body: bytes,
    content_type: str | None,
    canonicalization: Canonicalization,
    max_depth: int | None,
) -> bytes:
    """The bytes :func:`fingerprint` hashes."""
    if not body:
        return b""
    if is_json_media_type(content_type):
        return canonical_body(body, canonicalization, max_depth)
    if content_type:
        return body
    try:
        return canonical_body(body, canonicalization, max_depth)
    except InvalidJSONBody:
        return body


def parse_json(body: bytes) -> Any:
    """The value of a JSON text (UTF-8, -16 or -32); ``InvalidJSONBody`` if it does not
    parse, ``DuplicateJSONMember`` if an object repeats a member name."""
    try:
        return _FULL_DECODER.decode(body.decode(json.detect_encoding(body), "surrogatepass"))
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise InvalidJSONBody(f"the body is declared JSON but does not parse: {exc}") from exc


def is_text(value: str) -> bool:
    """False for a ``str`` that is not Unicode text: a lone surrogate, which Python keeps
    for bytes the system passed that are not UTF-8 (the environment, a command line) and
    JSON reads from an escape (``"\\ud800"``); no request, store or log line takes it."""
    try:
        value.encode()
    except UnicodeEncodeError:
        return False
    return True


def read_json(body: bytes, max_depth: int | None) -> Any:
    """The value of a JSON body read as a hashed one is (UTF-8, -16 or -32), for a policy
    that keys by a member of it (``json:``): None if it is not JSON (its members are
    absent); ``InvalidJSONBody`` if it nests deeper than ``max_depth`` (None: Python's
    own limit), ``DuplicateJSONMember`` if an object repeats a member name (a tool may
    read the first one). Strings may hold lone surrogates: the caller checks the ones
    it uses."""
    if body.find(b"\x00") != -1:
        try:
            body = _utf8(body)
        except InvalidJSONBody:
            return None
    if max_depth is not None and len(body) > 2 * max_depth:
        _check_depth(body, max_depth)
    try:
        return _FULL_DECODER.decode(body.decode(json.detect_encoding(body), "surrogatepass"))
    except RecursionError as exc:
        raise InvalidJSONBody("the body nests arrays and objects too deep to be read") from exc
    except ValueError:  # UnicodeDecodeError is a ValueError
        return None


def composite_key(
    plan: str,
    step: int | str,
    body: bytes | Any,
    canonicalization: Canonicalization | str = Canonicalization.JCS,
    max_depth: int | None = None,
) -> str:
    """The key an agent sends for ``body`` at ``step`` of plan ``plan``.

    ``body`` is either the raw request bytes or a JSON-compatible value. Bytes nested
    deeper than ``max_depth`` are hashed as they are, as the proxy does with a body
    without Content-Type: pass its ``limits.max_json_depth``.
    """
    mode = Canonicalization(canonicalization)
    raw = body if isinstance(body, bytes) else canonical_json(body, mode)
    key = f"{plan}:{step}:{fingerprint(raw, None, mode, max_depth)}"
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
