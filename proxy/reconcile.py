"""Asking the tool whether a call whose outcome is unknown ran (``routes[].reconcile``).

Many tools can say whether an operation happened: a look-up by idempotency key or by a
client reference. When a call's outcome is unknown (the route's timeout passed, the
connection broke, the proxy failed in flight, a lease lapsed), the proxy sends the
route's look-up, with the key's parts filled into its path:

- a ``found`` status: the call ran, and the look-up's answer becomes the recorded
  outcome (COMPLETED, replayed from then on);
- a ``not_found`` status: it did not run: the key is released, the next retry executes;
- anything else, or no answer in ``timeout``: it stays FAILED.

It asks at the moment of failure, and again when a retry meets the FAILED record: at
most ``retries`` times per record and proxy process, ``interval`` apart. Each look-up is
a ``reconciled`` log event and a ``tool_proxy_reconciliations`` count.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from enum import StrEnum
from typing import Any
from urllib.parse import quote

from proxy.config import ReconcileConfig
from proxy.errors import ProxyError, ResponseNotStored
from proxy.forwarding import UpstreamResponse
from proxy.metrics import Metrics
from proxy.operation import Operation
from proxy.outcome import StoredResponse
from proxy.store import RecordKey

Lookup = Callable[[str, str, float], Awaitable[UpstreamResponse]]
"""Send ``method`` to ``path?query`` on the route's upstream within ``seconds``."""

# A found answer larger than this is recorded as executed, its response not kept.
MAX_ANSWER_BYTES = 1024 * 1024
# How many FAILED records a process remembers asking about (the oldest are forgotten).
REMEMBERED_RECORDS = 10_000


class Finding(StrEnum):
    """What the tool said."""

    FOUND = "found"
    NOT_FOUND = "not_found"
    UNKNOWN = "unknown"


class Reconciler:
    """The look-ups of one route."""

    def __init__(self, route: str, config: ReconcileConfig, log: Any, metrics: Metrics) -> None:
        self.route = route
        self.config = config
        self.log = log
        self.metrics = metrics
        self._asked: OrderedDict[RecordKey, tuple[int, float]] = OrderedDict()

    def target(self, op: Operation) -> str:
        """The look-up's path and query, the key's parts filled in (percent-encoded)."""
        plan, _, rest = op.label.partition(":")
        step, _, args_hash = rest.partition(":")
        fields = {"key": op.label, "plan": plan, "step": step, "args_hash": args_hash}
        path = self.config.path
        for name, value in fields.items():
            path = path.replace("{" + name + "}", quote(value, safe=":"))
        return path

    def may_ask_again(self, key: RecordKey) -> bool:
        """True if a retry meeting this FAILED record may ask once more (and count it)."""
        asked, last = self._asked.pop(key, (0, -self.config.interval))
        now = time.monotonic()
        if asked >= self.config.retries or now - last < self.config.interval:
            self._asked[key] = (asked, last)
            return False
        self._asked[key] = (asked + 1, now)
        while len(self._asked) > REMEMBERED_RECORDS:
            self._asked.popitem(last=False)
        return True

    async def ask(
        self, op: Operation, lookup: Lookup, when: str
    ) -> tuple[Finding, StoredResponse | None]:
        """What the tool says of ``op``, and its answer when it ran."""
        target = self.target(op)
        try:
            async with asyncio.timeout(self.config.timeout):
                answer = await lookup(self.config.method, target, self.config.timeout)
                status = answer.status
                finding = self._finding(status)
                stored = await self._stored(answer) if finding is Finding.FOUND else None
                if finding is not Finding.FOUND:
                    await answer.read()  # the connection goes back to the pool
        except (ProxyError, TimeoutError) as exc:
            detail = exc.detail if isinstance(exc, ProxyError) else "no answer in time"
            self._report(op, when, Finding.UNKNOWN, error=detail)
            return Finding.UNKNOWN, None
        self._report(op, when, finding, status=status)
        return finding, stored

    def _finding(self, status: int) -> Finding:
        if status in self.config.found:
            return Finding.FOUND
        if status in self.config.not_found:
            return Finding.NOT_FOUND
        return Finding.UNKNOWN

    async def _stored(self, answer: UpstreamResponse) -> StoredResponse:
        if answer.length is not None and answer.length > MAX_ANSWER_BYTES:
            await answer.read()
            return _not_kept(answer.length)
        body = await answer.read()
        if len(body) > MAX_ANSWER_BYTES:
            return _not_kept(len(body))
        return StoredResponse.of(answer.status, answer.headers, body)

    def _report(self, op: Operation, when: str, finding: Finding, **fields: Any) -> None:
        self.metrics.reconciliation(self.route, when, finding.value)
        self.log.warning(
            "reconciled", route=self.route, key=op.label, when=when, result=finding.value, **fields
        )


def _not_kept(size: int) -> StoredResponse:
    return StoredResponse.of_problem(
        ResponseNotStored(
            f"the tool says the call ran; its {size}-byte answer to the look-up is above "
            f"{MAX_ANSWER_BYTES} bytes and was not kept"
        )
    )
