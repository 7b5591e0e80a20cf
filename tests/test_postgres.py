"""The PostgreSQL store beyond the contract suites: its URL, its schema, its round trips,
and the server failing under guarded calls (a server of the tests' own, restarted and
killed), or its pool running dry."""

from __future__ import annotations

import asyncio
import concurrent.futures
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import psycopg_pool
import pytest
import yaml

from proxy.config import parse_config
from proxy.errors import ConfigError, StoreError, StoreRefused, StoreUnavailable
from proxy.store import RecordKey, State, make_buckets, make_locks, make_queue, postgres
from proxy.store.buckets import Rate, Slots
from proxy.store.postgres import (
    DEFAULT_POOL_MAX,
    MIGRATIONS,
    RECONNECT_SECONDS,
    PostgresStore,
    parse_postgres_url,
    translate,
)
from proxy.store.queue import Job
from tests.conftest import Clock, ProxyFactory, new_key, route
from tests.postgres_server import PgBouncer, PostgresServer
from tests.servers import ROOT, CountingTool, free_port

pytestmark = pytest.mark.anyio
BODY = {"op": "charge"}
KEY = RecordKey("route|alice|plan|1", "hash")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def own_postgres() -> Iterator[PostgresServer]:
    """A server of this module's own, to restart and kill."""
    server = PostgresServer.started()
    yield server
    server.stop()


@pytest.fixture
async def store(postgres_url: str) -> AsyncIterator[PostgresStore]:
    opened = PostgresStore(postgres_url)
    await opened.open()
    yield opened
    await opened.close()


# -- the URL --------------------------------------------------------------------------------


def test_the_url_sets_the_pool_and_passes_the_rest_to_libpq() -> None:
    url = "postgresql://u:secret@db:5433/tp?pool_max=4&pool_timeout=250ms&sslmode=require"
    options = parse_postgres_url(url)
    assert (options.pool_min, options.pool_max, options.pool_timeout) == (1, 4, 0.25)
    assert options.conninfo == (
        "postgresql://u:secret@db:5433/tp?sslmode=require&connect_timeout=3"
    )
    assert parse_postgres_url("postgres://db/tp").pool_max == DEFAULT_POOL_MAX


@pytest.mark.parametrize(
    ("query", "named"),
    [
        ("pool_max=0", "pool_max"),
        ("pool_min=5&pool_max=2", "pool_min"),
        ("pool_timeout=soon", "pool_timeout"),
        ("timeout=-1s", "timeout"),
        ("prepare=maybe", "prepare"),
        ("schema=Robert');", "schema"),
    ],
)
def test_check_config_names_a_bad_url_parameter(query: str, named: str) -> None:
    data = {
        "store": {"url": f"postgresql://db/tp?{query}"},
        "routes": [{"name": "r", "path_prefix": "/r", "upstream": "http://h"}],
    }
    with pytest.raises(ConfigError, match=rf"store\.url: .*{named}"):
        parse_config(data, env={})


def test_foreign_errors_are_translated() -> None:
    assert type(translate(psycopg.errors.DiskFull("full"))) is StoreRefused
    assert type(translate(psycopg.errors.ProgramLimitExceeded("big"))) is StoreRefused
    assert type(translate(psycopg.errors.AdminShutdown("bye"))) is StoreUnavailable
    assert type(translate(psycopg.errors.TooManyConnections("many"))) is StoreUnavailable
    assert type(translate(psycopg.errors.DeadlockDetected("dead"))) is StoreUnavailable
    assert type(translate(psycopg.OperationalError("no route"))) is StoreUnavailable
    assert type(translate(psycopg_pool.PoolTimeout("dry"))) is StoreUnavailable
    assert type(translate(psycopg.errors.UndefinedFunction("old schema"))) is StoreError


async def test_an_unreachable_server_is_store_unavailable_quickly() -> None:
    store = PostgresStore(f"postgresql://postgres@127.0.0.1:{free_port()}/x?pool_timeout=300ms")
    started = time.monotonic()
    await store.open()  # as with Redis: the proxy starts, and fails closed
    with pytest.raises(StoreUnavailable, match="postgres"):
        await store.get(KEY)
    with pytest.raises(StoreUnavailable, match="postgres"):
        await store.ping()
    await store.close()
    assert time.monotonic() - started < 5


