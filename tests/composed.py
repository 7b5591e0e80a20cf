"""The composed fault test: many agents, injected faults, invariants checked afterwards.

In the spirit of Jepsen: simulated agents (retrying, replanning, polling operations)
call routes that combine idempotency, a lock with fencing tokens, limits, versioning, the
response cache (on its own, and on a versioned resource) and async operations, through
``tool-proxy serve`` replicas on one real redis-server and one replica on SQLite, while
a nemesis kills (SIGKILL, then restarts), freezes (SIGSTOP/SIGCONT) replicas, pauses
Redis (``CLIENT PAUSE`` or SIGSTOP) and the
tool stalls, resets connections or answers 429/503. Every answer a caller got is kept
(the history), and the tool keeps its own log of every execution (key, principal,
fencing token, version written). Once the faults stop and every lease had time to
lapse, each key is sent once more, and ``check`` reads the invariants off both logs:

- ``at-most-once``: at most one execution per key (route, store, principal, key);
- ``fencing``: fencing tokens strictly increasing per resource, as the tool sees them;
- ``lost-update``: no versioned write accepted that was based on a stale read;
- ``stale-read``: no read of a document (cached: the doc route names its resource, whose
  versioned writes invalidate the cached reads) older than a write of it whose answer
  its caller had before the read was sent;
- ``replay``: every answer a caller got under a key is what its retries replay (an
  unknown outcome may later become the tool's answer, as documented; never the reverse,
  nor one answer for another), and an operation's state, its result and the key agree;
- ``principals``: no answer reached another principal than the one it was made for;
- ``in-progress``: no key left IN_PROGRESS (409) once faults stopped and ``lock_ttl``
  passed, and every operation ended;
- ``internal-error``: no ``500 internal-error`` or ``store-error`` (a bug, or a malformed
  record).

Everything is bounded: the agents' steps and attempts, the nemesis' faults (one at a time,
each shorter than the leases and timeouts it could break unless ``harsh``), every wait.
The seed fixes the schedule of faults and the agents' choices; thread and process timing
is not reproducible, so a seed is a shape of run, not a replay of one.

Used by tests/test_composed.py (a short seed) and bench/composed_faults.py (longer runs).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import random
import signal
import socket
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import httpx
from starlette.types import Receive, Scope, Send

from proxy.keys import composite_key
from tests.idp import IdentityProvider
from tests.servers import ProxyProcess, RedisServer, ThreadServer, wait_for
from tests.test_auth import auth_config

# The replicas' sealing key of stored requests' credentials (store.sealing_key_env),
# inherited from this process.
SEALING_ENV = "TEST_SEALING_KEY"
os.environ.setdefault(SEALING_ENV, base64.b64encode(b"c" * 32).decode())

PRINCIPALS = ("alice", "bob", "carol")
ACCOUNTS = 3
DOCS = 2
QUERIES = 6
PROBLEM = "urn:tool-proxy:problem:"
RETRY = {  # answers that mean "nothing was sent, or not yet": the agent retries the key
    "request-in-progress",
    "resource-locked",
    "rate-limited",
    "store-unavailable",
    "store-refused",
    "upstream-unreachable",
    "not-executed",
    "identity-provider-unavailable",
}
FORGOTTEN = {  # after a recorded answer, these mean the proxy no longer knows the key
    "request-in-progress",
    "resource-locked",
    "not-executed",
    "upstream-unreachable",
    "precondition-failed",
}
UNKNOWN = {"outcome-unknown"}
TERMINAL = {"completed", "failed", "dead", "cancelled"}
REDIS_PAUSE = 0.5
"""The longest Redis pause or stop (unless harsh): a quarter of the store client's 2 s
timeout, so that a command is delayed, never failed, even on a loaded machine (a failed
claim or write is the harsh regime's)."""
FREEZE = 1.5
"""The longest freeze of a replica (unless harsh): below that timeout too (a frozen
process finds its timers due when it thaws)."""


@dataclass(frozen=True)
class Shape:
    """What a run looks like; every count and time is a bound."""

    seed: int
    seconds: float = 30.0
    """How long agents run while the nemesis injects faults."""
    agents: int = 12
    replicas: int = 2
    """``tool-proxy serve`` processes on Redis (one more runs on SQLite)."""
    max_steps: int = 40
    """Steps per agent at most."""
    max_attempts: int = 10
    """Attempts per request at most (then the agent gives the step up)."""
    lock_ttl: float = 6.0
    """The idempotency lease; unless ``harsh``, the nemesis keeps every freeze and pause
    below a quarter of it, and below the store client's timeout."""
    harsh: bool = False
    """Let freezes and pauses outlast the leases (finds the open items of issue 20)."""
    tool_fault_rate: float = 0.03
    """Chance of each kind of tool fault per guarded call (five kinds)."""
    reexecute: bool = False
    """Calibration: routes with ``on_lapsed_lease: reexecute``, the documented way to run
    a call twice after a crash; the checker must then see second executions."""
    client_timeout: float = 5.0
    """The agents' own HTTP timeout: a call that takes longer is retried (under its key,
    at another replica perhaps) while it still runs, as agents do."""


@dataclass
class Request:
    """One guarded request exactly as its agent sent it, to be sent again."""

    ns: str
    route: str
    principal: str
    key: str
    method: str
    path: str
    headers: dict[str, str]
    body: bytes

    @property
    def ident(self) -> tuple[str, str, str, str]:
        return (self.ns, self.route, self.principal, self.key)


@dataclass
class Answer:
    """One answer a caller got (the history)."""

    ident: tuple[str, str, str, str]
    agent: str
    replica: str
    status: int
    problem: str | None
    replayed: bool
    body: bytes
    sent: float
    got: float
    phase: str
    """``run`` (while faults ran), ``final`` (the resend after), ``result`` (an
    operation's ``/result``), ``operation`` (its terminal state, in ``problem``)."""

    @property
    def recorded(self) -> bool:
        """An answer the key records: the tool's (but a 429 or 503, which release the
        key), or an unknown outcome."""
        if self.problem is None:
            return self.status not in (0, 202, 429, 503)
        return self.problem in UNKNOWN

    @property
    def known(self) -> bool:
        return self.recorded and self.problem is None


@dataclass
class Read:
    """One read of a document an agent got (the ``stale-read`` check)."""

    ns: str
    doc: str
    rev: int
    sent: float
    cache: str
    """Its Cache-Status."""


@dataclass
class Violation:
    invariant: str
    detail: str

    def __str__(self) -> str:
        return f"{self.invariant}: {self.detail}"


def _principal(authorization: str) -> str:
    """The ``sub`` of a bearer JWT, unverified (the proxy verified it)."""
    try:
        payload = authorization.removeprefix("Bearer ").split(".")[1]
        claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
        return str(claims["sub"])
    except (IndexError, ValueError, KeyError):
        return ""


class Tool:
    """The upstream: a ledger, documents, look-ups and jobs, with its own log and faults.

    ``POST <ns>/ledger/debit`` (checks ``Fencing-Token`` per account), ``GET
    <ns>/ledger/lookup?key=`` (the route's ``reconcile``), ``GET <ns>/doc/read`` and
    ``POST <ns>/doc/write`` (``X-Doc``; a write carries ``based_on``, the revision it
    read), ``POST /lookup/q`` (cached), ``POST /jobs/run`` (async). ``<ns>`` is empty for
    the Redis replicas' routes and ``/sq`` for the SQLite replica's.

    While ``faulty``, each guarded call may get 429 or 503 (not executed), a long stall
    before it is executed (past the route's timeout), a reset after it is executed, or a
    short stall: each kind with ``rate`` (tripled during a ``storm``).
    """

    def __init__(self, seed: int, rate: float) -> None:
        self.rng = random.Random(f"tool:{seed}")
        self.rate = rate
        self.faulty = False
        self.storm = False
        self.lock = threading.Lock()
        self.executions: list[dict[str, Any]] = []
        self.violations: list[Violation] = []
        self.faults: Counter[str] = Counter()
        self.pending: set[tuple[str, str, str, str]] = set()
        self.answers: dict[tuple[str, str, str, str], bytes] = {}
        self.fences: dict[tuple[str, str], int] = {}
        self.revisions: Counter[tuple[str, str]] = Counter()
        self.serial = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        path: str = scope["path"]
        ns = "sq" if path.startswith("/sq/") else ""
        what = path.removeprefix("/sq")
        principal = _principal(headers.get("authorization", ""))
        if what == "/ledger/lookup":
            key = parse_qs(scope["query_string"].decode()).get("key", [""])[0]
            status, answer = self._lookup((ns, "ledger", principal, key))
            await _respond(send, status, answer)
            return
        if what == "/doc/read":
            doc = headers.get("x-doc", "")
            read = {"doc": doc, "rev": self.revisions[(ns, doc)], "principal": principal}
            await _respond(send, 200, json.dumps(read).encode())
            return
        route = what.strip("/").split("/")[0]
        ident = (ns, route, principal, headers.get("idempotency-key", ""))
        await self._guarded(ident, headers, body, receive, send)

    def _lookup(self, ident: tuple[str, str, str, str]) -> tuple[int, bytes]:
        if ident in self.answers:
            return 200, self.answers[ident]
        if ident in self.pending:  # running now: neither found nor "never will"
            return 425, b'{"pending":true}'
        return 404, b'{"found":false}'

    def _fault(self) -> str:
        if not self.faulty:
            return ""
        rate = self.rate * (3 if self.storm else 1)
        roll = self.rng.random()
        for n, kind in enumerate(("429", "503", "stall-long", "reset", "stall")):
            if roll < rate * (n + 1):
                self.faults[kind] += 1
                return kind
        return ""

    async def _guarded(
        self,
        ident: tuple[str, str, str, str],
        headers: dict[str, str],
        body: bytes,
        receive: Receive,
        send: Send,
    ) -> None:
        fault = self._fault()
        if fault in ("429", "503"):  # refused, nothing done (release_on_status)
            await _respond(send, int(fault), b'{"busy":true}', {"retry-after": "1"})
            return
        self.pending.add(ident)
        try:
            if fault == "stall-long":
                await asyncio.sleep(self.rng.uniform(3.5, 4.5))  # past the route's timeout
            elif fault == "stall":
                await asyncio.sleep(self.rng.uniform(0.2, 1.0))
            answer = self.execute(ident, headers, body)
        finally:
            self.pending.discard(ident)
        if fault == "reset":  # executed, then the connection breaks: outcome unknown
            transport = receive.__self__.transport  # type: ignore[attr-defined]
            transport.abort()
            await asyncio.sleep(0)  # uvicorn sees the connection lost: it answers nothing
            return
        await _respond(send, 200, answer)

    def execute(
        self, ident: tuple[str, str, str, str], headers: dict[str, str], body: bytes
    ) -> bytes:
        """Run the call: log it, check its fencing token or the revision it was based on,
        and keep its answer (what ``reconcile`` finds)."""
        ns, route, principal, key = ident
        with self.lock:
            self.serial += 1
            entry: dict[str, Any] = {
                "exec": f"{ns or 'r'}-{self.serial}",
                "ns": ns,
                "route": route,
                "principal": principal,
                "key": key,
                "at": time.monotonic(),
            }
            args = json.loads(body or b"{}")
            if route == "ledger":
                self._fence(entry, headers, args)
            elif route == "doc":
                self._write(entry, headers, args)
            self.executions.append(entry)
            answer = {k: entry[k] for k in ("exec", "principal", "key")}
            answer.update({k: entry[k] for k in ("fence", "rev", "account") if k in entry})
            encoded = json.dumps(answer).encode()
            self.answers[ident] = encoded
            return encoded

    def _fence(self, entry: dict[str, Any], headers: dict[str, str], args: Any) -> None:
        token = headers.get("fencing-token", "")
        entry["account"] = account = str(args.get("account"))
        if not token.isdigit():
            self.violations.append(Violation("fencing", f"no fencing token: {entry}"))
            return
        entry["fence"] = fence = int(token)
        resource = (entry["ns"], account)
        last = self.fences.get(resource, 0)
        if fence <= last:
            self.violations.append(
                Violation("fencing", f"token {fence} after {last} on {resource}: {entry}")
            )
        self.fences[resource] = max(fence, last)

    def _write(self, entry: dict[str, Any], headers: dict[str, str], args: Any) -> None:
        resource = (entry["ns"], headers.get("x-doc", ""))
        current = self.revisions[resource]
        entry["based_on"] = args.get("based_on")
        if args.get("based_on") != current:
            self.violations.append(
                Violation(
                    "lost-update",
                    f"write based on rev {args.get('based_on')} accepted at rev {current} "
                    f"of {resource}: {entry}",
                )
            )
        self.revisions[resource] = entry["rev"] = current + 1


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def _respond(
    send: Send, status: int, body: bytes, extra: dict[str, str] | None = None
) -> None:
    headers = [(b"content-type", b"application/json")]
    headers += [(k.encode(), v.encode()) for k, v in (extra or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


# -- the system under test ---------------------------------------------------------------------


def routes(tool: str, shape: Shape, *, sqlite: bool) -> list[dict[str, Any]]:
    """The routes of a replica: each combines several capabilities."""
    lease = f"{shape.lock_ttl}s"
    auth = {"required": True}

    def guarded(name: str, prefix: str, **extra: Any) -> dict[str, Any]:
        return {
            "name": name,
            "path_prefix": prefix,
            "upstream": tool + ("/sq" if sqlite else ""),
            "timeout": "3s",
            "auth": auth,
            "idempotency": {
                "lock_ttl": lease,
                "result_ttl": "1h",
                "retry_after": "1s",
                "on_lapsed_lease": "reexecute" if shape.reexecute else "fail",
            },
            **extra,
        }

    ledger = guarded(
        "ledger",
        "/ledger",
        lock={"key": "json:/account", "ttl": "10s", "wait": "3s"},
        limits=[
            {"name": "per-caller", "key": "principal", "rate": "200/1s"},
            {"name": "in-flight", "max_in_flight": 16},
        ],
        limit_wait="1s",
        reconcile={"path": "/ledger/lookup?key={key}", "found": [200], "not_found": [404]},
    )
    doc = guarded(
        "doc",
        "/doc",
        resource={"name": "doc", "key": "header:X-Doc"},
        lock={"ttl": "10s", "wait": "3s"},
        versioning={"methods": ["POST"], "required": True, "wait": "3s"},
        cache={"ttl": "30s", "methods": ["GET"]},  # reads: fenced by the doc's version
    )
    if sqlite:
        return [ledger, doc]
    lookup = guarded("lookup", "/lookup", cache={"ttl": "30s", "methods": ["POST"]})
    jobs = guarded(
        "jobs",
        "/jobs",
        **{"async": {"backoff": "100ms", "backoff_max": "300ms", "visibility": "4s"}},
    )
    return [ledger, doc, lookup, jobs]


class Replica(ProxyProcess):
    """A ``tool-proxy serve`` process that may start slowly (a loaded machine) and keeps
    the log of each life (``proxy-<port>.log.<n>`` for those it was killed in)."""

    lives = 0

    def start(self) -> Replica:
        try:
            super().start()
        except AssertionError:  # not healthy within 20 s: give it longer
            wait_for(
                lambda: httpx.get(f"{self.url}/_proxy/healthz").status_code == 200,
                seconds=60,
                what=f"proxy on {self.port}; log: {self.log_path}",
            )
        return self

    def kill(self) -> None:
        super().kill()
        self.lives += 1
        self.log_path.rename(self.log_path.with_name(f"{self.log_path.name}.{self.lives}"))


class System:
    """The tool, the identity provider, Redis and the replicas (the last one on SQLite)."""

    def __init__(self, shape: Shape, tmp: Path) -> None:
        self.shape = shape
        self.tool = Tool(shape.seed, shape.tool_fault_rate)
        self.tool_server = ThreadServer(self.tool)
        self.idp = IdentityProvider()
        self.idp_server = ThreadServer(self.idp.app)
        self.redis = RedisServer()
        self.tmp = tmp
        self.replicas: list[Replica] = []
        self.sqlite: Replica | None = None
        self.tokens: dict[str, str] = {}

    def start(self) -> System:
        self.tool_server.start()
        self.idp_server.start()
        self.idp.url = self.idp_server.url
        self.redis.start()
        exp = int(time.time()) + 6 * 3600
        self.tokens = {p: f"Bearer {self.idp.token(p, exp=exp)}" for p in PRINCIPALS}
        auth = auth_config(self.idp)
        shared = {
            "store": {"url": self.redis.url, "sealing_key_env": SEALING_ENV},
            "auth": auth,
            "routes": routes(self.tool_server.url, self.shape, sqlite=False),
        }
        alone = {
            "store": {"url": f"sqlite://{self.tmp}/state.db", "sealing_key_env": SEALING_ENV},
            "auth": auth,
            "routes": routes(self.tool_server.url, self.shape, sqlite=True),
        }
        self.replicas = [Replica(shared, self.tmp) for _ in range(self.shape.replicas)]
        self.sqlite = Replica(alone, self.tmp)
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda proxy: proxy.start(), self.everyone))
        return self

    @property
    def everyone(self) -> list[Replica]:
        assert self.sqlite is not None
        return [*self.replicas, self.sqlite]

    def group(self, ns: str) -> list[Replica]:
        assert self.sqlite is not None
        return [self.sqlite] if ns == "sq" else self.replicas

    def stop(self) -> None:
        for proxy in self.everyone:
            if proxy.process is not None:
                with contextlib.suppress(ProcessLookupError):
                    proxy.process.send_signal(signal.SIGCONT)
                proxy.stop()
        with contextlib.suppress(ProcessLookupError, AssertionError):
            self.redis.resume()
        self.redis.stop()
        self.idp_server.stop()
        self.tool_server.stop()


@contextlib.contextmanager
def running(shape: Shape, tmp: Path) -> Iterator[System]:
    system = System(shape, tmp)
    try:
        yield system.start()
    finally:
        system.stop()


# -- the nemesis ------------------------------------------------------------------------------


def _redis_command(redis: RedisServer, *words: str) -> None:
    command = f"*{len(words)}\r\n" + "".join(f"${len(w)}\r\n{w}\r\n" for w in words)
    with socket.create_connection(("127.0.0.1", redis.port), timeout=2) as sock:
        sock.sendall(command.encode())
        sock.recv(64)


class Nemesis:
    """Injects one fault at a time, from a seeded schedule, until told to stop."""

    def __init__(self, system: System, shape: Shape) -> None:
        self.system = system
        self.shape = shape
        self.rng = random.Random(f"nemesis:{shape.seed}")
        self.faults: Counter[str] = Counter()
        self.log: list[str] = []

    def longest(self, safe: float) -> float:
        """The longest freeze or pause: ``safe``, or past the lease when harsh."""
        return self.shape.lock_ttl * 1.5 if self.shape.harsh else safe

    async def run(self, until: float) -> None:
        """Rounds of every kind of fault, each round in a seeded order."""
        kinds = ["kill", "stop", "redis-pause", "redis-stop", "tool-storm"]
        if self.shape.harsh:
            kinds.append("redis-drop")
        rounds = 0
        while time.monotonic() < until:
            self.rng.shuffle(kinds)
            for kind in kinds:
                await asyncio.sleep(self.rng.uniform(0.5, 2.0))
                if time.monotonic() >= until and rounds:  # the first round runs whole
                    return
                self.faults[kind] += 1
                await getattr(self, kind.replace("-", "_"))()
            rounds += 1

    async def kill(self) -> None:
        proxy = self.rng.choice(self.system.everyone)
        self.log.append(f"{time.monotonic():.1f} SIGKILL {proxy.port}")
        await asyncio.to_thread(proxy.kill)
        await asyncio.sleep(self.rng.uniform(0.5, 2.0))
        await asyncio.to_thread(proxy.start)

    async def stop(self) -> None:
        proxy = self.rng.choice(self.system.everyone)
        seconds = self.rng.uniform(0.3, self.longest(min(self.shape.lock_ttl / 4, FREEZE)))
        self.log.append(f"{time.monotonic():.1f} SIGSTOP {proxy.port} {seconds:.1f}s")
        assert proxy.process is not None
        proxy.process.send_signal(signal.SIGSTOP)
        try:
            await asyncio.sleep(seconds)
        finally:
            proxy.process.send_signal(signal.SIGCONT)

    async def redis_pause(self) -> None:
        seconds = self.rng.uniform(0.3, self.longest(REDIS_PAUSE))
        self.log.append(f"{time.monotonic():.1f} CLIENT PAUSE {seconds:.1f}s")
        await asyncio.to_thread(
            _redis_command, self.system.redis, "CLIENT", "PAUSE", str(int(seconds * 1000)), "ALL"
        )
        await asyncio.sleep(seconds)

    async def redis_drop(self) -> None:
        """Every client's connection reset, with the commands they had sent dropped
        unexecuted: what a Redis restart (with its data kept) does to its clients."""
        seconds = self.rng.uniform(0.3, 1.5)
        self.log.append(f"{time.monotonic():.1f} redis connections dropped after {seconds:.1f}s")
        redis = self.system.redis
        await asyncio.to_thread(_redis_command, redis, "CLIENT", "PAUSE", "10000", "WRITE")
        try:
            await asyncio.sleep(seconds)
            await asyncio.to_thread(_redis_command, redis, "CLIENT", "KILL", "TYPE", "normal")
        finally:
            await asyncio.to_thread(_redis_command, redis, "CLIENT", "UNPAUSE")

    async def redis_stop(self) -> None:
        seconds = self.rng.uniform(0.3, self.longest(REDIS_PAUSE))
        self.log.append(f"{time.monotonic():.1f} redis SIGSTOP {seconds:.1f}s")
        self.system.redis.pause()
        try:
            await asyncio.sleep(seconds)
        finally:
            self.system.redis.resume()

    async def tool_storm(self) -> None:
        seconds = self.rng.uniform(1.0, 3.0)
        self.log.append(f"{time.monotonic():.1f} tool storm {seconds:.1f}s")
        self.system.tool.storm = True
        try:
            await asyncio.sleep(seconds)
        finally:
            self.system.tool.storm = False


# -- the agents -------------------------------------------------------------------------------


@dataclass
class History:
    """What the agents saw: every answer, each key's request, each key's operation."""

    answers: list[Answer] = field(default_factory=list)
    requests: dict[tuple[str, str, str, str], Request] = field(default_factory=dict)
    operations: dict[tuple[str, str, str, str], str] = field(default_factory=dict)
    """The ``Location`` of each key's operation (async calls)."""
    errors: Counter[str] = field(default_factory=Counter)
    """Transport errors by kind (refused connections, the agents' own timeouts, ...)."""
    attempts: int = 0
    reads: list[Read] = field(default_factory=list)


def _problem(response: httpx.Response) -> str | None:
    if response.headers.get("content-type", "").startswith("application/problem+json"):
        try:
            return str(response.json()["type"]).removeprefix(PROBLEM)
        except (ValueError, KeyError):
            return "unreadable"
    return None


class Agent:
    """One simulated agent: steps of a plan, each retried under its key, then replanned."""

    def __init__(
        self, n: int, system: System, client: httpx.AsyncClient, history: History, shape: Shape
    ) -> None:
        self.name = f"agent-{n}"
        self.rng = random.Random(f"agent:{shape.seed}:{n}")
        self.principal = PRINCIPALS[n % len(PRINCIPALS)]
        self.ns = "sq" if n % 4 == 3 else ""
        self.plan = f"plan-{shape.seed}-{n}-{self.rng.getrandbits(24):06x}"
        self.step = 0
        self.system = system
        self.client = client
        self.history = history
        self.shape = shape

    @property
    def auth(self) -> str:
        return self.system.tokens[self.principal]

    async def run(self, until: float) -> None:
        kinds = ["ledger", "doc", "peek"] + ([] if self.ns else ["lookup", "jobs"])
        while self.step < self.shape.max_steps and time.monotonic() < until:
            self.step += 1
            await getattr(self, self.rng.choice(kinds))()

    def request(self, route: str, path: str, body: Any, **headers: str) -> Request:
        raw = json.dumps(body).encode()
        plan, step = self.plan, self.step
        if route == "lookup":  # the same plan for every agent: shared keys across principals
            plan, step = f"shared-{self.shape.seed}", body["q"]
        key = composite_key(plan, step, body)
        sent = {"content-type": "application/json", "idempotency-key": key, **headers}
        request = Request(self.ns, route, self.principal, key, "POST", path, sent, raw)
        self.history.requests.setdefault(request.ident, request)
        return request

    async def ledger(self) -> None:
        body = {"account": f"acc-{self.rng.randrange(ACCOUNTS)}", "amount": self.step}
        await send(self.request("ledger", "/ledger/debit", body), self, "run")

    async def doc(self) -> None:
        doc = f"doc-{self.rng.randrange(DOCS)}"
        read = await self.read(doc)
        if read is None:
            return
        rev, etag = read
        body = {"based_on": rev, "note": f"{self.name}:{self.step}"}
        request = self.request("doc", "/doc/write", body, **{"x-doc": doc, "if-match": etag})
        await send(request, self, "run")

    async def peek(self) -> None:
        """Read a document without writing it (mostly a cache hit, unless written since)."""
        await self.read(f"doc-{self.rng.randrange(DOCS)}")

    async def read(self, doc: str) -> tuple[int, str] | None:
        for _ in range(self.shape.max_attempts):
            proxy = self.rng.choice(self.system.group(self.ns))
            headers = {"authorization": self.auth, "x-doc": doc}
            sent = time.monotonic()
            try:
                response = await self.client.get(f"{proxy.url}/doc/read", headers=headers)
            except httpx.HTTPError as exc:
                self.history.errors[type(exc).__name__] += 1
                await asyncio.sleep(self.rng.uniform(0.1, 0.5))
                continue
            if response.status_code == 200 and "etag" in response.headers:
                rev = int(response.json()["rev"])
                cache = response.headers.get("cache-status", "")
                self.history.reads.append(Read(self.ns, doc, rev, sent, cache))
                return rev, response.headers["etag"]
            await asyncio.sleep(self.rng.uniform(0.1, 0.5))
        return None

    async def lookup(self) -> None:
        body = {"q": self.rng.randrange(QUERIES)}
        await send(self.request("lookup", "/lookup/q", body), self, "run")

    async def jobs(self) -> None:
        body = {"job": f"{self.name}:{self.step}"}
        request = self.request("jobs", "/jobs/run", body, prefer="respond-async")
        await send(request, self, "run")


async def send(request: Request, agent: Agent, phase: str) -> Answer | None:
    """Send ``request`` until it gets an answer to keep (bounded); follow a 202."""
    history, rng = agent.history, agent.rng
    for attempt in range(agent.shape.max_attempts):
        proxy = rng.choice(agent.system.group(request.ns))
        headers = {**request.headers, "authorization": agent.auth}
        sent = time.monotonic()
        history.attempts += 1
        try:
            response = await agent.client.request(
                request.method, proxy.url + request.path, content=request.body, headers=headers
            )
        except httpx.HTTPError as exc:
            history.errors[type(exc).__name__] += 1
            await asyncio.sleep(_backoff(rng, attempt))
            continue
        answer = Answer(
            request.ident,
            agent.name,
            str(proxy.port),
            response.status_code,
            _problem(response),
            response.headers.get("idempotent-replayed") == "true",
            response.content,
            sent,
            time.monotonic(),
            phase,
        )
        history.answers.append(answer)
        if response.status_code == 202:
            history.operations[request.ident] = response.headers["location"]
            if not await follow(request, agent, response.headers["location"]):
                return None  # not ended in time: the caller gives up (stuck, if final)
            continue  # then the key again: its replay
        if answer.problem in RETRY or (answer.problem is None and answer.status in (429, 503)):
            hint = response.headers.get("retry-after", "")
            wait = min(float(hint), 2.0) if hint.isdigit() else _backoff(rng, attempt)
            await asyncio.sleep(wait * rng.uniform(0.5, 1.0))
            continue
        return answer
    return None


def _backoff(rng: random.Random, attempt: int) -> float:
    return float(min(2.0, 0.1 * 2**attempt) * rng.uniform(0.5, 1.0))


async def follow(request: Request, agent: Agent, location: str) -> bool:
    """Poll an operation until it ends (bounded), then read its result."""
    for _ in range(50):
        proxy = agent.rng.choice(agent.system.group(request.ns))
        try:
            status = await agent.client.get(
                proxy.url + location, headers={"authorization": agent.auth}
            )
        except httpx.HTTPError as exc:
            agent.history.errors[type(exc).__name__] += 1
            await asyncio.sleep(0.5)
            continue
        state = "completed" if status.status_code == 303 else None
        if status.status_code == 200:
            state = status.json().get("state")
        if state in TERMINAL:
            await result(request, agent, proxy, location, str(state))
            return True
        await asyncio.sleep(0.3)
    return False


async def result(
    request: Request, agent: Agent, proxy: ProxyProcess, location: str, state: str
) -> None:
    now = time.monotonic()
    agent.history.answers.append(
        Answer(
            request.ident, agent.name, str(proxy.port), 0, state, False, b"", now, now, "operation"
        )
    )
    if state not in ("completed", "failed"):
        return
    try:
        got = await agent.client.get(
            f"{proxy.url}{location}/result", headers={"authorization": agent.auth}
        )
    except httpx.HTTPError as exc:
        agent.history.errors[type(exc).__name__] += 1
        return
    agent.history.answers.append(
        Answer(
            request.ident,
            agent.name,
            str(proxy.port),
            got.status_code,
            _problem(got),
            True,
            got.content,
            now,
            time.monotonic(),
            "result",
        )
    )


# -- a run ------------------------------------------------------------------------------------


@dataclass
class Report:
    shape: Shape
    attempts: int
    answers: Counter[str]
    faults: Counter[str]
    executions: int
    keys: int
    errors: Counter[str]
    violations: list[Violation]
    seconds: float
    nemesis_log: list[str]
    reads: int = 0
    cached_reads: int = 0
    read_statuses: Counter[str] = field(default_factory=Counter)

    def lines(self) -> list[str]:
        s = self.shape
        return [
            f"seed {s.seed}: {s.seconds:.0f} s of faults, {s.agents} agents, "
            f"{s.replicas} Redis replicas + 1 SQLite, lock_ttl {s.lock_ttl:.0f}s"
            + (", harsh" if s.harsh else "")
            + (", reexecute (calibration)" if s.reexecute else ""),
            f"requests {self.attempts} (answers by status: {_counts(self.answers)}; "
            f"transport errors: {_counts(self.errors)})",
            f"faults {sum(self.faults.values())}: {_counts(self.faults)}",
            f"keys {self.keys}, executions at the tool {self.executions}",
            f"document reads {self.reads} ({self.cached_reads} from the cache; "
            f"{_counts(self.read_statuses)})",
            f"violations {len(self.violations)}",
            *(f"  {v}" for v in self.violations[:50]),
            f"took {self.seconds:.0f} s",
        ]


def _counts(counter: Counter[str]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counter.items())) or "none"


