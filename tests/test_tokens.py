"""Downstream tokens against a real token endpoint: client credentials, exchange, OBO."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.auth.tokens import DownstreamTokens
from proxy.config import parse_config
from proxy.errors import ConfigError, IdentityProviderUnavailable
from tests.conftest import ProxyFactory, new_key, route
from tests.idp import AUDIENCE, IdentityProvider
from tests.servers import CountingTool, ProxyProcess, ThreadServer, free_port, wait_for

BODY = {"db": "orders"}
SECRET_ENV = "TOOL_PROXY_TEST_CLIENT_SECRET"


@pytest.fixture(autouse=True)
def client_secret(idp: IdentityProvider, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SECRET_ENV, idp.client_secret)


def auth_section(idp: IdentityProvider) -> dict[str, Any]:
    return {
        "issuers": [{"issuer": idp.issuer, "jwks_url": f"{idp.url}/jwks", "audiences": [AUDIENCE]}]
    }


def token_route(
    tool: CountingTool, idp: IdentityProvider, mode: str, **extra: Any
) -> dict[str, Any]:
    spec = route(tool.url)
    if mode != "client_credentials":
        spec["auth"] = {"required": True}
    spec["token"] = {
        "mode": mode,
        "token_endpoint": extra.pop("endpoint", f"{idp.url}/token"),
        "client_id": "tool-proxy",
        "client_secret_env": SECRET_ENV,
        "audience": "provisioning-api",
        "scope": "db.write",
        **extra,
    }
    return spec


def call(url: str, token: str | None = None, key: str | None = None) -> httpx.Response:
    headers = {"Idempotency-Key": key or new_key(BODY)}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return httpx.post(url, json=BODY, headers=headers)


def forwarded_token(tool: CountingTool) -> str:
    return str(tool.requests[-1]["headers"]["authorization"]).removeprefix("Bearer ")


def test_client_credentials_is_fetched_once_and_forwarded(
    tool: CountingTool, make_proxy: ProxyFactory, idp: IdentityProvider
) -> None:
    proxy = make_proxy(token_route(tool, idp, "client_credentials"))
    for _ in range(3):
        assert call(f"{proxy.url}/tools/db").status_code == 200
    assert forwarded_token(tool) == "dt-1-machine"
    [grant] = idp.grants
    assert grant["grant_type"] == "client_credentials"
    assert (grant["audience"], grant["scope"], grant["client_id"]) == (
        "provisioning-api",
        "db.write",
        "tool-proxy",
    )


def test_token_exchange_per_principal(
    tool: CountingTool, make_proxy: ProxyFactory, idp: IdentityProvider
) -> None:
    proxy = make_proxy(token_route(tool, idp, "token_exchange"), auth=auth_section(idp))
    alice = idp.token("alice")
    assert call(f"{proxy.url}/tools/db", alice).status_code == 200
    assert forwarded_token(tool) == "dt-1-alice"
    assert call(f"{proxy.url}/tools/db", idp.token("alice")).status_code == 200
    assert call(f"{proxy.url}/tools/db", idp.token("bob")).status_code == 200
    assert forwarded_token(tool) == "dt-2-bob"
    assert len(idp.grants) == 2
    first = idp.grants[0]
    assert first["grant_type"] == "urn:ietf:params:oauth:grant-type:token-exchange"
    assert first["subject_token"] == alice
    assert first["subject_token_type"] == "urn:ietf:params:oauth:token-type:access_token"


@pytest.mark.parametrize("shared", [False, True], ids=["in-process", "shared-cache"])
@pytest.mark.parametrize("mode", ["token_exchange", "obo"])
def test_users_sharing_a_coarse_principal_get_their_own_tokens(
    tool: CountingTool,
    make_proxy: ProxyFactory,
    idp: IdentityProvider,
    monkeypatch: pytest.MonkeyPatch,
    mode: str,
    shared: bool,
) -> None:
    """``principal: [tid]`` scopes records by tenant; the token cache is still per user."""
    import base64
    import os

    auth: dict[str, Any] = {**auth_section(idp), "principal": ["tid"]}
    if shared:
        monkeypatch.setenv("TOOL_PROXY_TEST_TOKEN_KEY", base64.b64encode(os.urandom(32)).decode())
        auth["token_cache_key_env"] = "TOOL_PROXY_TEST_TOKEN_KEY"
    proxy = make_proxy(token_route(tool, idp, mode), auth=auth)
    assert call(f"{proxy.url}/tools/db", idp.token("alice", tid="t1")).status_code == 200
    assert forwarded_token(tool) == "dt-1-alice"
    assert call(f"{proxy.url}/tools/db", idp.token("bob", tid="t1")).status_code == 200
    assert forwarded_token(tool) == "dt-2-bob"  # never alice's
    assert call(f"{proxy.url}/tools/db", idp.token("alice", tid="t1")).status_code == 200
    assert forwarded_token(tool) == "dt-1-alice"  # hers, from the cache
    assert len(idp.grants) == 2


@pytest.mark.parametrize("mode", ["token_exchange", "obo"])
def test_a_token_from_wider_scopes_is_never_reused_for_a_narrower_one(
    tool: CountingTool, make_proxy: ProxyFactory, idp: IdentityProvider, mode: str
) -> None:
    proxy = make_proxy(token_route(tool, idp, mode), auth=auth_section(idp))
    narrow = idp.token("alice", scope="db.read")
    assert call(f"{proxy.url}/tools/db", idp.token("alice", scope="db.read db.write")).is_success
    assert forwarded_token(tool) == "dt-1-alice"
    assert call(f"{proxy.url}/tools/db", narrow).is_success
    assert forwarded_token(tool) == "dt-2-alice"  # exchanged from the narrow token
    assert narrow in (idp.grants[1].get("subject_token"), idp.grants[1].get("assertion"))
    again = idp.token("alice", scope="db.read db.write", iat=int(time.time()) - 5)
    assert call(f"{proxy.url}/tools/db", again).is_success  # another token, the same grant
    assert forwarded_token(tool) == "dt-1-alice"
    other_client = idp.token("alice", scope="db.read", azp="another-agent")
    assert call(f"{proxy.url}/tools/db", other_client).is_success
    assert forwarded_token(tool) == "dt-3-alice"
    assert len(idp.grants) == 3


def test_the_token_cache_keeps_at_most_max_entries_least_recently_used_first(
    tool: CountingTool, make_proxy: ProxyFactory, idp: IdentityProvider
) -> None:
    auth = {**auth_section(idp), "token_cache_entries": 2}
    proxy = make_proxy(token_route(tool, idp, "token_exchange"), auth=auth)
    seen = []
    for who in ("alice", "bob", "alice", "carol", "alice", "bob"):
        assert call(f"{proxy.url}/tools/db", idp.token(who)).is_success
        seen.append(forwarded_token(tool))
    # carol evicted bob (alice was used since): bob's token is fetched again, alice's kept
    assert seen == ["dt-1-alice", "dt-2-bob", "dt-1-alice", "dt-3-carol", "dt-1-alice", "dt-4-bob"]
    with pytest.raises(ConfigError, match="token_cache_entries"):
        parse_config({"auth": {**auth_section(idp), "token_cache_entries": 0}}, env={})


def test_a_refresh_token_held_for_one_user_does_not_let_another_in(
    tool: CountingTool, make_proxy: ProxyFactory, idp: IdentityProvider
) -> None:
    """An expired caller token passes only on its own user's refresh token, not on one
    held for another user of the same (coarse) principal."""
    import time

    idp.issue_refresh_tokens = True
    auth = {**auth_section(idp), "principal": ["tid"]}
    proxy = make_proxy(token_route(tool, idp, "token_exchange", use_refresh_tokens=True), auth=auth)
    now = int(time.time())
    assert call(f"{proxy.url}/tools/db", idp.token("alice", tid="t1")).status_code == 200
    expired_bob = idp.token("bob", tid="t1", exp=now - 120, iat=now - 600)
    refused = call(f"{proxy.url}/tools/db", expired_bob)
    assert refused.status_code == 401
    assert forwarded_token(tool) == "dt-1-alice"  # bob's call never reached the tool


def test_obo_uses_the_jwt_bearer_grant(
    tool: CountingTool, make_proxy: ProxyFactory, idp: IdentityProvider
) -> None:
    proxy = make_proxy(token_route(tool, idp, "obo"), auth=auth_section(idp))
    caller = idp.token("carol")
    assert call(f"{proxy.url}/tools/db", caller).status_code == 200
    [grant] = idp.grants
    assert grant["grant_type"] == "urn:ietf:params:oauth:grant-type:jwt-bearer"
    assert grant["assertion"] == caller
    assert grant["requested_token_use"] == "on_behalf_of"
    assert forwarded_token(tool) == "dt-1-carol"


def test_upstream_401_gets_a_new_token_once(
    tool: CountingTool, make_proxy: ProxyFactory, idp: IdentityProvider
) -> None:
    proxy = make_proxy(token_route(tool, idp, "client_credentials", retry_on_401=True))
    assert call(f"{proxy.url}/tools/db").status_code == 200
    tool.reject_tokens.add("dt-1-machine")  # the tool revoked it early
    key = new_key(BODY, step=2)
    response = call(f"{proxy.url}/tools/db", key=key)
    assert response.status_code == 200
    assert forwarded_token(tool) == "dt-2-machine"
    assert tool.count(key) == 1


def test_upstream_401_is_the_tools_answer_unless_retry_on_401(
    tool: CountingTool, make_proxy: ProxyFactory, idp: IdentityProvider
) -> None:
    """A guarded call is never sent twice by default: the 401 is recorded and replayed;
    the refused token is dropped, so the next call gets a new one."""
    proxy = make_proxy(token_route(tool, idp, "client_credentials"))
    assert call(f"{proxy.url}/tools/db").status_code == 200
    tool.reject_tokens.add("dt-1-machine")
    key = new_key(BODY, step=2)
    assert call(f"{proxy.url}/tools/db", key=key).status_code == 401
    assert len(idp.grants) == 1  # no second token: the call was not sent again
    replay = call(f"{proxy.url}/tools/db", key=key)
    assert (replay.status_code, replay.headers["idempotent-replayed"]) == (401, "true")
    assert len(idp.grants) == 1
    assert call(f"{proxy.url}/tools/db", key=new_key(BODY, step=3)).status_code == 200
    assert forwarded_token(tool) == "dt-2-machine"


def test_upstream_401_gets_a_new_token_with_the_shared_cache_too(
    tool: CountingTool,
    make_proxy: ProxyFactory,
    idp: IdentityProvider,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The refused token is still in the store the replicas share: it is not taken again."""
    import base64
    import os

    key_env = "TOOL_PROXY_TEST_TOKEN_KEY"
    monkeypatch.setenv(key_env, base64.b64encode(os.urandom(32)).decode())
    auth = {**auth_section(idp), "token_cache_key_env": key_env}
    route_spec = token_route(tool, idp, "client_credentials", retry_on_401=True)
    proxy = make_proxy(route_spec, auth=auth)
    assert call(f"{proxy.url}/tools/db").status_code == 200
    tool.reject_tokens.add("dt-1-machine")
    key = new_key(BODY, step=2)
    response = call(f"{proxy.url}/tools/db", key=key)
    assert response.status_code == 200
    assert forwarded_token(tool) == "dt-2-machine"
    assert tool.count(key) == 1
    assert call(f"{proxy.url}/tools/db").status_code == 200  # and it stays the new one
    assert forwarded_token(tool) == "dt-2-machine"


