"""Idempotency stores behind one contract (``base.Store``): memory, SQLite, Redis,
PostgreSQL; and their rate buckets, resource locks and job queues behind others
(``buckets.Buckets``, ``locks.Locks``, ``queue.Queue``)."""

from __future__ import annotations

from typing import Any

from proxy.store.base import Claim, Durability, Record, RecordKey, State, Store
from proxy.store.buckets import Buckets
from proxy.store.locks import Locks
from proxy.store.queue import Job, JobState, Queue

__all__ = [
    "Buckets",
    "Claim",
    "Durability",
    "Job",
    "JobState",
    "Locks",
    "Queue",
    "Record",
    "RecordKey",
    "State",
    "Store",
    "make_buckets",
    "make_locks",
    "make_queue",
    "make_store",
]


def make_store(url: str, durability: Durability | None = None) -> Store:
    """The store a URL names (not yet opened: call ``await store.open()``); ``durability``
    (``store.durability``) only for Redis, whose replicas confirm each write by ``WAIT``."""
    scheme = url.split("://", 1)[0]
    if durability is not None and scheme.partition("+")[0] not in ("redis", "rediss"):
        raise ValueError(f"store.durability: only for Redis stores, not {scheme}://")
    if scheme == "memory":
        from proxy.store.memory import MemoryStore

        return MemoryStore()
    if scheme == "sqlite":
        from proxy.store.sqlite import SQLiteStore

        return SQLiteStore(url)
    if scheme.partition("+")[0] in ("redis", "rediss"):
        from proxy.store.redis import RedisStore

        return RedisStore(url, durability)
    if scheme in ("postgresql", "postgres"):
        from proxy.store.postgres import PostgresStore

        return PostgresStore(url)
    raise ValueError(f"unknown store URL scheme: {scheme!r}")


def _beside(store: Store, part: str, what: str) -> Any:
    """The ``part`` (``buckets``, ``locks``, ``queue``) that lives beside ``store``'s records,
    over the same connection and clock; ``TypeError`` if the backend keeps none."""
    factory = getattr(store, part, None)
    if factory is None:
        raise TypeError(f"{type(store).__name__} keeps no {what}")
    return factory()


def make_buckets(store: Store) -> Buckets:
    """The rate buckets that live beside ``store``'s records (same connection and clock)."""
    buckets: Buckets = _beside(store, "buckets", "rate buckets")
    return buckets


def make_locks(store: Store) -> Locks:
    """The resource locks that live beside ``store``'s records (same connection and clock)."""
    locks: Locks = _beside(store, "locks", "resource locks")
    return locks


def make_queue(store: Store) -> Queue:
    """The job queue that lives beside ``store``'s records (same connection and clock)."""
    queue: Queue = _beside(store, "queue", "job queue")
    return queue