async def _drive(system: System, shape: Shape) -> tuple[History, Nemesis]:
    history = History()
    nemesis = Nemesis(system, shape)
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=16)
    async with httpx.AsyncClient(timeout=shape.client_timeout, limits=limits) as client:
        agents = [Agent(n, system, client, history, shape) for n in range(shape.agents)]
        until = time.monotonic() + shape.seconds
        system.tool.faulty = True
        try:
            await asyncio.gather(nemesis.run(until), *(a.run(until) for a in agents))
        finally:
            system.tool.faulty = False
            await asyncio.to_thread(_heal, system)
        # Every lease (and hold) may lapse now; then each key once more, without faults.
        await asyncio.sleep(shape.lock_ttl + 4.0)
        await _resend_all(system, history, agents, shape)
    return history, nemesis


def _heal(system: System) -> None:
    """Undo whatever a cancelled fault left: thaw and restart every process."""
    system.redis.resume()
    for proxy in system.everyone:
        if proxy.process is None:
            proxy.start()
        else:
            proxy.process.send_signal(signal.SIGCONT)


async def _resend_all(system: System, history: History, agents: list[Agent], shape: Shape) -> None:
    by_principal = {a.principal: a for a in agents}
    gate = asyncio.Semaphore(8)

    async def again(request: Request) -> None:
        agent = by_principal[request.principal]
        async with gate:
            answer = await send(request, agent, "final")
        last = [a for a in history.answers if a.ident == request.ident and a.phase == "final"]
        if answer is None and (
            not last or last[-1].problem == "request-in-progress" or last[-1].status == 202
        ):
            history.answers.append(
                Answer(
                    request.ident,
                    "final",
                    "",
                    409,
                    "request-in-progress",
                    False,
                    b"",
                    0,
                    0,
                    "stuck",
                )
            )

    await asyncio.gather(*(again(r) for r in list(history.requests.values())))


