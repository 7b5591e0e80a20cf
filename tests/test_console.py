"""The operator console's server-rendered pages and forms, over plain HTTP (no JavaScript),
against a real proxy on every store: sign-in, each view, each change with its CSRF token,
reason and confirmation, the audit events, the headers that keep it safe, the live feed."""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from html import unescape
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from structlog.testing import capture_logs

from proxy.console import CONSOLE_PATH, COOKIE, csrf_token
from tests.conftest import ProxyFactory, new_key, route
from tests.idp import IdentityProvider
from tests.servers import ThreadServer, wait_for
from tests.test_auth import auth_config

TOKEN = "console-operator-7f3a"
BODY = {"account": "acme", "amount": 42}
SCRIPT = "<script>alert('tool')</script>"


class ConsoleTool:
    """A tool for the console's tests. ``/tools/quick?delay=S`` answers JSON after S
    seconds (past the route's timeout: an unknown outcome) with a ``<script>`` in it, a
    secret field and a secret header; ``/tools/jobs`` answers 503 while ``broken``, and
    waits ``hold`` seconds first."""

    def __init__(self) -> None:
        self.broken = True
        self.hold = 0.0
        self.calls = 0
        self.app = Starlette(routes=[Route("/{path:path}", self.handle, methods=["POST"])])

    async def handle(self, request: Request) -> Response:
        self.calls += 1
        if request.url.path.startswith("/tools/jobs"):
            await asyncio.sleep(self.hold)
            if self.broken:
                return Response(b"busy", 503, headers={"Retry-After": "0"})
            return JSONResponse({"done": True})
        await asyncio.sleep(float(request.query_params.get("delay", "0")))
        answer = {"note": SCRIPT, "api_token": "tok-s3cr3t", "ok": True}
        return JSONResponse(answer, 201, headers={"x-api-key": "key-s3cr3t"})


@dataclass
class Setup:
    proxy: ThreadServer
    tool: ConsoleTool

    @property
    def url(self) -> str:
        return self.proxy.url + CONSOLE_PATH

    def call(self, key: str, delay: float = 0, body: Any = BODY) -> httpx.Response:
        return httpx.post(
            f"{self.proxy.url}/tools/quick?delay={delay}",
            json=body,
            headers={"Idempotency-Key": key},
            timeout=20,
        )

    def job(self, body: Any = BODY) -> str:
        answer = httpx.post(
            f"{self.proxy.url}/tools/jobs",
            json=body,
            headers={"Idempotency-Key": new_key(body), "Prefer": "respond-async"},
        )
        assert answer.status_code == 202, answer.text
        return str(answer.json()["id"])


def console_routes(upstream: str) -> list[dict[str, Any]]:
    quick = route(upstream, name="quick", prefix="/tools/quick", timeout="0.5s")
    jobs = route(upstream, name="jobs", prefix="/tools/jobs")
    jobs["async"] = {"attempts": 1, "visibility": "2s"}
    jobs["workers"] = {"concurrency": 1}
    jobs["limits"] = [{"name": "rpm", "key": "route", "rate": "600/1m"}]
    return [quick, jobs]


@pytest.fixture
def console_tool() -> Iterator[ConsoleTool]:
    tool = ConsoleTool()
    server = ThreadServer(tool.app).start()
    tool.url = server.url  # type: ignore[attr-defined]
    yield tool
    server.stop()


def start(
    tool: ConsoleTool, make_proxy: ProxyFactory, store: str, monkeypatch: pytest.MonkeyPatch
) -> Setup:
    monkeypatch.setenv("CONSOLE_ADMIN_TOKEN", TOKEN)
    proxy = make_proxy(
        *console_routes(tool.url),  # type: ignore[attr-defined]
        store=store,
        admin={"token_env": "CONSOLE_ADMIN_TOKEN"},
    )
    return Setup(proxy, tool)


