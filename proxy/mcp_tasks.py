"""MCP tasks made by the proxy: slow guarded ``tools/call`` run on the route's workers.

On a ``protocol: mcp`` route with ``async``, a guarded ``tools/call`` that asks for a task
(``params.task``, revision 2025-11-25) becomes a job of the route (``jobs.py``: the MCP
request is the stored request, without ``params.task``). The proxy answers it at once with
a ``CreateTaskResult`` whose task id is the job's; a worker of any replica sends the call
to the MCP server, exactly once, and records its JSON-RPC response as for a live guarded
call. The proxy answers ``tasks/get``, ``tasks/result``, ``tasks/cancel`` and
``tasks/list`` for its own tasks, to the principal that made them; to anyone else (and for
any other task id: the server's own tasks) they pass through to the server.

A guarded call that does not ask for a task, on a route whose ``async`` runs calls on
workers without being asked (``mode: always``, or ``after``), is a job too, followed by
its caller: over SSE its answer stream is kept alive (comments) and carries the tool's
progress notifications (with the caller's own ``progressToken``) until the result. A retry
of the same key while the job runs follows the same job: never a second execution. The
progress reaches followers on every replica (``Followers``: in this process as it comes,
from another one through the store, the latest). ``tasks/result`` over SSE ends with the
task's ``notifications/tasks/status``; on a route with tasks, ``tools/list`` answers
(2025-11-25) mark the guarded tools ``execution.taskSupport: optional`` (``mcp.py``).

    job          queued, running   completed                        failed, dead   cancelled
    task status  working           completed (failed: isError, or   failed         cancelled
                                   a JSON-RPC error)

At revision 2026-07-28 tasks are the extension ``io.modelcontextprotocol/tasks``: one
concept, another wire form. A guarded call whose per-request capabilities
(``params._meta["io.modelcontextprotocol/clientCapabilities"].extensions``) declare the
extension is made a task the same way, answered with a flat ``CreateTaskResult``
(``resultType: "task"``, ``ttlMs``, ``pollIntervalMs``); ``tasks/get`` answers the
``DetailedTask`` (``resultType: "complete"``; terminal: the call's result inlined,
``completed`` even for ``isError``, or its JSON-RPC ``error``, ``failed``);
``tasks/cancel`` and ``tasks/update`` (the proxy's tasks never wait for input) answer an
empty ``resultType: "complete"``. There is no ``tasks/result`` or ``tasks/list`` at that
revision: those are the server's. A 2026-07-28 ``tasks/*`` about a proxy's task from a
request that does not declare the extension is refused with -32021. ``server/discover``
answers (on a route with tasks) advertise the extension in ``capabilities.extensions``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import secrets
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from mcp import types
from starlette.responses import Response, StreamingResponse

from proxy import logs
from proxy.asgi import SSE, Incoming, RawHeaders, Reply
from proxy.errors import (
    OperationConflict,
    ProxyError,
    RequestInProgress,
    ResponseNotStored,
)
from proxy.idempotency import Forward, Outcome
from proxy.jobs import RouteJobs, asked, job_id_of
from proxy.mcp import (
    JSON,
    STREAM_SECONDS,
    VERSION_META,
    Exchange,
    Handled,
    McpView,
    ToolCall,
    body_of,
    content_type,
    error_reply,
    error_response,
    final_response,
    framed,
    identify_call,
    parse,
    problem_code,
    problem_message,
    read_answer,
    refusal,
    render,
    sse_event,
    tool_call,
    wants_sse,
)
from proxy.records import iso
from proxy.store import Job, JobState, RecordKey, Store

RELATED_TASK = "io.modelcontextprotocol/related-task"
TASKS_EXTENSION = "io.modelcontextprotocol/tasks"
"""The 2026-07-28 tasks extension (SEP-2663), declared in per-request capabilities."""
CAPABILITIES_META = "io.modelcontextprotocol/clientCapabilities"
EXTENSION_REVISION = "2026-07-28"
"""The revision whose tasks are the extension's (``params.task`` before it)."""
MISSING_CAPABILITY = -32021
"""A 2026-07-28 request needs a client capability it did not declare (data names it)."""
PROGRESS_TOKEN = "tool-proxy"
"""The progressToken of a job's call whose caller sent none (each follower gets its own)."""
STATUS_NOTE = "notifications/tasks/status"
PROBLEM_META = "io.github.tool-proxy/problem"
"""Where a failed task's status (``tasks/get``) carries the RFC 9457 document."""
# An SSE comment sent on a followed call's stream (or a tasks/result) this often while
# the job runs, so that idle proxies and load balancers do not close it.
KEEP_ALIVE_SECONDS = 15.0
# The longest a caller follows a job on one request (then -32010: send it again).
FOLLOW_SECONDS = STREAM_SECONDS
# Progress notifications held per follower that has not read them yet (then dropped).
MAX_HELD_PROGRESS = 256
# The largest progress notification shared with the followers on other replicas.
MAX_SHARED_PROGRESS_BYTES = 16 * 1024
# How often a replica with followers of a call run elsewhere reads the call's progress.
PROGRESS_POLL_SECONDS = 0.5
# The longest a worker waits for its call's latest progress to be written to the store.
FLUSH_SECONDS = 1.0
# How long a call's latest progress is kept in the store past its last one.
PROGRESS_TTL_SECONDS = 600.0
# Jobs looked at per tasks/list page (the page holds this caller's tasks among them).
LIST_PAGE = 200
_STATUS = {
    JobState.QUEUED: "working",
    JobState.RUNNING: "working",
    JobState.COMPLETED: "completed",
    JobState.FAILED: "failed",
    JobState.DEAD: "failed",
    JobState.CANCELLED: "cancelled",
}
_PROGRESS = b'"notifications/progress"'


