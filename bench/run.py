"""Benchmark tool-proxy (one worker) against an nginx hop, on loopback, with wrk.

Run it with ``bench/run`` (see docs/benchmarks.md). Every process (nginx, redis-server,
tool-proxy, the client-comparison apps, wrk) is started here on free 127.0.0.1 ports and
stopped at the end. Numbers are reported as ratios against the nginx hop measured in the
same run, because the machine is shared and its absolute speed varies. Large responses
(offloaded to a local-file object store) are compared with nginx serving the same file,
and the proxy's peak RSS is read while 20 callers replay a 5 MiB one.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import redis
import report
from store_servers import STORES, Counter, Store, redis_counter, start_store

from proxy.keys import composite_key

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
DOCS = ROOT / "docs" / "benchmarks.md"
RESULTS = BENCH / "results"
LUA = BENCH / "wrk" / "post.lua"
BODY = '{"tool":"bench","n":1}'
CALLERS = (1, 32)
CLIENT_CALLERS = 32
WARMUP_SECONDS = 1
# After a wrk run, requests still in flight get this long to finish before Redis is read.
SETTLE_SECONDS = 0.3
START_TIMEOUT = 20.0
MARKER = "WRK_RESULT "
MIB = 1024 * 1024
# Offload: bodies above this go to the object store (the configuration's default).
OFFLOAD_THRESHOLD = 102400
# Static files the upstream serves under /big/ (see bench/nginx.conf.tmpl), by name.
BIG_BODIES = {"1m.json": MIB, "5m.json": 5 * MIB}
BIG_PATH = "/big/1m.json"  # big-direct and big-replay
RSS_PATH = "/big/5m.json"  # the peak-RSS scenario
RSS_CALLERS = 20
# The fresh proxy of the RSS scenario idles this long before its RSS at rest is read.
REST_SECONDS = 0.5


@dataclass(frozen=True)
class Result:
    """One wrk measurement (or the median of several rounds)."""

    scenario: str
    callers: int
    requests: int
    rps: float
    p50_ms: float
    p99_ms: float
    errors: int
    round_trips: float | None = None
    """Store round trips per request: on Redis the request/reply exchanges the proxy made
    (EVALSHA and any other command it sent itself), pipelined or not; on PostgreSQL the
    transactions committed (one statement each)."""
    reads: float | None = None
    """Network reads Redis made per request: below round_trips when commands were pipelined."""
    commands: dict[str, float] | None = None
    """Redis commands per request by name (INFO commandstats: includes those run in scripts)."""
    store: str = ""
    """The store of a per-store measurement (bench/run --stores)."""


@dataclass(frozen=True)
class Memory:
    """The peak-RSS scenario: a fresh proxy process under offloaded replays."""

    load: Result
    path: str
    body_bytes: int
    rest_seconds: float
    rest_mb: float
    """VmRSS (MB = 10^6 bytes) of the fresh proxy, ready and idle, before the load."""
    peak_mb: float
    """VmHWM of the fresh proxy at the end of the load: its peak over its whole life."""


@dataclass(frozen=True)
class Runs:
    """Everything one bench/run measured."""

    results: list[Result] = field(default_factory=list)
    clients: list[Result] = field(default_factory=list)
    offload: list[Result] = field(default_factory=list)
    memory: Memory | None = None
    own_us: dict[str, float] = field(default_factory=dict)
    """The proxy's own CPU per request by scenario (bench/hot_path.py), in µs."""
    stores: list[Result] = field(default_factory=list)
    """First executions and replays per store, with nginx-hop before and after them and
    one pass-through (bench/run --stores)."""
    stores_meta: dict[str, str] = field(default_factory=dict)
    """The per-store measurement's load averages and each store's version and settings."""


