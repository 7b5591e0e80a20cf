"""The operation resource of long calls (``jobs.py``), under ``/_proxy/operations/``.

- ``GET /_proxy/operations/{id}``: the status document (200), or ``303 See Other`` to
  ``.../result`` once completed; with ``Accept: text/event-stream``, one SSE event per
  state change (``Last-Event-ID`` replays what the reader missed), comment heartbeats,
  closed after the end.
- ``GET /_proxy/operations/{id}/result``: the recorded answer, byte for byte, as a replay.
- ``DELETE /_proxy/operations/{id}``: cancel a queued operation (never sent; its key is
  released); a running one cannot be un-sent (409).
- ``GET /_proxy/admin/operations?state=dead`` and ``POST .../{id}/requeue``: operators'.

Only the principal that submitted an operation (or an operator with the admin
credential) reads or cancels it; for anyone else it does not exist (404). Its id is
unguessable (144 random bits).
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from proxy import numbers
from proxy.admin import AdminAuth
from proxy.asgi import SSE, Incoming
from proxy.config import RouteConfig
from proxy.errors import (
    InvalidField,
    OperationConflict,
    OperationNotFound,
    ProxyError,
    StoredResponseUnavailable,
)
from proxy.job_events import Hub
from proxy.jobs import OPERATIONS_PATH, RouteJobs, document, listing, location
from proxy.store import Job, JobState, Queue

# Seconds between the comment lines that keep an idle event stream open through proxies
# and load balancers.
HEARTBEAT_SECONDS = 15.0
# Retry-After (seconds) on the status of an operation still queued or running.
POLL_AFTER_SECONDS = 1
STATES = {state.value: state for state in JobState}
MAX_LIST = 1000
# What a listing's cursor is: an operation id (store/queue.py new_job_id: its route's
# shard, "~", token_urlsafe), or a shard and "~" alone (where a Redis listing goes on).
_CURSOR = re.compile(r"[0-9a-f]{16}~[A-Za-z0-9_-]{0,64}")

Caller = Callable[[Incoming, RouteConfig], Awaitable[tuple[str, str]]]
"""The caller's principal on a route (``app.Proxy._caller``); raises 401."""


