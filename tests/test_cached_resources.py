"""Cached reads and versioned writes of one named resource (``routes[].resource``): a
write invalidates the cached reads of what it changed, on every replica, before its
answer; a read racing a write never fills the cache with the state from before it; cached
reads carry the resource's ETag, ``If-None-Match`` of it is a 304 from the proxy, and
``If-Match`` from a cached read works as from a fresh one.

Real stores (memory, SQLite, Redis, PostgreSQL), two proxies on one store as replicas
(one on the memory store, which a process keeps to itself), a real upstream that keeps
state (accounts), and the official MCP SDK on both sides of an MCP route.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from proxy.config import parse_config
from proxy.errors import ConfigError
from tests.conftest import STORES, ProxyFactory, each_store_url
from tests.mcp_servers import McpTool, session
from tests.servers import ThreadServer, wait_for
from tests.test_mcp import account, text

store_url = pytest.fixture(params=STORES)(each_store_url)


class Accounts:
    """A tool that keeps balances: ``GET /accounts/{id}`` reads one (after ``X-Delay``
    seconds, the state taken before the wait: a slow read of the state it started on),
    ``PUT /accounts/{id}`` sets it, ``POST /charge`` takes ``amount`` off ``account``
    (then waits ``X-Delay``: a write the proxy may give up on after it happened)."""

    def __init__(self) -> None:
        self.balances: Counter[str] = Counter()
        self.reads: Counter[str] = Counter()
        self.writes: Counter[str] = Counter()
        self.snapshotted = threading.Event()
        """Set once a slow read has taken its state (and waits)."""
        self.url = ""
        self.app = Starlette(
            routes=[
                Route("/accounts/{id}", self._account, methods=["GET", "PUT"]),
                Route("/charge", self._charge, methods=["POST"]),
            ]
        )

    async def _account(self, request: Request) -> Response:
        id = request.path_params["id"]
        delay = float(request.headers.get("x-delay", "0"))
        if request.method == "PUT":
            self.balances[id] = json.loads(await request.body())["balance"]
            self.writes[id] += 1
            return JSONResponse({"id": id, "balance": self.balances[id]})
        self.reads[id] += 1
        state = {"id": id, "balance": self.balances[id]}
        if delay:
            self.snapshotted.set()
            await asyncio.sleep(delay)
        return JSONResponse(state, headers={"etag": '"the-tools-own"'})

    async def _charge(self, request: Request) -> Response:
        body = json.loads(await request.body())
        if "amount" not in body or "account" not in body:
            return JSONResponse({"error": "amount or account missing"}, status_code=422)
        if body["amount"] == "boom":
            return JSONResponse({"error": "broke mid-way"}, status_code=500)
        self.balances[body["account"]] -= body["amount"]
        self.writes[body["account"]] += 1
        await asyncio.sleep(float(request.headers.get("x-delay", "0")))
        return JSONResponse({"balance": self.balances[body["account"]]})


@pytest.fixture
def accounts() -> Iterator[Accounts]:
    tool = Accounts()
    server = ThreadServer(tool.app).start()
    tool.url = server.url
    yield tool
    server.stop()


def routes(upstream: str, **charge: Any) -> list[dict[str, Any]]:
    """``accounts``: cached reads and versioned PUTs of ``/accounts/{id}``; ``charge``: the
    guarded ``POST /charge`` of the same resource, named by its body."""
    return [
        {
            "name": "accounts",
            "path_prefix": "/accounts",
            "upstream": upstream,
            "resource": {"name": "account", "key": "path:0"},
            "cache": {"scope": "route", "ttl": "1h"},
            "versioning": {},
        },
        {
            "name": "charge",
            "path_prefix": "/charge",
            "upstream": upstream,
            "timeout": charge.pop("timeout", "10s"),
            "resource": {"name": "account", "key": "json:/account"},
            "idempotency": {"key": "opaque", "required": False},
            **charge,
        },
    ]


@pytest.fixture
def replicas(make_proxy: ProxyFactory, accounts: Accounts, store_url: str) -> list[str]:
    """Two proxies on one store (the memory store: one proxy, twice)."""
    first = make_proxy(*routes(accounts.url), store=store_url)
    if store_url.startswith("memory://"):
        return [first.url, first.url]
    return [first.url, make_proxy(*routes(accounts.url), store=store_url).url]


def fields(headers: dict[str, str], json: bool = False) -> dict[str, str]:
    """Request headers from keyword arguments (``if_match`` is If-Match)."""
    sent = {k.replace("_", "-"): v for k, v in headers.items()}
    return {"content-type": "application/json", **sent} if json else sent


def read(base: str, id: str = "A", **headers: str) -> httpx.Response:
    return httpx.get(f"{base}/accounts/{id}", headers=fields(headers), timeout=30)


def charge(base: str, id: str = "A", amount: int | str = 5, **headers: str) -> httpx.Response:
    sent = fields(headers, json=True)
    body = json.dumps({"account": id, "amount": amount})
    return httpx.post(f"{base}/charge", content=body, headers=sent, timeout=30)


def put(base: str, balance: int, id: str = "A", **headers: str) -> httpx.Response:
    sent = fields(headers, json=True)
    body = json.dumps({"balance": balance})
    return httpx.put(f"{base}/accounts/{id}", content=body, headers=sent, timeout=30)


def balance(answer: httpx.Response) -> int:
    assert answer.status_code == 200, answer.text
    value: int = answer.json()["balance"]
    return value


# -- configuration ----------------------------------------------------------------------------


def test_a_resource_is_named_once_and_its_problems_name_their_field() -> None:
    good = parse_config({"routes": routes("http://h")}, env={})
    reads, writes = good.routes
    assert reads.resource_scope() == writes.resource_scope() == "resource:account"
    assert reads.cached_methods() == {"GET"}  # POST, cached by default, writes the resource
    assert good.cached_resources() == good.versioned_resources() == {"account"}
    bad = routes("http://h")
    bad[0]["lock"] = {"key": "path:0"}  # named twice
    bad[0]["cache"]["methods"] = ["GET", "PUT"]  # a write is never cached
    bad[1]["resource"] = {"name": "no spaces", "key": "body:/x", "writes": ["GET"]}
    with pytest.raises(ConfigError) as caught:
        parse_config({"routes": bad}, env={})
    problems = "\n".join(caught.value.problems)
    for field in (
        "routes[0]: lock.key: the route names its resource",
        "routes[1].resource.name",
        "routes[1].resource.key",
        "routes[1].resource.writes: GET is a read",
    ):
        assert field in problems, problems
    only_cache = routes("http://h")[:1]
    only_cache[0]["cache"]["methods"] = ["GET", "PUT"]
    with pytest.raises(ConfigError, match=r"routes\[0\]: cache.methods: PUT writes the route"):
        parse_config({"routes": only_cache}, env={})
    keyless = {"name": "t", "path_prefix": "/t", "upstream": "http://h", "lock": {"ttl": "1s"}}
    with pytest.raises(ConfigError, match=r"routes\[0\]: lock.key: required without"):
        parse_config({"routes": [keyless]}, env={})
    mcp = {**routes("http://h")[0], "protocol": "mcp", "versioning": None}
    mcp["resource"] = {"key": "json:/params/arguments/account", "writes": ["POST"]}
    mcp["cache"] = {"scope": "route"}
    with pytest.raises(ConfigError, match=r"resource.writes: not on protocol: mcp"):
        parse_config({"routes": [mcp]}, env={})


# -- a write invalidates ------------------------------------------------------------------------


@pytest.mark.parametrize("store_url", [*STORES, "redis-cluster"], indirect=True)
def test_a_write_through_the_other_replica_supersedes_the_cached_read(
    replicas: list[str], accounts: Accounts
) -> None:
    a, b = replicas
    first = read(a)
    assert first.headers["cache-status"] == "tool-proxy; fwd=miss; stored"
    assert balance(first) == 0
    hit = read(b)
    assert hit.headers["cache-status"] == "tool-proxy; hit" and balance(hit) == 0
    assert accounts.reads["A"] == 1
    key = {"idempotency_key": "charge-A-1"}
    assert charge(b, **key).status_code == 200  # a guarded write
    assert charge(a, **key).headers["idempotent-replayed"] == "true"  # not sent again
    after = read(a)
    assert after.headers["cache-status"] == "tool-proxy; fwd=stale; stored"  # invalidated
    assert balance(after) == -5 and accounts.reads["A"] == 2
    again = read(b)
    assert again.headers["cache-status"] == "tool-proxy; hit" and balance(again) == -5
    assert read(a, "B").headers["cache-status"] == "tool-proxy; fwd=miss; stored"  # others: own


def test_a_refused_write_keeps_the_cached_read_and_an_unknown_outcome_invalidates(
    make_proxy: ProxyFactory, accounts: Accounts, store_url: str
) -> None:
    proxy = make_proxy(*routes(accounts.url, timeout="300ms"), store=store_url).url
    assert balance(read(proxy)) == 0
    refused = httpx.post(f"{proxy}/charge", content=b'{"account": "A"}', timeout=10)
    assert refused.status_code == 422  # the tool did not write: the cached read stays
    assert read(proxy).headers["cache-status"] == "tool-proxy; hit"
    broke = charge(proxy, amount="boom")
    assert broke.status_code == 500  # a 5xx may have written part of it
    assert read(proxy).headers["cache-status"] == "tool-proxy; fwd=stale; stored"
    lost = charge(proxy, x_delay="1")  # the tool charges, then answers too late
    assert lost.status_code == 504, lost.text
    after = read(proxy)
    assert after.headers["cache-status"] == "tool-proxy; fwd=stale; stored"
    assert balance(after) == -5
    unnamed = httpx.post(f"{proxy}/charge", content=b'{"amount": 1}', timeout=10)
    assert unnamed.status_code == 422  # a write that names no resource is forwarded
    assert read(proxy).headers["cache-status"] == "tool-proxy; hit"


def test_a_read_racing_a_write_never_fills_the_cache_with_the_state_before_it(
    replicas: list[str], accounts: Accounts
) -> None:
    """A slow read takes the balance, a write lands while it waits, the read's old state
    reaches the store after the write: the next read is never that old state."""
    a, b = replicas
    for round in range(8):
        accounts.snapshotted.clear()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            # no-cache: forwarded whatever is stored, and its answer stored (a fill)
            slow = pool.submit(read, a, "R", x_delay="0.3", cache_control="no-cache")
            assert accounts.snapshotted.wait(10)
            assert charge(b, "R").status_code == 200
            assert balance(slow.result()) == -5 * round  # its own answer: the state it read
        settled = read(b if round % 2 else a, "R")
        assert balance(settled) == -5 * (round + 1), (round, settled.headers)
        assert read(a, "R").headers["cache-status"] == "tool-proxy; hit"  # cached again
    assert accounts.writes["R"] == 8


# -- ETags, 304, If-Match from a cached read ------------------------------------------------


def test_cached_reads_carry_the_version_and_if_none_match_of_it_is_a_304(
    replicas: list[str], accounts: Accounts
) -> None:
    a, b = replicas
    first = read(a)
    etag = first.headers["etag"]
    assert first.headers.get_list("etag") == [etag] and etag != '"the-tools-own"'
    hit = read(b)
    assert hit.headers["etag"] == etag and hit.headers["cache-status"] == "tool-proxy; hit"
    for asked in (etag, f"W/{etag}", f'"x", {etag}', "*"):
        unchanged = read(b, if_none_match=asked)
        assert unchanged.status_code == 304, (asked, unchanged.text)
        assert unchanged.content == b"" and unchanged.headers["etag"] == etag
        assert unchanged.headers["cache-status"] == "tool-proxy; hit"
    other = f'"{int(etag.strip(chr(34))) + 1000}"'
    assert read(a, if_none_match=other).status_code == 200  # another version: the whole answer
    for malformed in (etag[:-1], etag[1:], '"*"'):  # unterminated (was a 304), bare, quoted *
        assert read(b, if_none_match=malformed).status_code == 200, malformed  # the answer
    assert accounts.reads["A"] == 1  # no 304 called the tool
    assert charge(a).status_code == 200
    changed = read(b, if_none_match=etag)
    assert changed.status_code == 200 and balance(changed) == -5
    assert changed.headers["etag"] != etag


def test_if_match_from_a_cached_etag_writes_and_a_stale_one_is_412(
    replicas: list[str], accounts: Accounts
) -> None:
    a, b = replicas
    read(a)
    cached = read(b)
    assert cached.headers["cache-status"] == "tool-proxy; hit"
    written = put(a, 100, if_match=cached.headers["etag"])
    assert written.status_code == 200, written.text
    stale = put(b, 50, if_match=cached.headers["etag"])
    assert stale.status_code == 412 and stale.headers["etag"] == written.headers["etag"]
    after = read(b)
    assert balance(after) == 100 and after.headers["etag"] == written.headers["etag"]
    assert after.headers["cache-status"] == "tool-proxy; fwd=stale; stored"
    assert accounts.writes["A"] == 1


def test_a_read_during_a_write_neither_uses_nor_fills_the_cache(
    make_proxy: ProxyFactory, accounts: Accounts, store_url: str
) -> None:
    proxy = make_proxy(*routes(accounts.url), store=store_url).url
    read(proxy)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        writing = pool.submit(charge, proxy, x_delay="0.5")
        time.sleep(0.2)  # the write is at the tool: its mark is on the resource
        during = read(proxy)
        assert writing.result().status_code == 200
    assert during.headers["cache-status"] == "tool-proxy; fwd=bypass; detail=writing"
    assert balance(during) == -5  # the tool's state (it charged before it waited)
    assert read(proxy).headers["cache-status"] == "tool-proxy; fwd=stale; stored"
    assert accounts.reads["A"] == 3


# -- MCP ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mcp_tool() -> Iterator[McpTool]:
    tool = McpTool(json_response=True).start()
    yield tool
    tool.stop()


def test_a_write_tool_invalidates_the_cached_results_of_read_only_tools_on_its_resource(
    make_proxy: ProxyFactory, mcp_tool: McpTool, store_url: str
) -> None:
    route = {
        "name": "billing",
        "path_prefix": "/mcp",
        "upstream": mcp_tool.url,
        "protocol": "mcp",
        "resource": {"name": "account", "key": "json:/params/arguments/account"},
        "cache": {"scope": "route", "ttl": "1h"},
    }
    proxies = [make_proxy(route, store=store_url)]
    if not store_url.startswith("memory://"):
        proxies.append(make_proxy(route, store=store_url))
    urls = [p.url + "/mcp" for p in proxies] * (3 - len(proxies))
    who, other = account(), account()

    async def scenario() -> list[str]:
        async with session(urls[0]) as a, session(urls[1]) as b:
            await a.list_tools()
            await b.list_tools()
            seen = [await a.call_tool("balance", {"account": who}) for _ in range(2)]
            seen.append(await b.call_tool("balance", {"account": other}))
            await b.call_tool("charge", {"account": who, "cents": 1})  # on the other replica
            seen += [await a.call_tool("balance", {"account": who}) for _ in range(2)]
            seen.append(await a.call_tool("balance", {"account": other}))  # not its resource
            return [text(r) for r in seen]

    answers = asyncio.run(scenario())
    assert answers == [f"{who}: 0 charges"] * 2 + [f"{other}: 0 charges"] + [
        f"{who}: 1 charges"
    ] * 2 + [f"{other}: 0 charges"]
    assert mcp_tool.executions[f"balance:{who}"] == 2  # one fill before the write, one after
    assert mcp_tool.executions[f"balance:{other}"] == 1
    assert mcp_tool.executions[who] == 1


def test_a_long_call_invalidates_when_its_worker_sends_it(
    make_proxy: ProxyFactory, accounts: Accounts, store_url: str
) -> None:
    proxy = make_proxy(*routes(accounts.url, **{"async": {"mode": "always"}}), store=store_url).url
    assert balance(read(proxy)) == 0
    accepted = charge(proxy, idempotency_key="long-1")
    assert accepted.status_code == 202, accepted.text
    status = proxy + accepted.headers["location"]
    wait_for(lambda: httpx.get(status, timeout=10).status_code == 303, what="the job's end")
    after = read(proxy)
    assert after.headers["cache-status"] == "tool-proxy; fwd=stale; stored"
    assert balance(after) == -5 and accounts.writes["A"] == 1
