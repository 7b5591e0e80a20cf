"""The fence: the last check before a guarded call's bytes go to the tool.

A guarded call holds a lease on its key (``idempotency.Lease``), renewed while it runs.
Between the claim and the send the route's policies may wait far longer than the lease
lasts: a resource lock, a rate limit, the cache's wait for an identical call, a
downstream token fetch, the resend after a 401. So the lease is checked here, by the
innermost send (``app.Proxy.sender``), right before the request is written, after every
wait, and the wait for an upstream connection is bounded by what is left of the lease; a
call whose lease lapsed or was taken over meanwhile is not sent (``LeaseLost``,
one of the "nothing sent" errors: the key is released by its owner only, so nothing is
recorded or released over another attempt's record).

    claim ──▶ Fence.arm(lease) ──▶ cache ▶ lock ▶ versioning ▶ limits ▶ token ──▶ check ──▶ send

An HTTP route's send is built once its key is claimed (a replay needs none), so it
checks the lease itself (``Leased``); a ``Fence`` stands in for the lease where the send
is built before the claim (an MCP ``tools/call``, a job's attempt), and refuses to send
until it is armed.
"""

from __future__ import annotations

from typing import Protocol

from proxy.errors import LeaseLost


class Leased(Protocol):
    """What the fence checks: a lease that raises ``LeaseLost`` once it is not held."""

    def check(self) -> float:
        """Raise ``LeaseLost`` unless the lease is still this call's; else how long it
        lasts yet (seconds)."""


class Fence:
    """One guarded call's fence, armed with its lease once the key is claimed."""

    __slots__ = ("lease",)

    def __init__(self) -> None:
        self.lease: Leased | None = None

    def arm(self, lease: Leased) -> None:
        self.lease = lease

    def check(self) -> float:
        """Raise ``LeaseLost`` unless the call may be sent now; else how long the lease
        lasts yet: the send must have its connection within it (a wait for a pooled or
        new connection is a wait too), or it is not sent."""
        if self.lease is None:  # never sent without a claim
            raise LeaseLost("the call was not claimed before it was sent: it was not sent")
        return self.lease.check()
