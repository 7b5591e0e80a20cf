"""The steps endpoint and the admin records API, against real servers on every store."""

from __future__ import annotations

import asyncio
import base64
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.requests import Request
from starlette.responses import Response
from structlog.testing import capture_logs

from proxy.config import parse_config
from proxy.errors import ConfigError
from tests.conftest import ProxyFactory, new_key, route
from tests.idp import IdentityProvider
from tests.servers import CountingTool, ThreadServer, wait_for
from tests.test_auth import auth_config

ADMIN_TOKEN = "adm-7c1f0e9b2d"
BODY = {"db": "orders"}


class StallingTool(CountingTool):
    """A CountingTool that stalls 2 s (past the quick route's timeout) on the first call of
    each key in ``stall_once``: the same request, retried, then gets through."""

    def __init__(self) -> None:
        super().__init__()
        self.stall_once: set[str] = set()

    async def handle(self, request: Request) -> Response:
        key = request.headers.get("idempotency-key", "")
        if key in self.stall_once:
            self.stall_once.discard(key)
            await asyncio.sleep(2)
        return await super().handle(request)


@pytest.fixture
def tool() -> Iterator[StallingTool]:
    stalling = StallingTool()
    server = ThreadServer(stalling.app).start()
    stalling.url = server.url
    yield stalling
    server.stop()


@pytest.fixture
def admin_file(tmp_path: Path) -> str:
    path = tmp_path / "admin-token"
    path.write_text(ADMIN_TOKEN + "\n")
    return str(path)