def test_idp_refusal_is_401_reauth_and_releases_the_key(
    tool: CountingTool, make_proxy: ProxyFactory, idp: IdentityProvider
) -> None:
    proxy = make_proxy(token_route(tool, idp, "token_exchange"), auth=auth_section(idp))
    idp.refuse_with = "interaction_required"
    key = new_key(BODY)
    refused = call(f"{proxy.url}/tools/db", idp.token("alice"), key)
    assert refused.status_code == 401
    assert refused.json()["type"].endswith("reauth-required")
    assert "interaction_required" in refused.json()["detail"]
    assert tool.total == 0
    idp.refuse_with = None
    assert call(f"{proxy.url}/tools/db", idp.token("alice"), key).status_code == 200  # released
    assert tool.count(key) == 1


def test_idp_down_is_503_and_nothing_is_forwarded(
    tool: CountingTool, make_proxy: ProxyFactory, idp: IdentityProvider
) -> None:
    down = f"http://127.0.0.1:{free_port()}/token"
    proxy = make_proxy(token_route(tool, idp, "client_credentials", endpoint=down))
    response = call(f"{proxy.url}/tools/db")
    assert response.status_code == 503
    assert response.headers["retry-after"] == "1"
    assert response.json()["type"].endswith("identity-provider-unavailable")
    assert tool.total == 0


