"""Large responses in object storage: a real S3 (moto's server), local files, memory."""

from __future__ import annotations

import asyncio
import hashlib
import re
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import boto3
import httpx
import obstore
import pytest
from moto.server import ThreadedMotoServer
from obstore.store import from_url

from proxy.config import OffloadConfig, parse_config
from proxy.offload import EXPIRY_MARGIN_SECONDS, Offload, expiry_of
from proxy.store import RecordKey, make_store
from tests.conftest import ProxyFactory, new_key, route
from tests.servers import CountingTool, free_port

BUCKET = "tool-proxy-test"
BODY = {"report": "big"}


class S3:
    """moto's S3 server on a free port, with one bucket."""

    def __init__(self) -> None:
        self.port = free_port()
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self) -> Any:
        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1")

    def keys(self) -> list[str]:
        listing = self.client().list_objects_v2(Bucket=BUCKET)
        return [item["Key"] for item in listing.get("Contents", [])]


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[S3]:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    server = S3()
    server.server.start()
    httpx.post(f"{server.endpoint}/moto-api/reset")  # moto's state is per process
    server.client().create_bucket(Bucket=BUCKET)
    yield server
    server.server.stop()


def s3_offload(s3: S3, threshold: int = 1024) -> dict[str, Any]:
    return {
        "url": f"s3://{BUCKET}/responses",
        "threshold_bytes": threshold,
        "endpoint_url": s3.endpoint,
        "region": "us-east-1",
        "allow_http": True,
    }


