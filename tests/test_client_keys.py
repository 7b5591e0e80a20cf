"""tool_proxy_client.keys and .session: the same digests as the proxy."""

from __future__ import annotations

import random
from typing import Any

import pytest
import rfc8785
from tool_proxy_client import InvalidKey, PlanSession, args_hash, body_hash, canonical_json
from tool_proxy_client import composite_key as client_key

from proxy.keys import composite_key as proxy_key
from tests.test_keys import _CHARS
from tests.vectors import key_vectors


@pytest.mark.parametrize("vector", key_vectors()["vectors"], ids=lambda v: v["canonical"][:40])
def test_the_client_gives_the_shared_vectors(vector: dict[str, Any]) -> None:
    assert canonical_json(vector["arguments"]).decode() == vector["canonical"]
    assert args_hash(vector["arguments"]) == vector["args_hash"]
    assert client_key(vector["plan"], vector["step"], vector["arguments"]) == vector["key"]
    assert (
        PlanSession(vector["plan"]).step(vector["step"]).key(vector["arguments"]) == vector["key"]
    )


@pytest.mark.parametrize("body", key_vectors()["bodies"], ids=lambda b: f"{b['content_type']}")
def test_raw_bodies_hash_as_the_proxy_hashes_them(body: dict[str, Any]) -> None:
    assert body_hash(body["body"].encode(), body["content_type"]) == body["args_hash"]


def _value(depth: int, rng: random.Random) -> Any:
    kind = rng.randrange(8 if depth < 3 else 5)
    if kind == 0:
        return rng.choice([None, True, False])
    if kind == 1:
        return rng.randint(-(2**53) + 1, 2**53 - 1)
    if kind == 2:
        return rng.choice(
            [
                rng.random(),
                rng.uniform(-1e307, 1e307),
                rng.random() * 10.0 ** rng.randint(-300, 300),
            ]
        )
    if kind in (3, 4):
        return "".join(rng.choice(_CHARS) for _ in range(rng.randrange(6)))
    if kind == 5:
        return [_value(depth + 1, rng) for _ in range(rng.randrange(4))]
    names = ["".join(rng.choice(_CHARS) for _ in range(rng.randrange(4))) for _ in range(4)]
    return {name: _value(depth + 1, rng) for name in names}


def test_generated_values_canonicalize_as_rfc8785_does() -> None:
    rng = random.Random(23)
    for _ in range(3000):
        value = _value(0, rng)
        assert canonical_json(value) == bytes(rfc8785.dumps(value)), value


def test_generated_keys_are_the_proxys() -> None:
    rng = random.Random(8785)
    for step in range(300):
        value = {"args": _value(1, rng)}
        try:
            expected = proxy_key("plan-x", step, value)
        except Exception:  # a float the proxy re-reads as an integer beyond 2^53
            continue
        assert client_key("plan-x", step, value) == expected


@pytest.mark.parametrize(
    "arguments",
    [2**53, -(2**53), float("nan"), float("inf"), {1: "a"}, {"a": object()}, "\ud800"],
)
def test_what_rfc8785_has_no_form_for_is_refused(arguments: Any) -> None:
    with pytest.raises(InvalidKey):
        client_key("p", 1, arguments)


def test_a_body_that_repeats_a_member_is_refused() -> None:
    with pytest.raises(InvalidKey, match="repeats"):
        body_hash(b'{"a":1,"a":2}', "application/json")


def test_plan_sessions_and_steps() -> None:
    assert PlanSession.derive("thread-42") == PlanSession.derive("thread-42")
    assert PlanSession.derive("thread-42") != PlanSession.derive("thread-43")
    assert PlanSession.new() != PlanSession.new()
    step = PlanSession("plan-1").step(3)
    assert step.key({"a": 1}) == step.key({"a": 1}) != step.key({"a": 2})
    assert step.sub(2).key({}).startswith("plan-1:3.2:")
    assert step.meta({"a": 1}) == {"idempotencyKey": step.key({"a": 1})}
    with pytest.raises(InvalidKey):
        PlanSession("thread 42")
    with pytest.raises(InvalidKey):
        PlanSession("p").step("call_abc:1")