def admin(token: str = ADMIN_TOKEN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def post(
    proxy: ThreadServer, path: str, key: str, token: str | None = None, body: Any = BODY
) -> httpx.Response:
    headers = {"Idempotency-Key": key, **(bearer(token) if token else {})}
    return httpx.post(f"{proxy.url}{path}", json=body, headers=headers, timeout=20)


def routes(tool: CountingTool, **extra: Any) -> list[dict[str, Any]]:
    """A quick route (timeout 0.5 s: a delayed call becomes FAILED) and a patient one."""
    return [
        route(tool.url, name="quick", prefix="/tools/quick", timeout="0.5s", **extra),
        route(tool.url, name="slow", prefix="/tools/slow", **extra),
    ]


@pytest.fixture
def three_steps(
    tool: CountingTool, make_proxy: ProxyFactory, idp: IdentityProvider, store_url: str
) -> Iterator[tuple[ThreadServer, str]]:
    """A plan of alice's: step 1 completed, step 2 failed (timeout), step 3 in progress."""
    proxy = make_proxy(
        *routes(tool, auth={"required": True}), store=store_url, auth=auth_config(idp)
    )
    plan = "plan-steps"
    alice = idp.token("alice")
    assert post(proxy, "/tools/quick", new_key(BODY, 1, plan), alice).status_code == 200
    assert post(proxy, "/tools/quick?delay=2", new_key(BODY, 2, plan), alice).status_code == 504
    key3 = new_key({"n": 3}, 3, plan)
    slow = threading.Thread(
        target=post, args=(proxy, "/tools/slow?delay=1.5", key3, alice, {"n": 3})
    )
    slow.start()
    wait_for(lambda: tool.arrived[key3] == 1, what="step 3 to reach the tool")
    yield proxy, plan
    slow.join()


def test_steps_lists_every_step_of_the_callers_plan(
    three_steps: tuple[ThreadServer, str], idp: IdentityProvider
) -> None:
    proxy, plan = three_steps
    replay = post(proxy, "/tools/quick", new_key(BODY, 1, plan), idp.token("alice"))
    assert replay.headers["idempotent-replayed"] == "true"
    answer = httpx.get(f"{proxy.url}/_proxy/sessions/{plan}/steps", headers=bearer(idp.token()))
    assert answer.status_code == 200, answer.text
    assert answer.json()["plan_session_id"] == plan
    steps = {s["step"]: s for s in answer.json()["steps"]}
    assert [s["step"] for s in answer.json()["steps"]] == ["1", "2", "3"]
    assert steps["1"]["route"] == "quick" and steps["3"]["route"] == "slow"
    assert (steps["1"]["state"], steps["1"]["status"], steps["1"]["replayable"]) == (
        "completed",
        200,
        True,
    )
    assert (steps["2"]["state"], steps["2"]["status"], steps["2"]["replayable"]) == (
        "failed",
        504,
        False,
    )
    assert steps["2"]["problem"] == "urn:tool-proxy:problem:outcome-unknown"
    assert steps["2"]["lapsed"] is False
    assert (steps["1"]["replays"], steps["2"]["replays"], steps["3"]["replays"]) == (1, 0, 0)
    assert (steps["3"]["state"], steps["3"]["status"]) == ("in_progress", None)
    assert steps["1"]["args_hash"] == new_key(BODY, 1, plan).rsplit(":", 1)[1]
    assert steps["1"]["created_at"].endswith("Z") and steps["1"]["updated_at"].endswith("Z")


def test_steps_are_scoped_by_principal(
    three_steps: tuple[ThreadServer, str], idp: IdentityProvider
) -> None:
    proxy, plan = three_steps
    url = f"{proxy.url}/_proxy/sessions/{plan}/steps"
    bob = httpx.get(url, headers=bearer(idp.token("bob")))
    assert bob.status_code == 404
    assert bob.json()["type"] == "urn:tool-proxy:problem:plan-not-found"
    nobody = httpx.get(url)
    assert nobody.status_code == 401
    assert nobody.headers["www-authenticate"] == "Bearer"
    forged = httpx.get(url, headers=bearer(idp.token(aud="someone-else")))
    assert forged.status_code == 401
    bad = httpx.get(f"{proxy.url}/_proxy/sessions/no%20spaces/steps", headers=bearer(idp.token()))
    assert bad.status_code == 400
    assert bad.json()["detail"].startswith("plan_session_id:")


def test_steps_of_anonymous_routes_and_unknown_plans(
    tool: CountingTool, make_proxy: ProxyFactory
) -> None:
    proxy = make_proxy(route(tool.url))
    key = new_key(BODY, 7, "plan-anon")
    assert post(proxy, "/tools/x", key).status_code == 200
    steps = httpx.get(f"{proxy.url}/_proxy/sessions/plan-anon/steps").json()["steps"]
    assert [(s["step"], s["state"], s["replayable"]) for s in steps] == [("7", "completed", True)]
    missing = httpx.get(f"{proxy.url}/_proxy/sessions/plan-other/steps")
    assert missing.status_code == 404


# -- the admin API ---------------------------------------------------------------------


@pytest.fixture
def admin_proxy(
    tool: CountingTool, make_proxy: ProxyFactory, store_url: str, admin_file: str
) -> ThreadServer:
    return make_proxy(*routes(tool), store=store_url, admin={"token_file": admin_file})


def records(proxy: ThreadServer, **query: Any) -> httpx.Response:
    return httpx.get(f"{proxy.url}/_proxy/admin/records", params=query, headers=admin())


def one(proxy: ThreadServer, **query: Any) -> dict[str, Any]:
    found = records(proxy, **query).json()["records"]
    assert len(found) == 1, found
    return dict(found[0])


def resolve(proxy: ThreadServer, record: str, **body: Any) -> httpx.Response:
    url = f"{proxy.url}/_proxy/admin/records/{record}/resolve"
    return httpx.post(url, json=body, headers=admin())


def test_admin_lists_with_filters_and_pages(admin_proxy: ThreadServer) -> None:
    for plan, steps in (("plan-a", 3), ("plan-b", 2)):
        for step in range(1, steps + 1):
            assert post(admin_proxy, "/tools/slow", new_key(BODY, step, plan)).status_code == 200
    post(admin_proxy, "/tools/quick?delay=2", new_key(BODY, 1, "plan-c"))
    seen: list[str] = []
    cursor: str | None = ""
    pages = 0
    while cursor is not None:
        page = records(admin_proxy, limit=2, cursor=cursor).json()
        assert len(page["records"]) <= 2
        seen += [r["id"] for r in page["records"]]
        cursor, pages = page["next_cursor"], pages + 1
    assert len(seen) == len(set(seen)) == 6 and pages >= 3
    assert len(records(admin_proxy, plan="plan-a").json()["records"]) == 3
    assert one(admin_proxy, state="failed")["plan"] == "plan-c"
    assert one(admin_proxy, route="quick")["route"] == "quick"
    assert len(records(admin_proxy, newer_than="1h").json()["records"]) == 6
    assert records(admin_proxy, older_than="1h").json()["records"] == []
    scoped = records(admin_proxy, route="slow", principal="", plan="plan-a", limit=2).json()
    assert [r["step"] for r in scoped["records"]] == ["1", "2"]
    rest = records(
        admin_proxy, route="slow", principal="", plan="plan-a", cursor=scoped["next_cursor"]
    )
    assert [r["step"] for r in rest.json()["records"]] == ["3"]
    assert rest.json()["next_cursor"] is None
    for bad, field in (
        ({"state": "done"}, "state"),
        ({"older_than": "soon"}, "older_than"),
        ({"limit": "0"}, "limit"),
        ({"cursor": "!!"}, "cursor"),
        ({"colour": "red"}, "colour"),
    ):
        refused = records(admin_proxy, **bad)
        assert refused.status_code == 400, bad
        assert refused.json()["detail"].startswith(f"{field}:")


def test_admin_refuses_cursors_and_bodies_it_cannot_read(admin_proxy: ThreadServer) -> None:
    """A cursor holding a lone surrogate (no store can take it) or nested past the JSON
    parser's recursion, and a JSON body nested so, are 400s naming them, not 500s."""
    for text in ('{"s": "\\ud800", "a": ""}', '{"s": "", "a": "\\udfff"}', "[" * 3000 + "]" * 3000):
        cursor = base64.urlsafe_b64encode(text.encode()).rstrip(b"=").decode()
        refused = records(admin_proxy, cursor=cursor)
        assert refused.status_code == 400, text[:30]
        assert refused.json()["detail"].startswith("cursor:"), refused.json()
    deep = b"[" * 5000 + b"]" * 5000
    url = f"{admin_proxy.url}/_proxy/admin/records/c2xvdHx8fC0AbmFtZQ"
    headers = {**admin(), "content-type": "application/json"}
    for answer in (
        httpx.post(url + "/resolve", content=deep, headers=headers),
        httpx.request("DELETE", url, content=deep, headers=headers),
    ):
        assert answer.status_code == 400, answer.text
        assert answer.json()["type"] == "urn:tool-proxy:problem:invalid-json-body"
    lone = b'{"as": "released", "reason": "\\ud800"}'  # JSON reads it; no store keeps it
    refused = httpx.post(url + "/resolve", content=lone, headers=headers)
    assert refused.status_code == 400, refused.text
    assert refused.json()["detail"].startswith("reason:")


def test_admin_shows_a_record_with_and_without_its_body(admin_proxy: ThreadServer) -> None:
    post(admin_proxy, "/tools/slow", new_key(BODY, 1, "plan-show"))
    listed = one(admin_proxy, plan="plan-show")
    url = f"{admin_proxy.url}/_proxy/admin/records/{listed['id']}"
    plain = httpx.get(url, headers=admin()).json()
    assert plain.pop("ttl_seconds") > 3500 and listed.pop("ttl_seconds") > 3500
    assert plain == listed and "response" not in plain
    full = httpx.get(url, params={"body": "true"}, headers=admin()).json()
    assert full["response"]["status"] == 200
    assert ["x-tool", "counting"] in full["response"]["headers"]
    assert full["response"]["body_encoding"] == "utf-8"
    assert '"execution": 1' in full["response"]["body"]
    assert httpx.get(url + "x", headers=admin()).status_code in (400, 404)
    assert httpx.get(url, params={"body": "maybe"}, headers=admin()).status_code == 400


def test_resolved_as_completed_is_replayed_without_calling_the_tool(
    admin_proxy: ThreadServer, tool: CountingTool
) -> None:
    key = new_key(BODY, 1, "plan-resolve")
    assert post(admin_proxy, "/tools/quick?delay=2", key).status_code == 504
    failed = one(admin_proxy, plan="plan-resolve")
    with capture_logs() as logs:
        answer = resolve(
            admin_proxy,
            failed["id"],
            **{"as": "completed", "status": 201, "headers": {"content-type": "application/json"}},
            body='{"db": "created by hand"}',
            reason="checked the tool: the database exists",
        )
    assert answer.status_code == 200, answer.text
    assert answer.json()["record"]["state"] == "completed"
    assert answer.json()["record"]["replayable"] is True
    arrived = tool.arrived[key]
    retry = post(admin_proxy, "/tools/quick?delay=2", key)
    assert (retry.status_code, retry.json()) == (201, {"db": "created by hand"})
    assert retry.headers["idempotent-replayed"] == "true"
    assert tool.arrived[key] == arrived == 1
    (event,) = [e for e in logs if e["event"] == "admin_record_resolved"]
    assert event["log_level"] == "warning" and event["admin"] == "token"
    assert event["reason"] == "checked the tool: the database exists"
    assert (event["record"], event["status"], event["step"]) == (failed["id"], 201, "1")
    again = resolve(admin_proxy, failed["id"], **{"as": "released"}, reason="oops")
    assert again.status_code == 409
    assert again.json()["type"] == "urn:tool-proxy:problem:record-not-failed"


def test_resolved_as_released_lets_the_next_retry_execute(
    admin_proxy: ThreadServer, tool: StallingTool
) -> None:
    key = new_key(BODY, 1, "plan-release")
    tool.stall_once.add(key)
    assert post(admin_proxy, "/tools/quick", key).status_code == 504
    failed = one(admin_proxy, plan="plan-release")
    assert post(admin_proxy, "/tools/quick", key).status_code == 504  # replayed, not run
    with capture_logs() as logs:
        answer = resolve(admin_proxy, failed["id"], **{"as": "released"}, reason="never ran")
    assert answer.status_code == 200, answer.text
    assert [e["event"] for e in logs if e["event"].startswith("admin_")] == [
        "admin_record_released"
    ]
    retry = post(admin_proxy, "/tools/quick", key)
    assert retry.status_code == 200 and "idempotent-replayed" not in retry.headers
    assert post(admin_proxy, "/tools/quick", key).headers["idempotent-replayed"] == "true"


def test_resolve_refuses_other_states_and_bad_input(admin_proxy: ThreadServer) -> None:
    post(admin_proxy, "/tools/slow", new_key(BODY, 1, "plan-done"))
    done = one(admin_proxy, plan="plan-done")["id"]
    conflict = resolve(admin_proxy, done, **{"as": "completed", "status": 200}, reason="x")
    assert conflict.status_code == 409
    for body, field in (
        ({"as": "released"}, "reason"),
        ({"as": "maybe", "reason": "r"}, "as"),
        ({"as": "completed", "reason": "r"}, "status"),
        ({"as": "completed", "status": 99, "reason": "r"}, "status"),
        ({"as": "completed", "status": 200, "headers": {"a b": "c"}, "reason": "r"}, "headers"),
        ({"as": "completed", "status": 200, "headers": {"a": "x\r\ny"}, "reason": "r"}, "headers"),
        ({"as": "completed", "status": 200, "body_base64": "%%", "reason": "r"}, "body_base64"),
        ({"as": "released", "status": 200, "reason": "r"}, "status"),
        ({"as": "released", "reason": "r", "extra": 1}, "extra"),
    ):
        refused = resolve(admin_proxy, done, **body)
        assert refused.status_code == 400, body
        assert refused.json()["detail"].startswith(f"{field}:"), refused.json()
    lone = b'{"as": "completed", "status": 200, "reason": "r", "body": "\\ud800"}'  # a surrogate
    url = f"{admin_proxy.url}/_proxy/admin/records/{done}/resolve"
    refused = httpx.post(url, content=lone, headers={**admin(), "content-type": "application/json"})
    assert refused.status_code == 400
    assert refused.json()["detail"].startswith("body:"), refused.json()
    missing = resolve(admin_proxy, "c2xvdHx8fC0AbmFtZQ", **{"as": "released"}, reason="r")
    assert missing.status_code == 404
    assert missing.json()["type"] == "urn:tool-proxy:problem:record-not-found"


def test_admin_deletes_a_record_with_a_reason(
    admin_proxy: ThreadServer, tool: CountingTool
) -> None:
    key = new_key(BODY, 1, "plan-delete")
    post(admin_proxy, "/tools/slow", key)
    record = one(admin_proxy, plan="plan-delete")["id"]
    url = f"{admin_proxy.url}/_proxy/admin/records/{record}"
    no_reason = httpx.delete(url, headers=admin())
    assert no_reason.status_code == 400 and no_reason.json()["detail"].startswith("reason:")
    with capture_logs() as logs:
        deleted = httpx.delete(url, params={"reason": "test data"}, headers=admin())
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True
    (event,) = [e for e in logs if e["event"] == "admin_record_deleted"]
    assert (event["reason"], event["previous_state"]) == ("test data", "completed")
    assert httpx.get(url, headers=admin()).status_code == 404
    assert (
        httpx.request("DELETE", url, json={"reason": "again"}, headers=admin()).status_code == 404
    )
    assert post(admin_proxy, "/tools/slow", key).json()["execution"] == 2


def test_admin_needs_configuring_and_a_valid_token(
    tool: CountingTool, make_proxy: ProxyFactory, admin_file: str
) -> None:
    plain = make_proxy(route(tool.url))
    assert httpx.get(f"{plain.url}/_proxy/admin/records", headers=admin()).status_code == 404
    proxy = make_proxy(route(tool.url), admin={"token_file": admin_file})
    url = f"{proxy.url}/_proxy/admin/records"
    for headers in ({}, admin("wrong"), {"Authorization": f"Basic {ADMIN_TOKEN}"}):
        refused = httpx.get(url, headers=headers)
        assert refused.status_code == 401, headers
        assert refused.headers["www-authenticate"].startswith("Bearer")
        assert refused.headers["content-type"] == "application/problem+json"
    assert httpx.get(url, headers=admin()).status_code == 200


def test_admin_by_jwt_role(
    tool: CountingTool, make_proxy: ProxyFactory, idp: IdentityProvider
) -> None:
    proxy = make_proxy(
        route(tool.url, name="quick", timeout="0.5s"),
        auth=auth_config(idp),
        admin={"role": "tool-proxy-admin"},
    )
    url = f"{proxy.url}/_proxy/admin/records"
    operator = bearer(idp.token("ops", roles=["tool-proxy-admin"]))
    assert httpx.get(url, headers=operator).status_code == 200
    lacking = httpx.get(url, headers=bearer(idp.token("eve", roles=["reader"])))
    assert lacking.status_code == 403
    assert lacking.json()["type"] == "urn:tool-proxy:problem:forbidden"
    assert httpx.get(url, headers=bearer(idp.token(aud="other"))).status_code == 401
    assert httpx.get(url, headers=admin()).status_code == 401
    post(proxy, "/tools/x?delay=2", new_key(BODY, 1, "plan-jwt"))
    failed = httpx.get(url, headers=operator).json()["records"][0]["id"]
    with capture_logs() as logs:
        answer = httpx.post(
            f"{url}/{failed}/resolve", json={"as": "released", "reason": "r"}, headers=operator
        )
    assert answer.status_code == 200
    (event,) = [e for e in logs if e["event"] == "admin_record_released"]
    assert event["admin"] == f"jwt iss={idp.issuer} sub=ops"


def test_an_operator_token_needs_no_principal_claim(
    tool: CountingTool, make_proxy: ProxyFactory, idp: IdentityProvider
) -> None:
    """``principal: [sub, tid]`` scopes callers' records; an operator's token (a service
    account without a tenant) scopes none, and signs in without ``tid``; a caller's
    token without it is a 401 on the tool's route."""
    auth = {**auth_config(idp), "principal": ["sub", "tid"]}
    proxy = make_proxy(
        route(tool.url, auth={"required": True}),
        auth=auth,
        admin={"role": "tool-proxy-admin"},
    )
    operator = bearer(idp.token("ops", roles=["tool-proxy-admin"]))
    assert httpx.get(f"{proxy.url}/_proxy/admin/records", headers=operator).status_code == 200
    key = new_key(BODY, 1, "plan-tenantless")
    caller = {**bearer(idp.token("alice")), "Idempotency-Key": key}
    assert httpx.post(f"{proxy.url}/tools/x", json=BODY, headers=caller).status_code == 401
    assert tool.count(key) == 0


def test_admin_config_is_validated(tmp_path: Path) -> None:
    base = {"routes": [route("http://127.0.0.1:9")]}
    for admin_section, expected in (
        ({"role": "ops"}, "admin.role: needs a top-level auth section"),
        ({}, "set exactly one of token_env, token_file and role"),
        ({"token_env": "A", "role": "ops"}, "set exactly one of"),
        ({"token_env": "A", "colour": 1}, "admin.colour: unknown key"),
    ):
        with pytest.raises(ConfigError) as caught:
            parse_config({**base, "admin": admin_section}, env={})
        assert any(expected in p for p in caught.value.problems), caught.value.problems
    config = parse_config({**base, "admin": {"token_env": "TP_NO_SUCH_VAR"}}, env={})
    from proxy.admin import AdminAuth, load_admin_token

    with pytest.raises(ConfigError) as missing:
        AdminAuth(config.admin, None)  # type: ignore[arg-type]
    assert missing.value.problems == [
        "admin.token_env: environment variable TP_NO_SUCH_VAR is empty or not set"
    ]
    secret = tmp_path / "t"
    secret.write_text("s3cret-admin\n")
    loaded = load_admin_token(parse_config({**base, "admin": {"token_file": str(secret)}}).admin)  # type: ignore[arg-type]
    assert str(loaded) == "s3cret-admin" and "s3cret" not in repr(loaded)
