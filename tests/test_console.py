"""The operator console's server-rendered pages and forms, over plain HTTP (no JavaScript),
against a real proxy on every store: sign-in, each view, each change with its CSRF token,
reason and confirmation, the audit events, the headers that keep it safe, the live feed,
the routes' limits, pauses and locks as the store holds them.

One proxy per store serves the whole module (each test its own plan sessions, keys and
routes' data), and one more on memory for what does not depend on the store; the tests
that need another configuration (no admin, JWTs, offload) start their own."""

from __future__ import annotations

import asyncio
import base64
import re
import threading
from collections import Counter
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

from proxy import console
from proxy.config import LimitConfig
from proxy.console import CONSOLE_PATH, COOKIE, csrf_token, limit_now, pauses_now
from proxy.store.buckets import Entry, GroupState
from tests.conftest import STORES, ProxyFactory, new_key, proxies, route, shared_store_url
from tests.idp import IdentityProvider
from tests.servers import ThreadServer, wait_for
from tests.test_auth import auth_config

TOKEN = "console-operator-7f3a"
TOKEN_ENV = "CONSOLE_ADMIN_TOKEN"
BODY = {"account": "acme", "amount": 42}
SCRIPT = "<script>alert('tool')</script>"


def _forget_cookies(response: httpx.Response) -> None:
    HTTP.cookies.clear()  # each request says who it is itself (a sign-in sets one)


# One client for every request of the tests (a new one per request costs ~40 ms: its SSL
# context), keeping no cookie and no connection between requests (proxies stop cleanly).
HTTP = httpx.Client(
    timeout=20,
    limits=httpx.Limits(max_keepalive_connections=0),
    event_hooks={"response": [_forget_cookies]},
)
# Seconds between two looks of a live region in these tests (2 s in production).
LIVE_SECONDS = 0.1
# An unknown outcome: the tool answers after this, past the quick route's timeout.
LATE = 1.0


class ConsoleTool:
    """A tool for the console's tests. ``/tools/quick?delay=S`` answers JSON after S
    seconds (past the route's timeout: an unknown outcome) with a ``<script>`` in it, a
    secret field and a secret header; ``/tools/jobs`` answers 503 while ``broken``;
    ``/tools/paced?status=429`` asks to slow down for 30 s; ``/tools/jobs`` and
    ``/tools/locked`` wait while ``holding`` (at most 10 s)."""

    def __init__(self) -> None:
        self.url = ""
        self.broken = True
        self.holding = False
        self.keys: Counter[str] = Counter()
        self.app = Starlette(routes=[Route("/{path:path}", self.handle, methods=["POST"])])

    def reset(self) -> None:
        self.broken, self.holding = True, False

    async def handle(self, request: Request) -> Response:
        self.keys[request.headers.get("idempotency-key", "")] += 1
        path = request.url.path
        if path.startswith(("/tools/jobs", "/tools/locked")):
            await self._released()
        if path.startswith("/tools/jobs"):
            if self.broken:
                return Response(b"busy", 503, headers={"Retry-After": "0"})
            return JSONResponse({"done": True})
        if request.query_params.get("status") == "429":
            return Response(b"slow down", 429, headers={"Retry-After": "30"})
        await asyncio.sleep(float(request.query_params.get("delay", "0")))
        answer = {"note": SCRIPT, "api_token": "tok-s3cr3t", "ok": True}
        return JSONResponse(answer, 201, headers={"x-api-key": "key-s3cr3t"})

    async def _released(self) -> None:
        for _ in range(1000):
            if not self.holding:
                return
            await asyncio.sleep(0.01)


@dataclass
class Setup:
    proxy: ThreadServer
    tool: ConsoleTool

    @property
    def url(self) -> str:
        return self.proxy.url + CONSOLE_PATH

    def call(
        self,
        key: str,
        delay: float = 0,
        body: Any = BODY,
        path: str = "quick",
        status: str = "",
        caller: str | None = None,
    ) -> httpx.Response:
        """A call of the tool; ``caller``: its ``x-caller`` (the paced route's key)."""
        headers = {"Idempotency-Key": key, **({"x-caller": caller} if caller else {})}
        return HTTP.post(
            f"{self.proxy.url}/tools/{path}?delay={delay}&status={status}",
            json=body,
            headers=headers,
        )

    def job(self, body: Any = BODY) -> str:
        answer = HTTP.post(
            f"{self.proxy.url}/tools/jobs",
            json=body,
            headers={"Idempotency-Key": new_key(body), "Prefer": "respond-async"},
        )
        assert answer.status_code == 202, answer.text
        return str(answer.json()["id"])