def tokens_for(idp: IdentityProvider, clock: list[float], **extra: Any) -> DownstreamTokens:
    tool = CountingTool()
    tool.url = "http://127.0.0.1:9"
    config = parse_config(
        {"auth": auth_section(idp), "routes": [token_route(tool, idp, "token_exchange", **extra)]},
        env={},
    )
    return DownstreamTokens(list(config.routes), clock=lambda: clock[0])


def test_a_late_drop_of_a_refused_token_keeps_the_newer_one(idp: IdentityProvider) -> None:
    """Two requests got a 401 for the same token: the second drop must not throw away the
    token the first one already fetched."""
    tokens = tokens_for(idp, [1000.0])
    subject = idp.token("alice")

    async def run() -> list[str]:
        first = await tokens.token("tool", "p-alice", subject)
        tokens.drop("tool", "p-alice", subject, first)  # the first 401
        second = await tokens.token("tool", "p-alice", subject)
        tokens.drop("tool", "p-alice", subject, first)  # the second 401, for the same old token
        third = await tokens.token("tool", "p-alice", subject)
        await tokens.close()
        return [first, second, third]

    assert asyncio.run(run()) == ["dt-1-alice", "dt-2-alice", "dt-2-alice"]
    assert len(idp.grants) == 2


def test_hundred_concurrent_requests_at_expiry_cause_one_exchange(idp: IdentityProvider) -> None:
    clock = [1000.0]
    tokens = tokens_for(idp, clock)
    subject = idp.token("alice")

    async def run() -> set[str]:
        first = await tokens.token("tool", "p-alice", subject)
        clock[0] += 300  # the cached token has expired
        again = await asyncio.gather(
            *(tokens.token("tool", "p-alice", subject) for _ in range(100))
        )
        await tokens.close()
        return {first, *again}

    assert asyncio.run(run()) == {"dt-1-alice", "dt-2-alice"}
    assert len(idp.grants) == 2


