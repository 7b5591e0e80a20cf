"""The tool annotations a ``protocol: mcp`` route learns from ``tools/list`` answers
(``guard: annotated``, ``cache.tools: annotated``), shared by every replica through the
store: a call landing on a replica that has not seen the list yet is guarded (and cached)
as on the replica that has.

One value per route (``mcp-tools|<route>``): tool name → ``[readOnlyHint, idempotentHint]``,
written after each ``tools/list`` answer (the latest wins, as within one replica), kept
for the answer's ``ttlMs`` (2026-07-28), within ``MIN_TTL_SECONDS`` and
``MAX_TTL_SECONDS``, or ``TOOLS_TTL_SECONDS`` past it when the answer has none. A replica
reads it for a tool it does not know, at most every ``RECALL_SECONDS``. The store out of
reach is not an error here: the replica knows what it learnt itself, and a tool it does
not know is guarded and not cached.
"""

from __future__ import annotations

import json
import time
from typing import Any

from proxy.errors import ProxyError
from proxy.store import Store

# How long a learnt list stays in the store after the last tools/list that wrote it
# (an answer without ttlMs).
TOOLS_TTL_SECONDS = 3600.0
# The bounds of a tools/list answer's ttlMs, as the shared list's time to live.
MIN_TTL_SECONDS = 1.0
MAX_TTL_SECONDS = 86400.0
# A replica reads the shared list for a tool it does not know at most this often.
RECALL_SECONDS = 1.0

Annotations = dict[str, tuple[bool, bool]]
"""Tool name → (readOnlyHint, idempotentHint), each False when absent."""


class SharedTools:
    """One route's learnt annotations in the store."""

    def __init__(self, store: Store, route: str, log: Any) -> None:
        self.store = store
        self.key = f"mcp-tools|{route}"
        self.log = log
        self._recalled_at = -RECALL_SECONDS

    async def remember(self, tools: Annotations, ttl: float = TOOLS_TTL_SECONDS) -> None:
        value = json.dumps({name: list(hints) for name, hints in tools.items()}).encode()
        try:
            await self.store.put_value(self.key, value, ttl)
        except ProxyError as exc:
            self.log.warning("mcp_tools_not_shared", key=self.key, error=exc.detail)

    async def recall(self) -> Annotations:
        """What the replicas learnt ({} if nothing, or read less than ``RECALL_SECONDS``
        ago, or the store is out of reach)."""
        now = time.monotonic()
        if now - self._recalled_at < RECALL_SECONDS:
            return {}
        self._recalled_at = now
        try:
            value = await self.store.get_value(self.key)
        except ProxyError as exc:
            self.log.warning("mcp_tools_not_read", key=self.key, error=exc.detail)
            return {}
        try:
            stored = json.loads(value) if value is not None else {}
            return {str(name): (bool(h[0]), bool(h[1])) for name, h in stored.items()}
        except (ValueError, TypeError, IndexError, AttributeError):
            return {}