def console_routes(upstream: str) -> list[dict[str, Any]]:
    quick = route(upstream, name="quick", prefix="/tools/quick", timeout="0.3s")
    jobs = route(upstream, name="jobs", prefix="/tools/jobs")
    jobs["async"] = {"attempts": 1, "visibility": "2s"}
    jobs["workers"] = {"concurrency": 1}
    jobs["limits"] = [{"name": "rpm", "key": "route", "rate": "600/1m"}]
    paced = route(upstream, name="paced", prefix="/tools/paced")
    paced["limits"] = [
        {"name": "route-rate", "key": "route", "rate": "5/1m"},
        {"name": "caller-rate", "key": "header:x-caller", "rate": "2/1m"},
    ]
    locked = route(upstream, name="locked", prefix="/tools/locked")
    locked["lock"] = {"key": "json:/account", "ttl": "5s"}
    locked["limits"] = [{"name": "flight", "key": "route", "max_in_flight": 3}]
    return [quick, jobs, paced, locked]


@pytest.fixture(scope="module")
def live_soon() -> Iterator[None]:
    """The admin token in the environment, and live regions looked at often."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(TOKEN_ENV, TOKEN)
        patch.setattr(console, "LIVE_SECONDS", LIVE_SECONDS)
        yield


@pytest.fixture(scope="module")
def console_tool() -> Iterator[ConsoleTool]:
    tool = ConsoleTool()
    server = ThreadServer(tool.app).start()
    tool.url = server.url
    yield tool
    tool.holding = False
    server.stop()


@pytest.fixture(autouse=True)
def fresh_tool(console_tool: ConsoleTool) -> Iterator[None]:
    console_tool.reset()
    yield
    console_tool.holding = False  # nothing waits past its test


@pytest.fixture(scope="module")
def module_proxy(
    tmp_path_factory: pytest.TempPathFactory, live_soon: None
) -> Iterator[ProxyFactory]:
    """Proxies that serve the whole module."""
    make, stop = proxies(tmp_path_factory.mktemp("state"))
    yield make
    stop()


module_store_url = pytest.fixture(scope="module", params=STORES)(shared_store_url)


def start(tool: ConsoleTool, make_proxy: ProxyFactory, store: str) -> Setup:
    admin = {"token_env": TOKEN_ENV}
    return Setup(make_proxy(*console_routes(tool.url), store=store, admin=admin), tool)


@pytest.fixture(scope="module")
def setup(console_tool: ConsoleTool, module_proxy: ProxyFactory, module_store_url: str) -> Setup:
    """The console on each store (memory, SQLite, Redis, PostgreSQL), for the module."""
    return start(console_tool, module_proxy, module_store_url)


@pytest.fixture(scope="module")
def plain(console_tool: ConsoleTool, module_proxy: ProxyFactory) -> Setup:
    """The console on the memory store, for what does not depend on the store."""
    return start(console_tool, module_proxy, "memory://")


@pytest.fixture
def own(monkeypatch: pytest.MonkeyPatch, live_soon: None) -> None:
    """For a test that starts a proxy of its own (``make_proxy``)."""
    monkeypatch.setenv(TOKEN_ENV, TOKEN)


def signed_in() -> dict[str, str]:
    return {"Cookie": f"{COOKIE}={TOKEN}"}


def page(setup: Setup, path: str = "", **params: str) -> httpx.Response:
    return HTTP.get(setup.url + path, params=params, headers=signed_in())


def form(
    setup: Setup, path: str, csrf: str | None = None, **fields: str | list[str]
) -> httpx.Response:
    data: dict[str, str | list[str]] = {
        "csrf": csrf_token(TOKEN) if csrf is None else csrf,
        **fields,
    }
    return HTTP.post(setup.url + path, data=data, headers=signed_in())


def record_ids(html: str) -> list[str]:
    return re.findall(r'href="/_proxy/console/records/([A-Za-z0-9_-]+)"', html)


def failed_record(setup: Setup, plan: str, step: int = 1) -> str:
    assert setup.call(new_key(BODY, step, plan), delay=LATE).status_code == 504
    (found,) = record_ids(page(setup, "records", plan=plan, state="failed").text)
    return found


# -- access ------------------------------------------------------------------------------


def test_the_console_is_off_without_admin(
    console_tool: ConsoleTool, make_proxy: ProxyFactory
) -> None:
    proxy = make_proxy(console_routes(console_tool.url)[0])
    for path in ("", "login", "records", "routes", "live/routes", "static/console.css"):
        assert HTTP.get(proxy.url + CONSOLE_PATH + path).status_code == 404


def test_sign_in_with_the_admin_token_sets_a_strict_cookie(plain: Setup) -> None:
    unsigned = HTTP.get(plain.url + "plans", params={"plan": "p-1"})
    assert unsigned.status_code == 303
    assert (
        unsigned.headers["location"]
        == CONSOLE_PATH + "login?next=%2F_proxy%2Fconsole%2Fplans%3Fplan%3Dp-1"
    )
    login = HTTP.get(plain.proxy.url + unsigned.headers["location"])
    assert login.status_code == 200 and 'type="password"' in login.text
    assert 'value="/_proxy/console/plans?plan=p-1"' in login.text
    back = HTTP.post(
        plain.url + "login", data={"token": TOKEN, "next": "/_proxy/console/plans?plan=p-1"}
    )
    assert back.headers["location"] == "/_proxy/console/plans?plan=p-1"
    for elsewhere in ("https://evil.example/", "//evil.example/", "/_proxy/admin/records"):
        away = HTTP.post(plain.url + "login", data={"token": TOKEN, "next": elsewhere})
        assert away.headers["location"] == CONSOLE_PATH
    wrong = HTTP.post(plain.url + "login", data={"token": "nope"})
    assert wrong.status_code == 401 and "not valid" in wrong.text
    assert "set-cookie" not in wrong.headers
    right = HTTP.post(plain.url + "login", data={"token": TOKEN})
    assert right.status_code == 303
    cookie = right.headers["set-cookie"]
    assert cookie.startswith(f"{COOKIE}={TOKEN};")
    assert all(p in cookie for p in ("HttpOnly", "SameSite=strict", f"Path={CONSOLE_PATH}"))
    foreign = HTTP.post(
        plain.url + "login", data={"token": TOKEN}, headers={"Origin": "https://evil.example"}
    )
    assert foreign.status_code == 403
    bearer = HTTP.get(plain.url + "records", headers={"Authorization": f"Bearer {TOKEN}"})
    assert bearer.status_code == 200
    assert HTTP.get(plain.url, headers={"Cookie": f"{COOKIE}=wrong"}).status_code == 303
    wrong_bearer = HTTP.get(plain.url, headers={"Authorization": "Bearer wrong"})
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


def test_a_client_that_asks_for_json_gets_problem_documents(plain: Setup) -> None:
    asks = {**signed_in(), "Accept": "application/problem+json"}
    for path, params, status in (
        ("records", {"state": "weird"}, 400),
        ("live/nothing", {}, 400),
        ("records/bm9wZQ", {}, 400),
        ("operations", {"state": "lost"}, 400),
        ("operations", {"cursor": "garbage"}, 400),  # as the admin API's listing
        ("records", {"cursor": base64.urlsafe_b64encode(b"[" * 3000 + b"]" * 3000).decode()}, 400),
    ):
        answer = HTTP.get(plain.url + path, params=params, headers=asks)
        assert answer.status_code == status, (path, answer.text)
        assert answer.headers["content-type"] == "application/problem+json"
        problem = answer.json()
        assert problem["status"] == status and problem["type"].startswith("urn:tool-proxy:problem:")
        assert problem["title"] and problem["detail"]
        assert "default-src 'none'" in answer.headers["content-security-policy"]
    unsigned = HTTP.get(plain.url + "routes", headers={"Accept": "application/json"})
    assert unsigned.status_code == 401 and unsigned.json()["status"] == 401  # no redirect
    refused = HTTP.post(plain.url + "logout", data={"csrf": "x"}, headers=asks)
    assert refused.status_code == 403 and refused.json()["status"] == 403
    browser = page(plain, "records", state="weird")  # a browser: the page, not JSON
    assert browser.status_code == 400 and browser.headers["content-type"].startswith("text/html")


# -- records -----------------------------------------------------------------------------


def test_records_list_failed_first_and_filter(setup: Setup) -> None:
    plan = "plan-list"
    assert setup.call(new_key(BODY, 1, plan)).status_code == 201
    failed = failed_record(setup, plan, step=2)
    listed = page(setup, "records", plan=plan).text
    assert record_ids(listed)[0] == failed  # the failed one first, though it is newer
    assert len(record_ids(listed)) == 2
    assert record_ids(page(setup, "records", plan=plan, state="completed").text) != [failed]
    assert record_ids(page(setup, "records", plan=plan, route="jobs").text) == []
    assert record_ids(page(setup, "records", plan=plan, older_than="1h").text) == []
    assert failed in record_ids(page(setup, "records").text)  # no filter: every route's
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
        foreign = HTTP.post(
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
    replay = setup.call(new_key(BODY, 1, "plan-resolve"), delay=LATE)
    assert replay.status_code == 201 and replay.json() == {"db": "orders"}
    assert replay.headers["idempotent-replayed"] == "true"
    again = form(setup, path, reason="again", **fields)
    assert again.status_code == 409 and "only a failed record" in again.text


def test_release_then_delete(setup: Setup) -> None:
    record = failed_record(setup, "plan-release")
    key = new_key(BODY, 1, "plan-release")
    calls = setup.tool.keys[key]
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
    assert setup.call(key).status_code == 201  # runs again
    assert setup.tool.keys[key] == calls + 1
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
    assert setup.call(new_key({"n": 2}, 2, plan), body={"n": 2}, delay=LATE).status_code == 504
    assert setup.call(new_key({"n": 3}, 2, plan), body={"n": 3}).status_code == 201  # replan
    html = page(setup, "plans", plan=plan).text
    assert html.index("Step 1") < html.index("Step 2")
    assert "replanned: 2 args hashes" in html
    assert len(record_ids(html)) == 3
    assert "state-failed" in html and "state-completed" in html
    empty = page(setup, "plans", plan="plan-nothing").text
    assert "No record of plan session" in empty


def test_a_plan_shows_the_replays_each_step_served(setup: Setup) -> None:
    plan = "plan-replays"
    first, second = new_key(BODY, 1, plan), new_key({"n": 2}, 2, plan)
    assert setup.call(first).status_code == 201
    assert setup.call(second, body={"n": 2}).status_code == 201
    for _ in range(2):
        replay = setup.call(first)
        assert replay.status_code == 201 and replay.headers["idempotent-replayed"] == "true"
    assert setup.call(first, body={"other": True}).status_code == 422  # not a replay
    html = page(setup, "plans", plan=plan).text
    assert '<th scope="col">Replays served</th>' in html
    step_1, step_2 = html.split('<h2 class="step">Step 2')
    assert '<td class="number">2</td>' in step_1
    assert '<td class="number">0</td>' in step_2
    detail = page(setup, f"records/{record_ids(step_1)[0]}").text
    assert re.search(r"<dt>Replays served</dt><dd>2</dd>", detail)


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
    setup.tool.holding = True  # one worker: the first job holds it, the others wait
    first = setup.job({"n": 1})
    wait_for(lambda: "state-running" in page(setup, f"operations/{first}").text)
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


def route_card(html: str, name: str) -> str:
    """The routes view's card of one route."""
    found = re.search(rf'<h2 id="route-\d+">{name}</h2>(.*?)</article>', html, re.S)
    assert found is not None, html
    return found.group(1)