def test_tokens_are_renewed_ahead_of_expiry(idp: IdentityProvider) -> None:
    idp.token_lifetime = 100
    clock = [0.0]
    tokens = tokens_for(idp, clock, refresh_ahead=0.8)
    subject = idp.token("alice")

    async def run() -> list[str]:
        seen = [await tokens.token("tool", "p", subject)]
        clock[0] = 79.0
        seen.append(await tokens.token("tool", "p", subject))  # still before 80 %
        clock[0] = 81.0
        seen.append(await tokens.token("tool", "p", subject))  # renewed, though still valid
        await tokens.close()
        return seen

    assert asyncio.run(run()) == ["dt-1-alice", "dt-1-alice", "dt-2-alice"]


def test_a_valid_token_outlives_a_short_idp_outage(
    idp_server: tuple[IdentityProvider, ThreadServer],
) -> None:
    idp, server = idp_server
    idp.token_lifetime = 100
    clock = [0.0]
    tokens = tokens_for(idp, clock)
    subject = idp.token("alice")

    async def run() -> None:
        assert await tokens.token("tool", "p", subject) == "dt-1-alice"
        server.stop()  # the IdP goes away
        clock[0] = 85.0  # time to renew, but the current token is good for 15 s more
        assert await tokens.token("tool", "p", subject) == "dt-1-alice"
        clock[0] = 95.0  # inside the last 10 s: no longer used
        with pytest.raises(IdentityProviderUnavailable):
            await tokens.token("tool", "p", subject)
        await tokens.close()

    asyncio.run(run())


