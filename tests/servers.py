"""Real servers for the tests: uvicorn on a thread, redis-server and tool-proxy as processes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import httpx
import uvicorn
import yaml
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp

from proxy.server import ProxyHttpProtocol

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for(predicate: Any, seconds: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except (OSError, httpx.HTTPError):
            pass
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


class ThreadServer:
    """An ASGI app served by uvicorn on a background thread (its own event loop)."""

    def __init__(self, app: ASGIApp, port: int | None = None, proxy_protocol: bool = False) -> None:
        self.port = port or free_port()
        config = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            lifespan="on",
            http=ProxyHttpProtocol if proxy_protocol else "httptools",
            timeout_graceful_shutdown=10,
            proxy_headers=False,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ThreadServer:
        self.thread.start()
        wait_for(lambda: self.server.started, what="uvicorn to start")
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive(), "server did not stop"


class CountingTool:
    """An upstream that counts how often each request was executed.

    Query parameters shape the answer: ``delay`` (seconds), ``gated`` (wait for
    ``gate``), ``status``, ``size`` (a
    streamed body of that many bytes, ``chunk_delay`` seconds between 64 KiB chunks),
    ``cookie`` (adds Set-Cookie), ``retry_after`` (adds Retry-After), ``cache_control``
    and ``vary`` (add Cache-Control and Vary), ``usage`` (adds
    ``"usage": {"total_tokens": <usage>}`` to the JSON answer). ``in_flight`` counts the
    requests being handled now, ``most_in_flight`` the most at once.
    """

    def __init__(self) -> None:
        self.url = ""
        self.reject_tokens: set[str] = set()
        self.executions: Counter[str] = Counter()
        self.arrived: Counter[str] = Counter()
        """Requests per key that reached the tool, counted before any ``delay``."""
        self.requests: list[dict[str, Any]] = []
        self.in_flight = 0
        self.most_in_flight = 0
        self.before: Callable[[], None] | None = None
        """Called as each request arrives (e.g. to inject a fault while the tool works)."""
        self.gate = threading.Event()
        """Requests with ``?gated=1`` wait for it (after they are counted as arrived)."""
        self.gate.set()
        self.app = Starlette(
            routes=[
                Route(
                    "/{path:path}",
                    self.handle,
                    methods=["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD"],
                )
            ]
        )

    def count(self, key: str) -> int:
        return self.executions[key]

    @property
    def total(self) -> int:
        return sum(self.executions.values())

    async def handle(self, request: Request) -> Response:
        body = await request.body()
        query = request.query_params
        if request.headers.get("authorization", "").removeprefix("Bearer ") in self.reject_tokens:
            return Response(b'{"error":"invalid_token"}', 401, media_type="application/json")
        key = request.headers.get("idempotency-key") or request.url.path
        self.arrived[key] += 1
        if self.before is not None:
            self.before()
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if "gated" in query:
                await asyncio.to_thread(self.gate.wait, 30)
            await asyncio.sleep(float(query.get("delay", 0)))
        finally:
            self.in_flight -= 1
        self.executions[key] += 1
        self.requests.append(
            {
                "method": request.method,
                "path": request.url.path,
                "query": request.url.query,
                "headers": dict(request.headers),
                "body": body,
            }
        )
        status = int(query.get("status", 200))
        headers = {"X-Tool": "counting"}
        if "retry_after" in query:
            headers["Retry-After"] = query["retry_after"]
        if "cookie" in query:
            headers["Set-Cookie"] = "session=secret-session; Path=/"
        for name in ("cache_control", "vary"):  # e.g. ?cache_control=max-age=60
            if name in query:
                headers[name.replace("_", "-").title()] = query[name]
        if "size" in query:
            size = int(query["size"])
            pause = float(query.get("chunk_delay", 0))
            return StreamingResponse(
                _chunks(size, pause),
                status,
                headers=headers,
                media_type="application/octet-stream",
            )
        payload = {
            "execution": self.executions[key],
            "path": request.url.path,
            "body": body.decode("utf-8", "replace"),
        }
        if "usage" in query:
            payload["usage"] = {"total_tokens": int(query["usage"])}
        return Response(json.dumps(payload), status, headers=headers, media_type="application/json")


async def _chunks(size: int, pause: float = 0.0) -> Any:
    block = bytes(range(256)) * 256
    sent = 0
    while sent < size:
        piece = block[: min(len(block), size - sent)]
        sent += len(piece)
        yield piece
        if pause:
            await asyncio.sleep(pause)


class BreakingTool:
    """A raw TCP upstream that reads the request, counts it, then closes without answering."""

    def __init__(self) -> None:
        self.port = free_port()
        self.received = 0
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", self.port))
        self._sock.listen(16)
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with conn:
                data = conn.recv(65536)
                if data:
                    self.received += 1

    def close(self) -> None:
        self._sock.close()


class RedisServer:
    """A real redis-server on a free port, without persistence; with ``aof_dir``, every
    write is in an append-only file there (fsync'd each time), so a server killed and
    started again keeps its data."""

    def __init__(
        self,
        port: int | None = None,
        aof_dir: Path | None = None,
        directory: Path | None = None,
        options: tuple[str, ...] = (),
    ) -> None:
        self.port = port or free_port()
        self.aof_dir = aof_dir
        self.directory = directory
        """Its working directory (a replica writes the primary's snapshot there, and any
        server started in it would load it): give each replica one of its own."""
        self.options = options
        """More command-line options (``--name value`` pairs)."""
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        binary = shutil.which("redis-server")
        assert binary, "redis-server is not installed (.ci/run installs it)"
        self.process = subprocess.Popen(
            [
                binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                *self._persistence(),
                "--protected-mode",
                "no",
                *self.options,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for(self.ping, what="redis-server")
        return self

    def _persistence(self) -> list[str]:
        if self.aof_dir is None:
            here = [] if self.directory is None else ["--dir", str(self.directory)]
            return ["--appendonly", "no", *here]
        return ["--appendonly", "yes", "--appendfsync", "always", "--dir", str(self.aof_dir)]

    def kill(self) -> None:
        """SIGKILL: the server is gone at once (kept only what its append-only file has)."""
        assert self.process is not None
        self.process.kill()
        self.process.wait(10)
        self.process = None

    def ping(self) -> bool:
        with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")

    def pause(self) -> None:
        """SIGSTOP: connections stay open but nothing answers (a partition, a stall)."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def flush(self) -> None:
        with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
            sock.sendall(b"FLUSHALL\r\n")
            assert sock.recv(16).startswith(b"+OK")

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(10)
            self.process = None


class ReplyDropper:
    """A TCP proxy in front of a Redis (on the test's event loop) that forwards every
    command but, once armed, swallows every reply on the connection of the next EVALSHA:
    the script runs in Redis, and its caller never hears of it (it times out)."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.armed = False
        self.dropped = 0
        """Connections whose replies were swallowed."""
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> str:
        """Listen on a free port; the Redis URL to reach it by."""
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        return f"redis://127.0.0.1:{port}/0"

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for writer in list(self._writers):
            writer.close()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        self._writers |= {writer, up_writer}
        deaf = asyncio.Event()

        async def commands() -> None:
            while data := await reader.read(65536):
                if self.armed and b"EVALSHA" in data:
                    self.armed = False
                    self.dropped += 1
                    deaf.set()
                up_writer.write(data)
                await up_writer.drain()

        async def replies() -> None:
            while data := await up_reader.read(65536):
                if not deaf.is_set():
                    writer.write(data)
                    await writer.drain()

        tasks = {
            asyncio.ensure_future(_quietly(commands())),
            asyncio.ensure_future(_quietly(replies())),
        }
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            for one in (writer, up_writer):
                one.close()
                self._writers.discard(one)


async def _quietly(work: Coroutine[Any, Any, None]) -> None:
    """``work``, ended by a connection that closes (reset, broken pipe) as by its end."""
    with suppress(OSError):
        await work


class ProxyProcess:
    """``tool-proxy serve`` as a real process; its JSON log lines are kept."""

    def __init__(
        self,
        config: dict[str, Any],
        tmp: Path,
        workers: int = 1,
        env: dict[str, str] | None = None,
        args: tuple[str, ...] = (),
    ) -> None:
        self.extra_env = env or {}
        self.args = args
        self.tmp = tmp
        self.port = free_port()
        self.config_path = tmp / f"proxy-{self.port}.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.log_path = tmp / f"proxy-{self.port}.log"
        self.workers = workers
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ProxyProcess:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TOOL_PROXY_")}
        env["TOOL_PROXY_STATE_DIR"] = str(self.tmp / "state")  # shared by the test's proxies
        env.update(self.extra_env)
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "proxy.cli",
                    "serve",
                    "--config",
                    str(self.config_path),
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(self.port),
                    "--workers",
                    str(self.workers),
                    *self.args,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=ROOT,
            )
        wait_for(
            lambda: httpx.get(f"{self.url}/_proxy/healthz").status_code == 200,
            seconds=20,
            what=f"proxy on {self.port}; log: {self.log_path}",
        )
        return self

    def stop(self) -> int:
        assert self.process is not None
        self.process.terminate()
        code = self.process.wait(30)
        self.process = None
        return code

    def kill(self) -> None:
        """SIGKILL: the proxy dies mid-work, as on a lost node."""
        assert self.process is not None
        self.process.kill()
        self.process.wait(10)
        self.process = None

    def pause(self) -> None:
        """SIGSTOP: the proxy stalls (a long GC pause, a frozen VM), timers and all."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def events(self) -> list[dict[str, Any]]:
        lines = self.log_path.read_text().splitlines()
        return [json.loads(line) for line in lines if line.startswith("{")]

    def log_text(self) -> str:
        return self.log_path.read_text()


@contextmanager
def running(server: ThreadServer) -> Iterator[ThreadServer]:
    server.start()
    try:
        yield server
    finally:
        server.stop()


class Relay:
    """A TCP relay on a free port to a server on this machine, that a test can ``cut``
    (every connection dropped, new ones closed at once: a partition from one client's
    side only) and ``mend``."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._cut = False
        self._open: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None

    def url(self, scheme: str = "redis", path: str = "/0") -> str:
        return f"{scheme}://127.0.0.1:{self.port}{path}"

    def start(self) -> Relay:
        self.thread.start()
        self._call(self._listen())
        return self

    def cut(self) -> None:
        self._call(self._set_cut(True))

    def mend(self) -> None:
        self._call(self._set_cut(False))

    def retarget(self, port: int) -> None:
        """Every connection dropped; new ones go to ``port`` (a promoted replica)."""
        self.cut()
        self.target_port = port
        self.mend()

    def stop(self) -> None:
        self._call(self._close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

    def _call(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(10)

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)

    async def _set_cut(self, cut: bool) -> None:
        self._cut = cut
        if cut:
            for writer in list(self._open):
                writer.transport.abort()
            self._open.clear()

    async def _close(self) -> None:
        await self._set_cut(True)
        if self._server is not None:
            self._server.close()
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in others:  # the connections' pipes: the loop is closed after this
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._cut:
            writer.transport.abort()
            return
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self._open.update((writer, up_writer))
        await asyncio.gather(
            self._pipe(reader, up_writer), self._pipe(up_reader, writer), return_exceptions=True
        )

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while chunk := await reader.read(65536):
                writer.write(chunk)
                await writer.drain()
        finally:
            self._open.discard(writer)
            writer.transport.abort()


def replica_synced(primary: int) -> bool:
    """The replica of the Redis primary on ``primary`` is online and has every write."""
    done = subprocess.run(
        ["redis-cli", "-p", str(primary), "INFO", "replication"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    info = dict(line.split(":", 1) for line in done.stdout.splitlines() if ":" in line)
    replica = info.get("slave0", "")
    return "state=online" in replica and f"offset={info['master_repl_offset'].strip()}," in replica


# A replica's full sync at once (not after the default 5 s wait for more replicas).
PROMPT_SYNC = ("--repl-diskless-sync-delay", "0")


def _made(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    return directory


class ReplicatedRedis:
    """A primary and its replica (real redis-servers), the replication link through a
    ``Relay`` (``lag``: replication stopped, ``catch_up``), and clients through another
    (``url``), so that a test can kill the primary and ``promote`` the replica: it is made
    a primary, given a new replica of its own, and the clients' relay sent to it."""

    def __init__(self, directory: Path) -> None:
        self.primary, self.replica, self.spare = (
            RedisServer(directory=_made(directory / name), options=PROMPT_SYNC)
            for name in ("a", "b", "c")
        )
        self.link: Relay | None = None
        self.front: Relay | None = None

    @property
    def url(self) -> str:
        assert self.front is not None
        return self.front.url()

    def start(self) -> ReplicatedRedis:
        try:
            self.primary.start()
            self.replica.start()
            self.link = Relay(self.primary.port).start()
            self.front = Relay(self.primary.port).start()
            self._replicate(self.replica, self.link.port)
            wait_for(self.synced, what="replica in sync")
        except BaseException:
            self.stop()
            raise
        return self

    def cli(self, port: int, *args: str) -> str:
        done = subprocess.run(
            ["redis-cli", "-p", str(port), *args], capture_output=True, text=True, timeout=30
        )
        return done.stdout.strip()

    def _replicate(self, server: RedisServer, port: int) -> None:
        assert self.cli(server.port, "REPLICAOF", "127.0.0.1", str(port)) == "OK"

    def synced(self) -> bool:
        """The replica is online, has every write of the primary and acknowledges new ones
        (right after a full sync, "online" comes before the stream flows)."""
        return replica_synced(self.primary.port) and replica_acknowledges(self.primary.port)

    def lag(self) -> None:
        """Replication stopped (the primary sees no replica): writes stay on the primary."""
        assert self.link is not None
        self.link.cut()

    def catch_up(self) -> None:
        assert self.link is not None
        self.link.mend()
        wait_for(self.synced, what="replica in sync")

    def promote(self) -> None:
        """The replica made the primary (the old one should be dead), with a replica of its
        own in sync, and the clients' relay pointed at it."""
        assert self.front is not None
        assert self.cli(self.replica.port, "REPLICAOF", "NO", "ONE") == "OK"
        self.primary, self.replica = self.replica, self.spare
        self.replica.start()
        self._replicate(self.replica, self.primary.port)
        wait_for(self.synced, what="new replica in sync")
        self.front.retarget(self.primary.port)

    def keys(self, port: int, pattern: str = "*") -> list[str]:
        return [k for k in self.cli(port, "--scan", "--pattern", pattern).splitlines() if k]

    def stop(self) -> None:
        for relay in (self.front, self.link):
            if relay is not None:
                relay.stop()
        for server in (self.primary, self.replica, self.spare):
            if server.process is not None:
                server.kill()


def replica_acknowledges(primary: int) -> bool:
    """A write on the Redis primary on ``primary``, then ``WAIT 1`` on the same connection,
    answers 1: a replica has it (right after a full sync, a replica shows "online" before
    the stream reaches it)."""
    with socket.create_connection(("127.0.0.1", primary), timeout=5) as sock:
        sock.sendall(b"SET probe 1\r\nWAIT 1 100\r\n")
        reply = b""
        while reply.count(b"\r\n") < 2:
            chunk = sock.recv(64)
            if not chunk:
                return False
            reply += chunk
    return reply == b"+OK\r\n:1\r\n"


def free_bus_port() -> int:
    """A free port whose cluster bus port (itself plus 10000) is free too."""
    while True:
        port = free_port()
        if port + 10000 < 65536:
            with contextlib.suppress(OSError), socket.socket() as sock:
                sock.bind(("127.0.0.1", port + 10000))
                return port


CLUSTER_CREATE = ("--cluster-replicas", "1", "--cluster-yes")
CLUSTER_NODE = (
    *("--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--protected-mode", "no"),
    *("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"),
    *("--cluster-node-timeout", "2000"),
)


class RedisCluster:
    """A real Redis Cluster on free ports: ``primaries`` redis-server processes with
    ``--cluster-enabled yes`` and a replica each, joined by ``redis-cli --cluster create``."""

    def __init__(self, directory: Path, primaries: int = 3) -> None:
        self.directory = directory
        self.ports = [free_bus_port() for _ in range(primaries * 2)]
        self.processes: dict[int, subprocess.Popen[bytes]] = {}

    @property
    def url(self) -> str:
        """The store URL: every node a seed."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def start(self) -> RedisCluster:
        try:
            for port in self.ports:
                self.start_node(port)
            nodes = [f"127.0.0.1:{p}" for p in self.ports]
            subprocess.run(
                ["redis-cli", "--cluster", "create", *nodes, *CLUSTER_CREATE],
                check=True,
                stdout=subprocess.DEVNULL,
                timeout=60,
            )
            wait_for(self.ready, seconds=30, what="redis cluster")
        except BaseException:
            self.stop()
            raise
        return self

    def start_node(self, port: int) -> None:
        binary = shutil.which("redis-server")
        assert binary, "redis-server is not installed (scripts/install installs it)"
        node_dir = self.directory / str(port)
        node_dir.mkdir(parents=True, exist_ok=True)
        self.processes[port] = subprocess.Popen(
            [binary, "--port", str(port), "--dir", str(node_dir), *CLUSTER_NODE],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for(lambda: self.cli(port, "PING") == "PONG", what=f"redis node {port}")

    def cli(self, port: int, *args: str) -> str:
        done = subprocess.run(
            ["redis-cli", "-p", str(port), *args], capture_output=True, text=True, timeout=30
        )
        return done.stdout.strip()

    def ready(self) -> bool:
        """Every node sees the cluster ok, every slot served, every replica in sync."""
        for port in self.ports:
            if "cluster_state:ok" not in self.cli(port, "CLUSTER", "INFO"):
                return False
        roles = [self.cli(p, "ROLE").splitlines() for p in self.ports]
        replicas = [r for r in roles if r and r[0] == "slave"]
        return len(replicas) == len(self.ports) // 2 and all(r[3] == "connected" for r in replicas)

    def primaries(self) -> list[int]:
        return [p for p in self.ports if self.cli(p, "ROLE").splitlines()[:1] == ["master"]]

    def flush(self) -> None:
        for port in self.primaries():
            self.cli(port, "FLUSHALL")

    def stop(self) -> None:
        for process in self.processes.values():
            process.kill()
            process.wait(10)
        self.processes.clear()


class RedisSentinels:
    """A real primary, a replica of it and three ``redis-sentinel`` processes watching it
    (quorum 2, a primary down after 1 s), on free ports."""

    NAME = "tp"

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.primary = RedisServer(directory=_made(directory / "primary"))
        self.replica = RedisServer(directory=_made(directory / "replica"))
        self.ports = [free_port() for _ in range(3)]
        self.sentinels: list[subprocess.Popen[bytes]] = []

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.ports)
        return f"redis+sentinel://{hosts}/{self.NAME}"

    def start(self) -> RedisSentinels:
        try:
            self.primary.start()
            self.replica.start()
            self.cli(self.replica.port, "REPLICAOF", "127.0.0.1", str(self.primary.port))
            wait_for(lambda: self.synced(self.primary.port), what="replica in sync")
            for port in self.ports:
                self.sentinels.append(self._sentinel(port))
            wait_for(self.watching, seconds=30, what="sentinels")
        except BaseException:
            self.stop()
            raise
        return self

    def _sentinel(self, port: int) -> subprocess.Popen[bytes]:
        conf = self.directory / f"sentinel-{port}.conf"
        conf.write_text(
            f"port {port}\nbind 127.0.0.1\nprotected-mode no\ndir {self.directory}\n"
            f"sentinel monitor {self.NAME} 127.0.0.1 {self.primary.port} 2\n"
            f"sentinel down-after-milliseconds {self.NAME} 1000\n"
            f"sentinel failover-timeout {self.NAME} 5000\n"
        )
        binary = shutil.which("redis-sentinel")
        command = [binary, str(conf)] if binary else ["redis-server", str(conf), "--sentinel"]
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(lambda: self.cli(port, "PING") == "PONG", what=f"sentinel {port}")
        return process

    def cli(self, port: int, *args: str) -> str:
        done = subprocess.run(
            ["redis-cli", "-p", str(port), *args], capture_output=True, text=True, timeout=30
        )
        return done.stdout.strip()

    def synced(self, primary: int) -> bool:
        return replica_synced(primary)

    def watching(self) -> bool:
        """Every sentinel knows the replica and the two other sentinels."""
        for port in self.ports:
            fields = self.cli(port, "SENTINEL", "MASTER", self.NAME).splitlines()
            master = dict(zip(fields[::2], fields[1::2], strict=False))
            if master.get("num-slaves") != "1" or master.get("num-other-sentinels") != "2":
                return False
        return True

    def primary_port(self) -> int:
        """The port the sentinels name as the primary now."""
        reply = self.cli(self.ports[0], "SENTINEL", "get-master-addr-by-name", self.NAME)
        return int(reply.splitlines()[1])

    def stop(self) -> None:
        for process in self.sentinels:
            process.kill()
            process.wait(10)
        self.sentinels.clear()
        for server in (self.primary, self.replica):
            if server.process is not None:
                server.kill()