def routes_card(setup: Setup, name: str) -> str:
    return route_card(page(setup, "routes").text, name)


def test_routes_show_limits_and_pauses_as_the_store_holds_them(setup: Setup) -> None:
    before = routes_card(setup, "paced")
    assert "5 of 5 left now" in before and "0 callers&#39; buckets in use" in before
    assert "Paused" not in before
    assert (
        setup.call(new_key(BODY, 1, "plan-paced"), path="paced", caller="alice").status_code == 201
    )
    slowed = setup.call(new_key(BODY, 2, "plan-paced"), path="paced", status="429", caller="alice")
    assert slowed.status_code == 429
    card = routes_card(setup, "paced")
    assert re.search(r"3 of 5 left now; full again at \d\d:\d\d:\d\d UTC", card), card
    assert "1 callers&#39; buckets in use, 1 of them empty (the lowest: 0 of 2 left)" in card
    assert card.count('class="row-limited"') == 1  # alice's bucket is empty, not the route's
    assert re.search(r"Paused by the tool for 1 caller \(the longest until [\d:]{8} UTC\)", card)
    paused = setup.call(new_key(BODY, 3, "plan-paced"), path="paced", caller="alice")
    assert paused.status_code == 429 and "pause" in paused.text
    assert "alice" not in page(setup, "routes").text  # callers' keys are digests


