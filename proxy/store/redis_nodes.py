"""Redis Cluster and Sentinel under the Redis store: one ``Coalescer`` per node.

``redis+cluster://host:port[,host:port...]``: ``ClusterCoalescer`` keeps the slot map
(``CLUSTER SLOTS``, asked of any node it knows) and sends each command to the primary of
its key's slot over that node's coalescer, so concurrent requests still share round trips
per node (docs/benchmarks.md has the measurement against redis-py's ``RedisCluster``).
A redirection means the command did not run, so it is sent again whatever it is:

- ``MOVED`` (the slot has moved): the slot map is fixed for that slot, refreshed in full
  in the background (once at a time), and the command sent to the new owner;
- ``ASK`` (a migration under way, the key already moved): sent once to the importing node
  after ``ASKING``, in the same round trip;
- ``TRYAGAIN`` (a script's keys split by that migration) and ``CLUSTERDOWN`` (a failover
  under way): sent again after a short pause, a few times;
- ``NOSCRIPT`` from a node (a new primary, an importing node): the script loaded there.

A node out of reach fails the command as a single Redis would (``StoreUnavailable``:
503, nothing forwarded) and refreshes the map, so the next calls go to the promoted
replica.

``redis+sentinel://host:26379[,host:26379...]/<master-name>``: ``SentinelCoalescer`` asks
the sentinels for the primary (``SENTINEL get-master-addr-by-name``), checks it (``ROLE``)
and sends everything there; a ``READONLY`` reply (a primary demoted while the connection
stayed up) or the primary out of reach makes it ask again. While no sentinel names a
primary that answers as one, calls fail closed (``StoreUnavailable``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from redis.asyncio import ConnectionPool
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot
from redis.exceptions import (
    AskError,
    ClusterDownError,
    MovedError,
    NoScriptError,
    ReadOnlyError,
    RedisError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError

from proxy.errors import StoreUnavailable
from proxy.store.redis_scripts import SCRIPTS

Address = tuple[str, int]
PoolFactory = Callable[[str], ConnectionPool]
# Redirections and pauses one command may meet before it fails (a slot moved twice, a
# migration's TRYAGAIN, a failover's CLUSTERDOWN).
REDIRECTS = 16
PAUSE = 0.05  # seconds, times the attempt
_SOURCES = {script.sha: script.source for script in SCRIPTS.values()}


def seeds(url: str) -> tuple[list[Address], str]:
    """The ``host:port`` list of a ``redis+cluster://`` or ``redis+sentinel://`` URL, and
    the URL of one node with a placeholder for the address (credentials, query kept)."""
    parts = urlsplit(url)
    scheme = parts.scheme.partition("+")[0]
    credentials, _, hosts = parts.netloc.rpartition("@")
    found = []
    for item in hosts.split(","):
        host, _, port = item.rpartition(":")
        found.append((host, int(port)))
    netloc = f"{credentials}@{{}}" if credentials else "{}"
    return found, urlunsplit((scheme, netloc, "/0", parts.query, ""))


def _address(value: Any, default_host: str) -> Address:
    host = value[0].decode() if isinstance(value[0], bytes) else str(value[0])
    return (host or default_host, int(value[1]))


class ClusterCoalescer:
    """A ``Coalescer`` per cluster node, each command sent to its key's primary."""

    def __init__(self, url: str, pools: PoolFactory) -> None:
        self._seeds, self._node_url = seeds(url)
        self._pools = pools
        self._nodes: dict[Address, Any] = {}
        self._slots: list[Address | None] = [None] * REDIS_CLUSTER_HASH_SLOTS
        self._refreshing: asyncio.Task[None] | None = None

    def node(self, address: Address) -> Any:
        """The coalescer of ``address``, made on first use."""
        from proxy.store.redis import Coalescer

        if address not in self._nodes:
            self._nodes[address] = Coalescer(
                self._pools(self._node_url.format(f"{address[0]}:{address[1]}"))
            )
        return self._nodes[address]

    async def primaries(self) -> list[Address]:
        """Every primary that serves slots, in order."""
        if not any(self._slots):
            await self.refresh()
        return sorted({a for a in self._slots if a is not None})

    async def refresh(self) -> None:
        """The slot map from the first node that answers ``CLUSTER SLOTS``."""
        error: Exception = StoreUnavailable("redis cluster: no node known")
        known = [*self._seeds, *(a for a in self._nodes if a not in self._seeds)]
        for address in known:
            try:
                ranges = await self.node(address).call("CLUSTER", "SLOTS", resend=True)
            except (RedisError, OSError) as exc:
                error = exc
                continue
            slots: list[Address | None] = [None] * REDIS_CLUSTER_HASH_SLOTS
            for start, end, primary, *_ in ranges:
                owner = _address(primary, address[0])
                slots[start : end + 1] = [owner] * (end - start + 1)
            self._slots = slots
            return
        raise error

    def _refresh_soon(self) -> None:
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.get_running_loop().create_task(self._refresh_quietly())

    async def _refresh_quietly(self) -> None:
        with contextlib.suppress(RedisError, OSError, StoreUnavailable):
            await self.refresh()

    async def _owner(self, slot: int) -> Address:
        owner = self._slots[slot]
        if owner is None:
            await self.refresh()
            owner = self._slots[slot]
        if owner is None:
            raise ClusterDownError(f"CLUSTERDOWN hash slot {slot} is not served")
        return owner

    async def call(
        self, *command: Any, resend: bool = False, key: str | None = None, confirm: Any = None
    ) -> Any:
        """Send ``command`` to the primary of ``key``'s slot (any primary without a key),
        following redirections; ``resend`` and ``confirm`` (a ``WAIT`` on that primary)
        as for ``Coalescer.call``."""
        slot = key_slot(key.encode()) if key is not None else None
        asking: Address | None = None
        last: RedisError = ClusterDownError("CLUSTERDOWN too many redirections")
        for attempt in range(REDIRECTS):
            address = asking or (
                await self._owner(slot) if slot is not None else (await self.primaries())[0]
            )
            try:
                return await self._at(address, command, resend, asking is not None, confirm)
            except MovedError as exc:
                self._slots[exc.slot_id] = exc.node_addr
                self._refresh_soon()
                asking, last = None, exc
            except AskError as exc:
                asking, last = exc.node_addr, exc
            except (TryAgainError, ClusterDownError) as exc:
                asking, last = None, exc
                await asyncio.sleep(PAUSE * (attempt + 1))
            except (RedisConnectionError, TimeoutError, OSError):
                self._refresh_soon()
                raise
        raise last

    async def owner_of(self, key: str) -> Address:
        """The primary of ``key``'s slot (the node that holds every key of its hash tag)."""
        return await self._owner(key_slot(key.encode()))

    async def call_at(self, address: Address, *command: Any, resend: bool = False) -> Any:
        """Send ``command`` to one node (``SCAN`` of each primary)."""
        return await self._at(address, command, resend, False)

    async def _at(
        self,
        address: Address,
        command: tuple[Any, ...],
        resend: bool,
        asking: bool,
        confirm: Any = None,
    ) -> Any:
        node = self.node(address)
        send = node.call_asking if asking else node.call
        try:
            return await send(*command, resend=resend, confirm=confirm)
        except NoScriptError:
            if command[0] != "EVALSHA":
                raise
            await node.call("SCRIPT", "LOAD", _SOURCES[command[1]], resend=True)
            return await send(*command, resend=resend, confirm=confirm)

    async def ping(self) -> None:
        for address in await self.primaries():
            await self.node(address).call("PING", resend=True)

    async def subscriber_address(self) -> Address:
        """A node to subscribe on (a cluster sends every PUBLISH to every node)."""
        return (await self.primaries())[0]

    async def close(self) -> None:
        if self._refreshing is not None:
            self._refreshing.cancel()
        for node in self._nodes.values():
            await node.close()


