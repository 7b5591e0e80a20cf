"""structlog set-up: JSON lines on stdout, secrets redacted before rendering.

One event per proxied request (``request``) carries route, key, outcome, status and
latency, fields of the proxy's own. Headers are never logged whole; in every other event,
any field named like a credential is replaced by ``[redacted]`` by :func:`redact`, at
any depth.
"""

from __future__ import annotations

import atexit
import functools
import json
import logging
import sys
import time
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any, TextIO

import structlog

from proxy.tracing import add_trace_ids

ENV_LOG_LEVEL = "TOOL_PROXY_LOG_LEVEL"
# Log lines are buffered up to this many bytes, and written out at least this often.
LOG_BUFFER_BYTES = 64 * 1024
FLUSH_INTERVAL_SECONDS = 0.5
REDACTED = "[redacted]"
SECRET_WORDS = ("authorization", "cookie", "token", "secret", "password", "api_key", "apikey")


@functools.lru_cache(maxsize=1024)
def is_secret(name: str) -> bool:
    """The name of a field, header or key reads like a credential (hidden in logs)."""
    low = name.lower()
    return any(word in low for word in SECRET_WORDS)


def redact(
    logger: Any, method_name: str, event_dict: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """structlog processor: blank every field (and nested field) named like a secret."""
    return _redact(event_dict)


def _redact(mapping: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    for name, value in mapping.items():
        if is_secret(str(name)):
            mapping[name] = REDACTED
        elif isinstance(value, MutableMapping):
            _redact(value)
    return mapping


class LineWriter:
    """A structlog logger that writes lines to a buffered stream and leaves flushing to
    :func:`flush` (called every ``FLUSH_INTERVAL_SECONDS`` and at exit): one write system
    call per buffer instead of one per request."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def msg(self, message: str) -> None:
        self._stream.write(message + "\n")

    debug = info = warning = error = critical = exception = msg


_stream: TextIO = sys.stdout


def _fallback(value: Any) -> Any:
    """How values JSON has no type for are written (as structlog's renderer does)."""
    structlog_form = getattr(value, "__structlog__", None)
    return structlog_form() if callable(structlog_form) else repr(value)


# One encoder for every line: ``json.dumps`` with options builds a new one per call.
_ENCODER = json.JSONEncoder(default=_fallback)


def _serialize(event: Any, **options: Any) -> str:
    return _ENCODER.encode(event)


_level: int | None = None
"""The configured level (``configure``); None where logging is not configured."""


class Timestamps:
    """UTC times as structlog's ``TimeStamper(fmt="iso", utc=True)`` writes them
    (``2026-12-02T17:12:44.610699Z``), the part up to the second formatted once a second:
    a third of ``datetime.now(UTC).isoformat()``'s cost, once per request line."""

    __slots__ = ("_clock", "_second", "_text")

    def __init__(self, clock: Callable[[], int] = time.time_ns) -> None:
        self._clock = clock
        self._second = -1
        self._text = ""

    def now(self) -> str:
        second, rest = divmod(self._clock(), 1_000_000_000)
        if second != self._second:
            self._second = second
            self._text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        return f"{self._text}.{rest // 1000:06d}Z"


_timestamp = Timestamps().now


_escape = json.encoder.encode_basestring_ascii
"""A string as ``json.dumps`` writes it (ASCII, quoted): the json module's C escaper."""


def _text(value: str | None) -> str:
    return "null" if value is None else _escape(value)


class RequestLog:
    """The ``request`` event, one per proxied request (method, path, route, key,
    outcome, status, latency: the proxy's own fields, never a header or a body, so it
    needs no redaction). Written straight to the log stream as the same JSON line
    structlog's chain would make, at a third of its cost; where logging is not
    configured (an app embedded in tests), through structlog, which tests capture."""

    __slots__ = ("_logger", "_stream")

    def __init__(self, stream: TextIO | None, logger: Any = None) -> None:
        self._stream = stream
        """The log stream; None below the configured level (nothing written)."""
        self._logger = logger
        """structlog's logger, when logging is not configured."""

    def write(
        self,
        method: str,
        path: str,
        route: str | None,
        key: str | None,
        outcome: str,
        status: int,
        latency_ms: float,
        more: Mapping[str, str] | None = None,
    ) -> None:
        """One line; ``more``: the request's trace and span ids, when traced."""
        if self._logger is not None:
            fields = {} if more is None else more
            self._logger.info(
                "request",
                method=method,
                path=path,
                route=route,
                key=key,
                outcome=outcome,
                status=status,
                latency_ms=latency_ms,
                **fields,
            )
            return
        if self._stream is None:
            return
        line = (
            f'{{"method": {_escape(method)}, "path": {_escape(path)}, "route": {_text(route)}, '
            f'"key": {_text(key)}, "outcome": {_escape(outcome)}, "status": {status:d}, '
            f'"latency_ms": {latency_ms!r}'
        )
        if more:
            line += "".join(f", {_escape(name)}: {_escape(value)}" for name, value in more.items())
        self._stream.write(
            f'{line}, "event": "request", "level": "info", "timestamp": "{_timestamp()}"}}\n'
        )


def flush() -> None:
    """Write out buffered log lines."""
    _stream.flush()


def configure(level: str = "info", stream: TextIO | None = None) -> None:
    """JSON logs on stdout (or ``stream``) at ``level``, buffered (see
    :class:`LineWriter`)."""
    global _stream, _level
    if stream is None:
        stream = open(sys.stdout.fileno(), "w", buffering=LOG_BUFFER_BYTES, closefd=False)  # noqa: SIM115
    _stream = stream
    atexit.register(flush)
    logging.basicConfig(format="%(message)s", stream=sys.stdout, level=level.upper())
    _level = logging.getLevelName(level.upper())
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            add_trace_ids,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            redact,
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(_serialize),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_level),
        logger_factory=lambda *args: LineWriter(_stream),
        cache_logger_on_first_use=True,
    )


def get_logger() -> Any:
    """The proxy's logger."""
    return structlog.get_logger("tool_proxy")


def get_request_log() -> RequestLog:
    """Where the ``request`` events go: the log stream, at the configured level."""
    if _level is None:  # an app embedded in tests: structlog's own defaults
        return RequestLog(None, get_logger().bind())
    return RequestLog(_stream if _level <= logging.INFO else None)
