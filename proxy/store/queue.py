"""The queue contract: long calls (``async`` routes) kept as jobs that workers share.

Kept apart from the records contract (``base.Store``), like the rate buckets and the
locks: a backend implements it in a class of its own (``MemoryQueue``, ``SQLiteQueue``,
``RedisQueue``), over the same connection as its records, and one contract test suite
(tests/test_queue_contract.py) runs against all three.

A job is one accepted call: the request to send (stored before the caller gets its
``202``), the idempotency record it concludes, and its state::

    submit ──▶ QUEUED ──take──▶ (held) ──move──▶ RUNNING ──move──▶ COMPLETED | FAILED
                 ▲  │                               │
                 │  └──move (not held)──▶ CANCELLED │
                 └──────────move (retry, due later)─┘──move──▶ DEAD (attempts spent)

``take`` hands a due QUEUED job to one worker and *holds* it for that worker for
``visibility`` seconds (``hold`` renews it while the worker works). A job whose holder
stopped renewing (its process died) is handed to the next ``take`` as it is: QUEUED if the
dead worker never started it, RUNNING (with ``sent``) if it may have sent the call. The
taker decides what that means (never send a ``sent`` job again).

Every ``move`` is a compare-and-set on the state (and, given a worker, on its hold), adds
one to ``seq`` and keeps a snapshot of the job as an *event*: ``events`` replays them, so a
client that reconnects misses nothing. ``changes`` tells, best effort, which jobs changed
(a process also polls, for changes its subscription missed).

Jobs and their events live ``keep`` seconds past their last change.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol


class JobState(StrEnum):
    """The state of a job, as the operation resource shows it."""

    QUEUED = "queued"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    DEAD = "dead"

    @property
    def terminal(self) -> bool:
        return self not in (JobState.QUEUED, JobState.RUNNING)

    @property
    def spent(self) -> bool:
        """Ended for good (COMPLETED, FAILED, CANCELLED): the job's request is never sent
        again, so ``move`` drops it (the caller's credentials with it). A DEAD job keeps
        it: an operator may requeue it."""
        return self.terminal and self is not JobState.DEAD


def job_shard(route: str) -> str:
    """16 hex digits of a digest of ``route``'s name: the prefix of its jobs' ids, by which
    a store may keep a job beside its route's queue (Redis: one hash tag per route, so a
    Redis Cluster spreads the routes over its nodes)."""
    return hashlib.blake2b(route.encode(), digest_size=8).hexdigest()


def new_job_id(route: str) -> str:
    """A fresh id for a job of ``route``: its shard, ``~``, 24 random URL-safe characters
    (no dot: a record's owner ``job.<id>.<token>`` is split at dots)."""
    return f"{job_shard(route)}~{secrets.token_urlsafe(18)}"


@dataclass(frozen=True, slots=True)
class Job:
    """A job as stored. ``submit`` takes one with ``id`` (``new_job_id(route)``),
    ``route``, ``principal``, the record's ``slot`` and ``name``, ``label``, ``request`` and
    ``keep``; the store sets the rest."""

    id: str
    route: str
    principal: str
    slot: str
    """The idempotency record this job concludes (``RecordKey(slot, name)``)."""
    name: str
    label: str
    """The Idempotency-Key as the caller sent it (logs)."""
    request: bytes = b""
    """What to send (``jobs.encode_request``); empty in events."""
    keep: float = 0.0
    """Seconds the job lives past its last change."""
    state: JobState = JobState.QUEUED
    attempts: int = 0
    """Attempts started (each one sent, or refused before anything ran)."""
    sent: bool = False
    """An attempt may have reached the tool: the job is never sent again."""
    error: bytes = b""
    """An RFC 9457 document (JSON) for a FAILED or DEAD job, or a retry's reason."""
    created_at: float = 0.0
    """Unix seconds, the store's clock."""
    updated_at: float = 0.0
    due: float = 0.0
    """Unix seconds (the store's clock) before which a QUEUED job is not taken."""
    seq: int = 0
    """The number of the job's last event (1 for the submit)."""


class Queue(Protocol):
    """Jobs of every route. Every method is atomic; failures raise ``StoreUnavailable``
    (``StoreRefused`` for a write the store refuses)."""

    async def submit(self, job: Job) -> Job:
        """Keep ``job`` (QUEUED, due now, seq 1, its first event) and queue it on its route.
        An id already in use raises ``ValueError`` (ids are random: it does not happen)."""

    async def get(self, id: str) -> Job | None:
        """The job, or None (never submitted, or expired)."""

    async def events(self, id: str, after: int) -> list[Job] | None:
        """The job's snapshots with ``seq`` above ``after``, oldest first (``request``
        empty); None for an unknown job (never submitted, or expired): a reader stops."""

    async def take(self, route: str, worker: str, visibility: float) -> Job | None:
        """Hold the next job of ``route`` for ``worker`` for ``visibility`` seconds: a due
        QUEUED job that nobody holds, else one whose holder's hold lapsed (QUEUED or
        RUNNING, as that holder left it); None if there is none. Does not block."""

    async def hold(self, id: str, worker: str, visibility: float) -> bool:
        """Renew ``worker``'s hold on the job for ``visibility`` seconds from now; False if
        it holds it no more (it lapsed and another took it, or the job ended)."""

    async def move(
        self,
        id: str,
        expect: frozenset[JobState],
        state: JobState,
        *,
        worker: str | None = None,
        attempts: int | None = None,
        sent: bool | None = None,
        error: bytes | None = None,
        due: float = 0.0,
    ) -> Job | None:
        """If the job's state is in ``expect`` (and, given ``worker``, that worker holds
        it), set ``state`` and the fields given, add one to ``seq``, keep the snapshot as
        an event and return the job; else None. Moved to QUEUED, the job is queued again,
        due ``due`` seconds from now, and held by nobody; to a terminal state, it leaves
        the queue (and to a ``spent`` one, its ``request`` is dropped); to RUNNING, it
        stays held."""

    async def list(self, state: JobState | None, cursor: str, count: int) -> tuple[str, list[Job]]:
        """About ``count`` jobs (in ``state``, if given) from ``cursor`` ("" to start), the
        next cursor ("" at the end); ``request`` empty. For operators."""

    def changes(self) -> AsyncIterator[str]:
        """The ids of jobs as they change (best effort: a subscriber may miss some, so it
        also polls), for as long as the caller iterates."""