class Followers:
    """The progress of the calls the route's workers run, for the callers that follow them
    (by the call's record key), on every replica.

    Within this process, a worker's progress goes to its followers' queues as it arrives;
    a follower who comes later gets the latest first (kept while the call is followed or
    run here).
    Across replicas, through the store: a worker keeps the latest progress notification of
    its call (``progress_key``; at most one write in flight per call, the newest waiting
    replacing the one before, ``MAX_SHARED_PROGRESS_BYTES`` at most), and a process with
    followers of a call that none of its own workers runs reads it every
    ``PROGRESS_POLL_SECONDS`` (one read per call, whatever the followers), handing a new
    one to them. A follower on another replica may miss intermediate progress (it gets the
    latest, the one before the end included), never the result."""

    def __init__(self, store: Store | None = None, log: Any = None) -> None:
        self.store = store
        self.log = log if log is not None else logs.get_logger()
        self.origin = secrets.token_hex(8)
        """This process's mark on the progress it shares (its own is not read back)."""
        self._queues: dict[RecordKey, set[asyncio.Queue[bytes]]] = {}
        self._running: Counter[RecordKey] = Counter()
        """Calls this process's workers are running (their progress is here already)."""
        self._numbered = 0
        self._pending: dict[RecordKey, bytes] = {}
        self._writers: dict[RecordKey, asyncio.Task[None]] = {}
        self._pollers: dict[RecordKey, asyncio.Task[None]] = {}
        self._latest: dict[RecordKey, bytes] = {}
        """The last progress of each call followed or run here, for followers to come."""
        self._seen: dict[RecordKey, bytes] = {}
        """The shared progress last handed to the followers of a call, per call followed."""

    def publish(self, key: RecordKey, data: bytes) -> None:
        if key in self._queues or key in self._running:  # for a follower who comes later
            self._latest[key] = data
        for queue in self._queues.get(key, ()):
            with contextlib.suppress(asyncio.QueueFull):  # a slow follower loses progress
                queue.put_nowait(data)

    @contextlib.contextmanager
    def running(self, key: RecordKey) -> Iterator[None]:
        """While a worker of this process runs the call of ``key``."""
        self._running[key] += 1
        try:
            yield
        finally:
            self._running[key] -= 1
            if self._running[key] <= 0:
                del self._running[key]
                if key not in self._queues:
                    self._latest.pop(key, None)

    def share(self, key: RecordKey, data: bytes) -> None:
        """Keep ``data`` (a worker's progress) in the store as the call's latest, for the
        followers on other replicas: written behind, the newest replacing any not written."""
        if self.store is None:
            return
        self._numbered += 1
        shared = _shared_progress(self.origin, self._numbered, data)
        if shared is None or len(shared) > MAX_SHARED_PROGRESS_BYTES:
            return  # not UTF-8 (never raised into the answer's reader), or too large
        self._pending[key] = shared
        if key not in self._writers:
            self._writers[key] = asyncio.create_task(self._write(key))

    async def _write(self, key: RecordKey) -> None:
        assert self.store is not None
        try:
            while (value := self._pending.pop(key, None)) is not None:
                try:
                    await self.store.put_value(progress_key(key), value, PROGRESS_TTL_SECONDS)
                except ProxyError as exc:  # the followers elsewhere miss it; the call goes on
                    self.log.warning("mcp_progress_not_shared", error=exc.detail)
        finally:
            self._writers.pop(key, None)

    @contextlib.contextmanager
    def follow(self, key: RecordKey | None) -> Iterator[asyncio.Queue[bytes]]:
        """A queue of the progress of ``key``'s call (None: a queue that gets none)."""
        queue: asyncio.Queue[bytes] = asyncio.Queue(MAX_HELD_PROGRESS)
        if key is None:
            yield queue
            return
        self._queues.setdefault(key, set()).add(queue)
        latest = self._latest.get(key)
        if latest is not None:  # the call's progress so far: the latest
            queue.put_nowait(latest)
        if self.store is not None and key not in self._pollers:
            self._pollers[key] = asyncio.create_task(self._poll(key))
        try:
            yield queue
        finally:
            queues = self._queues.get(key, set())
            queues.discard(queue)
            if not queues:
                self._queues.pop(key, None)
                self._seen.pop(key, None)
                if key not in self._running:
                    self._latest.pop(key, None)
                poller = self._pollers.pop(key, None)
                if poller is not None:
                    poller.cancel()

    async def _poll(self, key: RecordKey) -> None:
        """Hand the progress another replica's worker shares to this process's followers."""
        while True:
            await self.settle(key)
            await asyncio.sleep(PROGRESS_POLL_SECONDS)

    async def settle(self, key: RecordKey | None) -> None:
        """Read the call's shared progress once, and hand it to the followers here if it is
        new and another replica's (a follower's last read, once the job ended)."""
        if self.store is None or key is None or key in self._running:
            return
        try:
            value = await self.store.get_value(progress_key(key))
        except ProxyError:
            return  # the store is away: no progress from elsewhere meanwhile
        if value is None or value == self._seen.get(key):
            return
        if key in self._queues:
            self._seen[key] = value
        note = _read_shared(value, self.origin)
        if note is not None:
            self.publish(key, note)

    async def flush(self, key: RecordKey) -> None:
        """Wait for the call's latest progress to be in the store (before its result is
        recorded: a follower elsewhere reads it before the end)."""
        writer = self._writers.get(key)
        if writer is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(FLUSH_SECONDS):
                    await asyncio.shield(writer)