# -- the schema -----------------------------------------------------------------------------


async def test_replicas_starting_at_once_apply_the_schema_once(
    postgres_server: PostgresServer,
) -> None:
    dbname = postgres_server.create_database()
    stores = [PostgresStore(postgres_server.url(dbname)) for _ in range(4)]
    try:
        await asyncio.gather(*(store.open() for store in stores))
        assert (await stores[0].claim(KEY, "fp", "a", 5, 60)).claimed
        assert not (await stores[3].claim(KEY, "fp", "b", 5, 60)).claimed
        with postgres_server.admin(dbname) as conn:
            rows = conn.execute("SELECT version FROM tool_proxy.schema_version").fetchall()
        assert rows == [(version,) for version, _ in MIGRATIONS]  # each applied once
    finally:
        for store in stores:
            await store.close()
        postgres_server.drop_database(dbname)


async def test_a_newer_schema_is_refused_at_start_up(
    store: PostgresStore, postgres_url: str, postgres_server: PostgresServer, postgres_database: str
) -> None:
    with postgres_server.admin(postgres_database) as conn:
        conn.execute("INSERT INTO tool_proxy.schema_version (version) VALUES (999)")
    store = PostgresStore(postgres_url)
    try:
        with pytest.raises(StoreError, match="version 999, newer"):
            await store.open()
    finally:
        await store.close()
        with postgres_server.admin(postgres_database) as conn:
            conn.execute("DELETE FROM tool_proxy.schema_version WHERE version = 999")


