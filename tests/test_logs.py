"""The JSON request log of a real `tool-proxy serve` process."""

from __future__ import annotations

import io
import json
import logging
import socket
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest

from proxy import logs
from proxy.logs import REDACTED, redact
from tests.conftest import new_key, route
from tests.servers import CountingTool, ProxyProcess, wait_for

SECRET = "eyJhbGciOiJSUzI1NiJ9.super-secret-token"


def test_one_event_per_request_and_no_secrets(tool: CountingTool, tmp_path: Path) -> None:
    config = {"store": {"url": f"sqlite://{tmp_path}/state.db"}, "routes": [route(tool.url)]}
    proxy = ProxyProcess(config, tmp_path).start()
    plan = f"plan-{uuid.uuid4().hex[:8]}"
    key = new_key({"n": 1}, plan=plan)
    headers = {
        "Authorization": f"Bearer {SECRET}",
        "Cookie": f"session={SECRET}",
        "Idempotency-Key": key,
    }
    try:
        for body, k in (({"n": 1}, key), ({"n": 1}, key), ({"n": 2}, new_key({"n": 2}, plan=plan))):
            response = httpx.post(
                f"{proxy.url}/tools/x?cookie=1",
                json=body,
                headers={**headers, "Idempotency-Key": k},
            )
            assert response.status_code == 200
        httpx.post(f"{proxy.url}/tools/x", json={"n": 3}, headers=headers)  # 422
    finally:
        proxy.stop()
    assert SECRET not in proxy.log_text()
    events = proxy.events()
    requests = [e for e in events if e["event"] == "request"]
    assert [e["outcome"] for e in requests] == ["executed", "replayed", "executed", "rejected"]
    assert [e["status"] for e in requests] == [200, 200, 200, 422]
    for event in requests:
        assert event["route"] == "tool"
        assert event["latency_ms"] >= 0
        assert event["level"] == "info" and event["timestamp"]
    assert requests[0]["key"] == key
    replanned = [e for e in events if e["event"] == "replanned"]
    assert len(replanned) == 1
    assert replanned[0]["previous_args_hash"] == key.rsplit(":", 1)[1]


def test_redact_blanks_secret_fields_at_any_depth() -> None:
    event = {
        "event": "x",
        "authorization": "Bearer a",
        "headers": {"Cookie": "c", "x": "ok"},
        "client_secret": "s",
        "refresh_token": "t",
        "route": "r",
    }
    out = redact(None, "info", event)
    assert out["authorization"] == out["client_secret"] == out["refresh_token"] == REDACTED
    assert out["headers"] == {"Cookie": REDACTED, "x": "ok"}
    assert out["route"] == "r"


def test_metrics_count_requests_by_route_and_outcome(tool: CountingTool, tmp_path: Path) -> None:
    config = {"store": {"url": f"sqlite://{tmp_path}/state.db"}, "routes": [route(tool.url)]}
    proxy = ProxyProcess(config, tmp_path, workers=2).start()
    try:
        key = new_key({"n": 1})
        for _ in range(5):
            httpx.post(f"{proxy.url}/tools/x", json={"n": 1}, headers={"Idempotency-Key": key})
        httpx.post(f"{proxy.url}/tools/x", json={"n": 1})  # no key: 400
        text = ""
        for _ in range(4):  # whichever worker answers, it reports both workers' samples
            text = httpx.get(f"{proxy.url}/_proxy/metrics").text
            assert (
                'tool_proxy_requests_total{outcome="executed",route="tool",status="200"} 1.0'
                in text
            )
            assert (
                'tool_proxy_requests_total{outcome="replayed",route="tool",status="200"} 4.0'
                in text
            )
            assert (
                'tool_proxy_requests_total{outcome="rejected",route="tool",status="400"} 1.0'
                in text
            )
        assert (
            'tool_proxy_request_duration_seconds_count{outcome="replayed",route="tool"} 4.0' in text
        )
    finally:
        proxy.stop()


def test_a_caller_leaving_before_its_body_is_logged_not_forwarded(
    tool: CountingTool, tmp_path: Path
) -> None:
    config = {"store": {"url": f"sqlite://{tmp_path}/state.db"}, "routes": [route(tool.url)]}
    proxy = ProxyProcess(config, tmp_path).start()
    key = new_key({"n": 1})
    head = (
        "POST /tools/x HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Idempotency-Key: {key}\r\nContent-Length: 1000\r\n\r\n"
    )
    try:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
            sock.sendall(head.encode() + b'{"n": ')  # then the caller goes away
        wait_for(
            lambda: any(e["event"] == "request" for e in proxy.events()),
            what="the request event",
        )
    finally:
        proxy.stop()
    events = proxy.events()
    (request,) = [e for e in events if e["event"] == "request"]
    assert request["status"] == 499
    assert request["outcome"] == "rejected"
    assert not [e for e in events if e["event"] == "unexpected_error"]
    assert tool.total == 0


def test_request_timestamps_are_iso_utc_to_the_microsecond() -> None:
    """The request line's cheap timestamps read as datetime's own, across seconds (the
    cached part) and at a whole second (isoformat would drop the fraction there)."""
    epoch = datetime(1970, 1, 1, tzinfo=UTC)
    times = [
        1_796_000_000_123_456_789,
        1_796_000_000_999_999_999,
        1_796_000_001_000_000_000,
        1_796_000_001_000_000_999,
        1_796_003_601_500_000_000,
    ]
    clock = iter(times)
    stamps = logs.Timestamps(lambda: next(clock))
    for ns in times:
        expected = epoch + timedelta(microseconds=ns // 1000)
        assert stamps.now() == expected.isoformat(timespec="microseconds").replace("+00:00", "Z")


def test_the_request_line_is_the_json_structlog_would_write(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The request line, written without structlog's chain, is the same JSON object in
    the same order (escapes of caller-chosen paths and keys included); a traced one
    names its trace; below the configured level nothing is written."""
    stream = io.StringIO()
    line = logs.RequestLog(stream)
    line.write("POST", '/tools/"é\n\u2028', "tool", None, "executed", 200, 0.125)
    ids = {"trace_id": "0af7", "span_id": "b7"}
    line.write("GET", "/x", None, "p:1:ab", "passed", 404, 1e-05, ids)
    monkeypatch.setattr(logs, "_stream", stream)
    monkeypatch.setattr(logs, "_level", logging.WARNING)  # configure("warning")
    logs.get_request_log().write("POST", "/x", "tool", None, "passed", 200, 1.0)
    first, second = stream.getvalue().splitlines()
    event = json.loads(first)
    fields = {
        "method": "POST",
        "path": '/tools/"é\n\u2028',
        "route": "tool",
        "key": None,
        "outcome": "executed",
        "status": 200,
        "latency_ms": 0.125,
        "event": "request",
        "level": "info",
    }
    assert first == json.dumps({**fields, "timestamp": event["timestamp"]})
    traced = json.loads(second)
    assert list(traced)[-5:] == ["trace_id", "span_id", "event", "level", "timestamp"]
    assert traced["latency_ms"] == 1e-05 and traced["key"] == "p:1:ab" and traced["route"] is None
    assert datetime.fromisoformat(event["timestamp"]).tzinfo is not None