@dataclass(frozen=True)
class Scenario:
    name: str
    url: str
    key_mode: str = "none"  # none | fixed | unique (see bench/wrk/post.lua)
    key: str = ""

    @property
    def guarded(self) -> bool:
        return self.key_mode != "none"

    def wrk_args(self, args_hash: str) -> list[str]:
        if self.key_mode == "unique":  # a fresh plan id prefix for every wrk invocation
            return ["unique", f"{self.key}{secrets.token_hex(4)}", args_hash]
        return [self.key_mode, self.key]


# --- processes ---------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return int(response.status) == 200
    except OSError:
        return False


def urls_ok(*urls: str) -> Callable[[], bool]:
    """A readiness check: every URL answers 200."""
    return lambda: all(http_ok(url) for url in urls)


def tail(path: Path, lines: int = 20) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return "\n".join(text.splitlines()[-lines:])


@contextmanager
def service(
    name: str, argv: list[str], workdir: Path, ready: Callable[[], bool]
) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``argv`` as a child (output in ``workdir/name.log``) until the block ends."""
    log_path = workdir / f"{name}.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOOL_PROXY_")}
    with log_path.open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=workdir)
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while not ready():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not start:\n{tail(log_path)}")
            time.sleep(0.05)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def start_nginx(stack: ExitStack, workdir: Path, upstream: int, hop: int) -> None:
    conf = (BENCH / "nginx.conf.tmpl").read_text()
    for name, value in {"PREFIX": workdir, "UPSTREAM_PORT": upstream, "HOP_PORT": hop}.items():
        conf = conf.replace(f"@{name}@", str(value))
    (workdir / "nginx.conf").write_text(conf)
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    argv = [nginx, "-p", str(workdir), "-c", str(workdir / "nginx.conf"), "-e", "stderr"]
    ready = urls_ok(f"http://127.0.0.1:{upstream}/", f"http://127.0.0.1:{hop}/")
    stack.enter_context(service("nginx", argv, workdir, ready))


def start_redis(stack: ExitStack, workdir: Path, port: int) -> redis.Redis:
    argv = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
    argv += ["--appendonly", "no", "--dir", str(workdir)]
    client = redis.Redis(port=port)

    def ready() -> bool:
        try:
            return bool(client.ping())
        except redis.RedisError:
            return False

    stack.enter_context(service("redis", argv, workdir, ready))
    stack.callback(client.close)
    return client


def big_body(size: int) -> bytes:
    """A JSON document of exactly ``size`` bytes: ``{"data":"<random hex>"}``."""
    head, tail = b'{"data":"', b'"}'
    return head + secrets.token_hex(size // 2).encode()[: size - len(head) - len(tail)] + tail


def write_big_bodies(workdir: Path) -> None:
    """The large files nginx serves under /big/ (see bench/nginx.conf.tmpl)."""
    # nginx's worker may run as another user (nobody, when started by root): let it
    # through the temporary directory, which is created private.
    workdir.chmod(0o711)
    folder = workdir / "static" / "big"
    folder.mkdir(parents=True)
    for name, size in BIG_BODIES.items():
        (folder / name).write_bytes(big_body(size))


def static_file(workdir: Path, path: str) -> Path:
    return workdir / "static" / path.lstrip("/")


def objects_dir(workdir: Path) -> Path:
    return workdir / "objects"


def guarded(name: str, prefix: str, strip: bool) -> dict[str, Any]:
    policy = {"lock_ttl": "30s", "result_ttl": "5m"}
    return {"name": name, "path_prefix": prefix, "strip_prefix": strip, "idempotency": policy}


def write_proxy_config(
    workdir: Path,
    ports: dict[str, int],
    offload: bool,
    store_url: str | None = None,
    name: str = "proxy",
) -> Path:
    """The proxy's configuration (``workdir/<name>.yaml``), on the private Redis unless
    ``store_url``; with ``offload``, a local-file object store and /big."""
    routes = [
        {"name": "pass", "path_prefix": "/pass", "strip_prefix": True},
        guarded("tool", "/tool", strip=True),
    ]
    config: dict[str, Any] = {
        "store": {"url": store_url or f"redis://127.0.0.1:{ports['redis']}/0"},
        "server": {"host": "127.0.0.1", "port": ports["proxy"]},
    }
    if offload:
        objects_dir(workdir).mkdir()
        url = objects_dir(workdir).as_uri()
        config["offload"] = {"url": url, "threshold_bytes": OFFLOAD_THRESHOLD}
        routes.append(guarded("big", "/big", strip=False))
    upstream = f"http://127.0.0.1:{ports['upstream']}"
    config["routes"] = [{**r, "upstream": upstream} for r in routes]
    path = workdir / f"{name}.yaml"
    path.write_text(json.dumps(config, indent=2))  # JSON is YAML
    return path


def start_proxy(
    stack: ExitStack, workdir: Path, config: Path, port: int, name: str = "proxy"
) -> subprocess.Popen[bytes]:
    """``tool-proxy serve`` with one worker (in the process itself) on ``port``."""
    argv = [str(Path(sys.executable).parent / "tool-proxy"), "serve", "--config", str(config)]
    argv += ["--port", str(port), "--workers", "1"]
    ready = urls_ok(f"http://127.0.0.1:{port}/_proxy/readyz")
    return stack.enter_context(service(name, argv, workdir, ready))


def post(url: str, key: str) -> tuple[dict[str, str], bytes]:
    """One POST of BODY with ``key``; the response headers and body (raises unless 2xx)."""
    request = urllib.request.Request(url, BODY.encode(), method="POST")
    request.add_header("Content-Type", "application/json")
    request.add_header("Idempotency-Key", key)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return {k.lower(): v for k, v in response.headers.items()}, response.read()
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"POST {url}: {exc.code} {exc.read()[:500]!r}") from exc


def fixed_key(prefix: str, args_hash: str) -> str:
    """A new composite key for BODY, to be executed once and then replayed."""
    return f"{prefix}-{secrets.token_hex(4)}:1:{args_hash}"


def prime(url: str, key: str, body: bytes | None = None) -> None:
    """Execute ``key`` once, then check that it replays (with ``body``, when given)."""
    post(url, key)
    headers, replayed = post(url, key)
    if headers.get("idempotent-replayed") != "true":
        raise RuntimeError(f"{url}: the key {key} was not replayed")
    if body is not None and replayed != body:
        raise RuntimeError(f"{url}: the replay of {key} is not the upstream's body")


def count_objects(workdir: Path) -> int:
    return sum(1 for path in objects_dir(workdir).rglob("*") if path.is_file())


def prime_offloaded(proxy: str, path: str, key: str, workdir: Path) -> None:
    """Execute ``key`` on the /big route once; check it was offloaded and replays intact."""
    before = count_objects(workdir)
    prime(f"{proxy}{path}", key, static_file(workdir, path).read_bytes())
    if count_objects(workdir) != before + 1:
        raise RuntimeError(f"{path}: the response was not written to the object store")


# --- measuring ---------------------------------------------------------------------------


def wrk(url: str, callers: int, seconds: int, key_args: list[str]) -> dict[str, int]:
    threads = min(callers, 2)
    argv = ["wrk", f"-t{threads}", f"-c{callers}", f"-d{seconds}s", "--timeout", "10s"]
    argv += ["-s", str(LUA), url, "--", BODY, *key_args]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=seconds + 60)
    for line in out.stdout.splitlines():
        if line.startswith(MARKER):
            return dict(json.loads(line.removeprefix(MARKER)))
    raise RuntimeError(f"no {MARKER.strip()} line from wrk:\n{out.stdout}\n{out.stderr}")


def measure(
    scenario: Scenario, callers: int, seconds: int, args_hash: str, store: Counter | None
) -> Result:
    """Warm up, then one timed wrk run (with the store's counters around it when guarded)."""
    wrk(scenario.url, callers, WARMUP_SECONDS, scenario.wrk_args(args_hash))
    time.sleep(SETTLE_SECONDS)
    count = store() if store and scenario.guarded else None
    data = wrk(scenario.url, callers, seconds, scenario.wrk_args(args_hash))
    result = Result(
        scenario=scenario.name,
        callers=callers,
        requests=data["requests"],
        rps=data["requests"] / (data["duration_us"] / 1e6),
        p50_ms=data["p50_us"] / 1000,
        p99_ms=data["p99_us"] / 1000,
        errors=data["status_errors"] + data["socket_errors"],
    )
    if count is not None and result.requests:
        time.sleep(SETTLE_SECONDS)
        trips, reads, commands = count(result.requests)
        result = replace(result, round_trips=trips, reads=reads, commands=commands)
    print(f"  {report.text_row(result)}", flush=True)
    return result


def median(results: list[Result]) -> Result:
    """The median of every rate over rounds (requests and errors are summed)."""
    trips = [r.round_trips for r in results if r.round_trips is not None]
    reads = [r.reads for r in results if r.reads is not None]
    commands = [r.commands for r in results if r.commands is not None]
    names = sorted({name for c in commands for name in c})
    return replace(
        results[0],
        requests=sum(r.requests for r in results),
        rps=statistics.median(r.rps for r in results),
        p50_ms=statistics.median(r.p50_ms for r in results),
        p99_ms=statistics.median(r.p99_ms for r in results),
        errors=sum(r.errors for r in results),
        round_trips=statistics.median(trips) if trips else None,
        reads=statistics.median(reads) if reads else None,
        commands={n: statistics.median(c.get(n, 0.0) for c in commands) for n in names}
        if commands
        else None,
    )


def run_grid(
    scenarios: list[Scenario], callers: tuple[int, ...], args: argparse.Namespace, **kw: Any
) -> list[Result]:
    """Every scenario at every number of callers, ``args.rounds`` times; medians."""
    rounds: dict[tuple[str, int], list[Result]] = {}
    for n in range(args.rounds):
        for count in callers:
            print(f"round {n + 1}/{args.rounds}, {count} caller(s):", flush=True)
            for s in scenarios:
                rounds.setdefault((s.name, count), []).append(
                    measure(s, count, args.duration, **kw)
                )
    return [median(results) for results in rounds.values()]


def compare_clients(
    stack: ExitStack, workdir: Path, upstream: int, hop: Scenario, args: argparse.Namespace
) -> list[Result]:
    """nginx-hop, httpx and aiohttp forwarding apps, at 32 callers."""
    results = run_grid([hop], (CLIENT_CALLERS,), args, args_hash="", store=None)
    for client in ("httpx", "aiohttp"):
        port = free_port()
        argv = [sys.executable, str(BENCH / "clients.py"), "--client", client, "--port", str(port)]
        argv += ["--upstream", f"http://127.0.0.1:{upstream}"]
        with ExitStack() as app:
            app.enter_context(service(client, argv, workdir, urls_ok(f"http://127.0.0.1:{port}/")))
            scenario = Scenario(client, f"http://127.0.0.1:{port}/tool")
            results += run_grid([scenario], (CLIENT_CALLERS,), args, args_hash="", store=None)
    return results


# --- scenarios ---------------------------------------------------------------------------


def proc_status_mb(pid: int, name: str) -> float:
    """A memory line of /proc/<pid>/status (``VmRSS``, ``VmHWM``: KiB) in MB (10^6 bytes)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key == name:
            return int(value.split()[0]) * 1024 / 1e6
    raise RuntimeError(f"no {name} in /proc/{pid}/status")


def measure_own_work(args: argparse.Namespace) -> dict[str, float]:
    """bench/hot_path.py in a process of its own: µs of CPU per request of tool-proxy's
    own code (no sockets), the best of as many rounds as the rest of the run."""
    requests = 5000 if args.quick else 20000
    argv = [sys.executable, str(ROOT / "bench" / "hot_path.py"), "--json"]
    argv += ["--requests", str(requests), "--rounds", str(max(args.rounds, 3))]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=600)
    return {k: float(v) for k, v in json.loads(out.stdout.strip().splitlines()[-1]).items()}


def measure_core(
    args: argparse.Namespace, ports: dict[str, int], store: redis.Redis, args_hash: str
) -> list[Result]:
    """direct, nginx-hop, passthrough, first-exec and replay at 1 and 32 callers."""
    proxy = f"http://127.0.0.1:{ports['proxy']}"
    replay_key = fixed_key("replay", args_hash)
    prime(f"{proxy}/tool", replay_key)  # every later request is a replay
    scenarios = [
        Scenario("direct", f"http://127.0.0.1:{ports['upstream']}/tool"),
        Scenario("nginx-hop", f"http://127.0.0.1:{ports['hop']}/tool"),
        Scenario("passthrough", f"{proxy}/pass"),
        Scenario("first-exec", f"{proxy}/tool", "unique", "b"),
        Scenario("replay", f"{proxy}/tool", "fixed", replay_key),
    ]
    return run_grid(scenarios, CALLERS, args, args_hash=args_hash, store=redis_counter(store))


def measure_offload(
    args: argparse.Namespace,
    workdir: Path,
    ports: dict[str, int],
    store: redis.Redis,
    args_hash: str,
) -> list[Result]:
    """big-direct (nginx serves the 1 MiB file) and big-replay (offloaded, replayed)."""
    proxy = f"http://127.0.0.1:{ports['proxy']}"
    key = fixed_key("big", args_hash)
    prime_offloaded(proxy, BIG_PATH, key, workdir)
    scenarios = [
        Scenario("big-direct", f"http://127.0.0.1:{ports['upstream']}{BIG_PATH}"),
        Scenario("big-replay", f"{proxy}{BIG_PATH}", "fixed", key),
    ]
    return run_grid(scenarios, CALLERS, args, args_hash=args_hash, store=redis_counter(store))


def measure_memory(
    args: argparse.Namespace,
    workdir: Path,
    ports: dict[str, int],
    store: redis.Redis,
    args_hash: str,
) -> Memory:
    """RSS_CALLERS callers replay an offloaded 5 MiB response through a fresh proxy.

    The key is executed by the main proxy; a new proxy process (same configuration, its
    own port) then only serves this scenario, so its VmHWM is this scenario's peak.
    """
    key = fixed_key("rss", args_hash)
    prime_offloaded(f"http://127.0.0.1:{ports['proxy']}", RSS_PATH, key, workdir)
    print(f"peak RSS, fresh proxy, {RSS_CALLERS} callers:", flush=True)
    with ExitStack() as stack:
        config = workdir / "proxy.yaml"
        proc = start_proxy(stack, workdir, config, ports["proxy-rss"], name="proxy-rss")
        time.sleep(REST_SECONDS)
        rest = proc_status_mb(proc.pid, "VmRSS")
        url = f"http://127.0.0.1:{ports['proxy-rss']}{RSS_PATH}"
        scenario = Scenario("replay-5MiB", url, "fixed", key)
        load = measure(scenario, RSS_CALLERS, args.duration, args_hash, redis_counter(store))
        peak = proc_status_mb(proc.pid, "VmHWM")
    size = BIG_BODIES[RSS_PATH.rsplit("/", 1)[1]]
    memory = Memory(load, RSS_PATH, size, REST_SECONDS, rest, peak)
    print(f"  {report.memory_line(memory)}", flush=True)
    return memory


def load_average() -> str:
    return "{:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


def measure_store(
    args: argparse.Namespace,
    workdir: Path,
    ports: dict[str, int],
    store: Store,
    args_hash: str,
    passthrough: bool,
) -> list[Result]:
    """first-exec and replay (and, with ``passthrough``, pass-through) at 1 and 32 callers
    through a proxy process of the store's own, stopped before the next store starts."""
    print(f"store {store.name}: {store.about}", flush=True)
    with ExitStack() as stack:
        name = f"proxy-{store.name}"
        config = write_proxy_config(workdir, ports, False, store.url, name)
        port = free_port()
        start_proxy(stack, workdir, config, port, name=name)
        proxy = f"http://127.0.0.1:{port}"
        replay_key = fixed_key(f"replay-{store.name}", args_hash)
        prime(f"{proxy}/tool", replay_key)
        scenarios = [Scenario("passthrough", f"{proxy}/pass")] if passthrough else []
        scenarios += [
            Scenario("first-exec", f"{proxy}/tool", "unique", "s"),
            Scenario("replay", f"{proxy}/tool", "fixed", replay_key),
        ]
        results = run_grid(scenarios, CALLERS, args, args_hash=args_hash, store=store.counter)
    return [r if r.scenario == "passthrough" else replace(r, store=store.name) for r in results]


def measure_stores(
    args: argparse.Namespace, workdir: Path, ports: dict[str, int], args_hash: str
) -> tuple[list[Result], dict[str, str]]:
    """nginx-hop, then every store of ``args.stores`` one after the other (pass-through
    once, through the first store's proxy: it does not touch the store), then nginx-hop
    again: the ratios are to the median of both hops, the drift between them is shown."""
    hop = Scenario("nginx-hop", f"http://127.0.0.1:{ports['hop']}/tool")
    meta = {"load_start": load_average(), "started": datetime.now(UTC).strftime("%H:%M")}
    print("per store: nginx-hop before", flush=True)
    results = run_grid([hop], CALLERS, args, args_hash="", store=None)
    for i, name in enumerate(args.stores):
        with ExitStack() as stack:
            store = start_store(name, stack, workdir)
            meta[f"about_{name}"] = store.about
            results += measure_store(args, workdir, ports, store, args_hash, passthrough=i == 0)
        meta[f"load_after_{name}"] = load_average()
    print("per store: nginx-hop after", flush=True)
    after = run_grid([hop], CALLERS, args, args_hash="", store=None)
    results += [replace(r, store="after") for r in after]
    meta["load_end"] = load_average()
    meta["ended"] = datetime.now(UTC).strftime("%H:%M")
    return results, meta


# --- main --------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Benchmark tool-proxy against an nginx hop.")
    parser.add_argument("--duration", type=int, default=8, help="seconds per measurement (8)")
    parser.add_argument("--rounds", type=int, default=1, help="repeat the grid, keep medians")
    parser.add_argument(
        "--quick", action="store_true", help="2 s smoke run; does not write the docs"
    )
    parser.add_argument(
        "--clients", action="store_true", help="only the httpx/aiohttp comparison (no docs)"
    )
    parser.add_argument("--no-docs", action="store_true", help=f"do not write {DOCS.name}")
    parser.add_argument(
        "--stores",
        default=",".join(STORES),
        help="first executions and replays on each of these stores, comma-separated "
        f"(default: {','.join(STORES)}); empty for none",
    )
    parser.add_argument(
        "--stores-only",
        action="store_true",
        help=f"only nginx and the per-store measurement; rewrites only its section of {DOCS.name}",
    )
    parser.add_argument(
        "--no-offload",
        dest="offload",
        action="store_false",
        help="skip the large-response (offload) throughput and peak-RSS scenarios",
    )
    args = parser.parse_args()
    if args.quick:
        args.duration = 2
    if args.duration < 1 or args.rounds < 1:
        parser.error("--duration and --rounds must be at least 1")
    args.stores = [name.strip() for name in args.stores.split(",") if name.strip()]
    unknown = sorted(set(args.stores) - set(STORES))
    if unknown:
        parser.error(f"unknown store(s) {', '.join(unknown)}: choose from {', '.join(STORES)}")
    if len(set(args.stores)) != len(args.stores):
        parser.error("--stores names a store twice")
    if args.stores_only and not args.stores:
        parser.error("--stores-only needs at least one store")
    if args.stores_only and args.clients:
        parser.error("--stores-only and --clients exclude each other")
    return args


def run(args: argparse.Namespace, workdir: Path) -> Runs:
    names = ("upstream", "hop", "proxy", "proxy-rss", "redis")
    ports = {name: free_port() for name in names}
    hop = Scenario("nginx-hop", f"http://127.0.0.1:{ports['hop']}/tool")
    with ExitStack() as stack:
        write_big_bodies(workdir)
        start_nginx(stack, workdir, ports["upstream"], ports["hop"])
        if args.clients:
            return Runs(clients=compare_clients(stack, workdir, ports["upstream"], hop, args))
        args_hash = composite_key("bench", 1, BODY.encode()).rsplit(":", 1)[1]
        stores: list[Result] = []
        stores_meta: dict[str, str] = {}
        if args.stores_only:
            stores, stores_meta = measure_stores(args, workdir, ports, args_hash)
            return Runs(stores=stores, stores_meta=stores_meta)
        store = start_redis(stack, workdir, ports["redis"])
        config = write_proxy_config(workdir, ports, offload=args.offload)
        start_proxy(stack, workdir, config, ports["proxy"])
        results = measure_core(args, ports, store, args_hash)
        offload: list[Result] = []
        memory = None
        if args.offload:
            offload = measure_offload(args, workdir, ports, store, args_hash)
            memory = measure_memory(args, workdir, ports, store, args_hash)
        if args.stores:
            stores, stores_meta = measure_stores(args, workdir, ports, args_hash)
        clients = compare_clients(stack, workdir, ports["upstream"], hop, args)
    return Runs(results, clients, offload, memory, measure_own_work(args), stores, stores_meta)


def git_commit() -> str:
    def git(*argv: str) -> str:
        return subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True).stdout

    commit = git("rev-parse", "--short", "HEAD").strip() or "unknown"
    return (
        f"{commit} (with uncommitted changes)" if git("status", "--porcelain").strip() else commit
    )


