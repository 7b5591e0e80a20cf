from __future__ import annotations

import hashlib
import json
import random
from typing import Any

import pytest
import rfc8785

from proxy.errors import BodyNotCanonicalizable, InvalidIdempotencyKey, InvalidJSONBody
from proxy.keys import (
    Canonicalization,
    canonical_body,
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


# Characters that matter to JSON escaping and to key order: controls, quote, backslash,
# slash, DEL, Latin-1, the top of the BMP (sorts after surrogates in UTF-16), astral.
_CHARS = (
    [chr(c) for c in range(0x20)]
    + list('"\\/ azAZ09')
    + ["\x7f", "é", "ÿ", "Ā", "中", "\u2028", "\ue000", "\uffef", "😀", "\U0001d11e"]
)


def _text(rng: random.Random) -> str:
    return "".join(rng.choice(_CHARS) for _ in range(rng.randint(0, 6)))


def _value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(9 if depth < 3 else 6)
    if kind == 0:
        return rng.choice([None, True, False])
    if kind == 1:
        limit = 2**53 - 1
        return rng.choice([0, -1, 7, limit, -limit, limit + 1, -(2**60), rng.randint(-999, 999)])
    if kind == 2:
        return rng.choice([0.0, -0.0, 1.0, 0.1, 1e21, 1e-7, 123.456, -2.5e-300, 5e-324])
    if kind in (3, 4, 5):
        return _text(rng)
    if kind in (6, 7):
        return {_text(rng): _value(rng, depth + 1) for _ in range(rng.randint(0, 4))}
    return [_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]


def _reference(body: bytes) -> bytes | type[Exception]:
    try:
        return bytes(rfc8785.dumps(json.loads(body)))
    except rfc8785.CanonicalizationError:
        return BodyNotCanonicalizable


def _ours(body: bytes) -> bytes | type[Exception]:
    try:
        return canonical_body(body, JCS)
    except BodyNotCanonicalizable:
        return BodyNotCanonicalizable


def test_canonical_body_agrees_with_rfc8785_on_generated_values() -> None:
    """The stdlib fast path and the rfc8785 fallback give the reference bytes, always."""
    rng = random.Random(8785)
    fast = 0
    for _ in range(3000):
        value = _value(rng)
        encodings = [
            json.dumps(value).encode(),  # ASCII, \\u escapes (surrogate pairs for astral)
            json.dumps(value, ensure_ascii=False, indent=1).encode(),  # raw UTF-8
            json.dumps(value, ensure_ascii=False).encode("utf-16"),  # detected by json
        ]
        for body in encodings:
            assert _ours(body) == _reference(body), body
        fast += "." not in json.dumps(value) and "e" not in json.dumps(value).lower()
    assert fast > 300  # the generator does reach the fast path, often


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b'{"b": 1, "a": "x"}', b'{"a":"x","b":1}'),
        (b'{"a": 1.50}', b'{"a":1.5}'),
        (b'{"a": 1E2}', b'{"a":100}'),
        ('{"\ue000": 1, "😀": 2}'.encode(), '{"😀":2,"\ue000":1}'.encode()),
        (b'{"\\ud83d\\ude00": 2, "\\ue000": 1}', '{"😀":2,"\ue000":1}'.encode()),
        (b'"\\u001F\\u0008"', b'"\\u001f\\b"'),
    ],
)
def test_canonical_body_examples(body: bytes, expected: bytes) -> None:
    assert canonical_body(body, JCS) == expected


@pytest.mark.parametrize("body", [b"NaN", b"[Infinity]", b"9007199254740992", b'"\\ud800"'])
def test_canonical_body_refuses_what_rfc8785_refuses(body: bytes) -> None:
    with pytest.raises(BodyNotCanonicalizable):
        canonical_body(body, JCS)


def test_canonical_body_refuses_text_that_is_not_json() -> None:
    with pytest.raises(InvalidJSONBody):
        canonical_body(b"{not json", JCS)


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