class SentinelCoalescer:
    """One ``Coalescer`` to the primary the sentinels name, found again after a failover."""

    def __init__(self, url: str, pools: PoolFactory) -> None:
        self._sentinels, node_url = seeds(url)
        self._name = urlsplit(url).path.strip("/")
        self._node_url = node_url
        self._pools = pools
        self._primary: Any = None
        self._address: Address | None = None
        # Coalescers of former primaries: calls in flight may still use (and reconnect)
        # them, so they are closed with the store.
        self._former: list[Any] = []
        self._finding: asyncio.Lock | None = None

    @property
    def master_name(self) -> str:
        return self._name

    async def _find(self) -> Any:
        """The primary's coalescer: asked of the sentinels, confirmed by ``ROLE``."""
        if self._finding is None:
            self._finding = asyncio.Lock()
        async with self._finding:
            if self._primary is not None:
                return self._primary
            for sentinel in self._sentinels:
                address = await self._named_by(sentinel)
                primary = None if address is None else await self._confirmed(address)
                if primary is not None:
                    self._primary, self._address = primary, address
                    return primary
            raise StoreUnavailable(f"redis sentinel: no primary known for {self._name}")

    async def _named_by(self, sentinel: Address) -> Address | None:
        from proxy.store.redis import Coalescer

        pool = self._pools(f"redis://{sentinel[0]}:{sentinel[1]}/0")
        asker = Coalescer(pool)
        try:
            reply = await asker.call("SENTINEL", "get-master-addr-by-name", self._name, resend=True)
        except (RedisError, OSError):
            return None
        finally:
            await asker.close()
            await pool.disconnect()
        return None if not reply else _address(reply, sentinel[0])

    async def _confirmed(self, address: Address) -> Any:
        """A coalescer to ``address`` if it answers ``ROLE`` as a primary, else None."""
        from proxy.store.redis import Coalescer

        node = Coalescer(self._pools(self._node_url.format(f"{address[0]}:{address[1]}")))
        try:
            role = await node.call("ROLE", resend=True)
        except (RedisError, OSError):
            role = [b""]
        if role[0] == b"master":
            return node
        await node.close()
        return None

    async def _forget(self, primary: Any) -> None:
        if self._primary is primary:
            self._primary = self._address = None
            self._former.append(primary)
            await primary.close()

    async def call(
        self, *command: Any, resend: bool = False, key: str | None = None, confirm: Any = None
    ) -> Any:
        """Send ``command`` to the primary; ``READONLY`` (it was demoted) is sent again to
        the one found next (it did not run); a broken connection fails the command, as on
        one Redis, and the next one finds the primary again. ``confirm`` as for
        ``Coalescer.call``."""
        for _ in range(2):
            primary = self._primary or await self._find()
            try:
                return await primary.call(*command, resend=resend, confirm=confirm)
            except ReadOnlyError:
                await self._forget(primary)
            except (RedisConnectionError, TimeoutError, OSError):
                await self._forget(primary)
                raise
        raise StoreUnavailable(f"redis sentinel: {self._name} has no writable primary yet")

    async def ping(self) -> None:
        await self.call("PING", resend=True)

    async def subscriber_address(self) -> Address:
        while self._address is None:
            await self._find()
        return self._address

    async def close(self) -> None:
        for node in [*self._former, self._primary]:
            if node is not None:
                await node.close()