def progress_key(key: RecordKey) -> str:
    """Where a call's latest progress is kept for the followers on other replicas."""
    digest = hashlib.sha256(f"{key.slot}\n{key.name}".encode()).hexdigest()[:32]
    return f"mcp-progress|{digest}"


def _shared_progress(origin: str, number: int, data: bytes) -> bytes | None:
    """The value kept for ``data``; None if ``data`` is not UTF-8 (an SSE event must be)."""
    try:
        note = data.decode()
    except UnicodeDecodeError:
        return None
    return json.dumps({"origin": origin, "n": number, "note": note}, ensure_ascii=False).encode()


def _read_shared(value: bytes, origin: str) -> bytes | None:
    """The progress notification kept in ``value``; None if it is this process's own (its
    followers had it already) or not one."""
    try:
        shared = json.loads(value)
        if shared["origin"] == origin:
            return None
        note = shared["note"]
    except (ValueError, TypeError, KeyError):
        return None
    return note.encode() if isinstance(note, str) and _PROGRESS.decode() in note else None


class Relay:
    """A job's view of its call's SSE answer (``mcp.Messages``): progress to followers,
    here and on the other replicas."""

    def __init__(self, followers: Followers, key: RecordKey) -> None:
        self.followers = followers
        self.key = key

    def start(self) -> None:
        return None

    def event(self, data: bytes) -> None:
        if _PROGRESS in data:  # the server's requests and logs have no one to answer them
            self.followers.publish(self.key, data)
            self.followers.share(self.key, data)