def versions() -> str:
    def first_line(*argv: str) -> str:
        out = subprocess.run(argv, capture_output=True, text=True)
        return (out.stdout or out.stderr).strip().splitlines()[0]

    nginx = first_line(shutil.which("nginx") or "/usr/sbin/nginx", "-v").split("/")[-1]
    redis_server = first_line("redis-server", "--version").split()[2].removeprefix("v=")
    return f"Python {sys.version.split()[0]}, nginx {nginx}, Redis {redis_server}"


def main() -> int:
    args = parse_args()
    started = datetime.now(UTC)
    meta = {
        "date": started.strftime("%Y-%m-%d %H:%M UTC"),
        "commit": git_commit(),
        "duration": args.duration,
        "rounds": args.rounds,
        "cores": os.cpu_count(),
        "load": load_average(),
        "versions": versions(),
    }
    with tempfile.TemporaryDirectory(prefix="tool-proxy-bench-") as tmp:
        runs = run(args, Path(tmp))
    print()
    print(report.text(runs))
    RESULTS.mkdir(exist_ok=True)
    raw = {**meta, **asdict(runs)}
    out = RESULTS / f"{started.strftime('%Y%m%dT%H%M%SZ')}.json"
    out.write_text(json.dumps(raw, indent=2))
    print(f"\nraw results: {out.relative_to(ROOT)}")
    if args.quick or args.no_docs:
        return 0
    if runs.results:
        DOCS.write_text(report.markdown(meta, runs))
        print(f"wrote {DOCS.relative_to(ROOT)}")
    elif runs.stores:
        DOCS.write_text(report.with_stores_section(DOCS.read_text(), meta, runs))
        print(f"wrote the per-store section of {DOCS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
