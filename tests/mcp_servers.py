"""A real MCP server (the official SDK's FastMCP over Streamable HTTP) whose tools count
their side effects, and helpers to call it with the SDK's client."""

from __future__ import annotations

import asyncio
import json
import threading
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import anyio.to_thread
import httpx
from mcp import ClientSession, types
from mcp.client.streamable_http import streamable_http_client
from mcp.server.fastmcp import Context, FastMCP
from mcp.server.fastmcp.exceptions import ToolError
from mcp.server.lowlevel import Server
from mcp.server.streamable_http import EventCallback, EventId, EventStore, StreamId
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.types import ToolAnnotations
from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.routing import Mount
from starlette.types import Receive, Scope, Send

from tests.servers import ThreadServer


class McpTool:
    """A FastMCP server on a thread: ``charge`` counts per account, ``balance`` is
    read-only, ``refund`` fails with an ``isError`` result (and counts too); ``transfer``
    sees overlaps and fencing tokens, ``report`` answers large, ``chatty`` sends much
    progress, ``deploy`` is slow (progress around the ``gate``), ``whoami`` shows the
    Authorization it got."""

    def __init__(self, *, json_response: bool, resumable: bool = False) -> None:
        self.executions: Counter[str] = Counter()
        self.arrived: Counter[str] = Counter()
        """Calls of ``deploy`` that reached the tool (counted before they wait)."""
        self.running: Counter[str] = Counter()
        self.overlap: Counter[str] = Counter()
        """The most transfers of one account that ran at once."""
        self.fencing: list[str] = []
        """The Fencing-Token of each transfer, in the order they finished."""
        self.gate = threading.Event()
        """Calls with ``hold`` wait until it is set (it is, but while a test holds them)."""
        self.gate.set()
        self.finished: defaultdict[str, threading.Event] = defaultdict(threading.Event)
        """Set once ``charge`` of an account has counted."""
        self.notifications: list[str] = []
        """The method of every JSON-RPC notification the server received, in order."""
        self.json_response = json_response
        server = FastMCP(
            "billing",
            json_response=json_response,
            log_level="WARNING",
            event_store=EventLog() if resumable else None,
        )

        @server.tool()
        async def charge(account: str, cents: int, hold: bool = False) -> str:
            """Charge an account (a side effect); ``hold``: not before ``gate`` opens."""
            if hold:
                await anyio.to_thread.run_sync(self.gate.wait, 30)
            self.executions[account] += 1
            self.finished[account].set()
            return f"charged {cents} to {account} (#{self.executions[account]})"

        @server.tool()
        async def export(account: str, ctx: Context) -> str:  # type: ignore[type-arg]
            """Reports progress (SSE answers), then its result."""
            for done in range(3):
                await ctx.report_progress(done, 3)
            self.executions[f"export:{account}"] += 1
            return f"exported {account}"

        @server.tool(annotations=ToolAnnotations(readOnlyHint=True))
        async def balance(account: str, hold: bool = False) -> str:
            """Read a balance (no side effect); ``hold``: not before ``gate`` opens."""
            if hold:
                await anyio.to_thread.run_sync(self.gate.wait, 30)
            self.executions[f"balance:{account}"] += 1
            return f"{account}: {self.executions[account]} charges"

        @server.tool()
        def refund(account: str) -> str:
            """Always fails, after counting."""
            self.executions[f"refund:{account}"] += 1
            raise ToolError(f"refund #{self.executions[f'refund:{account}']} refused")

        @server.tool()
        async def transfer(account: str, cents: int, ctx: Context, delay: float = 0.0) -> str:  # type: ignore[type-arg]
            """Counts how many transfers of one account overlap, and the fencing tokens."""
            self.running[account] += 1
            self.overlap[account] = max(self.overlap[account], self.running[account])
            try:
                await asyncio.sleep(delay)
            finally:
                self.running[account] -= 1
            self.fencing.append(_header(ctx, "fencing-token"))
            self.executions[f"transfer:{account}"] += 1
            return f"moved {cents} from {account}"

        @server.tool()
        def report(account: str, size: int) -> str:
            """A result of ``size`` characters (a side effect, counted)."""
            self.executions[f"report:{account}"] += 1
            return "r" * size

        @server.tool()
        async def chatty(account: str, notes: int, ctx: Context) -> str:  # type: ignore[type-arg]
            """Many long progress notifications (SSE answers), then a short result."""
            for done in range(notes):
                await ctx.report_progress(done, notes, "n" * 1000)
            self.executions[f"chatty:{account}"] += 1
            return f"told {account}"

        @server.tool()
        async def close(account: str, ctx: Context) -> str:  # type: ignore[type-arg]
            """Asks the client to confirm (elicitation, on the call's SSE stream), then acts."""
            answer = await ctx.elicit(f"Close {account}?", Confirmation)
            if answer.action != "accept" or not answer.data.sure:
                return f"kept {account}"
            self.executions[f"close:{account}"] += 1
            return f"closed {account}"

        @server.tool()
        async def deploy(account: str, ctx: Context) -> str:  # type: ignore[type-arg]
            """A slow call: progress, then waits while ``gate`` is shut, progress, counts."""
            self.arrived[f"deploy:{account}"] += 1
            await ctx.report_progress(0, 2, "started")
            await anyio.to_thread.run_sync(self.gate.wait, 30)
            await ctx.report_progress(1, 2, "almost")
            self.executions[f"deploy:{account}"] += 1
            self.finished[f"deploy:{account}"].set()
            return f"deployed {account} (#{self.executions[f'deploy:{account}']})"

        @server.tool()
        def whoami(account: str, ctx: Context) -> str:  # type: ignore[type-arg]
            """The Authorization header this call reached the server with (counted)."""
            self.executions[f"whoami:{account}"] += 1
            return _header(ctx, "authorization")

        self.tools = [tool.name for tool in server._tool_manager.list_tools()]
        self.server = ThreadServer(_Noting(server.streamable_http_app(), self.notifications))

    @contextmanager
    def holding(self) -> Iterator[None]:
        """Calls with ``hold: true`` wait while in this block."""
        self.gate.clear()
        try:
            yield
        finally:
            self.gate.set()

    def start(self) -> McpTool:
        self.server.start()
        return self

    @property
    def url(self) -> str:
        return self.server.url

    def stop(self) -> None:
        self.server.stop()