class McpTasks:
    """The proxy's tasks on one MCP route (``mcp.Tasks``), run by the route's jobs."""

    def __init__(self, view: McpView, jobs: RouteJobs, followers: Followers) -> None:
        self.view = view
        self.jobs = jobs
        self.followers = followers

    # -- the worker's side ---------------------------------------------------------------

    def deferred(self, forward: Forward, request: Incoming, body: bytes, principal: str) -> Forward:
        """A job's send on this route: the server's answer read as a live guarded call's
        (its JSON-RPC response is what is recorded), its progress to the followers."""
        view = self.view
        call = tool_call(parse(body))
        assert view.policy is not None
        op = identify_call(view.route.name, view.policy, view.config, request, call, principal)
        if op is None:

            async def plain() -> Any:
                sent = await forward()
                return await read_answer(sent, call.id, view.not_run, view.answer_bound, None)

            return plain
        key, relay = op.key, Relay(self.followers, op.key)

        async def send() -> Any:
            with self.followers.running(key):
                sent = await forward()
                answer = await read_answer(sent, call.id, view.not_run, view.answer_bound, relay)
                await self.followers.flush(key)
                return answer

        return send

    # -- tools/call ----------------------------------------------------------------------

    async def call(
        self, request: Incoming, exchange: Exchange, principal: str, call: ToolCall, body: bytes
    ) -> Handled | None:
        """A guarded call as a task (``params.task``), or followed on the route's workers;
        None: answered as a live call (no key on a route that does not need one, or a
        record that is no job's in progress)."""
        params = json.loads(body).get("params") or {}
        extension = declares_extension(params)
        task = extension or (isinstance(params, dict) and "task" in params)
        if not task and asked(self.jobs.config, None) is None:
            return None
        view = self.view
        assert view.policy is not None
        try:
            op = identify_call(view.route.name, view.policy, view.config, request, call, principal)
            if op is None:
                return None
            sent = _stored_body(body)
            job = await self.jobs.enter(op, request, sent, principal, exchange.identity)
            if job is None and task:
                job = await self._ended_job(op.key, principal)
        except ProxyError as exc:
            return Handled(refusal(call.id, exc), Outcome.REJECTED)
        if job is None:
            return None
        accept, session = _header(request, b"accept"), _header(request, b"mcp-session-id")
        if task:
            if extension:  # 2026-07-28: the task itself, flat, is the result
                result = {"resultType": "task", **_handle(await self._detailed(job))}
            else:
                result = {"task": await self._task(job)}
            created = self._reply(call.id, result, accept, session)
            return Handled(created, Outcome.ACCEPTED, op.label)
        token = call.meta.get("progressToken")
        response = await self._follow(job, op.key, call.id, accept, session, _retoken(token))
        return Handled(response, Outcome.ACCEPTED, op.label)

    async def _ended_job(self, key: RecordKey, principal: str) -> Job | None:
        """The job whose outcome the key's record holds (a task asked again after it
        ended gets the same task), if it is still kept."""
        record = await self.jobs.store.get(key)
        job_id = None if record is None else job_id_of(record.owner)
        job = None if job_id is None else await self.jobs.queue.get(job_id)
        return job if job is not None and self._owns(job, principal) else None

    # -- initialize ----------------------------------------------------------------------

    async def initialized(self, exchange: Exchange, body: bytes) -> Response:
        """The server's ``initialize`` answer, its capabilities with ``tasks`` (list,
        cancel, ``tools/call``), or its ``server/discover`` answer (2026-07-28), its
        capabilities with the tasks extension: clients that check them before asking for a
        task ask."""
        discover = json.loads(body).get("method") == "server/discover"
        upstream = await exchange.forward(body)
        raw = await upstream.read()
        form = content_type(upstream.headers)
        answer = final_response(raw, form) if upstream.status == 200 else None
        kept = [(k, v) for k, v in upstream.headers if k.lower() != b"content-type"]
        if not isinstance(answer, types.JSONRPCResponse):
            headers = [*upstream.headers, (b"content-length", str(len(raw)).encode())]
            return Reply(upstream.status, headers, raw)
        capabilities = answer.result.setdefault("capabilities", {})
        if discover and isinstance(capabilities, dict):
            extensions = capabilities.setdefault("extensions", {})
            if isinstance(extensions, dict):
                extensions.setdefault(TASKS_EXTENSION, {})
        elif isinstance(capabilities, dict):
            tasks = capabilities.setdefault("tasks", {})
            if isinstance(tasks, dict):
                tasks.setdefault("list", {})
                tasks.setdefault("cancel", {})
                tasks.setdefault("requests", {}).setdefault("tools", {}).setdefault("call", {})
        payload = answer.model_dump_json(by_alias=True, exclude_none=True).encode()
        return framed(payload, form == SSE, kept)

    # -- tasks/* -------------------------------------------------------------------------

    async def answer(
        self, request: Incoming, message: types.JSONRPCRequest, principal: str
    ) -> Handled | None:
        params = message.params or {}
        extension = _speaks_extension(request, params)
        try:
            if message.method == "tasks/list" and not extension:
                return Handled(await self._list(request, message, principal), Outcome.PASSED)
            task_id = params.get("taskId")
            if not isinstance(task_id, str):
                return None
            job = await self.jobs.queue.get(task_id)
            if job is None or not self._owns(job, principal):
                return None  # not the proxy's (or not this caller's): the server's to answer
            if extension:
                response = await self._about_extension(request, message, job, params)
            else:
                response = await self._about(request, message, job)
        except ProxyError as exc:
            return Handled(refusal(message.id, exc), Outcome.REJECTED)
        return None if response is None else Handled(response, Outcome.PASSED, job.label)

    async def _about(
        self, request: Incoming, message: types.JSONRPCRequest, job: Job
    ) -> Response | None:
        accept, session = _header(request, b"accept"), _header(request, b"mcp-session-id")
        if message.method == "tasks/get":
            return self._reply(message.id, await self._task(job, problem=True), accept, session)
        if message.method == "tasks/cancel":
            return await self._cancel(message.id, job, accept, session)
        if message.method == "tasks/result":
            return await self._follow(job, None, message.id, accept, session, _no_progress, job.id)
        return None

    async def _about_extension(
        self, request: Incoming, message: types.JSONRPCRequest, job: Job, params: dict[str, Any]
    ) -> Response | None:
        """A 2026-07-28 ``tasks/get``, ``tasks/cancel`` or ``tasks/update`` about one of
        the proxy's tasks (None: another method, the server's)."""
        if message.method not in ("tasks/get", "tasks/cancel", "tasks/update"):
            return None
        if not declares_extension(params):
            required: dict[str, Any] = {
                "requiredCapabilities": {"extensions": {TASKS_EXTENSION: {}}}
            }
            return error_reply(
                message.id, MISSING_CAPABILITY, "Missing required client capability: the "
                f"request does not declare the {TASKS_EXTENSION} extension", status=200,
                data=required,
            )  # fmt: skip
        accept, session = _header(request, b"accept"), _header(request, b"mcp-session-id")
        if message.method == "tasks/get":
            result = {"resultType": "complete", **await self._detailed(job)}
            return self._reply(message.id, result, accept, session)
        if message.method == "tasks/cancel":
            return await self._cancel(message.id, job, accept, session, extension=True)
        # tasks/update: the proxy's tasks are never input_required; responses to requests
        # it did not make are ignored, as the extension lets a server do.
        return self._reply(message.id, {"resultType": "complete"}, accept, session)

    async def _cancel(
        self, id: str | int, job: Job, accept: str, session: str, *, extension: bool = False
    ) -> Response:
        if job.state.terminal:
            return error_reply(
                id, types.INVALID_PARAMS, f"Task {job.id} has already ended ({job.state.value})",
                status=200,
            )  # fmt: skip
        cancelled = await self.jobs.cancel(job)
        if cancelled is None:  # it was sent: it completes or fails, and is recorded
            return refusal(
                id,
                OperationConflict(
                    "the task's call was sent to the tool: it cannot be cancelled; it "
                    "completes or fails and is recorded as usual"
                ),
            )
        if extension:  # 2026-07-28: an empty acknowledgement
            return self._reply(id, {"resultType": "complete"}, accept, session)
        return self._reply(id, await self._task(cancelled), accept, session)

    async def _list(
        self, request: Incoming, message: types.JSONRPCRequest, principal: str
    ) -> Response:
        cursor = (message.params or {}).get("cursor") or ""
        if not isinstance(cursor, str):
            return error_reply(message.id, types.INVALID_PARAMS, "Invalid cursor", status=200)
        after, jobs = await self.jobs.queue.list(None, cursor, LIST_PAGE)
        mine = [job for job in jobs if self._owns(job, principal)]
        result: dict[str, Any] = {"tasks": [await self._task(job) for job in mine]}
        if after:
            result["nextCursor"] = after
        accept, session = _header(request, b"accept"), _header(request, b"mcp-session-id")
        return self._reply(message.id, result, accept, session)

    def _owns(self, job: Job, principal: str) -> bool:
        return job.route == self.view.route.name and job.principal == principal

    # -- what a task says ----------------------------------------------------------------

    async def _task(self, job: Job, *, problem: bool = False) -> dict[str, Any]:
        """The task's status (``Task``); ``problem``: with a failure's RFC 9457 document."""
        status, message, doc = _STATUS[job.state], "", None
        if job.state is JobState.COMPLETED and await self._failed_result(job):
            status = "failed"
            message = "the tool answered with an error (isError, or a JSON-RPC error)"
        elif job.error and job.state in (JobState.FAILED, JobState.DEAD):
            doc = json.loads(job.error)
            message = str(doc.get("detail") or doc.get("title") or "")
        elif job.state is JobState.CANCELLED:
            message = "cancelled before it was sent: the tool was not called"
        task: dict[str, Any] = {
            "taskId": job.id,
            "status": status,
            "createdAt": iso(job.created_at),
            "lastUpdatedAt": iso(job.updated_at),
            "ttl": round(job.keep * 1000),
            "pollInterval": round(self.jobs.guard.policy.retry_after * 1000),
        }
        if message:
            task["statusMessage"] = message
        if problem and doc is not None:
            task["_meta"] = {PROBLEM_META: doc}
        return task

    async def _detailed(self, job: Job) -> dict[str, Any]:
        """The task as the 2026-07-28 extension says it (``DetailedTask``): an ended one
        with the call's result (``completed``, an ``isError`` one too) or its JSON-RPC
        error (``failed``), as a ``tools/call`` sent again with its key would be answered."""
        task: dict[str, Any] = {
            "taskId": job.id,
            "status": "working",
            "createdAt": iso(job.created_at),
            "lastUpdatedAt": iso(job.updated_at),
            "ttlMs": round(job.keep * 1000),
            "pollIntervalMs": round(self.jobs.guard.policy.retry_after * 1000),
        }
        if job.state is JobState.CANCELLED:
            task["status"] = "cancelled"
            task["statusMessage"] = "cancelled before it was sent: the tool was not called"
        elif job.state.terminal:
            answer = json.loads(await body_of(await self._final(job, 0, None, "")))
            result, error = answer.get("result"), answer.get("error")
            if isinstance(result, dict):
                result.setdefault("resultType", "complete")
                task.update(status="completed", result=result)
            else:
                if not isinstance(error, dict):  # not a JSON-RPC answer: an internal error
                    error = {"code": types.INTERNAL_ERROR, "message": "no result was recorded"}
                task.update(status="failed", error=error)
                if isinstance(error.get("message"), str) and error["message"]:
                    task["statusMessage"] = error["message"]
        return task

    async def _failed_result(self, job: Job) -> bool:
        response = await self.jobs.result(job, first=True)
        if response is None:
            return False
        answer = _message(await body_of(response))
        if isinstance(answer, types.JSONRPCError):
            return True
        return isinstance(answer, types.JSONRPCResponse) and answer.result.get("isError") is True

    def _reply(self, id: str | int, result: dict[str, Any], accept: str, session: str) -> Response:
        payload = json.dumps({"jsonrpc": "2.0", "id": id, "result": result}).encode()
        extra: RawHeaders = [(b"mcp-session-id", session.encode())] if session else []
        return framed(payload, wants_sse(accept, False), extra)

    # -- following a job -----------------------------------------------------------------

    async def _follow(
        self,
        job: Job,
        key: RecordKey | None,
        id: str | int,
        accept: str,
        session: str,
        retoken: Retoken,
        related: str | None = None,
    ) -> Response:
        """The job's answer to request ``id`` once it ends: over SSE, the stream kept alive
        meanwhile, with the tool's progress; as JSON, once it ends (-32010 past
        ``FOLLOW_SECONDS``). ``related``: a ``tasks/result``'s task, named in its _meta."""
        if not wants_sse(accept, True):
            ended = await self._ended(job)
            return await self._final(ended, id, related, session)
        response = StreamingResponse(self._frames(job, key, id, retoken, related), 200)
        extra: RawHeaders = [(b"mcp-session-id", session.encode())] if session else []
        response.raw_headers = [
            (b"content-type", SSE.encode()),
            (b"cache-control", b"no-cache"),
            *extra,
        ]
        return response

    async def _frames(
        self,
        job: Job,
        key: RecordKey | None,
        id: str | int,
        retoken: Retoken,
        related: str | None,
    ) -> AsyncIterator[bytes]:
        with self.followers.follow(key) as queue:
            ended = asyncio.ensure_future(self._ended(job))
            try:
                while not ended.done():
                    taken = asyncio.ensure_future(queue.get())
                    done, _ = await asyncio.wait(
                        {ended, taken},
                        timeout=KEEP_ALIVE_SECONDS,
                        return_when=asyncio.FIRST_COMPLETED,
                    )
                    if taken in done:
                        data = retoken(taken.result())
                        if data is not None:
                            yield sse_event(data)
                    else:
                        taken.cancel()
                    if not done:
                        yield b": keep-alive\n\n"
                await self.followers.settle(key)  # the progress shared just before the end
                while not queue.empty():
                    data = retoken(queue.get_nowait())
                    if data is not None:
                        yield sse_event(data)
            finally:  # the caller may leave: the job goes on
                ended.cancel()
        last = ended.result()
        if related is not None and last is not None:  # the requester of a task: its status
            yield sse_event(await self._status_note(last))
        final = await self._final(last, id, related, "")
        yield sse_event(await body_of(final))

    async def _status_note(self, job: Job) -> bytes:
        """``notifications/tasks/status`` (2025-11-25) of an ended task."""
        note = {"jsonrpc": "2.0", "method": STATUS_NOTE, "params": await self._task(job)}
        return json.dumps(note).encode()

    async def _ended(self, job: Job) -> Job | None:
        if job.state.terminal:
            return job
        return await self.jobs.hub.ended(job.id, FOLLOW_SECONDS)

    async def _final(
        self, job: Job | None, id: str | int, related: str | None, session: str
    ) -> Response:
        """The ended job's answer to request ``id``, as JSON: the recorded JSON-RPC
        response (``related``: with the task named in its result's _meta), or the
        proxy's JSON-RPC error for a job that ended without one."""
        if job is None:
            return refusal(id, _still_running())
        recorded = None
        if job.state in (JobState.COMPLETED, JobState.FAILED):
            recorded = await self.jobs.result(job, first=True)
        if recorded is not None:
            rendered = await render(recorded, id, JSON, session, replayed=False)
            if related is None:
                return rendered
            return _related(rendered, await body_of(rendered), related)
        if job.error:
            problem = json.loads(job.error)
            return error_response(id, problem_code(problem), problem_message(problem), problem)
        if job.state is JobState.CANCELLED:
            detail = f"Task {job.id} was cancelled before it was sent: the tool was not called"
            return error_reply(id, types.INVALID_REQUEST, detail, status=200)
        return refusal(id, ResponseNotStored("the task's result is no longer kept"))


