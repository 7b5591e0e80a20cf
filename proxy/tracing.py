"""Traces: off unless the ``OTEL_*`` variables configure an exporter; then ``proxy.otel``.

This module imports nothing of OpenTelemetry, so the proxy runs without the SDK installed
while tracing is off. It decides whether tracing is on (``from_env``) and holds the hooks
that code far from ``app.py`` calls: each is one ``ContextVar`` read when tracing is off,
since no request then ever has a span.

    from_env(env)        None (off), or a ``proxy.otel.Tracing`` built from ``OTEL_*``
    note(name, value)    an attribute on the current request's (or job's) span
    add_trace_ids        structlog processor: ``trace_id``/``span_id`` in log lines

The spans themselves (server, MCP, policies, token fetch, client, job) are made by
``proxy.otel.Tracing``, which ``app.py`` and ``jobs.py`` call behind one
``if tracing is not None`` each; see docs/tracing.md.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from proxy.errors import ConfigError

if TYPE_CHECKING:
    from proxy.otel import Tracing

# ``full``: spans carry the whole Idempotency-Key (``tool_proxy.idempotency_key``); by
# default only a composite key's plan session id and step are recorded.
ENV_TRACE_KEYS = "TOOL_PROXY_TRACE_KEYS"
# Exporters this proxy builds (OTEL_TRACES_EXPORTER); ``none`` turns tracing off.
EXPORTERS = frozenset({"otlp", "console", "none"})

CURRENT: ContextVar[Any] = ContextVar("tool_proxy_span", default=None)
"""The span of the request (or job) this task works for; None when tracing is off."""


def configured(env: Mapping[str, str]) -> bool:
    """True if the ``OTEL_*`` variables ask for traces: an OTLP endpoint, or a traces
    exporter other than ``none``; never with ``OTEL_SDK_DISABLED=true``."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter:
        return exporter != "none"
    return bool(
        env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    )


def from_env(env: Mapping[str, str]) -> Tracing | None:
    """The tracing the environment configures, or None (off). Raises ``ConfigError`` if
    it is configured but the SDK is not installed, or names an exporter not built here."""
    if not configured(env):
        return None
    exporter = env.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() or "otlp"
    if exporter not in EXPORTERS:
        raise ConfigError([f"OTEL_TRACES_EXPORTER: {exporter!r} is not one of otlp, console, none"])
    try:
        from proxy.otel import Tracing
    except ImportError as exc:
        raise ConfigError(
            [
                "OTEL_*: tracing is configured but the OpenTelemetry SDK is not installed "
                f"({exc.name}); install tool-proxy[otel], or unset the OTEL_ variables"
            ]
        ) from exc
    return Tracing.from_env(env, exporter)


def note(name: str, value: str | int | bool) -> None:
    """Set ``name`` on the current span, if there is one."""
    span = CURRENT.get()
    if span is not None:
        span.set_attribute(name, value)


def add_trace_ids(
    logger: Any, method_name: str, event_dict: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """structlog processor: the current span's ``trace_id`` and ``span_id`` (hex), so a
    log line leads to its trace; nothing when tracing is off."""
    span = CURRENT.get()
    if span is not None:
        context = span.get_span_context()
        event_dict["trace_id"] = format(context.trace_id, "032x")
        event_dict["span_id"] = format(context.span_id, "016x")
    return event_dict