def run(shape: Shape, tmp: Path) -> Report:
    """Start the system, run the agents and the nemesis, check the history."""
    started = time.monotonic()
    with running(shape, tmp) as system:
        history, nemesis = asyncio.run(_drive(system, shape))
        tool = system.tool
        violations = check(history, tool)
    faults = Counter(nemesis.faults)
    faults.update({f"tool-{k}": v for k, v in tool.faults.items()})
    return Report(
        shape,
        history.attempts,
        Counter(_label(a) for a in history.answers if a.phase in ("run", "final")),
        faults,
        len(tool.executions),
        len(history.requests),
        history.errors,
        violations,
        time.monotonic() - started,
        nemesis.log,
        len(history.reads),
        sum(1 for r in history.reads if r.cache == "tool-proxy; hit"),
        Counter(r.cache.removeprefix("tool-proxy; ") for r in history.reads),
    )


def _label(answer: Answer) -> str:
    return f"{answer.status}" + (f" {answer.problem}" if answer.problem else "")


# -- the checker ------------------------------------------------------------------------------


def check(history: History, tool: Tool) -> list[Violation]:
    """Every invariant, read off the history and the tool's log."""
    violations = list(tool.violations)
    violations += at_most_once(tool)
    violations += stale_reads(history)
    by_key: dict[tuple[str, str, str, str], list[Answer]] = defaultdict(list)
    for answer in history.answers:
        by_key[answer.ident].append(answer)
    for ident, answers in by_key.items():
        violations += replays(ident, answers)
        violations += operation(ident, answers)
        violations += principals(ident, answers)
        violations += [
            Violation("internal-error", f"{ident} answered {a.status}: {a.body[:300]!r}")
            for a in answers
            if a.problem in ("internal-error", "store-error")
        ]
        where = history.operations.get(ident, "no operation")
        violations += [
            Violation(
                "in-progress",
                f"{ident} still IN_PROGRESS after the faults (409, or an operation "
                f"that did not end); {where}",
            )
            for a in answers
            if a.phase == "stuck"
        ]
    return violations