def _migrate(tmp_path: Path, url: str) -> subprocess.CompletedProcess[str]:
    """``tool-proxy migrate`` on a configuration naming ``url``, as a process."""
    config = tmp_path / "migrate.yaml"
    routes = [{"name": "t", "path_prefix": "/t", "upstream": "http://127.0.0.1:9"}]
    config.write_text(yaml.safe_dump({"store": {"url": url}, "routes": routes}))
    return subprocess.run(
        [sys.executable, "-m", "proxy.cli", "migrate", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
    )


async def test_migrate_applies_the_schema_once_and_then_finds_it_done(
    postgres_server: PostgresServer, tmp_path: Path
) -> None:
    dbname = postgres_server.create_database()
    url = f"{postgres_server.url(dbname)}?schema=migrated"
    latest = MIGRATIONS[-1][0]
    try:
        first = await asyncio.to_thread(_migrate, tmp_path, url)
        assert first.returncode == 0, first.stderr
        assert (
            first.stdout == f"ok: schema migrated at version {latest} (migrated from version 0)\n"
        )
        again = await asyncio.to_thread(_migrate, tmp_path, url)
        assert again.stdout == f"ok: schema migrated at version {latest} (already up to date)\n"
        with postgres_server.admin(dbname) as conn:
            rows = conn.execute(
                "SELECT version FROM migrated.schema_version ORDER BY version"
            ).fetchall()
        assert rows == [(version,) for version, *_ in MIGRATIONS]  # each applied once
        store = PostgresStore(url)  # a replica starting on it finds nothing to do
        await store.open()
        try:
            assert (await store.claim(KEY, "fp", "a", 5, 60)).claimed
        finally:
            await store.close()
    finally:
        postgres_server.drop_database(dbname)


async def test_migrate_says_why_it_cannot(tmp_path: Path) -> None:
    down = f"postgresql://postgres@127.0.0.1:{free_port()}/nothing?connect_timeout=1"
    failed = await asyncio.to_thread(_migrate, tmp_path, down)
    assert failed.returncode == 1
    assert failed.stderr.startswith("error: ") and "Traceback" not in failed.stderr
    other = await asyncio.to_thread(_migrate, tmp_path, "sqlite:///tmp/x.db")
    assert other.returncode == 2
    assert "store.url: migrate applies the PostgreSQL schema; sqlite:///tmp/x.db has none" in (
        other.stderr
    )


async def _migrated_to(
    version: int, server: PostgresServer, dbname: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Apply the schema of ``dbname`` up to ``version`` only: a database of that release."""
    with monkeypatch.context() as patch:
        patch.setattr(postgres, "MIGRATIONS", MIGRATIONS[:version])
        async with await psycopg.AsyncConnection.connect(
            parse_postgres_url(server.url(dbname)).conninfo, autocommit=True
        ) as conn:
            assert await postgres.migrate(conn, "tool_proxy") == version


async def test_version_2_upgrades_a_version_1_database_whose_replicas_keep_working(
    postgres_server: PostgresServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The replays counter (version 2) is added to a database of version 1 with its
    records; version 1's claim, as its replicas still running call it, answers as before
    and counts the replays too."""
    dbname = postgres_server.create_database()
    v1_claim = "SELECT * FROM tool_proxy.claim(%s, %s, %s, 'fp', %s, 5, 60, false, NULL)"
    complete = (
        "SELECT tool_proxy.complete(%s, %s, %s, 'a', 'fp', 'completed', 'done', 60, true,"
        " 'a', NULL)"
    )
    await _migrated_to(1, postgres_server, dbname, monkeypatch)
    args = (*KEY, KEY.scope)
    with postgres_server.admin(dbname) as conn:
        assert conn.execute(v1_claim, (*args, "a")).fetchone()[0] is True  # type: ignore[index]
        assert conn.execute(complete, args).fetchone() == (True,)
    store = PostgresStore(postgres_server.url(dbname))
    try:
        await store.open()
        record = await store.get(KEY)
        assert record is not None and (record.payload, record.replays) == (b"done", 0)
        with postgres_server.admin(dbname) as conn:
            old = conn.execute(v1_claim, (*args, "b")).fetchone()
            versions = conn.execute("SELECT version FROM tool_proxy.schema_version").fetchall()
        assert old is not None and len(old) == 11 and old[:2] == (False, None)
        assert versions == [(version,) for version, _ in MIGRATIONS]
        replayed = await store.claim(KEY, "fp", "c", 5, 60)
        assert replayed.record is not None and replayed.record.replays == 2
    finally:
        await store.close()
        postgres_server.drop_database(dbname)


async def test_version_3_upgrades_a_version_2_database_whose_replicas_keep_working(
    postgres_server: PostgresServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A version's mark in its answer (version 3) on a database of version 2: the mark a
    replica of version 2 left is seen as writing, and version 1's ``version_op``, as those
    replicas still running call it, answers as before (two columns) on the same entries."""
    dbname = postgres_server.create_database()
    v1_op = "SELECT * FROM tool_proxy.version_op(%s, 'scope', 'res', %s, %s, 60, 0, NULL)"
    await _migrated_to(2, postgres_server, dbname, monkeypatch)
    with postgres_server.admin(dbname) as conn:
        begun = conn.execute(v1_op, ("begin", "old", False)).fetchone()
    assert begun == (1, False)
    store = PostgresStore(postgres_server.url(dbname))
    try:
        await store.open()
        locks = make_locks(store)
        assert (await locks.version("scope", "res", 60)).writing  # the old replica's mark
        with postgres_server.admin(dbname) as conn:
            assert conn.execute(v1_op, ("read", "", False)).fetchone() == (1, False)
            assert conn.execute(v1_op, ("settle", "old", True)).fetchone() == (2, True)
            versions = conn.execute("SELECT version FROM tool_proxy.schema_version").fetchall()
        assert versions == [(1,), (2,), (3,)]
        settled = await locks.version("scope", "res", 60)
        assert (settled.number, settled.written, settled.writing) == (2, True, False)
        assert (await locks.begin("scope", "res", "new", 60)).writing
        with postgres_server.admin(dbname) as conn:  # an old replica's read meanwhile
            assert conn.execute(v1_op, ("read", "", False)).fetchone() == (2, True)
        assert await locks.settle("scope", "res", "new", False, 60) == 2
    finally:
        await store.close()
        postgres_server.drop_database(dbname)


async def test_a_schema_of_its_own_keeps_stores_apart(postgres_url: str) -> None:
    mine, theirs = PostgresStore(postgres_url), PostgresStore(f"{postgres_url}?schema=other")
    await mine.open()
    await theirs.open()
    try:
        assert (await mine.claim(KEY, "fp", "a", 5, 60)).claimed
        assert (await theirs.claim(KEY, "fp", "b", 5, 60)).claimed
    finally:
        await mine.close()
        await theirs.close()


async def test_sweep_deletes_what_expired_in_every_table_but_the_counters(
    postgres_url: str, postgres_server: PostgresServer, postgres_database: str, clock: Clock
) -> None:
    store = PostgresStore(postgres_url, clock)
    await store.open()
    try:
        await store.claim(KEY, "fp", "a", 1, 2)
        await store.put_value("v", b"x", 2)
        await make_buckets(store).take("g", [Rate("r", 0.5, 1)], [Slots("s", 1)], "a", 2)
        await make_buckets(store).pause("g", 2)
        await make_locks(store).acquire("scope", "res", "a", 2)
        await make_locks(store).version("scope", "other", 2)
        await make_queue(store).submit(Job("job-1", "r", "p", "s", "n", "l", b"rq", 2))
        assert await store.sweep() == 0  # nothing expired yet
        clock.now += 3
        assert await store.sweep() == 1  # the record
        with postgres_server.admin(postgres_database) as conn:
            left = {
                str(table): conn.execute(f"SELECT count(*) FROM tool_proxy.{table}").fetchone()
                for (table,) in conn.execute(
                    "SELECT tablename FROM pg_tables WHERE schemaname = 'tool_proxy'"
                ).fetchall()
            }
        assert {t: n for t, n in left.items() if n != (0,)} == {
            "resource_counters": (1,),  # a scope's counter never goes (tokens only grow)
            "schema_version": (len(MIGRATIONS),),  # a row per version applied
        }
    finally:
        await store.close()


async def test_replicas_claiming_one_key_at_once_have_one_winner(postgres_url: str) -> None:
    stores = [PostgresStore(postgres_url) for _ in range(3)]
    for store in stores:
        await store.open()
    try:
        claims = await asyncio.gather(
            *(stores[i % 3].claim(KEY, "fp", f"o{i}", 5, 60) for i in range(30))
        )
        assert sum(claim.claimed for claim in claims) == 1
    finally:
        for store in stores:
            await store.close()


async def test_workers_of_several_replicas_take_each_job_once(postgres_url: str) -> None:
    stores = [PostgresStore(postgres_url) for _ in range(3)]
    for store in stores:
        await store.open()
    try:
        queues = [make_queue(store) for store in stores]
        for n in range(10):
            await queues[0].submit(Job(f"job-{n}", "r", "p", "s", "n", "l", b"rq", 60))
        taken = await asyncio.gather(*(queues[i % 3].take("r", f"w{i}", 30) for i in range(30)))
        ids = [job.id for job in taken if job is not None]
        assert sorted(ids) == sorted(f"job-{n}" for n in range(10))  # each once, none lost
    finally:
        for store in stores:
            await store.close()


# -- job changes ----------------------------------------------------------------------------


async def test_job_changes_reach_the_listeners_of_other_replicas(
    store: PostgresStore, postgres_url: str
) -> None:
    """A submit on one replica is heard on another's ``changes`` (NOTIFY). The listener
    may connect after a first submit (best effort), so the submits go on until one is
    heard."""
    other = PostgresStore(postgres_url)
    await other.open()
    changes = make_queue(other).changes()
    listening = asyncio.ensure_future(anext(changes))
    try:
        for n in range(25):
            await make_queue(store).submit(Job(f"job-{n}", "r", "p", "s", "n", "l", b"rq", 60))
            done, _ = await asyncio.wait({listening}, timeout=0.2)
            if done:
                break
        assert (await asyncio.wait_for(listening, 1)).startswith("job-")
    finally:
        listening.cancel()
        await asyncio.gather(listening, return_exceptions=True)
        await changes.aclose()  # type: ignore[attr-defined]
        await other.close()


# -- round trips ----------------------------------------------------------------------------


class Calls:
    """Counts the store's calls: each is one statement, one round trip."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.names: Counter[str] = Counter()
        real = PostgresStore.call

        async def counted(store: PostgresStore, function: str, args: Any) -> Any:
            self.names[function] += 1
            return await real(store, function, args)

        monkeypatch.setattr(PostgresStore, "call", counted)

    def take(self) -> Counter[str]:
        names, self.names = self.names, Counter()
        return names


def test_two_round_trips_per_first_execution_and_one_per_replay(
    make_proxy: ProxyFactory,
    tool: CountingTool,
    postgres_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = Calls(monkeypatch)
    proxy = make_proxy(route(tool.url), store=postgres_url)
    key = new_key(BODY)
    calls.take()  # start-up
    first = httpx.post(f"{proxy.url}/tools/a", json=BODY, headers={"Idempotency-Key": key})
    assert first.status_code == 200
    assert calls.take() == {"claim_v2": 1, "complete": 1}
    replay = httpx.post(f"{proxy.url}/tools/a", json=BODY, headers={"Idempotency-Key": key})
    assert replay.headers["idempotent-replayed"] == "true"
    assert calls.take() == {"claim_v2": 1}  # the replay counted in the same statement


# -- faults ---------------------------------------------------------------------------------


def test_an_exhausted_pool_is_a_quick_503_not_a_hang(
    make_proxy: ProxyFactory,
    tool: CountingTool,
    postgres_server: PostgresServer,
    postgres_database: str,
    postgres_url: str,
) -> None:
    url = f"{postgres_url}?pool_min=1&pool_max=1&pool_timeout=300ms&timeout=20s"
    proxy = make_proxy(route(tool.url), store=url)
    assert httpx.post(
        f"{proxy.url}/tools/a", json=BODY, headers={"Idempotency-Key": new_key(BODY)}
    ).is_success
    blocker = postgres_server.admin(postgres_database)
    blocker.execute("BEGIN")
    blocker.execute("LOCK TABLE tool_proxy.records IN ACCESS EXCLUSIVE MODE")
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            key = new_key(BODY)
            stuck = pool.submit(
                httpx.post,
                f"{proxy.url}/tools/a",
                json=BODY,
                headers={"Idempotency-Key": key},
                timeout=30,
            )
            _wait_for_a_waiting_claim(postgres_server, postgres_database)
            started = time.monotonic()
            refused = httpx.post(
                f"{proxy.url}/tools/a", json=BODY, headers={"Idempotency-Key": new_key(BODY)}
            )
            assert time.monotonic() - started < 2
            assert refused.status_code == 503
            assert refused.json()["type"] == "urn:tool-proxy:problem:store-unavailable"
            assert "no free connection" in refused.json()["detail"]
            blocker.execute("ROLLBACK")
            assert stuck.result().status_code == 200  # the held one goes on when it can
            assert tool.count(key) == 1
    finally:
        blocker.close()


async def test_a_call_past_its_timeout_is_store_unavailable_and_the_pool_goes_on(
    postgres_server: PostgresServer, postgres_database: str, postgres_url: str
) -> None:
    store = PostgresStore(f"{postgres_url}?pool_max=1&timeout=500ms")
    await store.open()
    blocker = postgres_server.admin(postgres_database)
    blocker.execute("BEGIN")
    blocker.execute("LOCK TABLE tool_proxy.records IN ACCESS EXCLUSIVE MODE")
    try:
        started = time.monotonic()
        with pytest.raises(StoreUnavailable, match="timed out"):
            await store.claim(KEY, "fp", "a", 5, 60)
        assert time.monotonic() - started < 2
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    try:
        assert (await store.claim(KEY, "fp", "a", 5, 60)).claimed  # the pool goes on
    finally:
        await store.close()


def _wait_for_a_waiting_claim(server: PostgresServer, dbname: str) -> None:
    """Until a connection of the store waits on the lock the test holds."""
    with server.admin() as conn:
        for _ in range(200):
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND wait_event_type"
                " = 'Lock' AND query LIKE '%%claim%%'",
                (dbname,),
            ).fetchone()
            if row is not None and row[0]:
                return
            time.sleep(0.02)
    raise AssertionError("no claim waits on the lock")


def test_a_proxy_started_before_its_server_fails_closed_then_migrates_and_works(
    make_proxy: ProxyFactory, tool: CountingTool, own_postgres: PostgresServer
) -> None:
    dbname = own_postgres.create_database()  # empty: no schema yet
    own_postgres.kill()
    try:
        url = own_postgres.url(dbname, pool_timeout="300ms")
        proxy = make_proxy(route(tool.url), store=url)
        key = new_key(BODY)
        headers = {"Idempotency-Key": key}
        refused = httpx.post(f"{proxy.url}/tools/a", json=BODY, headers=headers)
        assert refused.status_code == 503
        assert httpx.get(f"{proxy.url}/_proxy/readyz").status_code == 503
        assert tool.count(key) == 0
    finally:
        own_postgres.start()
    started = time.monotonic()
    while (ok := httpx.post(f"{proxy.url}/tools/a", json=BODY, headers=headers)).status_code == 503:
        assert time.monotonic() - started < RECONNECT_SECONDS + 3, ok.text  # the pool reconnects
        time.sleep(0.1)
    assert ok.status_code == 200, ok.text  # the schema was applied by the first call
    assert tool.count(key) == 1
    own_postgres.drop_database(dbname)


def test_a_server_restarted_and_killed_under_guarded_calls_fails_closed_and_runs_nothing_twice(
    make_proxy: ProxyFactory, tool: CountingTool, own_postgres: PostgresServer
) -> None:
    """Four callers each retry their keys until answered while the server is restarted,
    then killed and started: calls fail closed (503) meanwhile, none runs twice, and
    every key ends answered. (A claim committed just before a crash whose answer was lost
    is an unknown outcome, 502, once its lease lapses: never sent, never sent twice.)"""
    dbname = own_postgres.create_database()
    url = own_postgres.url(dbname, pool_max="4", pool_timeout="500ms", timeout="3s")
    proxy = make_proxy(route(tool.url, lock_ttl="1s"), store=url)
    answers: dict[str, list[int]] = {key: [] for key in (new_key(BODY) for _ in range(40))}

    def caller(mine: list[str]) -> None:
        with httpx.Client(timeout=30) as client:
            for key in mine:
                while not answers[key] or answers[key][-1] in (409, 503):
                    sent = client.post(
                        f"{proxy.url}/tools/a", json=BODY, headers={"Idempotency-Key": key}
                    )
                    answers[key].append(sent.status_code)
                    time.sleep(0.05)

    keys = list(answers)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        running = [pool.submit(caller, keys[i::4]) for i in range(4)]
        time.sleep(0.3)
        own_postgres.restart()
        time.sleep(0.3)
        own_postgres.kill()
        time.sleep(0.3)
        own_postgres.start()
        for done in running:
            done.result(timeout=60)  # every key ends answered: the store works again
    seen = Counter(status for history in answers.values() for status in history)
    assert set(seen) <= {200, 409, 502, 503}, seen
    assert seen[503] > 0  # the faults were met: those calls failed closed
    assert all(tool.count(key) <= 1 for key in keys)  # nothing executed twice
    assert all(tool.count(key) == 1 for key in keys if answers[key][-1] == 200)
    own_postgres.drop_database(dbname)


async def test_through_pgbouncer_in_transaction_mode(
    postgres_server: PostgresServer, postgres_database: str, postgres_url: str
) -> None:
    """Every call is one autocommit statement, so a transaction-mode pooler may run each
    on another server connection. Statements are not prepared (by default), which
    PgBouncer before 1.21 refuses: with ``prepare=true`` this test fails on 1.18."""
    bouncer = PgBouncer(postgres_server).start()
    stores = [PostgresStore(f"{bouncer.url(postgres_database)}?pool_max=4") for _ in range(2)]
    try:
        for store in stores:
            await store.open()
        keys = [RecordKey(f"route|alice|plan|{n}", "h") for n in range(20)]
        claims = await asyncio.gather(
            *(stores[n % 2].claim(key, "fp", f"o{n}", 5, 60) for n, key in enumerate(keys * 2))
        )
        assert sum(claim.claimed for claim in claims) == len(keys)  # one winner per key
        for n, (key, claim) in enumerate(zip(keys * 2, claims, strict=True)):
            if claim.claimed:
                assert await stores[0].complete(key, f"o{n}", "fp", State.COMPLETED, b"x", 60)
        assert all(
            record is not None and record.state is State.COMPLETED
            for record in await asyncio.gather(*(stores[1].get(key) for key in keys))
        )
    finally:
        for store in stores:
            await store.close()
        bouncer.stop()
