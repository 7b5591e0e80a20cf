"""Reconcile: the proxy asks the tool whether a call whose outcome is unknown ran."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from proxy.app import create_app
from proxy.config import parse_config
from proxy.errors import ConfigError
from proxy.operation import identify
from proxy.store import State
from proxy.store.memory import MemoryStore
from tests.conftest import ProxyFactory, new_key, route
from tests.servers import ThreadServer

BODY = {"account": "acme", "amount": 42}


class ChargeTool:
    """A tool with a side effect and a look-up by client reference (``plan:step``).

    ``delay`` holds the answer back (past the route's timeout, say); ``charge_first``
    says whether the charge happens before that wait (the call ran) or never (it was
    still queued when the proxy gave up). ``lookup_status`` overrides the look-up.
    """

    def __init__(self) -> None:
        self.url = ""
        self.delay = 0.0
        self.charge_first = True
        self.lookup_status: int | None = None
        self.charges: dict[str, int] = {}
        self.lookups = 0
        self.lookup_headers: list[dict[str, str]] = []
        self.app = Starlette(
            routes=[
                Route("/charge", self.charge, methods=["POST"]),
                Route("/charges", self.lookup, methods=["GET"]),
            ]
        )

    @staticmethod
    def reference(request: Request) -> str:
        plan, step, _ = request.headers["idempotency-key"].split(":")
        return f"{plan}:{step}"

    async def charge(self, request: Request) -> Response:
        body = await request.json()
        reference = self.reference(request)
        if self.charge_first:
            self.charges[reference] = self.charges.get(reference, 0) + 1
        await asyncio.sleep(self.delay)
        return JSONResponse({"charged": body["amount"], "reference": reference}, 201)

    async def lookup(self, request: Request) -> Response:
        self.lookups += 1
        self.lookup_headers.append(dict(request.headers))
        if self.lookup_status is not None:
            return JSONResponse({"error": "lookup failed"}, self.lookup_status)
        reference = request.query_params["client_reference"]
        if reference not in self.charges:
            return JSONResponse({"error": "no such charge"}, 404)
        return JSONResponse({"reference": reference, "found": True}, 200)


@pytest.fixture
def charges() -> Any:
    tool = ChargeTool()
    server = ThreadServer(tool.app).start()
    tool.url = server.url
    yield tool
    server.stop()


def charge_route(tool: ChargeTool, **reconcile: Any) -> dict[str, Any]:
    spec = route(tool.url, prefix="/tools", strip_prefix=True, timeout="0.5s")
    spec["reconcile"] = {"path": "/charges?client_reference={plan}:{step}", **reconcile}
    return spec


def post(proxy: ThreadServer, key: str) -> httpx.Response:
    return httpx.post(
        f"{proxy.url}/tools/charge",
        json=BODY,
        headers={"Idempotency-Key": key, "Authorization": "Bearer caller-token"},
        timeout=10,
    )


def test_a_timed_out_call_that_ran_records_the_lookups_answer(
    charges: ChargeTool, make_proxy: ProxyFactory
) -> None:
    charges.delay = 1.0  # past the route's 0.5 s timeout, after charging
    proxy = make_proxy(charge_route(charges))
    key = new_key(BODY)
    first = post(proxy, key)
    assert first.status_code == 200
    assert first.json() == {"reference": key.rsplit(":", 1)[0], "found": True}
    replay = post(proxy, key)
    assert replay.headers["idempotent-replayed"] == "true"
    assert replay.content == first.content
    assert charges.charges == {key.rsplit(":", 1)[0]: 1}
    assert charges.lookups == 1
    sent = charges.lookup_headers[0]
    assert (sent["idempotency-key"], sent["authorization"]) == (key, "Bearer caller-token")


def test_a_timed_out_call_that_never_ran_is_released_and_the_retry_executes(
    charges: ChargeTool, make_proxy: ProxyFactory
) -> None:
    charges.delay, charges.charge_first = 1.0, False
    proxy = make_proxy(charge_route(charges))
    key = new_key(BODY)
    first = post(proxy, key)
    assert first.status_code == 504
    assert first.json()["type"] == "urn:tool-proxy:problem:not-executed"
    charges.delay, charges.charge_first = 0.0, True
    retry = post(proxy, key)
    assert retry.status_code == 201 and "idempotent-replayed" not in retry.headers
    assert charges.charges == {key.rsplit(":", 1)[0]: 1}


def test_a_lookup_that_does_not_settle_it_leaves_it_failed_and_a_retry_asks_again(
    charges: ChargeTool, make_proxy: ProxyFactory
) -> None:
    charges.delay, charges.lookup_status = 1.0, 500
    proxy = make_proxy(charge_route(charges, interval="50ms"))
    key = new_key(BODY)
    first = post(proxy, key)
    assert first.status_code == 504
    assert first.json()["type"] == "urn:tool-proxy:problem:outcome-unknown"
    charges.lookup_status = None  # the tool can answer now
    retry = post(proxy, key)
    assert retry.status_code == 200 and retry.headers["idempotent-replayed"] == "true"
    assert retry.json()["found"] is True
    assert charges.lookups == 2
    again = post(proxy, key)
    assert again.content == retry.content and charges.lookups == 2  # settled: no more asks
    assert charges.charges == {key.rsplit(":", 1)[0]: 1}


def test_retries_ask_a_bounded_number_of_times(
    charges: ChargeTool, make_proxy: ProxyFactory
) -> None:
    charges.delay, charges.lookup_status = 1.0, 503
    proxy = make_proxy(charge_route(charges, retries=2, interval="1ms"))
    key = new_key(BODY)
    assert post(proxy, key).status_code == 504
    for _ in range(4):
        replay = post(proxy, key)
        assert replay.status_code == 504 and replay.headers["idempotent-replayed"] == "true"
    assert charges.lookups == 1 + 2  # at the failure, then twice on retries


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("ran", [True, False], ids=["ran", "never-ran"])
def test_a_lapsed_lease_is_reconciled_when_a_retry_meets_it(charges: ChargeTool, ran: bool) -> None:
    """The proxy that claimed the call died: the retry finds its lapsed lease (FAILED),
    asks the tool, and replays the tool's answer, or executes the call that never ran."""
    clock = Clock()
    store = MemoryStore(clock)
    config = parse_config({"routes": [charge_route(charges)]}, env={})
    proxy = ThreadServer(create_app(config, store=store)).start()
    try:
        key = new_key(BODY)
        plan, step, _ = key.split(":")
        (route_config,) = config.routes
        assert route_config.idempotency is not None
        op = identify(
            "tool",
            route_config.idempotency,
            key,
            json.dumps(BODY).encode(),
            "application/json",
            target=b"POST /tools/charge",
        )
        assert op is not None
        asyncio.run(store.claim(op.key, op.fingerprint, "a-dead-proxy", 5.0, 3600.0))
        clock.now += 6  # its lease lapses
        if ran:
            charges.charges[f"{plan}:{step}"] = 1
        retry = post(proxy, key)
        if ran:
            assert retry.status_code == 200 and retry.headers["idempotent-replayed"] == "true"
            assert retry.json()["found"] is True
            record = asyncio.run(store.get(op.key))
            assert record is not None and record.state is State.COMPLETED
        else:
            assert retry.status_code == 201 and "idempotent-replayed" not in retry.headers
        assert charges.charges == {f"{plan}:{step}": 1}
        assert charges.lookups == 1
    finally:
        proxy.stop()


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ({"path": "/c?r={plan}:{stepp}"}, "routes[0].reconcile.path: unknown placeholder"),
        ({"path": "c"}, "routes[0].reconcile.path: must start with '/'"),
        ({"path": "/c", "found": [200], "not_found": [200]}, "cannot be both"),
        ({"path": "/c", "timeout": "soon"}, "routes[0].reconcile.timeout"),
    ],
)
def test_bad_reconcile_configuration_names_the_field(spec: dict[str, Any], problem: str) -> None:
    with pytest.raises(ConfigError) as raised:
        parse_config({"routes": [{**route("http://127.0.0.1:9"), "reconcile": spec}]}, env={})
    assert any(problem in p for p in raised.value.problems), raised.value.problems


def test_reconcile_needs_idempotency_and_composite_fields_need_composite_keys() -> None:
    plain = {**route("http://127.0.0.1:9", guarded=False), "reconcile": {"path": "/c?k={key}"}}
    with pytest.raises(ConfigError, match="needs idempotency"):
        parse_config({"routes": [plain]}, env={})
    opaque = {**route("http://127.0.0.1:9", key="opaque"), "reconcile": {"path": "/c/{plan}"}}
    with pytest.raises(ConfigError, match="needs composite keys"):
        parse_config({"routes": [opaque]}, env={})