Retoken = Callable[[bytes], bytes | None]
"""``(data) -> data | None``: a progress notification as one follower gets it (None: not)."""


def _retoken(token: object) -> Retoken:
    """Progress with the follower's own ``progressToken``; none if it asked for none."""

    def retoken(data: bytes) -> bytes | None:
        if token is None or not isinstance(token, str | int):
            return None
        note = json.loads(data)
        params = note.get("params")
        if not isinstance(params, dict):
            return None
        params["progressToken"] = token
        return json.dumps(note).encode()

    return retoken


def _no_progress(data: bytes) -> bytes | None:
    """A ``tasks/result`` stream is kept alive, without progress (the token of the task's
    call is not known to the proxy once the call is running)."""
    return None


def _related(response: Response, body: bytes, task_id: str) -> Response:
    """A ``tasks/result`` answer: the result names its task in ``_meta``."""
    answer = json.loads(body)
    result = answer.get("result")
    if not isinstance(result, dict):
        return response
    meta = result.setdefault("_meta", {})
    if isinstance(meta, dict):
        meta[RELATED_TASK] = {"taskId": task_id}
    return framed(json.dumps(answer).encode(), False, [])


def _message(body: bytes) -> types.JSONRPCResponse | types.JSONRPCError | None:
    try:
        message = types.JSONRPCMessage.model_validate_json(body).root
    except ValueError:
        return None
    return message if isinstance(message, types.JSONRPCResponse | types.JSONRPCError) else None