def test_routes_show_the_locks_slots_and_records_in_flight(setup: Setup) -> None:
    setup.tool.holding = True
    body = {"account": "acme-flight", "amount": 1}
    slow = threading.Thread(
        target=setup.call,
        args=(new_key(body, 1, "plan-fly"),),
        kwargs={"body": body, "path": "locked"},
    )
    slow.start()
    try:
        wait_for(lambda: "Fencing token" in routes_card(setup, "locked"))
        card = routes_card(setup, "locked")
    finally:
        setup.tool.holding = False
        slow.join()
    assert "In flight (records in progress): <strong>1</strong>" in card
    assert "1 of 3 slots taken" in card
    row = re.search(r"<td>lock</td><td><code title=\"([0-9a-f]{32})\">.*?<td>(\d+)</td>", card)
    assert row is not None, card
    assert "acme-flight" not in card  # the resource's key value is never shown
    freed = ("No resource lock held now", "0 of 3 slots taken", "<strong>0</strong>")
    wait_for(lambda: all(text in routes_card(setup, "locked") for text in freed))
    html = page(setup, "routes").text
    assert "quick" in html and "jobs" in html and "600/1m" in html and "lock_ttl" in html


def test_limit_sentences() -> None:
    now = 1_700_000_000.0  # 2023-11-14 22:13:20 UTC
    rate = LimitConfig(name="rpm", rate="60/1m", burst=10)
    caller = LimitConfig(name="per", key="principal", rate="60/1m")
    slots = LimitConfig(name="flight", max_in_flight=2)
    state = GroupState(
        rates=(Entry("rpm", 4.5), Entry("per|a", 60.0), Entry("per|b", 1.0), Entry("rpmx", 9)),
        slots=(Entry("flight", 3.0, 2),),
        pauses=(Entry("", 12.4), Entry("c1", 3.0), Entry("c2", 7.25)),
    )
    assert limit_now(rate, state, now) == {
        "text": "5 of 10 left now; full again at 22:13:25 UTC",
        "limited": False,
    }
    assert limit_now(rate, GroupState(), now)["text"] == "10 of 10 left now"
    assert limit_now(caller, state, now) == {
        "text": "2 callers' buckets in use, 1 of them empty (the lowest: 0 of 60 left)",
        "limited": True,
    }
    assert limit_now(slots, state, now) == {"text": "2 of 2 slots taken", "limited": True}
    assert limit_now(slots, GroupState(), now) == {"text": "0 of 2 slots taken", "limited": False}
    assert pauses_now(state, now) == {
        "route": "22:13:33 UTC",
        "callers": 2,
        "longest": "22:13:28 UTC",
    }
    assert pauses_now(GroupState(), now) == {"route": None, "callers": 0, "longest": None}


