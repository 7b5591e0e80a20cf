"""Caller authentication against a real JWKS endpoint with real keys."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import jwt
import pytest

from proxy.auth.callers import Authenticator, principal_of
from proxy.config import parse_config
from proxy.errors import Unauthorized
from tests.conftest import ProxyFactory, new_key, route
from tests.idp import AUDIENCE, IdentityProvider
from tests.servers import CountingTool, free_port

BODY = {"db": "orders"}


def auth_config(idp: IdentityProvider, **issuer: Any) -> dict[str, Any]:
    spec = {
        "issuer": idp.issuer,
        "jwks_url": f"{idp.url}/jwks",
        "audiences": [AUDIENCE],
        "algorithms": ["RS256", "ES256"],
        "leeway": "5s",
        **issuer,
    }
    if "discovery" in issuer:
        spec.pop("jwks_url")
    return {"issuers": [spec], "principal": ["iss", "sub"]}


def call(url: str, token: str | None, key: str | None = None) -> httpx.Response:
    headers = {"Idempotency-Key": key or new_key(BODY)}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    return httpx.post(url, json=BODY, headers=headers)


def test_valid_tokens_pass_and_records_are_scoped_by_principal(
    tool: CountingTool, make_proxy: ProxyFactory, idp: IdentityProvider
) -> None:
    proxy = make_proxy(route(tool.url, auth={"required": True}), auth=auth_config(idp))
    key = new_key(BODY)
    alice = call(f"{proxy.url}/tools/db", idp.token("alice"), key)
    alice_again = call(f"{proxy.url}/tools/db", idp.token("alice"), key)  # a refreshed token
    bob = call(f"{proxy.url}/tools/db", idp.token("bob"), key)
    assert alice.status_code == alice_again.status_code == bob.status_code == 200
    assert alice_again.headers["idempotent-replayed"] == "true"
    assert "idempotent-replayed" not in bob.headers  # bob never gets alice's response
    assert tool.count(key) == 2


def test_a_token_without_a_principal_claim_is_refused_not_pooled(
    tool: CountingTool, make_proxy: ProxyFactory, idp: IdentityProvider
) -> None:
    """``principal: [tid]``: two tokens without a ``tid`` would be one principal (one
    record, one private cache), nor would two whose ``tid`` is empty: each is a 401, and
    nothing runs."""
    auth = {**auth_config(idp), "principal": ["tid"]}
    proxy = make_proxy(route(tool.url, auth={"required": True}), auth=auth)
    key = new_key(BODY)
    alice = call(f"{proxy.url}/tools/db", idp.token("alice"), key)
    bob = call(f"{proxy.url}/tools/db", idp.token("bob"), key)
    empty = [call(f"{proxy.url}/tools/db", idp.token(who, tid=""), key) for who in ("a", "b")]
    for refused in (alice, bob, *empty):
        assert refused.status_code == 401, refused.text
        assert refused.headers["content-type"] == "application/problem+json"
        assert '"tid"' in refused.json()["detail"]
    tenant = call(f"{proxy.url}/tools/db", idp.token("alice", tid="t-1"), key)
    assert tenant.status_code == 200
    assert tool.count(key) == 1


def test_opaque_keys_are_scoped_by_principal(
    tool: CountingTool, make_proxy: ProxyFactory, idp: IdentityProvider
) -> None:
    """One opaque key from two principals is two operations; from one, a replay."""
    spec = route(tool.url, auth={"required": True}, key="opaque")
    proxy = make_proxy(spec, auth=auth_config(idp))
    key = "9b2e1c4e-1d7f-4a51-9a3c-2f0b8c6d7e10"
    alice = call(f"{proxy.url}/tools/db", idp.token("alice"), key)
    bob = call(f"{proxy.url}/tools/db", idp.token("bob"), key)
    alice_again = call(f"{proxy.url}/tools/db", idp.token("alice"), key)
    assert alice.status_code == bob.status_code == alice_again.status_code == 200
    assert "idempotent-replayed" not in bob.headers  # executed for bob too
    assert (alice.json()["execution"], bob.json()["execution"]) == (1, 2)
    assert alice_again.headers["idempotent-replayed"] == "true"
    assert alice_again.json() == alice.json()  # alice's own answer, not bob's
    assert tool.count(key) == 2


@pytest.mark.parametrize(
    "mutate",
    [
        "expired",
        "wrong-audience",
        "wrong-issuer",
        "alg-none",
        "hs-confusion",
        "tampered",
        "no-sub",
        "unknown-kid",
        "garbage",
    ],
)
def test_invalid_tokens_are_401(
    tool: CountingTool, make_proxy: ProxyFactory, idp: IdentityProvider, mutate: str
) -> None:
    proxy = make_proxy(route(tool.url, auth={"required": True}), auth=auth_config(idp))
    token = bad_token(idp, mutate)
    response = call(f"{proxy.url}/tools/db", token)
    assert response.status_code == 401, mutate
    assert response.headers["www-authenticate"] == 'Bearer error="invalid_token"'
    assert response.json()["type"].endswith("invalid-token")
    assert tool.total == 0


def bad_token(idp: IdentityProvider, mutate: str) -> str:
    now = int(time.time())
    if mutate == "expired":
        return idp.token(exp=now - 60, iat=now - 600)
    if mutate == "wrong-audience":
        return idp.token(aud="someone-else")
    if mutate == "wrong-issuer":
        return idp.token(iss="https://evil.example")
    if mutate == "no-sub":
        return idp.token(sub=None)
    if mutate == "alg-none":
        claims = jwt.decode(idp.token(), options={"verify_signature": False})
        return jwt.encode(claims, key=None, algorithm="none")  # type: ignore[arg-type]
    if mutate == "hs-confusion":
        return idp.hs256_signed_with_public_key()
    if mutate == "tampered":
        head, body, signature = idp.token().split(".")
        return f"{head}.{body}.{signature[:-4]}AAAA"
    if mutate == "unknown-kid":
        other = IdentityProvider()
        other.url = idp.url
        return other.token()
    return "not.a.jwt"


def test_missing_token_on_a_required_route(
    tool: CountingTool, make_proxy: ProxyFactory, idp: IdentityProvider
) -> None:
    proxy = make_proxy(route(tool.url, auth={"required": True}), auth=auth_config(idp))
    response = call(f"{proxy.url}/tools/db", None)
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"
    optional = make_proxy(route(tool.url, auth={"required": False}), auth=auth_config(idp))
    assert call(f"{optional.url}/tools/db", None).status_code == 200


def test_key_rotation_refetches_once_and_floods_do_not_amplify(
    tool: CountingTool, make_proxy: ProxyFactory, idp: IdentityProvider
) -> None:
    proxy = make_proxy(route(tool.url, auth={"required": True}), auth=auth_config(idp))
    assert call(f"{proxy.url}/tools/db", idp.token()).status_code == 200
    assert idp.jwks_hits == 1
    new_kid = idp.rotate("ES256")
    # a rotated key is refetched on demand, but at most once per interval: the first
    # fetch was just now, so the new kid is still unknown
    assert call(f"{proxy.url}/tools/db", idp.token(kid=new_kid)).status_code == 401
    for _ in range(20):
        call(f"{proxy.url}/tools/db", bad_token(idp, "unknown-kid"))
    assert idp.jwks_hits == 1


def test_unknown_kid_after_the_interval_fetches_the_new_keys(
    idp: IdentityProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("proxy.auth.jwks.REFETCH_INTERVAL_SECONDS", 0.0)
    config = parse_config(
        {"auth": auth_config(idp), "routes": [route("http://127.0.0.1:9")]}, env={}
    )
    assert config.auth is not None

    async def run() -> tuple[str, str]:
        authenticator = Authenticator(config.auth)  # type: ignore[arg-type]
        first = await authenticator.validate(idp.token("alice"))
        kid = idp.rotate("ES256")
        second = await authenticator.validate(idp.token("alice", kid=kid))
        await authenticator.close()
        return first.principal, second.principal

    first, second = asyncio.run(run())
    assert first == second == principal_of({"iss": idp.issuer, "sub": "alice"}, ["iss", "sub"])
    assert idp.jwks_hits == 2


def test_discovery_and_idp_down(idp: IdentityProvider) -> None:
    config = parse_config(
        {"auth": auth_config(idp, discovery=True), "routes": [route("http://127.0.0.1:9")]},
        env={},
    )
    down = parse_config(
        {
            "auth": {
                "issuers": [
                    {
                        "issuer": idp.issuer,
                        "jwks_url": f"http://127.0.0.1:{free_port()}/jwks",
                        "audiences": [AUDIENCE],
                    }
                ]
            },
            "routes": [route("http://127.0.0.1:9")],
        },
        env={},
    )

    async def run() -> None:
        found = Authenticator(config.auth)  # type: ignore[arg-type]
        assert (await found.validate(idp.token("carol"))).claims["sub"] == "carol"
        await found.close()
        unreachable = Authenticator(down.auth)  # type: ignore[arg-type]
        from proxy.errors import IdentityProviderUnavailable

        with pytest.raises(IdentityProviderUnavailable):
            await unreachable.validate(idp.token("carol"))
        await unreachable.close()

    asyncio.run(run())


def test_config_refuses_symmetric_algorithms_and_auth_without_issuers() -> None:
    from proxy.errors import ConfigError

    with pytest.raises(ConfigError, match="HS256"):
        parse_config(
            {
                "auth": {
                    "issuers": [
                        {
                            "issuer": "https://i",
                            "jwks_url": "https://i/j",
                            "audiences": ["a"],
                            "algorithms": ["HS256"],
                        }
                    ]
                },
                "routes": [route("http://h")],
            },
            env={},
        )
    with pytest.raises(ConfigError, match="needs a top-level auth section"):
        parse_config({"routes": [route("http://h", auth={"required": True})]}, env={})


def test_unauthorized_is_a_problem_with_a_challenge() -> None:
    error = Unauthorized("no", error="invalid_token")
    assert error.status == 401
    assert error.headers == {"WWW-Authenticate": 'Bearer error="invalid_token"'}