def expected(size: int) -> bytes:
    return (bytes(range(256)) * (size // 256 + 1))[:size]


def dechunked(data: bytes) -> bytes:
    """A chunked HTTP/1.1 body, decoded (it must end with its last chunk)."""
    body = bytearray()
    while True:
        line, _, data = data.partition(b"\r\n")
        size = int(line, 16)
        if size == 0:
            return bytes(body)
        body.extend(data[:size])
        data = data[size + 2 :]


def fill_the_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    """From now on, temporary files open but every write to them fails with ENOSPC."""
    import errno
    import os
    import tempfile

    opened = tempfile.TemporaryFile

    class FullDisk:
        def __init__(self) -> None:
            self.file = opened()

        def write(self, data: bytes) -> int:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def __getattr__(self, name: str) -> Any:
            return getattr(self.file, name)

    monkeypatch.setattr(tempfile, "TemporaryFile", FullDisk)


def call(url: str, key: str) -> httpx.Response:
    return httpx.post(url, json=BODY, headers={"Idempotency-Key": key}, timeout=60)


def stored_payload(store_url: str, key: str) -> bytes:
    plan, step, args_hash = key.split(":")

    async def read() -> bytes:
        store = make_store(store_url)
        await store.open()
        record = await store.get(RecordKey(f"tool||{plan}|{step}", args_hash))
        await store.close()
        assert record is not None
        return record.payload

    return asyncio.run(read())


@pytest.mark.parametrize("size", [1024 - 50, 150 * 1024, 5 * 1024 * 1024])
def test_s3_replays_byte_for_byte(
    tool: CountingTool, make_proxy: ProxyFactory, s3: S3, tmp_path: Path, size: int
) -> None:
    store_url = f"sqlite://{tmp_path}/state.db"
    proxy = make_proxy(route(tool.url), store=store_url, offload=s3_offload(s3))
    key = new_key(BODY)
    first = call(f"{proxy.url}/tools/big?size={size}", key)
    replay = call(f"{proxy.url}/tools/big?size={size}", key)
    assert first.content == replay.content == expected(size)
    assert replay.headers["idempotent-replayed"] == "true"
    assert replay.headers["content-length"] == str(size)
    assert tool.count(key) == 1
    payload = stored_payload(store_url, key)
    if size > 1024:
        assert len(payload) < 1024  # only the pointer is in the store
        [object_key] = s3.keys()
        assert re.fullmatch(r"responses/tool/[0-9]{10}-[0-9a-f]{32}", object_key)
        assert expiry_of(object_key.removeprefix("responses/")) == pytest.approx(
            time.time() + 3600 + EXPIRY_MARGIN_SECONDS, abs=60
        )  # the route's result_ttl (1 h) plus the margin
        assert hashlib.sha256(expected(size)).hexdigest().encode() in payload
        assert (
            f"s3://{BUCKET}/responses/{object_key.removeprefix('responses/')}".encode() in payload
        )
    else:
        assert s3.keys() == []
        assert payload.endswith(expected(size))


@pytest.mark.parametrize("backend", ["file", "memory"])
def test_local_backends(
    tool: CountingTool, make_proxy: ProxyFactory, tmp_path: Path, backend: str
) -> None:
    url = f"file://{tmp_path}/objects" if backend == "file" else "memory://"
    if backend == "file":
        (tmp_path / "objects").mkdir()
    store_url = f"sqlite://{tmp_path}/state.db"
    offload = {"url": url, "threshold_bytes": 100}
    proxy = make_proxy(route(tool.url), store=store_url, offload=offload)
    key = new_key(BODY)
    first = call(f"{proxy.url}/tools/big?size=200000", key)
    replay = call(f"{proxy.url}/tools/big?size=200000", key)
    assert first.content == replay.content == expected(200000)
    assert replay.headers["idempotent-replayed"] == "true"
    assert tool.count(key) == 1
    payload = stored_payload(store_url, key)
    assert len(payload) < 1024  # only the pointer is in the store
    assert hashlib.sha256(expected(200000)).hexdigest().encode() in payload
    if backend == "file":
        files = [p for p in (tmp_path / "objects").rglob("*") if p.is_file()]
        assert len(files) == 1 and files[0].read_bytes() == expected(200000)


def test_object_deleted_behind_the_proxys_back_is_a_502(
    tool: CountingTool, make_proxy: ProxyFactory, s3: S3
) -> None:
    proxy = make_proxy(route(tool.url), offload=s3_offload(s3))
    key = new_key(BODY)
    assert call(f"{proxy.url}/tools/big?size=5000", key).status_code == 200
    [object_key] = s3.keys()
    s3.client().delete_object(Bucket=BUCKET, Key=object_key)
    replay = call(f"{proxy.url}/tools/big?size=5000", key)
    assert replay.status_code == 502
    assert replay.headers["content-type"] == "application/problem+json"
    assert replay.json()["type"].endswith("stored-response-unavailable")
    assert tool.count(key) == 1  # never executed again


def test_an_offloaded_body_after_offload_is_removed_is_a_502_never_a_second_run(
    tool: CountingTool, make_proxy: ProxyFactory, tmp_path: Path
) -> None:
    """The next deployment drops ``offload``: a record that points at an object is a 502
    stored-response-unavailable, not a reason to execute again."""
    (tmp_path / "objects").mkdir()
    store_url = f"sqlite://{tmp_path}/state.db"
    offload = {"url": f"file://{tmp_path}/objects", "threshold_bytes": 1000}
    before = make_proxy(route(tool.url), store=store_url, offload=offload)
    key = new_key(BODY)
    assert call(f"{before.url}/tools/big?size=5000", key).status_code == 200
    before.stop()
    after = make_proxy(route(tool.url), store=store_url)
    replay = call(f"{after.url}/tools/big?size=5000", key)
    assert replay.status_code == 502
    assert replay.headers["content-type"] == "application/problem+json"
    assert replay.json()["type"].endswith("stored-response-unavailable")
    assert "no object store is configured" in replay.json()["detail"]
    assert tool.count(key) == 1


def test_corrupt_large_object_is_cut_short_never_a_wrong_body(
    tool: CountingTool, make_proxy: ProxyFactory, s3: S3
) -> None:
    size = 3 * 1024 * 1024
    proxy = make_proxy(route(tool.url), offload=s3_offload(s3))
    key = new_key(BODY)
    assert call(f"{proxy.url}/tools/big?size={size}", key).status_code == 200
    [object_key] = s3.keys()
    s3.client().put_object(Bucket=BUCKET, Key=object_key, Body=b"x" * size)
    received = bytearray()

    def replay() -> None:
        with httpx.stream(
            "POST",
            f"{proxy.url}/tools/big?size={size}",
            json=BODY,
            headers={"Idempotency-Key": key},
            timeout=60,
        ) as response:
            assert response.headers["content-length"] == str(size)
            for chunk in response.iter_raw():
                received.extend(chunk)

    with pytest.raises(httpx.RemoteProtocolError):
        replay()
    assert len(received) < size  # the last chunk is held back and never sent
    assert tool.count(key) == 1


def test_corrupt_object_is_a_502_never_a_wrong_body(
    tool: CountingTool, make_proxy: ProxyFactory, s3: S3
) -> None:
    proxy = make_proxy(route(tool.url), offload=s3_offload(s3))
    key = new_key(BODY)
    assert call(f"{proxy.url}/tools/big?size=5000", key).status_code == 200
    [object_key] = s3.keys()
    s3.client().put_object(Bucket=BUCKET, Key=object_key, Body=b"x" * 5000)
    replay = call(f"{proxy.url}/tools/big?size=5000", key)
    assert replay.status_code == 502
    assert b"x" * 100 not in replay.content


def test_object_store_down_while_recording_keeps_the_outcome_inline(
    tool: CountingTool, make_proxy: ProxyFactory, s3: S3, tmp_path: Path
) -> None:
    store_url = f"sqlite://{tmp_path}/state.db"
    proxy = make_proxy(route(tool.url), store=store_url, offload=s3_offload(s3))
    s3.server.stop()
    key = new_key(BODY)
    first = call(f"{proxy.url}/tools/big?size=5000", key)
    replay = call(f"{proxy.url}/tools/big?size=5000", key)
    assert first.status_code == replay.status_code == 200
    assert replay.content == first.content == expected(5000)
    assert replay.headers["idempotent-replayed"] == "true"
    assert tool.count(key) == 1
    assert stored_payload(store_url, key).endswith(expected(5000))
    s3.server.start()  # the fixture stops it again


def test_response_above_max_stored_bytes_executes_once_and_is_not_replayed(
    tool: CountingTool, make_proxy: ProxyFactory
) -> None:
    proxy = make_proxy(route(tool.url, max_stored_bytes=10_000))
    key = new_key(BODY)
    first = call(f"{proxy.url}/tools/big?size=20000", key)
    retry = call(f"{proxy.url}/tools/big?size=20000", key)
    small_key = new_key(BODY, step=2)
    small = call(f"{proxy.url}/tools/big?size=5000", small_key)
    small_retry = call(f"{proxy.url}/tools/big?size=5000", small_key)
    assert first.status_code == 200 and first.content == expected(20000)
    assert retry.status_code == 410
    assert retry.json()["type"].endswith("response-not-stored")
    assert retry.headers["idempotent-replayed"] == "true"
    assert small_retry.content == small.content == expected(5000)
    assert tool.count(key) == 1


class Clock:
    """A wall clock the test moves by hand."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def sweep_offload(request: pytest.FixtureRequest, tmp_path: Path, backend: str) -> dict[str, Any]:
    """The offload config of ``backend``: a directory, or moto's S3."""
    if backend == "file":
        (tmp_path / "objects").mkdir()
        return {"url": f"file://{tmp_path}/objects"}
    return s3_offload(request.getfixturevalue("s3"))


async def write_foreign(config: dict[str, Any], path: str) -> None:
    """An object the proxy did not write with an expiry: another deployment's, or an
    older version's (``<route>/<32 hex digits>``)."""
    options: dict[str, Any] = {}
    if "endpoint_url" in config:
        options = {
            "config": {"endpoint": config["endpoint_url"], "region": config["region"]},
            "client_options": {"allow_http": True},
        }
    await obstore.put_async(from_url(config["url"], **options), path, b"foreign")


async def names(offload: Offload) -> list[str]:
    found = [m["path"] async for chunk in obstore.list(offload._store) for m in chunk]
    return sorted(found)


@pytest.mark.parametrize("backend", ["file", "s3"])
def test_sweep_deletes_only_expired_objects_named_with_an_expiry(
    request: pytest.FixtureRequest, tmp_path: Path, backend: str
) -> None:
    config = sweep_offload(request, tmp_path, backend)
    clock = Clock(2_000_000_000.0)
    offload = Offload(OffloadConfig(**config), {"tool": 600.0}, clock=clock)

    foreign = sorted([f"tool/{'a' * 32}", "other-deployment/report.json"])

    async def run() -> tuple[list[str], list[int]]:
        live = await offload.put("tool", b"live")  # the route's result_ttl: 600 s
        expiring = await offload.put("tool", b"soon", keep_for=60.0)
        for name in foreign:
            await write_foreign(config, name)
        assert expiry_of(live.path) == 2_000_000_000 + 600 + EXPIRY_MARGIN_SECONDS
        assert expiry_of(expiring.path) == 2_000_000_000 + 60 + EXPIRY_MARGIN_SECONDS
        clock.now += 60 + EXPIRY_MARGIN_SECONDS + 1  # past the second one's expiry only
        swept = [await offload.sweep()]
        assert await names(offload) == sorted([live.path, *foreign])
        clock.now += 10 * 365 * 86400.0  # years later: every expiry has passed
        swept.append(await offload.sweep())
        return await names(offload), swept

    assert asyncio.run(run()) == (foreign, [1, 1])


@pytest.mark.parametrize("backend", ["file", "s3"])
def test_lowering_result_ttl_does_not_sweep_bodies_recorded_before(
    request: pytest.FixtureRequest, tmp_path: Path, backend: str
) -> None:
    """Recorded with result_ttl 24 h; the next deployment says 1 s, and sweeps two hours
    later: the record still lives, so its body does too."""
    config = OffloadConfig(**sweep_offload(request, tmp_path, backend))
    clock = Clock(time.time())
    before = Offload(config, {"tool": 86400.0}, clock=clock)
    after = Offload(config, {"tool": 1.0}, clock=clock)

    async def run() -> tuple[int, bytes | AsyncIterator[bytes]]:
        ref = await before.put("tool", b"recorded yesterday")
        clock.now += 2 * 3600.0
        return await after.sweep(), await after.get(ref)

    assert asyncio.run(run()) == (0, b"recorded yesterday")


def test_offload_sweep_false_leaves_the_objects_alone() -> None:
    config = parse_config(
        {"routes": [route("http://127.0.0.1:9")], "offload": {"url": "memory://", "sweep": False}},
        env={},
    )
    assert config.offload is not None and not Offload(config.offload).sweeps
    assert Offload(OffloadConfig(url="memory://")).sweeps


def test_expiry_is_read_only_from_names_of_the_scheme() -> None:
    assert expiry_of(f"tool/1700000000-{'0' * 32}") == 1700000000
    for name in (
        f"tool/{'0' * 32}",  # written before names carried an expiry
        f"tool/1700000000-{'0' * 31}",
        f"a/b/1700000000-{'0' * 32}",
        f"tool/x1700000000-{'0' * 32}",
        "1700000000-" + "0" * 32,
    ):
        assert expiry_of(name) is None, name


def test_offloaded_response_streams_to_the_caller_while_it_is_recorded(
    tool: CountingTool, make_proxy: ProxyFactory, tmp_path: Path
) -> None:
    import time

    proxy = make_proxy(route(tool.url), offload={"url": "memory://", "threshold_bytes": 1000})
    key = new_key(BODY)
    size = 16 * 65536  # 16 chunks, 0.1 s apart: the upstream takes about 1.5 s
    url = f"{proxy.url}/tools/big?size={size}&chunk_delay=0.1"
    started = time.monotonic()
    first_byte_at = None
    body = bytearray()
    with httpx.stream("POST", url, json=BODY, headers={"Idempotency-Key": key}, timeout=60) as r:
        for chunk in r.iter_raw():
            first_byte_at = first_byte_at or time.monotonic() - started
            body.extend(chunk)
    total = time.monotonic() - started
    assert bytes(body) == expected(size)
    assert first_byte_at is not None and first_byte_at < total / 2  # streamed, not buffered
    replay = call(url, key)
    assert replay.headers["idempotent-replayed"] == "true"
    assert replay.content == expected(size)
    assert tool.count(key) == 1


def test_a_caller_leaving_mid_stream_does_not_stop_the_recording(
    tool: CountingTool, make_proxy: ProxyFactory
) -> None:
    import time

    proxy = make_proxy(route(tool.url), offload={"url": "memory://", "threshold_bytes": 1000})
    key = new_key(BODY)
    size = 8 * 65536
    url = f"{proxy.url}/tools/big?size={size}&chunk_delay=0.1"
    with httpx.stream("POST", url, json=BODY, headers={"Idempotency-Key": key}, timeout=60) as r:
        next(r.iter_raw())  # one chunk, then the caller hangs up
    time.sleep(1.5)  # the upstream finishes; the proxy records without the caller
    replay = call(url, key)
    assert replay.status_code == 200
    assert replay.headers["idempotent-replayed"] == "true"
    assert replay.content == expected(size)
    assert tool.count(key) == 1


def test_a_slow_first_caller_does_not_hold_the_recording_back(
    tool: CountingTool, make_proxy: ProxyFactory
) -> None:
    """The first caller reads nothing for longer than the route's timeout: the recording
    goes on at the tool's pace (the body is far above what socket buffers hold), the
    caller then gets the whole body, and the retry the replay."""
    import socket
    import time

    offload = {"url": "memory://", "threshold_bytes": 1000}
    proxy = make_proxy(route(tool.url, timeout="2s"), offload=offload)
    key = new_key(BODY)
    size = 24 * 1024 * 1024
    payload = b'{"report":"big"}'
    head = (
        f"POST /tools/big?size={size} HTTP/1.1\r\nHost: proxy\r\nConnection: close\r\n"
        f"Content-Type: application/json\r\nIdempotency-Key: {key}\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", proxy.port)) as caller:
        caller.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        caller.sendall(head.encode() + payload)
        time.sleep(3)  # past the route's 2 s timeout, reading nothing
        received = bytearray()
        while chunk := caller.recv(1 << 20):
            received.extend(chunk)
    status_line, _, rest = bytes(received).partition(b"\r\n")
    assert status_line == b"HTTP/1.1 200 OK"
    assert dechunked(rest.partition(b"\r\n\r\n")[2]) == expected(size)
    replay = call(f"{proxy.url}/tools/big?size={size}", key)
    assert replay.headers["idempotent-replayed"] == "true"
    assert replay.content == expected(size)
    assert tool.count(key) == 1


def test_a_spool_that_fails_records_the_call_as_executed_not_stored(
    tool: CountingTool, make_proxy: ProxyFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk under the spool fills up mid-body: the tool did run, so the retry gets
    410 response-not-stored, never a second execution."""
    import errno
    import os

    from proxy.offload import Spool

    write = Spool.write

    def write_until_full(self: Spool, chunk: bytes) -> None:
        if self.size >= 4 * 65536:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        write(self, chunk)

    monkeypatch.setattr(Spool, "write", write_until_full)
    proxy = make_proxy(route(tool.url), offload={"url": "memory://", "threshold_bytes": 1000})
    key = new_key(BODY)
    url = f"{proxy.url}/tools/big?size={16 * 65536}"
    with pytest.raises(httpx.RemoteProtocolError):  # the first caller's body is cut short
        call(url, key)
    retry = call(url, key)
    assert retry.status_code == 410
    assert retry.headers["idempotent-replayed"] == "true"
    assert retry.json()["type"].endswith("response-not-stored")
    assert "No space left on device" in retry.json()["detail"]
    assert tool.count(key) == 1


def test_a_disk_full_when_the_spool_moves_to_disk_cuts_the_response_short(
    tool: CountingTool, make_proxy: ProxyFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The temporary file opens but the first write fails: the caller's response ends
    (it does not spin on a spool shorter than it should be), and the call is kept as
    executed."""
    fill_the_disk(monkeypatch)
    # the first 64 KiB chunk stays in memory (and is readable); the second moves it to disk
    offload_config = {"url": "memory://", "threshold_bytes": 100_000}
    proxy = make_proxy(route(tool.url), offload=offload_config)
    key = new_key(BODY)
    url = f"{proxy.url}/tools/big?size={16 * 65536}"
    with pytest.raises(httpx.RemoteProtocolError):
        call(url, key)
    retry = call(url, key)
    assert retry.status_code == 410
    assert retry.headers["idempotent-replayed"] == "true"
    assert tool.count(key) == 1


def test_a_spool_failure_on_a_release_status_releases_the_key(
    tool: CountingTool, make_proxy: ProxyFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 503 (in release_on_status) frees the key even when its body could not be spooled."""
    import errno
    import os

    from proxy.offload import Spool

    def full(self: Spool, chunk: bytes) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(Spool, "write", full)
    proxy = make_proxy(route(tool.url), offload={"url": "memory://", "threshold_bytes": 1000})
    key = new_key(BODY)
    url = f"{proxy.url}/tools/big?size={4 * 65536}&status=503"
    for _ in range(2):
        with pytest.raises(httpx.RemoteProtocolError):
            call(url, key)
    assert tool.count(key) == 2  # released each time: the retry executed


def test_presigned_url_of_an_offloaded_replay(
    tool: CountingTool, make_proxy: ProxyFactory, s3: S3
) -> None:
    proxy = make_proxy(
        route(tool.url), offload={**s3_offload(s3), "presign": True, "presign_ttl": "2m"}
    )
    key = new_key(BODY)
    first = call(f"{proxy.url}/tools/big?size=5000", key)
    replay = call(f"{proxy.url}/tools/big?size=5000", key)
    assert "content-location" not in first.headers
    location = replay.headers["content-location"]
    assert location.startswith(f"{s3.endpoint}/{BUCKET}/responses/tool/")
    assert "X-Amz-Expires=120" in location
    assert replay.content == expected(5000)
    assert httpx.get(location).content == expected(5000)  # the agent can fetch it itself


def test_spool_stays_whole_in_memory_when_moving_to_disk_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from proxy.offload import Spool

    spool = Spool(threshold=10)
    spool.write(b"12345678")
    fill_the_disk(monkeypatch)
    with pytest.raises(OSError, match="No space left"):
        spool.write(b"abcdef")
    assert spool.read(0, 8) == b"12345678"  # what was readable still is
    with pytest.raises(OSError, match="holds 8 bytes"):
        spool.read(0, 14)  # never a short read taken for data
    spool.close()


def test_spool_reads_any_part_while_it_grows_on_disk() -> None:
    from proxy.offload import Spool

    spool = Spool(threshold=4)
    spool.write(b"abc")
    assert spool.read(1, 2) == b"bc"
    spool.write(b"defgh")  # now on disk
    assert spool.read(0, 8) == b"abcdefgh"
    spool.write(b"ij")
    assert spool.read(6, 4) == b"ghij"
    assert spool.whole() == b"abcdefghij"
    assert spool.sha256 == hashlib.sha256(b"abcdefghij").hexdigest()
    spool.close()
