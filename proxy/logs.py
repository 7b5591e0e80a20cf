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
from collections.abc import MutableMapping
from datetime import UTC, datetime
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


_configured = False


def render_request(logger: Any, method_name: str, event: MutableMapping[str, Any]) -> str:
    """The ``request`` line in one processor: level, UTC ISO timestamp, JSON.

    The ``request`` event, one per proxied request, is made of the proxy's own fields
    (method, path, route, key, outcome, status, latency), never of a header or a body:
    it needs no redaction, and one processor costs less than the chain of the others.
    """
    event["level"] = method_name
    event["timestamp"] = datetime.now(UTC).isoformat().replace("+00:00", "Z")
    return _ENCODER.encode(event)


def flush() -> None:
    """Write out buffered log lines."""
    _stream.flush()


def configure(level: str = "info") -> None:
    """JSON logs on stdout at ``level``, buffered (see :class:`LineWriter`)."""
    global _stream
    _stream = open(sys.stdout.fileno(), "w", buffering=LOG_BUFFER_BYTES, closefd=False)  # noqa: SIM115
    atexit.register(flush)
    logging.basicConfig(format="%(message)s", stream=sys.stdout, level=level.upper())
    global _configured
    _configured = True
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            add_trace_ids,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            redact,
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(_serialize),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=lambda *args: LineWriter(_stream),
        cache_logger_on_first_use=True,
    )


def get_logger() -> Any:
    """The proxy's logger."""
    return structlog.get_logger("tool_proxy")


def get_request_logger() -> Any:
    """The logger of the ``request`` events: the configured one, without redaction."""
    if not _configured:  # an app embedded in tests: structlog's own defaults
        return get_logger()
    return structlog.wrap_logger(None, processors=[render_request])
