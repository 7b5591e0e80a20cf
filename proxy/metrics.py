"""Prometheus metrics, served at ``/_proxy/metrics``.

Each app has its own registry. With several worker processes (``serve --workers N``) the
CLI points ``PROMETHEUS_MULTIPROC_DIR`` at a fresh directory and every worker writes its
samples there, so a scrape of any worker sees the whole server.
"""

from __future__ import annotations

import os

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.multiprocess import MultiProcessCollector
from starlette.requests import Request
from starlette.responses import Response

ENV_MULTIPROC_DIR = "PROMETHEUS_MULTIPROC_DIR"
# Request latency buckets, in seconds: from a replay (sub-millisecond) to a long tool call.
LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    120,
    300,
)


class Metrics:
    """Counters and histograms of proxied requests."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._requests = Counter(
            "tool_proxy_requests",
            "Proxied requests by route, outcome (executed, replayed, conflict, released, "
            "failed, passed, rejected, accepted, cached) and status.",
            ["route", "outcome", "status"],
            registry=self.registry,
        )
        self._latency = Histogram(
            "tool_proxy_request_duration_seconds",
            "Time from a proxied request to its response being ready, by route and outcome.",
            ["route", "outcome"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self._outcome_events = Counter(
            "tool_proxy_outcome_events",
            "Events in recording outcomes, by route and event: recorded_late (after the "
            "store came back), refused (by the store: kept in the small 'not kept' form), "
            "release_failed, not_recorded (lost: see the critical log line).",
            ["route", "event"],
            registry=self.registry,
        )
        self._reconciliations = Counter(
            "tool_proxy_reconciliations",
            "Look-ups of calls whose outcome was unknown, by route, when (at_failure, "
            "on_retry) and result (found, not_found, unknown).",
            ["route", "when", "result"],
            registry=self.registry,
        )
        self._limit_decisions = Counter(
            "tool_proxy_limit_decisions",
            "Route limit decisions, by route, limit and decision: allowed, limited (429), "
            "waited (refused once while waiting in line, limit_wait), paused (429 while the "
            "tool's own pause lasts; limit ''), pause_set (the tool asked for a pause), "
            "store_down_open (forwarded without limits).",
            ["route", "limit", "decision"],
            registry=self.registry,
        )
        self._limit_waiting = Gauge(
            "tool_proxy_limit_waiting",
            "Calls waiting (limit_wait) for room in a route's limits now, by route.",
            ["route"],
            registry=self.registry,
            multiprocess_mode="livesum",
        )
        self._resource_decisions = Counter(
            "tool_proxy_resource_decisions",
            "Resource lock and versioning decisions, by route, policy (lock, versioning) and "
            "decision: acquired, waited (had after waiting), locked (409), lost (lapsed "
            "before it was freed), store_down (503); versioning also: forwarded, bumped, "
            "precondition_failed (412), precondition_required (428).",
            ["route", "policy", "decision"],
            registry=self.registry,
        )
        self._cache_decisions = Counter(
            "tool_proxy_cache_decisions",
            "Response cache decisions, by route and decision: hit, collapsed (a miss that "
            "got the answer of an identical call in flight), stored, uncacheable (passed on, "
            "not stored), bypass (the request said no-store, or its body has no digest), "
            "waited_out (called the tool itself after cache.wait), not_kept (the body was not "
            "read whole, or was too large), store_down.",
            ["route", "decision"],
            registry=self.registry,
        )
        self._cache_series: dict[tuple[str, str], Counter] = {}
        # The labelled children, looked up once per distinct label set (a dict hit after).
        self._series: dict[tuple[str, str, int], tuple[Counter, Histogram]] = {}

    def observe(self, route: str, outcome: str, status: int, seconds: float) -> None:
        """Count one proxied request."""
        key = (route, outcome, status)
        series = self._series.get(key)
        if series is None:
            series = self._series[key] = (
                self._requests.labels(route, outcome, str(status)),
                self._latency.labels(route, outcome),
            )
        series[0].inc()
        series[1].observe(seconds)

    def outcome_event(self, route: str, event: str) -> None:
        """Count an event of the recording path (rare: not cached)."""
        self._outcome_events.labels(route, event).inc()

    def reconciliation(self, route: str, when: str, result: str) -> None:
        """Count one reconcile look-up."""
        self._reconciliations.labels(route, when, result).inc()

    def limit_decision(self, route: str, limit: str, decision: str) -> None:
        """Count one decision of a route limit."""
        self._limit_decisions.labels(route, limit, decision).inc()

    def limit_waiting(self, route: str, delta: int) -> None:
        """One more (1) or one fewer (-1) call waiting for room."""
        self._limit_waiting.labels(route).inc(delta)

    def resource_decision(self, route: str, policy: str, decision: str) -> None:
        """Count one decision of a resource lock or of versioning."""
        self._resource_decisions.labels(route, policy, decision).inc()

    def cache_decision(self, route: str, decision: str) -> None:
        """Count one decision of a route's response cache (on every hit: the labelled
        child is looked up once)."""
        child = self._cache_series.get((route, decision))
        if child is None:
            child = self._cache_series[route, decision] = self._cache_decisions.labels(
                route, decision
            )
        child.inc()

    def exposition(self) -> bytes:
        """The text format, from every worker when several share the server."""
        if os.environ.get(ENV_MULTIPROC_DIR):
            registry = CollectorRegistry()
            MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
            return bytes(generate_latest(registry))
        return bytes(generate_latest(self.registry))

    async def endpoint(self, request: Request) -> Response:
        return Response(self.exposition(), media_type=CONTENT_TYPE_LATEST)