@pytest.fixture
def setup(
    console_tool: ConsoleTool,
    make_proxy: ProxyFactory,
    store_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> Setup:
    """The console on each store (memory, SQLite, Redis)."""
    return start(console_tool, make_proxy, store_url, monkeypatch)


@pytest.fixture
def plain(
    console_tool: ConsoleTool, make_proxy: ProxyFactory, monkeypatch: pytest.MonkeyPatch
) -> Setup:
    """The console on the memory store, for what does not depend on the store."""
    return start(console_tool, make_proxy, "memory://", monkeypatch)


def signed_in() -> dict[str, str]:
    return {"Cookie": f"{COOKIE}={TOKEN}"}


def page(setup: Setup, path: str = "", **params: str) -> httpx.Response:
    return httpx.get(setup.url + path, params=params, headers=signed_in())


def form(
    setup: Setup, path: str, csrf: str | None = None, **fields: str | list[str]
) -> httpx.Response:
    data: dict[str, str | list[str]] = {
        "csrf": csrf_token(TOKEN) if csrf is None else csrf,
        **fields,
    }
    return httpx.post(setup.url + path, data=data, headers=signed_in())


def record_ids(html: str) -> list[str]:
    return re.findall(r'href="/_proxy/console/records/([A-Za-z0-9_-]+)"', html)


def failed_record(setup: Setup, plan: str) -> str:
    assert setup.call(new_key(BODY, 1, plan), delay=1.5).status_code == 504
    (found,) = record_ids(page(setup, "records", plan=plan, state="failed").text)
    return found


# -- access ------------------------------------------------------------------------------


def test_the_console_is_off_without_admin(
    console_tool: ConsoleTool, make_proxy: ProxyFactory
) -> None:
    proxy = make_proxy(*console_routes(console_tool.url))  # type: ignore[attr-defined]
    for path in ("", "login", "records", "static/console.css"):
        assert httpx.get(proxy.url + CONSOLE_PATH + path).status_code == 404


def test_sign_in_with_the_admin_token_sets_a_strict_cookie(plain: Setup) -> None:
    unsigned = httpx.get(plain.url + "plans", params={"plan": "p-1"})
    assert unsigned.status_code == 303
    assert (
        unsigned.headers["location"]
        == CONSOLE_PATH + "login?next=%2F_proxy%2Fconsole%2Fplans%3Fplan%3Dp-1"
    )
    login = httpx.get(plain.proxy.url + unsigned.headers["location"])
    assert login.status_code == 200 and 'type="password"' in login.text
    assert 'value="/_proxy/console/plans?plan=p-1"' in login.text
    back = httpx.post(
        plain.url + "login", data={"token": TOKEN, "next": "/_proxy/console/plans?plan=p-1"}
    )
    assert back.headers["location"] == "/_proxy/console/plans?plan=p-1"
    for elsewhere in ("https://evil.example/", "//evil.example/", "/_proxy/admin/records"):
        away = httpx.post(plain.url + "login", data={"token": TOKEN, "next": elsewhere})
        assert away.headers["location"] == CONSOLE_PATH
    wrong = httpx.post(plain.url + "login", data={"token": "nope"})
    assert wrong.status_code == 401 and "not valid" in wrong.text
    assert "set-cookie" not in wrong.headers
    right = httpx.post(plain.url + "login", data={"token": TOKEN})
    assert right.status_code == 303
    cookie = right.headers["set-cookie"]
    assert cookie.startswith(f"{COOKIE}={TOKEN};")
    assert all(p in cookie for p in ("HttpOnly", "SameSite=strict", f"Path={CONSOLE_PATH}"))
    foreign = httpx.post(
        plain.url + "login", data={"token": TOKEN}, headers={"Origin": "https://evil.example"}
    )
    assert foreign.status_code == 403
    bearer = httpx.get(plain.url + "records", headers={"Authorization": f"Bearer {TOKEN}"})
    assert bearer.status_code == 200
    assert httpx.get(plain.url, headers={"Cookie": f"{COOKIE}=wrong"}).status_code == 303
    wrong_bearer = httpx.get(plain.url, headers={"Authorization": "Bearer wrong"})
    assert wrong_bearer.status_code == 401 and "not valid" in wrong_bearer.text


def test_every_page_is_html_with_a_strict_content_security_policy(plain: Setup) -> None:
    plain.job()
    for path in ("", "records", "plans", "operations", "routes", "login"):
        answer = page(plain, path)
        assert answer.status_code == 200, (path, answer.text)
        assert answer.headers["content-type"].startswith("text/html")
        csp = answer.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "default-src 'none'" in csp
        assert "frame-ancestors 'none'" in csp and "unsafe-inline" not in csp
        assert answer.headers["x-content-type-options"] == "nosniff"
        assert "<script>" not in answer.text  # no inline script: only <script src=...>
        assert '<html lang="en">' in answer.text
    css = page(plain, "static/console.css")
    assert css.headers["content-type"].startswith("text/css")
    assert page(plain, "static/console.js").headers["content-type"].startswith("text/javascript")
    assert page(plain, "static/secrets.txt").status_code == 400


# -- records -----------------------------------------------------------------------------


def test_records_list_failed_first_and_filter(setup: Setup) -> None:
    assert setup.call(new_key(BODY, 1, "plan-ok")).status_code == 201
    failed = failed_record(setup, "plan-bad")
    listed = page(setup, "records").text
    assert record_ids(listed)[0] == failed  # the failed one first, though it is newer
    assert len(record_ids(listed)) == 2
    assert record_ids(page(setup, "records", state="completed").text) != [failed]
    assert record_ids(page(setup, "records", route="jobs").text) == []
    assert record_ids(page(setup, "records", older_than="1h").text) == []
    refused = page(setup, "records", state="weird")
    assert refused.status_code == 400 and "state" in refused.text


def test_a_record_shows_its_answer_as_text_with_secrets_redacted(setup: Setup) -> None:
    assert setup.call(new_key(BODY, 1, "plan-show")).status_code == 201
    (record,) = record_ids(page(setup, "records", plan="plan-show").text)
    html = page(setup, f"records/{record}").text
    assert SCRIPT not in html
    assert "&lt;script&gt;alert(&#39;tool&#39;)&lt;/script&gt;" in html
    assert "tok-s3cr3t" not in html and "key-s3cr3t" not in html
    assert html.count("[redacted]") == 2
    assert "Request fingerprint" in html and "plan-show" in html
    assert "Resolve this unknown outcome" not in html  # completed: nothing to resolve
    assert page(setup, "records/bm9wZQ").status_code == 400
    missing = page(setup, "records/cXVpY2t8fHh8MQBhYmM")
    assert missing.status_code == 404 and "no record" in missing.text


def test_resolve_needs_the_csrf_token_a_reason_and_a_confirmation(setup: Setup) -> None:
    record = failed_record(setup, "plan-resolve")
    path = f"records/{record}/resolve"
    fields = {"as": "completed", "status": "201", "body": '{"db": "orders"}', "confirm": "yes"}
    with capture_logs() as logs:
        assert form(setup, path, csrf="", reason="x", **fields).status_code == 403
        assert form(setup, path, csrf="0" * 64, reason="x", **fields).status_code == 403
        no_reason = form(setup, path, reason=" ", **fields)
        assert no_reason.status_code == 400 and "reason" in no_reason.text
        unconfirmed = form(setup, path, reason="INC-1", **{**fields, "confirm": ""})
        assert unconfirmed.status_code == 400 and "confirm" in unconfirmed.text
        foreign = httpx.post(
            setup.url + path,
            data={"csrf": csrf_token(TOKEN), "reason": "INC-1", **fields},
            headers={**signed_in(), "Origin": "https://evil.example"},
        )
        assert foreign.status_code == 403
    assert not [e for e in logs if e["event"].startswith("admin_")]
    assert "state-failed" in page(setup, f"records/{record}").text
    with capture_logs() as logs:
        done = form(
            setup,
            path,
            reason="INC-1: it ran",
            headers="content-type: application/json",
            **fields,
        )
    assert done.status_code == 303
    assert done.headers["location"].startswith(f"{CONSOLE_PATH}records/{record}?done=")
    (event,) = [e for e in logs if e["event"] == "admin_record_resolved"]
    assert event["admin"] == "token" and event["reason"] == "INC-1: it ran"
    assert event["status"] == 201 and event["plan"] == "plan-resolve"
    shown = page(setup, f"records/{record}", done="resolved").text
    assert "state-completed" in shown and "Done: resolved" in shown
    replay = setup.call(new_key(BODY, 1, "plan-resolve"), delay=1.5)
    assert replay.status_code == 201 and replay.json() == {"db": "orders"}
    assert replay.headers["idempotent-replayed"] == "true"
    again = form(setup, path, reason="again", **fields)
    assert again.status_code == 409 and "only a failed record" in again.text


def test_release_then_delete(setup: Setup) -> None:
    record = failed_record(setup, "plan-release")
    calls = setup.tool.calls
    with capture_logs() as logs:
        released = form(
            setup,
            f"records/{record}/resolve",
            reason="never ran",
            confirm="yes",
            **{"as": "released"},
        )
    assert released.status_code == 303
    assert [e["event"] for e in logs if e["event"].startswith("admin_")] == [
        "admin_record_released"
    ]
    assert page(setup, f"records/{record}").status_code == 404
    assert setup.call(new_key(BODY, 1, "plan-release")).status_code == 201  # runs again
    assert setup.tool.calls == calls + 1
    (record,) = record_ids(page(setup, "records", plan="plan-release").text)
    assert form(setup, f"records/{record}/delete", reason="test data").status_code == 400
    with capture_logs() as logs:
        deleted = form(setup, f"records/{record}/delete", reason="test data", confirm="yes")
    assert deleted.status_code == 303
    assert deleted.headers["location"].startswith(f"{CONSOLE_PATH}records?done=")
    (event,) = [e for e in logs if e["event"] == "admin_record_deleted"]
    assert event["previous_state"] == "completed" and event["reason"] == "test data"
    assert page(setup, f"records/{record}").status_code == 404


# -- plans -------------------------------------------------------------------------------


def test_a_plan_shows_its_steps_and_replans(setup: Setup) -> None:
    plan = "plan-timeline"
    assert setup.call(new_key(BODY, 1, plan)).status_code == 201
    assert setup.call(new_key({"n": 2}, 2, plan), body={"n": 2}, delay=1.5).status_code == 504
    assert setup.call(new_key({"n": 3}, 2, plan), body={"n": 3}).status_code == 201  # replan
    html = page(setup, "plans", plan=plan).text
    assert html.index("Step 1") < html.index("Step 2")
    assert "replanned: 2 args hashes" in html
    assert len(record_ids(html)) == 3
    assert "state-failed" in html and "state-completed" in html
    empty = page(setup, "plans", plan="plan-nothing").text
    assert "No record of plan session" in empty


# -- operations --------------------------------------------------------------------------


def dead_operation(setup: Setup) -> str:
    job = setup.job()
    wait_for(lambda: f'value="{job}"' in page(setup, "operations", state="dead").text)
    return job


def test_a_dead_operation_is_listed_with_its_events_and_requeued(setup: Setup) -> None:
    job = dead_operation(setup)
    detail = page(setup, f"operations/{job}").text
    assert "state-dead" in detail and "#1" in detail and "#3" in detail  # queued, running, dead
    assert "busy" in detail or "503" in detail
    assert form(setup, "operations/requeue", ids=job).status_code == 400  # unconfirmed
    setup.tool.broken = False
    with capture_logs() as logs:
        done = form(setup, "operations/requeue", ids=job, confirm="yes", reason="tool fixed")
    assert done.status_code == 303, done.text
    (event,) = [e for e in logs if e["event"] == "job_requeued"]
    assert event["admin"] == "token" and event["reason"] == "tool fixed"
    wait_for(lambda: "state-completed" in page(setup, f"operations/{job}").text)
    again = form(setup, "operations/requeue", ids=job, confirm="yes")
    assert again.status_code == 409 and "only a dead one" in again.text


def test_queued_operations_are_cancelled_in_bulk(setup: Setup) -> None:
    setup.tool.hold = 1.5  # one worker: the first job holds it, the others wait
    first = setup.job({"n": 1})
    queued = [setup.job({"n": 2}), setup.job({"n": 3})]
    listed = page(setup, "operations", state="queued").text
    assert all(f'value="{j}"' in listed for j in queued)
    with capture_logs() as logs:
        done = form(setup, "operations/cancel", ids=queued, confirm="yes")
    assert done.status_code == 303
    assert len([e for e in logs if e["event"] == "job_cancelled"]) == 2
    cancelled = page(setup, "operations", state="cancelled").text
    assert all(f"operations/{j}" in cancelled for j in queued)
    refused = form(setup, "operations/cancel", ids=first, confirm="yes")
    assert refused.status_code == 409


# -- routes and the live feed ------------------------------------------------------------


def test_routes_show_policies_and_what_is_in_flight(setup: Setup) -> None:
    slow = threading.Thread(target=setup.call, args=(new_key(BODY, 1, "plan-fly"), 0.4))
    slow.start()
    try:
        wait_for(lambda: "<strong>1</strong>" in page(setup, "routes").text)
    finally:
        slow.join()
    html = page(setup, "routes").text
    assert "quick" in html and "jobs" in html and "600/1m" in html and "lock_ttl" in html


def test_the_live_feed_sends_a_region_again_when_it_changes(plain: Setup) -> None:
    shown = page(plain, "records", plan="plan-live").text
    assert "No record matches" in shown
    found = re.search(r'data-live="([^"]+)"', shown)
    assert found is not None and "seen=" in found.group(1)
    live = unescape(found.group(1))
    seen: list[str] = []
    with httpx.stream("GET", plain.proxy.url + live, headers=signed_in()) as feed:
        assert feed.headers["content-type"].startswith("text/event-stream")
        assert "script-src 'self'" in feed.headers["content-security-policy"]
        plain.call(new_key(BODY, 1, "plan-live"))
        for line in feed.iter_lines():  # nothing until the region changes: the page has it
            if line.startswith("data:"):
                seen.append(line)
            elif not line and seen:
                break
    assert "plan-live" in "".join(seen) and "state-completed" in "".join(seen)
    assert httpx.get(plain.url + "live/records").status_code == 303
    assert page(plain, "live/nothing").status_code == 400


def test_sign_out_needs_the_csrf_token(plain: Setup) -> None:
    assert form(plain, "logout", csrf="x").status_code == 403
    out = form(plain, "logout")
    assert out.status_code == 303 and f'{COOKIE}=""' in out.headers["set-cookie"]


def test_operators_sign_in_with_a_jwt_and_a_read_role_only_looks(
    console_tool: ConsoleTool, make_proxy: ProxyFactory, idp: IdentityProvider
) -> None:
    proxy = make_proxy(
        *console_routes(console_tool.url),  # type: ignore[attr-defined]
        auth=auth_config(idp),
        admin={"role": "tool-proxy-admin", "read_role": "tool-proxy-viewer"},
    )
    setup = Setup(proxy, console_tool)
    record = failed_record_as(setup, "plan-jwt", idp.token("ops", roles=["tool-proxy-admin"]))
    viewer = idp.token("val", roles=["tool-proxy-viewer"])
    shown = httpx.get(f"{setup.url}records/{record}", headers={"Cookie": f"{COOKIE}={viewer}"})
    assert shown.status_code == 200 and "(read-only)" in shown.text
    assert "Resolve this unknown outcome" not in shown.text and "read-only role" in shown.text
    fields = {"as": "released", "reason": "no", "confirm": "yes", "csrf": csrf_token(viewer)}
    refused = httpx.post(
        f"{setup.url}records/{record}/resolve",
        data=fields,
        headers={"Cookie": f"{COOKIE}={viewer}"},
    )
    assert refused.status_code == 403 and "tool-proxy-admin" in refused.text
    api = httpx.get(
        f"{proxy.url}/_proxy/admin/records", headers={"Authorization": f"Bearer {viewer}"}
    )
    assert api.status_code == 403  # the read role is the console's views only
    nobody = idp.token("eve", roles=["reader"])
    assert httpx.post(setup.url + "login", data={"token": nobody}).status_code == 403
    ops = idp.token("ops", roles=["tool-proxy-admin"])
    with capture_logs() as logs:
        done = httpx.post(
            f"{setup.url}records/{record}/resolve",
            data={**fields, "csrf": csrf_token(ops)},
            headers={"Cookie": f"{COOKIE}={ops}"},
        )
    assert done.status_code == 303
    (event,) = [e for e in logs if e["event"] == "admin_record_released"]
    assert event["admin"] == f"jwt iss={idp.issuer} sub=ops"


def failed_record_as(setup: Setup, plan: str, token: str) -> str:
    assert setup.call(new_key(BODY, 1, plan), delay=1.5).status_code == 504
    listed = httpx.get(
        setup.url + "records", params={"plan": plan}, headers={"Cookie": f"{COOKIE}={token}"}
    )
    (found,) = record_ids(listed.text)
    return found


def test_an_offloaded_body_is_linked_as_a_download(
    console_tool: ConsoleTool,
    make_proxy: ProxyFactory,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CONSOLE_ADMIN_TOKEN", TOKEN)
    (tmp_path / "objects").mkdir()
    proxy = make_proxy(
        *console_routes(console_tool.url),  # type: ignore[attr-defined]
        admin={"token_env": "CONSOLE_ADMIN_TOKEN"},
        offload={"url": f"file://{tmp_path}/objects", "threshold_bytes": 10},
    )
    setup = Setup(proxy, console_tool)
    answer = setup.call(new_key(BODY, 1, "plan-big"))
    assert answer.status_code == 201
    (record,) = record_ids(page(setup, "records", plan="plan-big").text)
    shown = page(setup, f"records/{record}").text
    assert "offloaded to object storage" in shown and SCRIPT not in shown
    assert f'href="{CONSOLE_PATH}records/{record}/body" download' in shown
    body = page(setup, f"records/{record}/body")
    assert body.status_code == 200 and body.content == answer.content
    assert body.headers["content-type"] == "application/octet-stream"
    assert body.headers["content-disposition"].startswith("attachment")
    assert httpx.get(f"{setup.url}records/{record}/body").status_code == 303  # signed in only