def declares_extension(params: object) -> bool:
    """True if a request's per-request capabilities (2026-07-28) declare the tasks
    extension: ``params._meta[CAPABILITIES_META].extensions[TASKS_EXTENSION]``, an object
    (empty: no settings are defined)."""
    meta = params.get("_meta") if isinstance(params, dict) else None
    capabilities = meta.get(CAPABILITIES_META) if isinstance(meta, dict) else None
    extensions = capabilities.get("extensions") if isinstance(capabilities, dict) else None
    return isinstance(extensions, dict) and isinstance(extensions.get(TASKS_EXTENSION), dict)


def _speaks_extension(request: Incoming, params: dict[str, Any]) -> bool:
    """True if a ``tasks/*`` request is of 2026-07-28 (its ``_meta`` revision, or its
    ``MCP-Protocol-Version`` header), or declares the extension: the extension's forms."""
    meta = params.get("_meta")
    declared = meta.get(VERSION_META) if isinstance(meta, dict) else None
    version = declared if isinstance(declared, str) else _header(request, b"mcp-protocol-version")
    return version == EXTENSION_REVISION or declares_extension(params)


def _handle(task: dict[str, Any]) -> dict[str, Any]:
    """A ``CreateTaskResult``'s task: without an ended task's result or error (``tasks/get``
    has them)."""
    return {k: v for k, v in task.items() if k not in ("result", "error")}


def _stored_body(body: bytes) -> bytes:
    """The call as the MCP server gets it from a worker: without ``params.task`` or the
    declared tasks extension (the task is the proxy's: the server makes none), and with a
    ``progressToken`` (the proxy's if the caller sent none), so that the server reports
    progress for whoever follows the job."""
    message = json.loads(body)
    params = message["params"]
    params.pop("task", None)
    meta = params.setdefault("_meta", {})
    if isinstance(meta, dict):
        meta.setdefault("progressToken", PROGRESS_TOKEN)
        capabilities = meta.get(CAPABILITIES_META)  # 2026-07-28: nor the tasks extension
        extensions = capabilities.get("extensions") if isinstance(capabilities, dict) else None
        if isinstance(extensions, dict):
            extensions.pop(TASKS_EXTENSION, None)
    return json.dumps(message, separators=(",", ":")).encode()


def _still_running() -> RequestInProgress:
    return RequestInProgress(
        "the task is still running; send the same call with the same key again to follow it",
        headers={"Retry-After": "1"},
    )


def _header(request: Incoming, name: bytes) -> str:
    return request.header(name) or ""