def test_secrets_and_tokens_never_reach_the_logs(
    tool: CountingTool, idp: IdentityProvider, tmp_path: Path
) -> None:
    config = {
        "store": {"url": f"sqlite://{tmp_path}/state.db"},
        "auth": auth_section(idp),
        "routes": [token_route(tool, idp, "token_exchange")],
    }
    proxy = ProxyProcess(config, tmp_path, env={SECRET_ENV: idp.client_secret}).start()
    caller = idp.token("alice")
    try:
        assert call(f"{proxy.url}/tools/db", caller).status_code == 200
        idp.refuse_with = "invalid_grant"
        assert call(f"{proxy.url}/tools/db", idp.token("bob")).status_code == 401
    finally:
        proxy.stop()
    text = proxy.log_text()
    assert '"event": "request"' in text
    for secret in (idp.client_secret, caller, "dt-1-alice"):
        assert secret not in text


def test_missing_client_secret_is_a_config_error(idp: IdentityProvider, tmp_path: Path) -> None:
    import subprocess
    import sys

    import yaml

    tool = CountingTool()
    tool.url = "http://127.0.0.1:9"
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"routes": [token_route(tool, idp, "client_credentials")]}))
    result = subprocess.run(
        [sys.executable, "-m", "proxy.cli", "check-config", str(path)],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin"},
        timeout=60,
    )
    assert result.returncode == 2
    assert f"routes[0].token.client_secret_env: environment variable {SECRET_ENV}" in result.stderr


def test_replicas_share_one_exchange_through_redis_sealed(
    tool: CountingTool, idp: IdentityProvider, redis_url: str, tmp_path: Path
) -> None:
    import base64
    import os
    import socket

    key_env = "TOOL_PROXY_TEST_TOKEN_KEY"
    auth = {**auth_section(idp), "token_cache_key_env": key_env}
    config = {
        "store": {"url": redis_url},
        "auth": auth,
        "routes": [token_route(tool, idp, "token_exchange")],
    }
    env = {SECRET_ENV: idp.client_secret, key_env: base64.b64encode(os.urandom(32)).decode()}
    proxies = [ProxyProcess(config, tmp_path, env=env).start() for _ in range(2)]
    caller = idp.token("alice")

    async def storm() -> list[int]:
        async with httpx.AsyncClient(timeout=30) as client:
            responses = await asyncio.gather(
                *(
                    client.post(
                        f"{proxies[i % 2].url}/tools/db",
                        json=BODY,
                        headers={
                            "Idempotency-Key": new_key(BODY, step=i),
                            "Authorization": f"Bearer {caller}",
                        },
                    )
                    for i in range(40)
                )
            )
        return [r.status_code for r in responses]

    try:
        assert asyncio.run(storm()) == [200] * 40
    finally:
        for proxy in proxies:
            proxy.stop()
    assert len(idp.grants) == 1  # one exchange for both replicas and 40 requests
    port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"KEYS tp:v:*\r\n")
        listing = sock.recv(65536)
        name = next(line for line in listing.split(b"\r\n") if line.startswith(b"tp:v:"))
        sock.sendall(b"GET " + name + b"\r\n")
        stored = sock.recv(65536)
    assert b"dt-1-alice" not in stored and len(stored) > 40  # sealed at rest