def stale_reads(history: History) -> list[Violation]:
    """A read sent after its caller's write of the document was answered shows that
    write's revision at least (the cache never serves what the write superseded)."""
    written: dict[tuple[str, str], list[tuple[float, int]]] = defaultdict(list)
    for answer in history.answers:
        if answer.ident[1] != "doc" or not answer.known or answer.status != 200:
            continue
        doc = history.requests[answer.ident].headers["x-doc"]
        written[(answer.ident[0], doc)].append((answer.got, int(json.loads(answer.body)["rev"])))
    found = []
    for read in history.reads:
        before = [rev for got, rev in written[(read.ns, read.doc)] if got < read.sent]
        if before and max(before) > read.rev:
            found.append(
                Violation(
                    "stale-read",
                    f"{read.ns or 'r'}/{read.doc} read at rev {read.rev} ({read.cache}) after "
                    f"a write of rev {max(before)} was answered",
                )
            )
    return found


def at_most_once(tool: Tool) -> list[Violation]:
    runs: dict[tuple[str, str, str, str], list[str]] = defaultdict(list)
    for entry in tool.executions:
        runs[(entry["ns"], entry["route"], entry["principal"], entry["key"])].append(entry["exec"])
    return [
        Violation("at-most-once", f"{ident} executed {len(execs)} times: {execs}")
        for ident, execs in runs.items()
        if len(execs) > 1
    ]


