from __future__ import annotations

import hashlib

import pytest

from proxy.errors import BodyNotCanonicalizable, InvalidIdempotencyKey, InvalidJSONBody
from proxy.keys import (
    Canonicalization,
    canonical_json,
    composite_key,
    fingerprint,
    parse_composite,
    parse_opaque,
    unquote,
)

JCS = Canonicalization.JCS
PY = Canonicalization.PYTHON_JSON
HASH = "ab" * 32


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_jcs_sorts_keys_and_normalizes_numbers() -> None:
    assert canonical_json({"b": 1.0, "a": [1e21, "é"]}, JCS) == '{"a":[1e+21,"é"],"b":1}'.encode()


def test_python_json_is_sorted_compact_ascii() -> None:
    assert canonical_json({"b": 1.0, "a": "é"}, PY) == b'{"a":"\\u00e9","b":1.0}'


def test_jcs_refuses_integers_beyond_2_53() -> None:
    with pytest.raises(BodyNotCanonicalizable):
        canonical_json(2**60, JCS)


def test_fingerprint_rules() -> None:
    assert fingerprint(b"", "application/json", JCS) == sha(b"")
    assert fingerprint(b'{"b":1, "a":2}', "application/json", JCS) == sha(b'{"a":2,"b":1}')
    assert fingerprint(b'{"b":1}', "application/vnd.api+json; charset=utf-8", JCS) == sha(
        b'{"b":1}'
    )
    assert fingerprint(b'{"b":1, "a":2}', None, JCS) == sha(b'{"a":2,"b":1}')
    assert fingerprint(b"not json", None, JCS) == sha(b"not json")
    assert fingerprint(b'{"b":1, "a":2}', "text/plain", JCS) == sha(b'{"b":1, "a":2}')
    with pytest.raises(InvalidJSONBody):
        fingerprint(b"{nope", "application/json", JCS)


def test_composite_key_round_trip() -> None:
    key = composite_key("plan.A-1", 7, {"x": 1})
    parsed = parse_composite(key)
    assert (parsed.plan, parsed.step) == ("plan.A-1", "7")
    assert parsed.args_hash == sha(b'{"x":1}')
    assert composite_key("plan.A-1", 7, b'{ "x" : 1 }') == key
    assert str(parsed) == key


@pytest.mark.parametrize(
    "key",
    [
        "",
        "p:1",
        f"p:1:{HASH}:x",
        f"p q:1:{HASH}",
        f"p:1:{HASH[:-1]}",
        f"p:1:{HASH}0",
        f"{'p' * 129}:1:{HASH}",
        f"p:{'1' * 129}:{HASH}",
        f":1:{HASH}",
        f"p::{HASH}",
        f"p:1:{'g' * 64}",
    ],
)
def test_bad_composite_keys(key: str) -> None:
    with pytest.raises(InvalidIdempotencyKey):
        parse_composite(key)


def test_composite_key_length_limit() -> None:
    longest = f"{'p' * 128}:{'1' * 61}:{HASH}"
    assert len(longest) == 255
    parse_composite(longest)
    with pytest.raises(InvalidIdempotencyKey):
        parse_composite(f"{'p' * 128}:{'1' * 62}:{HASH}")


def test_quoted_keys_are_accepted() -> None:
    assert parse_composite(f'"p:1:{HASH.upper()}"').args_hash == HASH
    assert unquote(r'"a\"b\\c"') == 'a"b\\c'
    assert parse_opaque('"order 17"') == "order 17"


@pytest.mark.parametrize("key", ["", " ", "a" * 256, "tab\there", "é"])
def test_bad_opaque_keys(key: str) -> None:
    with pytest.raises(InvalidIdempotencyKey):
        parse_opaque(key)