class Operations:
    """The operation endpoints, over the routes' jobs."""

    def __init__(
        self,
        jobs: dict[str, RouteJobs],
        queue: Queue,
        hub: Hub,
        caller: Caller,
        admin: AdminAuth | None,
    ) -> None:
        self.jobs = jobs
        self.queue = queue
        self.hub = hub
        self.caller = caller
        self.admin = admin

    async def _job(self, request: Request) -> tuple[Job, RouteJobs]:
        """The operation, if the caller may see it; else 404 (or 401 without a token on
        a route that requires one)."""
        job, jobs = await self.find(request.path_params["id"])
        if await self._allowed(request, job, jobs.route):
            return job, jobs
        raise OperationNotFound("no operation under this id (it may have expired)")

    async def find(self, job_id: str) -> tuple[Job, RouteJobs]:
        """The operation under ``job_id`` and its route's jobs, whoever may see it; 404."""
        job = await self.queue.get(job_id)
        jobs = None if job is None else self.jobs.get(job.route)
        if job is None or jobs is None:
            raise OperationNotFound("no operation under this id (it may have expired)")
        return job, jobs

    async def _allowed(self, request: Request, job: Job, route: RouteConfig) -> bool:
        if self.admin is not None and request.headers.get("authorization"):
            try:
                await self.admin.identity(request)
                return True
            except ProxyError:
                pass  # not an operator: perhaps the caller that submitted it
        if route.auth is None:
            return job.principal == ""
        principal, _ = await self.caller(Incoming.of(request.scope, request.receive), route)
        return principal == job.principal

    async def show(self, request: Request) -> Response:
        job, _ = await self._job(request)
        if SSE in request.headers.get("accept", ""):
            return self._stream(job, _last_event_id(request))
        if job.state is JobState.COMPLETED:
            return JSONResponse(
                document(job), 303, headers={"Location": location(job.id) + "/result"}
            )
        headers = {} if job.state.terminal else {"Retry-After": str(POLL_AFTER_SECONDS)}
        return JSONResponse(document(job), headers=headers)

    def _stream(self, job: Job, after: int) -> Response:
        async def events() -> AsyncIterator[ServerSentEvent]:
            async for event in self.hub.follow(job.id, after):
                yield ServerSentEvent(
                    data=json.dumps(document(event), separators=(",", ":")),
                    event="state",
                    id=str(event.seq),
                )

        return EventSourceResponse(events(), ping=HEARTBEAT_SECONDS)

    async def result(self, request: Request) -> Response:
        job, jobs = await self._job(request)
        if job.state not in (JobState.COMPLETED, JobState.FAILED):
            raise OperationConflict(f"the operation is {job.state.value}: it has no result")
        response = await jobs.result(job)
        if response is None:
            raise StoredResponseUnavailable("the operation's recorded answer has expired")
        return response

    async def cancel(self, request: Request) -> Response:
        job, jobs = await self._job(request)
        return JSONResponse(document(await self.cancel_job(job, jobs)))

    async def cancel_job(self, job: Job, jobs: RouteJobs) -> Job:
        """Cancel a queued operation (``job_cancelled``); 409 for a running or ended one."""
        cancelled = await jobs.cancel(job)
        if cancelled is not None:
            return cancelled
        current = await self.queue.get(job.id) or job
        if current.state is JobState.RUNNING:
            raise OperationConflict(
                "the operation is running: its call may have reached the tool and cannot "
                "be un-sent; it completes (or fails) and is recorded as usual"
            )
        raise OperationConflict(f"the operation is {current.state.value}: nothing to cancel")

    async def list(self, request: Request) -> Response:
        assert self.admin is not None
        await self.admin.identity(request)
        query = request.query_params
        unknown = set(query) - {"state", "cursor", "limit"}
        if unknown:
            raise InvalidField(sorted(unknown)[0], "unknown parameter")
        state = None
        if "state" in query:
            state = STATES.get(query["state"])
            if state is None:
                raise InvalidField("state", f"one of {', '.join(STATES)}")
        limit = parse_limit(query.get("limit"))
        after = check_cursor(query.get("cursor", ""))
        cursor, page = await self.queue.list(state, after, limit)
        return JSONResponse(
            {
                "operations": [listing(j) for j in page],
                "next_cursor": cursor or None,
            }
        )

    async def requeue(self, request: Request) -> Response:
        assert self.admin is not None
        admin = await self.admin.identity(request)
        job, jobs = await self._job(request)
        return JSONResponse(document(await self.requeue_job(job, jobs, admin)))

    async def requeue_job(
        self, job: Job, jobs: RouteJobs, admin: str, reason: str | None = None
    ) -> Job:
        """Queue a dead operation again for operator ``admin`` (audited ``job_requeued``,
        with the ``reason`` given); 409 if it is not dead, or its key was used since."""
        if job.state is not JobState.DEAD:
            raise OperationConflict(f"the operation is {job.state.value}: only a dead one")
        requeued = await jobs.requeue(job)
        if requeued is None:
            raise OperationConflict(
                "the operation's Idempotency-Key was used again since it died (or it was "
                "requeued meanwhile): it is not queued again, so the call cannot run twice"
            )
        said = {} if reason is None else {"reason": reason}
        jobs.log.warning("job_requeued", route=job.route, job=job.id, admin=admin, **said)
        return requeued


def _last_event_id(request: Request) -> int:
    value = request.headers.get("last-event-id", "0").strip() or "0"
    seq = numbers.whole(value)
    if seq is None:
        raise InvalidField("Last-Event-ID", "must be the id of an event of this operation")
    return seq


def parse_limit(value: str | None, field: str = "limit") -> int:
    """A page size from 1 to MAX_LIST (100 when not given); 400 naming ``field``."""
    return numbers.parse_limit(value, field, MAX_LIST, 100)


def check_cursor(value: str, field: str = "cursor") -> str:
    """``value`` if it may be the next_cursor of an earlier page ("": the first page);
    400 naming ``field``."""
    if value and not _CURSOR.fullmatch(value):
        raise InvalidField(field, "must be the next_cursor of an earlier page")
    return value


def is_operation_id(value: str) -> bool:
    """True if ``value`` may be an operation's id (it may still name none)."""
    return _CURSOR.fullmatch(value) is not None and not value.endswith("~")


def operation_routes(
    jobs: dict[str, RouteJobs],
    queue: Queue | None,
    hub: Hub | None,
    caller: Caller,
    admin: AdminAuth | None,
) -> Sequence[Route]:
    """The operation endpoints, when some route runs jobs."""
    if queue is None or hub is None:
        return []
    api = Operations(jobs, queue, hub, caller, admin)
    base = OPERATIONS_PATH.rstrip("/")
    routes: list[Any] = [
        Route(f"{base}/{{id}}", api.show, methods=["GET"]),
        Route(f"{base}/{{id}}", api.cancel, methods=["DELETE"]),
        Route(f"{base}/{{id}}/result", api.result, methods=["GET"]),
    ]
    if admin is not None:
        routes += [
            Route("/_proxy/admin/operations", api.list, methods=["GET"]),
            Route("/_proxy/admin/operations/{id}/requeue", api.requeue, methods=["POST"]),
        ]
    return routes