def test_the_live_feed_sends_a_region_again_when_it_changes(plain: Setup) -> None:
    shown = page(plain, "records", plan="plan-live").text
    assert "No record matches" in shown
    found = re.search(r'data-live="([^"]+)"', shown)
    assert found is not None and "seen=" in found.group(1)
    live = unescape(found.group(1))
    seen: list[str] = []
    with HTTP.stream("GET", plain.proxy.url + live, headers=signed_in()) as feed:
        assert feed.headers["content-type"].startswith("text/event-stream")
        assert "script-src 'self'" in feed.headers["content-security-policy"]
        plain.call(new_key(BODY, 1, "plan-live"))
        for line in feed.iter_lines():  # nothing until the region changes: the page has it
            if line.startswith("data:"):
                seen.append(line)
            elif not line and seen:
                break
    assert "plan-live" in "".join(seen) and "state-completed" in "".join(seen)
    assert HTTP.get(plain.url + "live/records").status_code == 303
    assert page(plain, "live/nothing").status_code == 400


def test_the_routes_live_feed_follows_a_pause(plain: Setup) -> None:
    shown = page(plain, "routes").text
    found = re.search(r'data-live="([^"]+)"', shown)
    assert found is not None
    seen: list[str] = []
    with HTTP.stream(
        "GET", plain.proxy.url + unescape(found.group(1)), headers=signed_in()
    ) as feed:
        key = new_key(BODY, 1, "plan-live-pause")
        slowed = plain.call(key, path="paced", status="429", caller="bo")
        assert slowed.status_code == 429
        for line in feed.iter_lines():
            if line.startswith("data:"):
                seen.append(line)
            elif not line and "Paused by the tool" in "".join(seen):
                break
    assert "Paused by the tool for 1 caller" in "".join(seen)