def replays(ident: tuple[str, str, str, str], answers: list[Answer]) -> list[Violation]:
    """Once a key has the tool's answer, every later answer is that one, byte for byte."""
    found: list[Violation] = []
    known = [a for a in answers if a.known and a.phase != "operation"]
    if len({(a.status, a.body) for a in known}) > 1:
        seen = sorted({(a.status, a.body[:120]) for a in known})
        found.append(Violation("replay", f"{ident} answered differently: {seen}"))
    if known:
        first = min(a.got for a in known)
        for later in answers:
            if later.sent <= first or later.phase in ("operation", "stuck"):
                continue
            if later.problem in UNKNOWN or later.problem in FORGOTTEN:
                found.append(
                    Violation(
                        "replay",
                        f"{ident} answered {later.status} {later.problem} ({later.phase}, "
                        f"replica {later.replica}) after the tool's answer was recorded",
                    )
                )
    return found


def operation(ident: tuple[str, str, str, str], answers: list[Answer]) -> list[Violation]:
    """An operation's state, its result and its key's replay agree (issue 20, 1.3)."""
    found: list[Violation] = []
    states = {a.problem for a in answers if a.phase == "operation"}
    if len(states) > 1:
        found.append(Violation("replay", f"{ident} operation seen as {sorted(map(str, states))}"))
    known = any(a.known for a in answers if a.phase != "operation")
    if "failed" in states and known:
        found.append(
            Violation("replay", f"{ident} operation failed, yet its key replays the tool's answer")
        )
    return found


def principals(ident: tuple[str, str, str, str], answers: list[Answer]) -> list[Violation]:
    found: list[Violation] = []
    for answer in answers:
        if not answer.known:
            continue
        try:
            made_for = json.loads(answer.body).get("principal")
        except ValueError:
            continue
        if made_for != ident[2]:
            found.append(
                Violation(
                    "principals",
                    f"{ident} got an answer made for {made_for}: {answer.body[:120]!r}",
                )
            )
    return found
