from __future__ import annotations

import hashlib
import json
import random
from typing import Any

import pytest
import rfc8785

from proxy.config import DEFAULT_MAX_JSON_DEPTH
from proxy.errors import (
    BodyNotCanonicalizable,
    DuplicateJSONMember,
    InvalidIdempotencyKey,
    InvalidJSONBody,
)
from proxy.keys import (
    Canonicalization,
    canonical_body,
    canonical_json,
    composite_key,
    fingerprint,
    json_depth,
    parse_composite,
    parse_opaque,
    unquote,
)
from tests.vectors import key_vectors

JCS = Canonicalization.JCS
PY = Canonicalization.PYTHON_JSON
HASH = "ab" * 32
DEPTH = DEFAULT_MAX_JSON_DEPTH


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
        return canonical_body(body, JCS, DEPTH)
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
    assert canonical_body(body, JCS, DEPTH) == expected


@pytest.mark.parametrize("body", [b"NaN", b"[Infinity]", b"9007199254740992", b'"\\ud800"'])
def test_canonical_body_refuses_what_rfc8785_refuses(body: bytes) -> None:
    with pytest.raises(BodyNotCanonicalizable):
        canonical_body(body, JCS, DEPTH)


def test_canonical_body_refuses_text_that_is_not_json() -> None:
    with pytest.raises(InvalidJSONBody):
        canonical_body(b"{not json", JCS, DEPTH)


def test_fingerprint_rules() -> None:
    assert fingerprint(b"", "application/json", JCS, DEPTH) == sha(b"")
    assert fingerprint(b'{"b":1, "a":2}', "application/json", JCS, DEPTH) == sha(b'{"a":2,"b":1}')
    assert fingerprint(b'{"b":1}', "application/vnd.api+json; charset=utf-8", JCS, DEPTH) == sha(
        b'{"b":1}'
    )
    assert fingerprint(b'{"b":1, "a":2}', None, JCS, DEPTH) == sha(b'{"a":2,"b":1}')
    assert fingerprint(b"not json", None, JCS, DEPTH) == sha(b"not json")
    assert fingerprint(b'{"b":1, "a":2}', "text/plain", JCS, DEPTH) == sha(b'{"b":1, "a":2}')
    with pytest.raises(InvalidJSONBody):
        fingerprint(b"{nope", "application/json", JCS, DEPTH)


def _nested(depth: int) -> bytes:
    """Objects and arrays in turn, ``depth`` deep."""
    opens = [b'{"a":' if level % 2 else b"[" for level in range(depth)]
    closes = [b"}" if level % 2 else b"]" for level in reversed(range(depth))]
    return b"".join([*opens, b"1", *closes])


def _depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


@pytest.mark.parametrize("mode", [JCS, PY])
def test_a_body_nested_deeper_than_the_limit_is_invalid_json(mode: Canonicalization) -> None:
    assert json_depth(_nested(8)) == 8
    assert canonical_body(_nested(8), mode, 8)
    with pytest.raises(InvalidJSONBody, match="deeper than 8"):
        canonical_body(_nested(9), mode, 8)
    attack = b"[" * 1000 + b"]" * 1000  # a 2 KB body that made the decoders recurse 1000 deep
    with pytest.raises(InvalidJSONBody):
        fingerprint(attack, "application/json", mode, DEPTH)
    with pytest.raises(InvalidJSONBody):  # no limit: Python's own, still a 400
        fingerprint(b"[" * 100_000 + b"]" * 100_000, "application/json", mode, None)
    assert fingerprint(attack, None, mode, DEPTH) == sha(attack)  # not JSON to the proxy


def test_brackets_in_strings_do_not_count_towards_the_depth() -> None:
    body = json.dumps({"text": "[{" * 300 + '\\" ]]', "list": [[1]]}).encode()
    assert json_depth(body) == 3
    assert canonical_body(body, JCS, 3) == rfc8785.dumps(json.loads(body))
    utf16 = json.dumps({"a": [[[1]]], "t": "[[[[[["}).encode("utf-16")
    assert canonical_body(utf16, JCS, 4)
    with pytest.raises(InvalidJSONBody):
        canonical_body(utf16, JCS, 3)


def test_json_depth_is_the_nesting_of_generated_values() -> None:
    rng = random.Random(7493)
    for _ in range(1000):
        value = _value(rng)
        for body in (json.dumps(value).encode(), json.dumps(value, ensure_ascii=False).encode()):
            assert json_depth(body) == _depth(value), body


@pytest.mark.parametrize(
    "body",
    [
        b'{"amount":1,"amount":1000}',  # the stdlib fast path
        b'{"amount":1.5,"amount":1000}',  # a float: the rfc8785 path
        b'{"a":1,"\\u0061":2}',  # the same name once unescaped
        b'[{"x":{"k":true,"k":false}}]',  # nested
    ],
)
@pytest.mark.parametrize("mode", [JCS, PY])
@pytest.mark.parametrize("content_type", ["application/json", None])
def test_duplicate_member_names_are_refused(
    body: bytes, mode: Canonicalization, content_type: str | None
) -> None:
    with pytest.raises(DuplicateJSONMember):
        fingerprint(body, content_type, mode, DEPTH)


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


@pytest.mark.parametrize("vector", key_vectors()["vectors"], ids=lambda v: v["canonical"][:40])
def test_composite_key_gives_the_shared_vectors(vector: dict[str, Any]) -> None:
    key = composite_key(vector["plan"], vector["step"], vector["arguments"])
    assert canonical_json(vector["arguments"], JCS).decode() == vector["canonical"]
    assert key == vector["key"]
    assert key.rsplit(":", 1)[1] == vector["args_hash"] == sha(vector["canonical"].encode())


@pytest.mark.parametrize("body", key_vectors()["bodies"], ids=lambda b: f"{b['content_type']}")
def test_fingerprint_gives_the_shared_body_vectors(body: dict[str, Any]) -> None:
    digest = fingerprint(body["body"].encode(), body["content_type"], JCS, DEPTH)
    assert digest == body["args_hash"]