def test_sign_out_needs_the_csrf_token(plain: Setup) -> None:
    assert form(plain, "logout", csrf="x").status_code == 403
    out = form(plain, "logout")
    assert out.status_code == 303 and f'{COOKIE}=""' in out.headers["set-cookie"]


def test_operators_sign_in_with_a_jwt_and_a_read_role_only_looks(
    console_tool: ConsoleTool, make_proxy: ProxyFactory, idp: IdentityProvider
) -> None:
    proxy = make_proxy(
        *console_routes(console_tool.url),
        auth=auth_config(idp),
        admin={"role": "tool-proxy-admin", "read_role": "tool-proxy-viewer"},
    )
    setup = Setup(proxy, console_tool)
    record = failed_record_as(setup, "plan-jwt", idp.token("ops", roles=["tool-proxy-admin"]))
    viewer = idp.token("val", roles=["tool-proxy-viewer"])
    as_viewer = {"Cookie": f"{COOKIE}={viewer}"}
    shown = HTTP.get(f"{setup.url}records/{record}", headers=as_viewer)
    assert shown.status_code == 200 and "(read-only)" in shown.text
    assert "Resolve this unknown outcome" not in shown.text and "read-only role" in shown.text
    routes = HTTP.get(f"{setup.url}routes", headers=as_viewer)  # the live state: a view
    assert routes.status_code == 200 and "of 5 left now" in routes.text
    assert "<form" not in route_card(routes.text, "paced")
    fields = {"as": "released", "reason": "no", "confirm": "yes", "csrf": csrf_token(viewer)}
    refused = HTTP.post(f"{setup.url}records/{record}/resolve", data=fields, headers=as_viewer)
    assert refused.status_code == 403 and "tool-proxy-admin" in refused.text
    api = HTTP.get(
        f"{proxy.url}/_proxy/admin/records", headers={"Authorization": f"Bearer {viewer}"}
    )
    assert api.status_code == 403  # the read role is the console's views only
    nobody = idp.token("eve", roles=["reader"])  # a caller of the tools: no operator
    assert HTTP.post(setup.url + "login", data={"token": nobody}).status_code == 403
    for path in ("routes", "live/routes", "records", f"records/{record}", "plans?plan=plan-jwt"):
        bearer = HTTP.get(setup.url + path, headers={"Authorization": f"Bearer {nobody}"})
        assert bearer.status_code == 403, path
        cookie = HTTP.get(setup.url + path, headers={"Cookie": f"{COOKIE}={nobody}"})
        assert cookie.status_code == 303 and "plan-jwt" not in cookie.text, path
    ops = idp.token("ops", roles=["tool-proxy-admin"])
    with capture_logs() as logs:
        done = HTTP.post(
            f"{setup.url}records/{record}/resolve",
            data={**fields, "csrf": csrf_token(ops)},
            headers={"Cookie": f"{COOKIE}={ops}"},
        )
    assert done.status_code == 303
    (event,) = [e for e in logs if e["event"] == "admin_record_released"]
    assert event["admin"] == f"jwt iss={idp.issuer} sub=ops"


def failed_record_as(setup: Setup, plan: str, token: str) -> str:
    assert setup.call(new_key(BODY, 1, plan), delay=LATE).status_code == 504
    listed = HTTP.get(
        setup.url + "records", params={"plan": plan}, headers={"Cookie": f"{COOKIE}={token}"}
    )
    (found,) = record_ids(listed.text)
    return found


def test_an_offloaded_body_is_linked_as_a_download(
    console_tool: ConsoleTool, make_proxy: ProxyFactory, tmp_path: Path, own: None
) -> None:
    (tmp_path / "objects").mkdir()
    proxy = make_proxy(
        console_routes(console_tool.url)[0],
        admin={"token_env": TOKEN_ENV},
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
    assert HTTP.get(f"{setup.url}records/{record}/body").status_code == 303  # signed in only