class EventLog(EventStore):
    """An event store that numbers events and replays none: enough for the SDK server to
    open each SSE answer with its priming event (an id, empty data; 2025-11-25)."""

    def __init__(self) -> None:
        self.count = 0

    async def store_event(
        self, stream_id: StreamId, message: types.JSONRPCMessage | None
    ) -> EventId:
        self.count += 1
        return f"{stream_id}:{self.count}"

    async def replay_events_after(
        self, last_event_id: EventId, send_callback: EventCallback
    ) -> StreamId | None:
        return None


class Confirmation(BaseModel):
    """What ``close`` asks the client for."""

    sure: bool


class _Noting:
    """ASGI middleware: notes the method of each JSON-RPC notification POSTed to ``app``
    (the SDK's session handles some, such as ``notifications/cancelled``, without a hook)."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], seen: list[str]):
        self.app, self.seen = app, seen

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []

        async def teed() -> Any:
            message = await receive()
            if message["type"] == "http.request":
                chunks.append(message.get("body", b""))
                if not message.get("more_body"):
                    self._note(b"".join(chunks))
            return message

        await self.app(scope, teed, send)

    def _note(self, body: bytes) -> None:
        try:
            message = json.loads(body)
        except ValueError:
            return
        if isinstance(message, dict) and "method" in message and "id" not in message:
            self.seen.append(str(message["method"]))


def _header(ctx: Context, name: str) -> str:  # type: ignore[type-arg]
    """A header of the HTTP request that carried the current call."""
    request = ctx.request_context.request
    return str(request.headers.get(name, "")) if request is not None else ""


@asynccontextmanager
async def session(
    url: str, headers: dict[str, str] | None = None, **callbacks: Any
) -> AsyncIterator[ClientSession]:
    """An initialized SDK client session on ``url`` (the MCP endpoint); ``callbacks``
    go to ``ClientSession`` (e.g. ``elicitation_callback``)."""
    async with (
        httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(30, read=300)) as http,
        streamable_http_client(url, http_client=http) as (read, write, _),
        ClientSession(read, write, **callbacks) as client,
    ):
        await client.initialize()
        yield client


def confirming(asked: list[str]) -> Callable[..., Awaitable[types.ElicitResult]]:
    """An elicitation callback that says yes (to ``close``), noting each question."""

    async def confirm(context: Any, params: types.ElicitRequestParams) -> types.ElicitResult:
        asked.append(params.message)
        return types.ElicitResult(action="accept", content={"sure": True})

    return confirm


class RawSession:
    """A hand-driven MCP session (httpx), to see the HTTP side of each answer."""

    def __init__(self, http: httpx.Client, url: str, accept: str) -> None:
        self.http = http
        self.url = url
        self.headers = {"Accept": accept, "Content-Type": "application/json"}

    def open(self, revision: str = "2025-06-18") -> RawSession:
        answer = self.post({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
            "protocolVersion": revision, "capabilities": {},
            "clientInfo": {"name": "raw", "version": "1"},
        }})  # fmt: skip
        self.headers["Mcp-Session-Id"] = answer.headers["mcp-session-id"]
        self.headers["MCP-Protocol-Version"] = revision
        self.post({"jsonrpc": "2.0", "method": "notifications/initialized"})
        return self

    def post(self, message: Any, **headers: str) -> httpx.Response:
        return self.http.post(
            self.url, content=json.dumps(message), headers={**self.headers, **headers}
        )


def message_of(response: httpx.Response) -> Any:
    """The JSON-RPC message of a JSON answer or of a one-response SSE stream."""
    if response.headers["content-type"].startswith("text/event-stream"):
        data = [line[5:].strip() for line in response.text.splitlines() if line.startswith("data:")]
        return json.loads(data[-1])
    return response.json()


class TaskTool:
    """A low-level SDK server with task support (2025-11-25): ``provision`` runs as a task
    when the call asks for one, counting its runs per ``db``."""

    def __init__(self) -> None:
        self.runs: Counter[str] = Counter()
        server: Server[Any, Any] = Server("tasks")
        server.experimental.enable_tasks()

        @server.list_tools()  # type: ignore[untyped-decorator, no-untyped-call]
        async def list_tools() -> list[types.Tool]:
            execution = types.ToolExecution(taskSupport="optional")
            schema = {"type": "object"}
            return [types.Tool(name="provision", inputSchema=schema, execution=execution)]

        @server.call_tool()  # type: ignore[untyped-decorator]
        async def call_tool(
            name: str, arguments: dict[str, Any]
        ) -> types.CallToolResult | types.CreateTaskResult:
            async def work(task: Any) -> types.CallToolResult:
                await asyncio.sleep(0.05)
                self.runs[arguments["db"]] += 1
                return types.CallToolResult(content=[types.TextContent(type="text", text="ok")])

            context = server.request_context
            if context.experimental.is_task:
                created: types.CreateTaskResult = await context.experimental.run_task(work)
                return created
            return await work(None)

        manager = StreamableHTTPSessionManager(app=server, json_response=True)

        @asynccontextmanager
        async def lifespan(app: Starlette) -> AsyncIterator[None]:
            async with manager.run():
                yield

        async def endpoint(scope: Scope, receive: Receive, send: Send) -> None:
            await manager.handle_request(scope, receive, send)

        app = Starlette(routes=[Mount("/mcp", app=endpoint)], lifespan=lifespan)
        self.server = ThreadServer(app)

    def start(self) -> TaskTool:
        self.server.start()
        return self

    @property
    def url(self) -> str:
        return self.server.url

    def stop(self) -> None:
        self.server.stop()
