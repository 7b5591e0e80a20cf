"""The journal: an outcome the store cannot take yet is kept on disk, and recorded later,
also by the next proxy to start."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.journal import Entry, Journal, read_entries
from proxy.store import RecordKey, State
from proxy.store.memory import MemoryStore
from tests.conftest import new_key, route
from tests.guards import EventLog
from tests.servers import CountingTool, ProxyProcess, RedisServer, wait_for

BODY = {"op": "charge", "amount": 42}
# Small timeouts, so an unreachable (paused) Redis is noticed in well under a second.
FAST = "?socket_timeout=0.3&socket_connect_timeout=0.3"


def entry(n: int = 1, payload: bytes = b"v2 200\r\n\r\nok") -> Entry:
    return Entry("tool", f"tool||plan|{n}", "h", "owner", "fp", "completed", 60.0, payload, "k")


def test_entries_survive_a_round_trip_and_a_torn_tail_is_dropped() -> None:
    data = entry(1).encode() + entry(2, b"\x00\xff" * 100).encode()
    assert read_entries(data) == [entry(1), entry(2, b"\x00\xff" * 100)]
    assert read_entries(data[:-3]) == [entry(1)]  # the last write was cut short
    corrupt = bytearray(data)
    corrupt[10] ^= 0xFF
    assert read_entries(bytes(corrupt)) == []


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_journal_left_behind_is_adopted_and_recorded(tmp_path: Path) -> None:
    store, log = MemoryStore(), EventLog()
    key = RecordKey("tool||plan|1", "h")
    await store.claim(key, "fp", "owner", 5, 60)
    first = Journal(tmp_path, store, log)
    first.open()
    await first.keep(entry(1))
    first._pending.clear()  # the process died before the store answered
    assert first._file is not None
    first._file.close()  # and its lock went with it
    second = Journal(tmp_path, store, log)
    second.open()
    assert len(second) == 1 and "journal_adopted" in log.events
    await second.flush()
    record = await store.get(key)
    assert record is not None and (record.state, record.payload) == (
        State.COMPLETED,
        b"v2 200\r\n\r\nok",
    )
    second.close()
    assert not any(name.endswith(".journal") for name in os.listdir(tmp_path))  # all done


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_live_processs_journal_is_never_adopted(tmp_path: Path) -> None:
    store, log = MemoryStore(), EventLog()
    live = Journal(tmp_path, store, log)
    live.open()
    await live.keep(entry(1))
    other = Journal(tmp_path, store, log)
    other.open()
    assert len(other) == 0
    live.close()
    other.close()


def test_the_store_away_longer_than_the_lease_one_execution_outcome_recorded(
    tool: CountingTool, tmp_path: Path
) -> None:
    """Redis stops answering while the tool works, for longer than the lease: the caller
    gets the tool's answer, the outcome waits in the journal, retries never execute
    again, and once Redis answers the outcome is recorded and replayed."""
    redis = RedisServer().start()
    config = {"store": {"url": redis.url + FAST}, "routes": [route(tool.url, lock_ttl="1s")]}
    proxy = ProxyProcess(config, tmp_path).start()
    key = new_key(BODY)
    path = "/tools/charge?delay=0.5"
    try:
        answer = journaled_call(tool, proxy, redis, path, key)
        assert answer.status_code == 200
        time.sleep(1.2)  # longer than the lease
        assert post(proxy.url + path, key).status_code == 503  # fail closed, not executed
        redis.resume()
        wait_for(lambda: "journal_recorded" in names(proxy), what="the late recording")
        replay = post(proxy.url + path, key)
        assert replay.headers["idempotent-replayed"] == "true"
        assert replay.content == answer.content
        assert tool.count(key) == 1
    finally:
        redis.resume()
        proxy.stop()
        redis.stop()


def test_a_journal_outlives_the_proxy_and_the_next_one_records_it(
    tool: CountingTool, tmp_path: Path
) -> None:
    """The proxy is killed while Redis is away: its journal stays on disk, and the next
    proxy on the same state directory records the outcome once Redis answers."""
    redis = RedisServer().start()
    config = {"store": {"url": redis.url + FAST}, "routes": [route(tool.url, lock_ttl="1s")]}
    first = ProxyProcess(config, tmp_path).start()
    key = new_key(BODY)
    path = "/tools/charge?delay=0.3"
    try:
        answer = journaled_call(tool, first, redis, path, key)
        first.kill()
        assert list((tmp_path / "state").glob("*.journal"))
        redis.resume()
        second = ProxyProcess(config, tmp_path).start()
        try:
            wait_for(lambda: "journal_recorded" in names(second), what="the adopted entry")
            replay = post(second.url + path, key)
            assert replay.headers["idempotent-replayed"] == "true"
            assert replay.content == answer.content
            assert tool.count(key) == 1
        finally:
            second.stop()
    finally:
        redis.resume()
        redis.stop()


def journaled_call(
    tool: CountingTool, proxy: ProxyProcess, redis: RedisServer, path: str, key: str
) -> httpx.Response:
    """Send a call, stop Redis while the tool works on it, and wait for the proxy to keep
    its outcome in the journal; the caller's answer."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        call = pool.submit(post, proxy.url + path, key)
        wait_for(lambda: tool.arrived[key] == 1, what="the call at the tool")
        redis.pause()
        answer = call.result()
    wait_for(lambda: "outcome_not_recorded_yet" in names(proxy), what="the journal entry")
    return answer


def post(url: str, key: str) -> httpx.Response:
    return httpx.post(url, json=BODY, headers={"Idempotency-Key": key}, timeout=30)


def names(proxy: ProxyProcess) -> set[str]:
    return {e["event"] for e in proxy.events()}


def test_an_unwritable_state_dir_is_a_cli_error(tmp_path: Path) -> None:
    import subprocess
    import sys

    blocker = tmp_path / "file"
    blocker.write_text("")
    config = tmp_path / "proxy.yaml"
    config.write_text(
        f"store: {{url: 'redis://127.0.0.1:1/0'}}\nstate_dir: {blocker}/state\n"
        "routes: [{name: t, path_prefix: /t, upstream: 'http://127.0.0.1:9'}]\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "proxy.cli", "serve", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2
    assert "state_dir: the journal cannot be kept" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_an_entry_being_written_is_never_truncated_away(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store comes back while an entry is on its way to disk: recording the earlier
    entries must not truncate the file under it."""
    import proxy.journal as journal_module

    store, log = MemoryStore(), EventLog()
    journal = Journal(tmp_path, store, log)
    journal.open()
    await journal.keep(entry(1))
    written = asyncio.Event()
    append = journal_module._append

    def slow_append(file: Any, data: bytes) -> None:
        append(file, data)  # on disk, but not yet known as pending
        time.sleep(0.2)

    monkeypatch.setattr(journal_module, "_append", slow_append)

    async def keep_second() -> None:
        await journal.keep(entry(2))
        written.set()

    task = asyncio.create_task(keep_second())
    await asyncio.sleep(0.05)
    await journal.flush()  # records entry 1 while entry 2 is being written
    await written.wait()
    await task
    assert journal._own is not None
    assert entry(2) in read_entries(journal._own.read_bytes())
    journal.close()


def test_a_journal_file_gone_before_it_is_adopted_is_skipped(tmp_path: Path) -> None:
    journal = Journal(tmp_path, MemoryStore(), EventLog())
    journal._adopt(tmp_path / "gone.journal")  # adopted and finished by another process
    assert len(journal) == 0