def test_refresh_tokens_renew_without_the_callers_token(idp: IdentityProvider) -> None:
    idp.token_lifetime = 100
    idp.issue_refresh_tokens = True
    clock = [0.0]
    tokens = tokens_for(idp, clock, use_refresh_tokens=True)

    async def run() -> tuple[str, str, bool]:
        first = await tokens.token("tool", "p", idp.token("alice"))
        clock[0] = 90.0  # due for renewal; the caller's token has expired by now
        expired = idp.token("alice", exp=1, iat=0)  # a token granting the same
        second = await tokens.token("tool", "p", expired)
        can = await tokens.can_refresh("tool", "p", expired)
        await tokens.close()
        return first, second, can

    assert asyncio.run(run()) == ("dt-1-alice", "dt-2-alice", True)
    assert idp.grants[1]["grant_type"] == "refresh_token"
    assert idp.grants[1]["refresh_token"] == "rt-1-alice"


def test_an_expired_caller_token_passes_only_with_a_refresh_token(
    tool: CountingTool, make_proxy: ProxyFactory, idp: IdentityProvider
) -> None:
    import time

    idp.issue_refresh_tokens = True
    proxy = make_proxy(
        token_route(tool, idp, "token_exchange", use_refresh_tokens=True), auth=auth_section(idp)
    )
    now = int(time.time())
    assert call(f"{proxy.url}/tools/db", idp.token("alice")).status_code == 200
    expired_alice = idp.token("alice", exp=now - 120, iat=now - 600)
    assert call(f"{proxy.url}/tools/db", expired_alice).status_code == 200  # the plan goes on
    expired_bob = idp.token("bob", exp=now - 120, iat=now - 600)
    refused = call(f"{proxy.url}/tools/db", expired_bob)
    assert refused.status_code == 401
    assert "expired" in refused.json()["detail"]
    forged = idp.token("alice", exp=now - 120, iat=now - 600, aud="someone-else")
    assert call(f"{proxy.url}/tools/db", forged).status_code == 401


def test_token_exchange_sends_the_actor_token(
    tool: CountingTool,
    make_proxy: ProxyFactory,
    idp: IdentityProvider,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TOOL_PROXY_TEST_ACTOR", "agent-identity-token")
    proxy = make_proxy(
        token_route(tool, idp, "token_exchange", actor_token_env="TOOL_PROXY_TEST_ACTOR"),
        auth=auth_section(idp),
    )
    assert call(f"{proxy.url}/tools/db", idp.token("alice")).status_code == 200
    [grant] = idp.grants
    assert grant["actor_token"] == "agent-identity-token"
    assert grant["actor_token_type"] == "urn:ietf:params:oauth:token-type:access_token"


# -- deferred calls (routes with async: the token is had when the job sends the call) ------


@pytest.mark.parametrize("mode", ["client_credentials", "token_exchange"])
def test_a_long_call_gets_its_downstream_token_when_it_is_sent(
    tool: CountingTool, make_proxy: ProxyFactory, idp: IdentityProvider, mode: str
) -> None:
    spec = token_route(tool, idp, mode)
    spec["async"] = {"mode": "always", "visibility": "2s"}
    proxy = make_proxy(spec, auth=auth_section(idp))
    alice = idp.token("alice")
    accepted = httpx.post(
        f"{proxy.url}/tools/db",
        json=BODY,
        headers={"Idempotency-Key": new_key(BODY), "Authorization": f"Bearer {alice}"},
    )
    assert accepted.status_code == 202, accepted.text
    location = accepted.headers["location"]
    wait_for(lambda: httpx.get(proxy.url + location, headers=_bearer(alice)).status_code == 303)
    expected = "dt-1-machine" if mode == "client_credentials" else "dt-1-alice"
    assert forwarded_token(tool) == expected  # the route's token, never the caller's
    if mode == "token_exchange":
        assert idp.grants[0]["subject_token"] == alice


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}
