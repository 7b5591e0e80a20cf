"""Tables, targets and docs/benchmarks.md for bench/run.py's results."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from run import Memory, Result, Runs

BASELINE = "nginx-hop"
OFFLOAD_BASELINE = "big-direct"
RSS_TARGET_MB = 200
MIB = 1024 * 1024
HEADER = [
    "scenario",
    "callers",
    "req/s",
    "req/s ratio",
    "p50 ms",
    "p99 ms",
    "p50 added over direct, ms",
    "errors",
    "Redis round trips/req",
]


@dataclass(frozen=True)
class Target:
    what: str
    measured: str
    met: bool
    note: str = ""

    @property
    def status(self) -> str:
        return ("met" if self.met else "NOT MET") + (f" ({self.note})" if self.note else "")


def _index(results: list[Result]) -> dict[tuple[str, int], Result]:
    return {(r.scenario, r.callers): r for r in results}


def ratio(results: list[Result], scenario: str, callers: int, baseline: str = BASELINE) -> float:
    by = _index(results)
    return by[(scenario, callers)].rps / by[(baseline, callers)].rps


def added_p50(results: list[Result], scenario: str, callers: int) -> float | None:
    by = _index(results)
    direct = by.get(("direct", callers))
    return None if direct is None else by[(scenario, callers)].p50_ms - direct.p50_ms


def row(results: list[Result], r: Result) -> list[str]:
    added = added_p50(results, r.scenario, r.callers)
    return [
        r.scenario,
        str(r.callers),
        f"{r.rps:,.0f}",
        f"{ratio(results, r.scenario, r.callers):.3f}",
        f"{r.p50_ms:.2f}",
        f"{r.p99_ms:.2f}",
        "" if added is None else f"{added:+.2f}",
        str(r.errors),
        "" if r.round_trips is None else f"{r.round_trips:.2f}",
    ]


def text_row(r: Result) -> str:
    """A progress line for one measurement."""
    trips = "" if r.round_trips is None else f", {r.round_trips:.2f} store round trips/req"
    return (
        f"{r.scenario:<12} {r.callers:>2} callers: {r.rps:>8,.0f} req/s, p50 {r.p50_ms:.2f} ms, "
        f"p99 {r.p99_ms:.2f} ms, {r.errors} errors{trips}"
    )


def _floor_target(what: str, value: float, goal: float, floor: float | None) -> Target:
    note = ""
    if floor is not None:
        note = f"floor {floor:.2f} " + ("held" if value >= floor else "BROKEN")
    return Target(what, f"{value:.3f}", value >= goal, note)


def _core_targets(results: list[Result]) -> list[Target]:
    by = _index(results)
    first_trips = max(by[("first-exec", c)].round_trips or 0.0 for c in (1, 32))
    replay_trips = max(by[("replay", c)].round_trips or 0.0 for c in (1, 32))
    added = added_p50(results, "first-exec", 1) or 0.0
    return [
        _floor_target(
            "first-exec req/s ratio at 32 callers >= 0.10 (never below 0.07)",
            ratio(results, "first-exec", 32),
            0.10,
            0.07,
        ),
        _floor_target(
            "replay req/s ratio at 32 callers >= 0.20 (never below 0.15)",
            ratio(results, "replay", 32),
            0.20,
            0.15,
        ),
        _floor_target(
            "passthrough req/s ratio at 32 callers >= 0.15",
            ratio(results, "passthrough", 32),
            0.15,
            None,
        ),
        Target(
            "first-exec adds <= 0.6 ms p50 over direct at 1 caller",
            f"{added:+.2f} ms",
            added <= 0.6,
        ),
        # Rounded to 0.1: requests in flight when wrk stops reach Redis but are not counted by wrk.
        Target(
            "<= 2 Redis round trips per first execution",
            f"{first_trips:.2f}",
            round(first_trips, 1) <= 2,
        ),
        Target("1 Redis round trip per replay", f"{replay_trips:.2f}", round(replay_trips, 1) <= 1),
    ]


def _rss_target(memory: Memory) -> Target:
    what = (
        f"offloaded {memory.body_bytes / MIB:g} MiB replays at {memory.load.callers} callers: "
        f"peak RSS < {RSS_TARGET_MB} MB"
    )
    return Target(what, f"{memory.peak_mb:.1f} MB", memory.peak_mb < RSS_TARGET_MB)


def _measured(runs: Runs) -> list[Result]:
    """Every wrk measurement against the proxy's scenarios (not the client comparison)."""
    return [*runs.results, *runs.offload, *([runs.memory.load] if runs.memory else [])]


def targets(runs: Runs) -> list[Target]:
    found = _core_targets(runs.results)
    if runs.memory is not None:
        found.append(_rss_target(runs.memory))
    errors = sum(r.errors for r in _measured(runs))
    found.append(Target("no errors (status >= 400 or socket errors)", str(errors), errors == 0))
    return found


def _table(header: list[str], rows: list[list[str]], markdown: bool) -> str:
    if markdown:
        lines = [header, ["---"] * len(header), *rows]
        return "\n".join("| " + " | ".join(cells) + " |" for cells in lines)
    widths = [max(len(cells[i]) for cells in [header, *rows]) for i in range(len(header))]
    return "\n".join(
        "  ".join(
            c.rjust(w) if i else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )
        for cells in [header, *rows]
    )


def results_table(results: list[Result], markdown: bool = False) -> str:
    return _table(HEADER, [row(results, r) for r in results], markdown)


def clients_table(clients: list[Result], markdown: bool = False) -> str:
    header = ["forwarder", "callers", "req/s", "req/s ratio", "p50 ms", "p99 ms", "errors"]
    return _table(header, [[*row(clients, r)[:6], str(r.errors)] for r in clients], markdown)


def own_table(own_us: dict[str, float], markdown: bool = False) -> str:
    rows = [[scenario, f"{us:.1f}"] for scenario, us in own_us.items()]
    return _table(["scenario", "µs of CPU per request"], rows, markdown)


def targets_table(runs: Runs, markdown: bool = False) -> str:
    rows = [[t.what, t.measured, t.status] for t in targets(runs)]
    return _table(["target", "measured", "status"], rows, markdown)


def offload_table(offload: list[Result], markdown: bool = False) -> str:
    header = [
        "scenario",
        "callers",
        "req/s",
        f"req/s ratio to {OFFLOAD_BASELINE}",
        "p50 ms",
        "p99 ms",
        "errors",
        "Redis round trips/req",
    ]
    rows = [
        [
            r.scenario,
            str(r.callers),
            f"{r.rps:,.1f}",
            f"{ratio(offload, r.scenario, r.callers, OFFLOAD_BASELINE):.3f}",
            f"{r.p50_ms:.2f}",
            f"{r.p99_ms:.2f}",
            str(r.errors),
            "" if r.round_trips is None else f"{r.round_trips:.2f}",
        ]
        for r in offload
    ]
    return _table(header, rows, markdown)


def memory_table(memory: Memory, markdown: bool = False) -> str:
    header = [
        "scenario",
        "callers",
        "body",
        "req/s",
        "p50 ms",
        "p99 ms",
        "errors",
        "RSS at rest, MB",
        "peak RSS (VmHWM), MB",
    ]
    r = memory.load
    row = [
        r.scenario,
        str(r.callers),
        f"{memory.body_bytes / MIB:g} MiB",
        f"{r.rps:,.1f}",
        f"{r.p50_ms:.2f}",
        f"{r.p99_ms:.2f}",
        str(r.errors),
        f"{memory.rest_mb:.1f}",
        f"{memory.peak_mb:.1f}",
    ]
    return _table(header, [row], markdown)


def memory_line(memory: Memory) -> str:
    """A progress line for the peak-RSS scenario."""
    return (
        f"proxy RSS at rest {memory.rest_mb:.1f} MB, peak (VmHWM) {memory.peak_mb:.1f} MB "
        f"(target < {RSS_TARGET_MB} MB)"
    )


def _per_request(n: float) -> str:
    return f"{n:.2f}" if n >= 0.005 else "<0.01"


def commands_table(results: list[Result], markdown: bool = False) -> str:
    guarded = [r for r in results if r.commands is not None]
    rows = [
        [
            r.scenario,
            str(r.callers),
            f"{r.round_trips or 0.0:.2f}",
            f"{r.reads or 0.0:.2f}",
            f"{sum((r.commands or {}).values()):.2f}",
            ", ".join(f"{name} {_per_request(n)}" for name, n in (r.commands or {}).items()),
        ]
        for r in guarded
    ]
    header = [
        "scenario",
        "callers",
        "round trips/req",
        "network reads/req",
        "commands/req",
        "commands/req by name",
    ]
    return _table(header, rows, markdown)


STORES_HEADING = "## First executions and replays per store"
DASH = "-"


def _hop_baseline(stores: list[Result]) -> dict[int, float]:
    """nginx-hop's req/s by callers: the median of its measurements before and after."""
    rates: dict[int, list[float]] = {}
    for r in stores:
        if r.scenario == BASELINE:
            rates.setdefault(r.callers, []).append(r.rps)
    return {callers: statistics.median(values) for callers, values in rates.items()}


def _store_label(r: Result) -> tuple[str, str]:
    if r.scenario == BASELINE:
        return "", f"{BASELINE} ({'after' if r.store == 'after' else 'before'})"
    return (r.store or "(none)"), r.scenario


def stores_table(stores: list[Result], markdown: bool = False) -> str:
    """One row per store and scenario; the callers counts side by side."""
    baseline = _hop_baseline(stores)
    callers = sorted({r.callers for r in stores})
    rows: dict[tuple[str, str], dict[int, Result]] = {}
    for r in stores:
        rows.setdefault(_store_label(r), {})[r.callers] = r
    header = ["store", "scenario"]
    header += [f"req/s (ratio), {c} caller{'s' if c > 1 else ''}" for c in callers]
    header += [f"p50 / p99 ms, {c} caller{'s' if c > 1 else ''}" for c in callers]
    header += ["round trips/req (" + " / ".join(map(str, callers)) + ")", "errors"]
    cells = []
    for (store, scenario), by in rows.items():
        guarded = scenario not in (BASELINE, "passthrough") and not scenario.startswith(BASELINE)
        line = [store, scenario]
        line += [
            f"{by[c].rps:,.0f} ({by[c].rps / baseline[c]:.3f})" if c in by else DASH
            for c in callers
        ]
        line += [f"{by[c].p50_ms:.2f} / {by[c].p99_ms:.2f}" if c in by else DASH for c in callers]
        trips = [by[c].round_trips if c in by else None for c in callers]
        if not guarded:
            line.append("")
        elif all(t is None for t in trips):
            line.append(DASH)
        else:
            line.append(" / ".join(DASH if t is None else f"{t:.2f}" for t in trips))
        line.append(str(sum(r.errors for r in by.values())))
        cells.append(line)
    return _table(header, cells, markdown)


def stores_markdown(meta: dict[str, Any], runs: Runs) -> str:
    """The section "First executions and replays per store" of docs/benchmarks.md."""
    if not runs.stores:
        return STORES_SKIPPED
    m = runs.stores_meta
    stores = [r.store for r in runs.stores if r.store and r.store != "after"]
    names = list(dict.fromkeys(stores))
    # Busy: the 1-minute load average reached the core count at any reading.
    load1 = max(float(v.split()[0]) for k, v in m.items() if k.startswith("load_"))
    busy = load1 >= (meta.get("cores") or 2)
    return STORES_DOC.format(
        **meta,
        table=stores_table(runs.stores, markdown=True),
        started=m["started"],
        ended=m["ended"],
        load_start=m["load_start"],
        load_end=m["load_end"],
        loads=", ".join(f"after {n} {m[f'load_after_{n}']}" for n in names),
        stores="\n".join(f"- **{n}**: {m[f'about_{n}']}." for n in names),
        busy=STORES_BUSY if busy else STORES_QUIET,
    )


def with_stores_section(doc: str, meta: dict[str, Any], runs: Runs) -> str:
    """``doc`` (docs/benchmarks.md as it is) with its per-store section replaced, or
    inserted before the offload section when it has none; the rest left as it is."""
    section = stores_markdown(meta, runs).rstrip("\n") + "\n\n"
    start = doc.find(STORES_HEADING + "\n")
    if start >= 0:
        end = doc.find("\n## ", start + len(STORES_HEADING))
        return doc[:start] + section + (doc[end + 1 :] if end >= 0 else "")
    for anchor in ("## Large responses (offload)\n", "## Targets\n"):
        at = doc.find(anchor)
        if at >= 0:
            return doc[:at] + section + doc[at:]
    return doc.rstrip("\n") + "\n\n" + section


def client_speedup(clients: list[Result]) -> str:
    by = _index(clients)
    return f"{by[('aiohttp', 32)].rps / by[('httpx', 32)].rps:.1f}x"


def _offload_text(runs: Runs) -> list[str]:
    parts = []
    if runs.offload:
        parts += [
            f"Large responses (offload), req/s ratio = req/s / {OFFLOAD_BASELINE} req/s:",
            offload_table(runs.offload),
            "",
        ]
    if runs.memory is not None:
        parts += [memory_table(runs.memory), memory_line(runs.memory), ""]
    return parts


def text(runs: Runs) -> str:
    parts = []
    if runs.stores:
        parts += [
            "First executions and replays per store, req/s ratio = req/s / nginx-hop req/s "
            "(the median of before and after) at the same number of callers:",
            stores_table(runs.stores),
            "",
        ]
    if runs.results:
        parts += [
            f"req/s ratio = req/s / {BASELINE} req/s at the same number of callers",
            results_table(runs.results),
            "",
            "Redis (per request):",
            commands_table(runs.results),
            "",
            *_offload_text(runs),
            targets_table(runs),
            "",
        ]
    if runs.own_us:
        parts += ["The proxy's own work (bench/hot_path.py):", own_table(runs.own_us), ""]
    if runs.clients:
        parts += [
            f"Upstream client, forwarding app at 32 callers (aiohttp/httpx req/s: "
            f"{client_speedup(runs.clients)}):",
            clients_table(runs.clients),
        ]
    return "\n".join(parts)


def offload_markdown(meta: dict[str, Any], runs: Runs) -> str:
    """The section "Large responses (offload)" of docs/benchmarks.md."""
    if not runs.offload or runs.memory is None:
        return OFFLOAD_SKIPPED
    return OFFLOAD_DOC.format(
        duration=meta["duration"],
        offload=offload_table(runs.offload, markdown=True),
        memory=memory_table(runs.memory, markdown=True),
        rss=_rss_target(runs.memory).status,
        peak=runs.memory.peak_mb,
        target=RSS_TARGET_MB,
        rest_seconds=runs.memory.rest_seconds,
        callers=runs.memory.load.callers,
        body=f"{runs.memory.body_bytes / MIB:g} MiB",
        path=runs.memory.path,
    )


def markdown(meta: dict[str, Any], runs: Runs) -> str:
    """The whole of docs/benchmarks.md."""
    met = targets(runs)
    return DOC.format(
        **meta,
        results=results_table(runs.results, markdown=True),
        commands=commands_table(runs.results, markdown=True),
        offload=offload_markdown(meta, runs),
        stores=stores_markdown(meta, runs),
        targets=targets_table(runs, markdown=True),
        met=sum(t.met for t in met),
        total=len(met),
        clients=clients_table(runs.clients, markdown=True),
        speedup=client_speedup(runs.clients),
        own=own_table(runs.own_us, markdown=True) if runs.own_us else "Not measured.",
    )


DOC = """\
# Benchmarks

What one tool-proxy worker process costs in front of a tool, measured with
[wrk](https://github.com/wg/wrk) against a trivial upstream: an nginx server that answers
every request with `200 {{"ok":true}}` (or, for the large-response scenarios, with a
static 1 MiB or 5 MiB JSON file). Every request is a `POST` of the same small JSON body,
`{{"tool":"bench","n":1}}`.

This file is written by `bench/run` (the script, its nginx template and wrk script are in
`bench/`); edit the generator, not this file.

## How to run

```sh
bench/run                # the full run, about 3 minutes; rewrites this file
bench/run --quick        # 2 s per measurement: a smoke test, leaves this file alone
bench/run --no-offload   # without the large-response (offload) scenarios
bench/run --clients      # only the httpx / aiohttp comparison (printed, not written here)
bench/run --stores-only --stores redis,postgresql   # only the per-store section, rewritten in place
bench/run --duration 15 --rounds 3   # longer measurements, medians over 3 rounds
```

`bench/run` installs nginx and wrk (and redis-server) from Debian packages when they are
missing, then runs `.venv/bin/python bench/run.py`. It starts everything itself on free
127.0.0.1 ports (nginx with its own prefix in a temporary directory, a private
`redis-server` without persistence, `tool-proxy serve --workers 1`) and stops it at the
end. It is not part of CI. Raw numbers of every run go to `bench/results/*.json`.

Each measurement is a 1 s warm-up, then a timed wrk run of {duration} s, at 1 caller
(`wrk -t1 -c1`) and at 32 callers (`wrk -t2 -c32`).

## The machine, and why ratios

2 cores, shared with other work and noisy; wrk, nginx, Redis and the proxy all run on
those same 2 cores, over loopback. One proxy worker. Absolute numbers on such a machine
move from run to run, so every result is also given as a ratio against **nginx-hop**, a
plain nginx reverse proxy measured in the same run: `req/s ratio = req/s / nginx-hop req/s`
at the same number of callers.

This run: {date}, commit `{commit}`, {cores} cores, load average at start {load},
{duration} s per measurement, {rounds} round(s) (medians when more than one); {versions}.

## Scenarios

- **direct**: wrk calls the upstream nginx server directly.
- **nginx-hop** (the baseline, ratio 1.000): a second nginx server block that
  `proxy_pass`es to the upstream with a keepalive pool (`keepalive 64`,
  `proxy_http_version 1.1`, `proxy_set_header Connection ""`).
- **passthrough**: a tool-proxy route without `idempotency`.
- **first-exec**: a guarded route on the Redis store, a new key on every request
  (`Idempotency-Key: b<run><thread>n<count>:1:<args_hash>`, the args_hash being the
  SHA-256 of the body's RFC 8785 form): every request is claimed, forwarded and recorded.
- **replay**: the same route, one key for every request, executed once before the
  measurement: every request is a replay from Redis.

## Results

{results}

p50 added over direct: the scenario's p50 minus direct's p50 at the same number of
callers. Errors: responses with status >= 400 (wrk's "Non-2xx or 3xx responses") plus
socket errors (connect, read, write, timeout).

## Redis round trips

{commands}

Counted from the private Redis around each timed run (`INFO stats commandstats` before
and after, divided by the requests wrk completed). **Round trips** are the request/reply
exchanges the proxy made: the commands it sent itself (`EVALSHA`, and `PING`, `SCRIPT`,
`HELLO` if any), however many commands a script runs. Under load the proxy pipelines
the commands of concurrent requests (one write, one read for many), so **network
reads** (`total_reads_processed`, less the `INFO` that took the reading) fall below the
round trips. **Commands** are all `INFO commandstats` calls (without `info`): Redis
counts there, as well, every command a Lua script runs with `redis.call`. Requests still
in flight when wrk stops reach Redis without being counted by wrk, so the ratios can
exceed the exact value by up to 32 / requests.

{stores}

{offload}

## Targets

{met} of {total} met.

{targets}

The round-trip targets are checked on the value rounded to 0.1 (see above); the
round-trip value is the larger of 1 and 32 callers. The error count covers every
scenario above (the client comparison below excepted).

## The proxy's own work, and where the time goes

`bench/hot_path.py` calls the app in-process, without sockets, on the memory store, with
the upstream client replaced by a canned answer: what it measures is tool-proxy's own
code per request (routing, key and body checks, the state machine, the stored outcome,
the request log line and metrics), not aiohttp, uvicorn, Redis or the kernel. CPU time,
best of the rounds: much steadier than wrk on a shared machine, so it is the number to
compare when changing the hot path.

{own}

### The same code on two machines

Sessions run on different machines of one kind (2 cores, shared), and the ratios move
with the machine: tool-proxy's time is mostly Python, nginx's is C, and a faster machine
does not speed both up alike. The same code measured on two machines on 2026-11-29 (the
commits differ only in a log-line simplification; `bench/hot_path.py` gives the same
µs for both on one machine), `bench/run --rounds 3`, medians:

| | slower machine, 13:18 UTC (`f8e9a63`) | faster machine, 14:15 UTC (`780e4c6`) |
| --- | --- | --- |
| own CPU (hot_path), pass / first / replay, µs | 21.3 / 35.2 / 34.1 | 14.4 / 24.2 / 23.2 |
| loopback round trip (`redis-benchmark -c 1 -t ping`, p50) | 0.079 ms | 0.047 ms |
| nginx-hop at 32 callers | 40,964 req/s | 49,259 req/s |
| passthrough at 32 callers (target ≥ 0.15) | 0.133 | 0.170 |
| first-exec at 32 callers (target ≥ 0.10) | 0.095 | 0.119 |
| replay at 32 callers (target ≥ 0.20) | 0.269 | 0.339 |
| first-exec p50 added at 1 caller (target ≤ 0.6 ms) | +0.80 ms | +0.47 ms |

So the targets hold with some margin on the faster machine and three of them fail on the
slower one: read this file's "Targets" with its own-CPU table beside it. A machine whose
hot_path numbers are well above the faster machine's should expect ratios below it.

### Where a request's CPU goes

Under load tool-proxy's own code costs about twice what hot_path measures (cold caches,
the other processes on the same two cores), and it is a minority of a request's CPU.
Sampled with py-spy at 32 callers on the slower machine, a first execution spends about
30% in aiohttp (the upstream request), 25% in the event loop (uvloop, tasks, futures),
20% in tool-proxy's own code, 11% in uvicorn and 9% in the Redis client; the system
calls are charged to their callers.

At one caller the picture differs. A first execution makes three round trips more than
the direct call (Redis twice, the tool once): about 0.15 to 0.24 ms of waiting at the
round-trip times above. The rest is CPU, and an idle proxy spends much more of it per
request than a busy one, with the same code (the process's CPU time over wrk's request
count): on the faster machine about 245 µs per pass-through and 390 µs per first
execution at one caller, against 118 and 166 µs at 32; on the slower one, about 600 µs
per first execution at one caller against 250 µs at 32. Between requests the other
processes run on its core and its caches go cold, and each request wakes it from sleep
several times (four `epoll_wait` calls per pass-through, counted with strace). At one
caller the proxy is busy most of the time it takes to answer: that CPU, not the
network, is most of the added p50.

What was measured on the slower machine, 2026-11-29, and done:

- **Redis**: the coalescer's round trips go over a connection of its own, packed by
  hiredis, with one timer per round trip: about 10 µs of CPU per command at 32 concurrent
  callers, from about 26 µs with redis-py's pipelines (46 µs with a command per call).
- **One write per response**: uvicorn wrote a response's head and body in two system calls
  (two TCP segments); `proxy.server.CoalescingTransport` sends them in one. Pass-through
  gained 10 to 15% in an A/B run.
- **RFC 8785 by the stdlib**: for bodies where both give the same bytes (no fractions or
  exponents, integers within ±2^53, BMP text), the stdlib's C JSON decoder and encoder
  replace the pure-Python rfc8785: 6.8 to 4.7 µs for the bench body, 14.5 to 7.2 µs for a
  130-byte one. Other bodies still go through rfc8785; a test checks both agree.
- **No task per call**: a guarded call runs in its request's own task (uvicorn never
  cancels it when the caller leaves) instead of a task and a shield of its own: about
  18 µs per first execution.
- **No Starlette objects on the hot path** (`proxy/asgi.py`): 3 to 5 µs per request.
- **The request log line** costs about 9 µs of pass-through's 21 (structlog's call, the
  timestamp, the JSON); one processor renders it (it holds no header, so it skips the
  redaction pass), about 4 µs less than the chain of the other events.
- **One lease timer per route** instead of one per call: about 2 µs per first execution.

Measured and not done:

- A hand-written upstream client over httptools (asyncio protocol, one write per
  request, no task per body) served about 8% more pass-through requests per second than
  aiohttp in an A/B run. Not taken: an HTTP/1.1 client (pooling, keep-alive, streaming,
  timeouts) is a library's job, and aiohttp's is well kept. Two other libraries were no
  faster than aiohttp in a client-only loop (µs of CPU per request at 32 concurrent
  requests: aiohttp 65 to 100, aiosonic 90 to 113, blacksheep's client 140 to 160).
- On Python 3.11 (this machine's), aiohttp writes every request body from a task of its
  own, and uvicorn starts every request in a task scheduled for the next loop iteration;
  on 3.12 and later aiohttp starts that task eagerly. A newer Python is not available
  here.
- Pass-through's target (0.15 of nginx) is close to what a minimal forwarder reaches:
  the starlette + aiohttp app below, with no guard, no log line and no metrics, served
  0.13 to 0.15 of nginx-hop on the slower machine, about as much as tool-proxy's
  pass-through there; this run's measurement of it is in the next section.

## Upstream client: httpx or aiohttp

The measurement behind the choice of aiohttp in `proxy/forwarding.py`: a minimal
starlette app (`bench/clients.py`), served by uvicorn (uvloop, httptools, one worker),
that forwards every request to the same nginx upstream with one shared client: an
`httpx.AsyncClient` (limits raised to 100 connections) or an `aiohttp.ClientSession`.
32 callers; the ratio is against nginx-hop measured just before.

{clients}

aiohttp serves {speedup} the requests per second of httpx here. The issue that led to the
choice reported about 500 req/s (p50 57 ms) for httpx and 5,500 req/s (p50 5 ms) for
aiohttp on this kind of machine; the table above is this run's own measurement.

pyreqwest (Rust's reqwest and hyper behind a Python API) was tried as well, once, on
2026-11-29, and is not part of this script. Alone in a process, 32 concurrent requests to
the same nginx upstream, it did about twice aiohttp's requests per second (about 36,000
against 18,000, and 31 to 36 µs of CPU per request against 53 to 58). Inside tool-proxy,
where its Tokio thread competes for the two cores with the event loop, wrk, nginx and
Redis, first executions fell from about 4,300 to 1,900 req/s and pass-through from about
7,000 to 4,500, and its errors did not tell a request that was never sent from one whose
answer was lost (a timeout while waiting for the answer came as a `ConnectTimeoutError`).
aiohttp stays.

## Long calls (`async` routes)

`bench/long_calls.py` (2026-12-01, 2-core development machine, another engineer's tests
running beside it; Redis started by the script, tool-proxy and the tool each in a
process of their own, aiohttp clients; `--seconds 8 --jobs 500 --subscribers 200`, three
runs):

| 32 callers, times in ms | run 1 | run 2 | run 3 |
|---|---|---|---|
| pass-through p50 / p99 (the baseline) | 17.4 / 42.3 | 18.8 / 39.2 | 19.7 / 38.2 |
| **time to 202** p50 / p99 | 22.6 / **41.2** | 18.5 / **44.6** | 16.6 / **29.2** |
| p99 time to 202 / p99 pass-through | 0.97 | 1.14 | 0.76 |
| 202s per second | 1,337 | 1,593 | 1,850 |
| operations completed per second (note 1) | 329 | 350 | 430 |
| reads of an operation's events, 200 SSE readers | 2 | 2 | 2 |
| the same, 1 reader | 2 | 2 | 2 |
| first to last of 200 readers' `completed` event | 409 | 114 | 74 |

Note 1: 500 operations submitted at once, 32 workers, a tool answering at once.

- The target, a p99 time to 202 under 50 ms at 32 callers, is met in each run: a 202 is
  the claim, the job kept (one script: job hash, first event, stream entry) and the
  answer; it costs about what a pass-through of a tool that answers at once does.
- 200 readers of one operation cost the same two reads of its events as one reader
  (`XRANGE` calls counted with `INFO commandstats`): one per change the process's one
  subscription announces, shared by every reader in the process (`proxy/job_events.py`).
- With httpx's async client at 32 callers the client itself was the bottleneck (a direct
  call of the tool measured 117 calls/s, p50 179 ms): the script uses aiohttp.

## Store durability

What `store.durability: {{replicas: 1, timeout: 200ms}}` costs on Redis, from
`bench/durability.py` (`PYTHONPATH=. .venv/bin/python bench/durability.py --calls 4000
--rounds 4`): a real primary and one replica on this machine (loopback, replication
direct), the store's claims and completions (the two writes of a first execution),
off and on alternating, four rounds, 2026-12-02 on the shared 2-core machine (load
about 1 to 1.5, so the spread between rounds is wide).

| | one write at a time, median | 64 callers at once | `WAIT`s per write (64 at once) |
| --- | --- | --- | --- |
| off | 166 to 320 µs (median of rounds about 210) | 16,900 to 18,600 writes/s | 0 |
| on | 303 to 338 µs (about 320) | 13,000 to 17,300 writes/s | 0.032 |
| off, quieter (`--calls 2000 --rounds 2`, load below 0.5) | 101 and 180 µs | 23,100 and \
23,500 writes/s | 0 |
| on, quieter | 136 and 139 µs | 19,300 and 20,600 writes/s | 0.032 |

- **No extra round trip**: the `WAIT` is pipelined after the script, in the same write and
  read, so a guarded call still makes 2 round trips per first execution and 1 per replay.
- **One at a time** a write waits for the replica to acknowledge it (the primary asks the
  replicas with `REPLCONF GETACK` once per event loop cycle while a client waits): about
  35 to 100 µs more per write on loopback, so up to about 0.2 ms more per first
  execution; over a network, add one primary-to-replica round trip per write.
- **Under load** the coalescer sends one `WAIT` per round trip, after all of its commands
  (1 per 31 writes with 64 callers): throughput is 5 to 20 % below off on this machine
  (12 to 18 % on the quieter run). Sending one `WAIT` per command instead would serialize: \
Redis blocks the
  connection at each `WAIT` until its replicas answer, so the commands behind it wait.
- **Replays** carry the `WAIT` too (a claim does not know beforehand whether it finds a
  record): it returns at once when the replicas have acknowledged the connection's
  earlier writes, else after their next acknowledgement.
- **A lagging replica** costs `timeout` per round trip that carries a durable write (the
  `WAIT` runs out): everything behind it on the connection waits, and claims are refused.
  Keep `timeout` short.

## Tracing

The cost of traces, off and on, is in [tracing.md](tracing.md#overhead): off, nothing
measurable; on with every request sampled, 4 to 8 times the proxy's own CPU per request
(`bench/traced.py`, on/off alternately in one run); sampling a tenth, 1.6 to 2.5 times.

## The hot path against earlier commits

`bench/hot_path.py` run alternately with earlier commits on the same busy 2-core machine,
2026-12-02 (10,000 requests, 3 rounds a run; the best run of each; main at `08576d3`).
`c48c92c`'s own script was run with new keys for its first executions, as `5dea61a` fixed
it (it measured replays there). Ratios main / the earlier commit, µs of CPU per request:

| against | runs | pass-through | first execution | replay |
|---|---|---|---|---|
| `c48c92c` (the seams issue's reference) | 6 | 1.06 | 1.14 | 1.23 |
| `0880570` (before the seams and stores work) | 5 | 0.97 | 1.02 | 0.98 |
| `7b44ef6` (this session's start) | 6 (replays: 8) | 1.00 | 1.00 | 0.97 |

Since `0880570` the fence at the send, per-caller scoping, sealed credentials, bounded
state, the new stores, durability, replay counting and traces cost nothing measurable on
these routes; against `c48c92c` first executions and replays are still slower. A profile
says where: some 50 more Python calls per first execution than there (about 286 against
233), spread over the capabilities added since (the fence, the claim's index, the
recorded outcome's verdict, duplicate-member checks of JSON bodies, the job and task
seams), no single one above a few per cent.

After the hot-path work on branch `hotpath` (a replay builds no send, fence or policy
context; an HTTP route's send checks its lease itself; records, claims, operations and
verdicts are named tuples, not frozen dataclasses; the memory store keeps one object per
record; the MCP modules are imported only for a route that speaks MCP), 2026-12-02:
`bench/hot_path.py` as it is (20,000 requests, 3 rounds a run), `c48c92c`, main
(`1fb0541`) and `hotpath` run in turn, 10 runs each, the best run of each, ratios to
`c48c92c`:

| commit / `c48c92c` | runs | pass-through | first execution | replay |
|---|---|---|---|---|
| main `1fb0541` | 10 | 0.99 | 1.12 | 1.10 |
| `hotpath` | 10 | 1.00 | 1.14 | 1.00 |

Replays are back at `c48c92c`'s cost; first executions are not: in these runs no better
than main's, within this machine's noise (a run's first executions spread over 20 µs, a
third of their cost). Shorter rounds, steadier here, do see them gain: main and
`hotpath` alternately, 4 runs each of 5,000 requests and 8 rounds, `hotpath` / main:
pass-through 1.00, first execution 0.90, replay 0.94. Part of the gain is the
collector's: in-process, without the server's `gc.freeze()` at start-up,
every full collection goes through the objects the proxy holds (the MCP SDK's types were
a third of them) and those the memory store keeps per record (two now, four before).

## Measurements behind design choices

Measured once on the 2-core development machine and not rerun by this script; the code's
docstrings give the reasons, these are the figures.

- **Before and after the long calls, the response cache's fixes and the MCP work**
  (`bench/run --rounds 1`, 2026-12-01 at about 13:55 UTC, one after the other on the same
  quiet 2-core machine, which measured slower that day than on 2026-12-01 11:35: nginx's
  hop 21,900 to 26,400 req/s, the minimal aiohttp forwarder 0.09 to 0.13 of it). The
  session's starting commit `207f8b9` against this one, req/s ratios to nginx at 32
  callers: first executions 0.058 against **0.078**, replays 0.176 against **0.205**,
  pass-through 0.111 against **0.109**; first execution at 1 caller +1.42 ms against
  +1.17 ms over direct; 2.01 and 1.00 Redis round trips per first execution and replay in
  both. Routes without the new capabilities did not get slower; the targets the generated
  table marks NOT MET were not met by the starting commit on that machine either.
  `bench/hot_path.py`, alternating runs of both commits: pass-through 46.5 to 49.7 µs
  against 46.7 to 51.9, first executions 122.7 to 147.1 against 129.2 to 142.0, replays
  83.3 to 88.4 against 85.6 to 91.8 (within the machine's noise).
- **Redis Cluster: a coalescer per node, not redis-py's `RedisCluster`**
  (`proxy/store/redis_nodes.py`; `PYTHONPATH=. .venv/bin/python bench/cluster.py`,
  2026-12-01 21:30 UTC, on the shared 2-core machine under a load average of about 18, so
  the spread between runs is wide; every server on the same cores). Claim + complete pairs
  per second (two scripts, a 256-byte outcome), 64 concurrent callers, 5 s each, three
  runs: one Redis through today's coalescer 1,676 / 4,514 / 1,362 (at 8 callers); a
  3-primary cluster (3 replicas) through a coalescer per node 960 / 1,503 / 1,244 (8
  callers); the same cluster through redis-py's asyncio `RedisCluster` (EVALSHA of the
  same scripts) 640 / 670 / 1,001 (8 callers). The coalescer per node does 1.2 to 2.2 times
  the pairs of `RedisCluster` in every run (redis-py's cluster client pays a task, a
  slot lookup and a connection checkout per command, and pipelines nothing on its own);
  both are below one Redis on one machine, where six servers and the client share two
  cores and each node's batches are a third as large. A cluster is for capacity and
  spread (memory, slots over nodes), not for a faster call.
- **Redis auto-pipelining** (`proxy/store/redis.py`, `Coalescer`): with 32 concurrent
  callers, about 10 µs of the proxy's CPU per Redis command, against about 26 µs with
  redis-py's pipelines and 46 µs with one redis-py command per call.
- **A guarded call in its request's own task** (`proxy/idempotency.py`): a task and a
  shield of its own per call cost about 18 µs per first execution (`bench/hot_path.py`).
- **One lease timer per route** (`proxy/idempotency.py`, `Leases`): a timer per call cost
  about 3 µs per call.
- **aiohttp rather than httpx** (`proxy/forwarding.py`): the section above.
- **A route with one rate limit** (`proxy/policies/limits.py`, `bench/hot_path.py`
  scenario `first-exec-limited`, memory store): 40.0 to 42.1 µs of CPU per first
  execution against 39.2 to 39.5 µs for the plain first execution of the same runs, a
  ratio of 1.02 to 1.07 (the machine's noise is of the same size). Routes without
  limits: 21.6 / 39.5 / 38.4 µs (pass / first / replay) against 21.5 / 38.9 / 37.5
  before the limits existed, within the noise. On Redis the limit is **one extra round
  trip** per call (its `take` script: pause, every rate and every slot of the route),
  not merged into the claim; `test_one_rate_limit_costs_one_extra_redis_round_trip`
  (tests/test_limits.py) counts it with `INFO commandstats` (2 EVALSHA per first
  execution without the limit, 3 with it). These figures were taken while
  `bench/hot_path.py` repeated its keys (its "first executions" were replays after the
  first batch of a run); with a new key per request, two runs gave 80.3 to 82.8 µs
  against 54.7 to 57.3 µs, a ratio of 1.44 to 1.47.
- **A route with a resource lock** (`proxy/policies/lock.py`, `bench/hot_path.py`
  scenario `first-exec-locked`, memory store, every call on the same resource, one
  after the other): 114.6 to 121.6 µs of CPU per first execution against 54.7 to 57.3 µs
  for the plain first execution of the same runs, a ratio of **2.09 to 2.16**. What it
  adds per call: the resource key (the body parsed again for its JSON pointer, a
  SHA-256), the acquisition, a renewal timer, the answer wrapped to free the lock when
  its body is read, and the release as a background task, which the next call on the
  same resource waits for in this process's line (first come, first served). On Redis
  the lock is **two extra round trips** per call (acquire, release). Routes without a
  lock or versioning pay nothing: their chain is built at start-up without it.
- **A cache hit** (`proxy/policies/cache.py`, `bench/hot_path.py` scenario `cache-hit`,
  memory store, a route with `cache` and no idempotency, the same request every time;
  2026-12-01, commit `ef9b9b7`): 94.5 µs of CPU per request against 47.7 µs for
  pass-through in the same run, a ratio
  of **1.98** (first-exec 133.9 µs and replay 89.0 µs in that run, on a machine loaded
  by other work: every figure about twice the table above). A hit costs about what a
  replay does, without the tool's work: the body read whole and its RFC 8785 digest, the
  key's SHA-256, one store read, the entry decoded, the answer built with `Age` and
  `Cache-Status`. On Redis a hit is **one round trip** (`GET`). Routes without `cache`
  were unchanged within the noise in that run against the run just before the cache
  existed (pass / first / replay / limited / locked: 47.7 / 133.9 / 89.0 / 174.9 / 233.8
  µs against 46.6 / 129.1 / 84.0 / 183.1 / 234.5): their chain is built without it.
- **MCP `tools/call`** (`bench/mcp_calls.py`, protocol: mcp route, memory store, a
  FastMCP server with JSON answers in its own process, one httpx client, one call at a
  time, 3 rounds of 1,000 calls, best round): direct 417 calls/s (p50 2.28 ms), first
  execution through the proxy 326 calls/s (ratio **0.78**, p50 2.91 ms: +0.63 ms), replay
  1,630 calls/s (ratio **3.91**, p50 0.57 ms: the recorded result is sent without the
  server's own work, which dominates here).
  Again on 2026-12-01 at about 14:15 UTC, after this session's MCP work (progress
  streamed to the first caller, the answer bound, version checks), on a slower machine,
  against the session's starting commit `207f8b9` right before it: first execution 0.645
  and 0.780 of direct in two runs (direct 252 and 305 calls/s) against 0.644 (direct 246);
  replays 3.21 and 3.18 against 3.81 (p50 1.20 and 0.97 ms against 1.00 ms).
  A cache hit (`cache-hit`: a second route with `cache: {scope: route, tools: [charge]}`,
  the same call without a key, answered from the cache with its own `id`), on 2026-12-01
  at about 15:20 UTC in the same run as the others: 3.41 of direct (745 calls/s, p50
  1.30 ms), where replays were 2.68 (p50 1.60 ms) and first executions 0.69; a first run
  of 300 calls gave 4.74 and 3.62 for hits, 4.12 and 4.98 for replays. A hit costs about
  what a replay does: one store read and the `id` rewritten, the server not called.
  The time to a task answer (`task`: a third route with `async`, a new key per call with
  `params.task`, answered `CreateTaskResult` by the proxy while its workers run the calls
  in the same process), on 2026-12-01 at about 21:25 UTC, 2 rounds of 300 calls, on a
  machine shared with several other runs (so every number is far below the ones above):
  direct 31 calls/s (p50 28 ms), first execution 0.49 of it (p50 59 ms), task answer 1.35
  of direct (42 calls/s, p50 20 ms, p99 82 ms): the claim, the job kept and queued, then
  the answer, without waiting for the server. To be measured again on a quiet machine.
- **psycopg 3 rather than asyncpg for PostgreSQL** (`proxy/store/postgres.py`;
  2026-12-01 at about 20:58 UTC, PostgreSQL 15 on the same 2-core machine, loaded by
  other work: load average 8.5, so the spread between rounds is wide). A loop of claim +
  completion (the store's own `claim` and `complete` functions, a new key each time,
  1,500 per round, median of 3 rounds, pools of 10 connections, `synchronous_commit=off`
  so the commit's fsync does not hide the drivers' cost), in claim+complete per second:

  | driver | 1 at a time | 20 at a time |
  |---|---|---|
  | psycopg 3.3 + psycopg_pool, prepared after 5 uses (`prepare=true`) | 179 (178-504) | 262 \
(193-327) |
  | psycopg, never prepared (the default) | 325 (132-429) | 304 (201-340) |
  | asyncpg 0.32, statement cache (default) | 525 (451-537) | 247 (242-297) |
  | asyncpg, no statement cache (PgBouncer before 1.21) | 308 (276-312) | 191 (160-256) |

  With `synchronous_commit=on` (the default, each commit flushed) all four gave 84 to 122
  at 1 and 209 to 283 at 20: the server's work (the function, the commit) dominates.
  asyncpg is faster one call at a time with its statement cache, which breaks PgBouncer
  in transaction mode before 1.21; under concurrency, where a proxy serving many callers
  is, the drivers are within the noise of each other. psycopg it is: it works through
  PgBouncer either way, it ships type hints (`mypy --strict`), and its pool bounds the
  connections with a wait timeout (a dry pool answers 503 at once, not a hang).
  Statements are not prepared by default: that measured no slower, and PgBouncer before
  1.21 in transaction mode refuses prepared statements (tests/test_postgres.py runs the
  store through PgBouncer 1.18).
"""

STORES_SKIPPED = f"""\
{STORES_HEADING}

Not measured in this run (`bench/run --stores ''`).\
"""

STORES_BUSY = (
    "**These ratios were measured on a busy machine** (its load average reached its "
    "core count: other work shared the 2 cores with wrk, nginx, the stores and the proxy), "
    "so they are lower, and wider apart from run to run, than on a quiet one; compare the "
    "stores with each other within this table rather than with the tables above."
)
STORES_QUIET = (
    "The machine was not busy during this part of the run (load average below its core "
    "count); it is still shared, so compare the stores with each other within this table."
)

STORES_DOC = f"""\
{STORES_HEADING}

The same guarded route (`/tool`) on each store, one store at a time: the store started
(the tests' helpers: tests/servers.py, tests/postgres_server.py), then a
**tool-proxy process of its own** on it, the scenarios, and both stopped before the next
store starts; the same wrk settings as above (a 1 s warm-up, {{duration}} s, `-t1 -c1`
and `-t2 -c32`, {{rounds}} round(s)). **first-exec** is a new key on every request,
**replay** one key executed once beforehand. Pass-through does not touch a store: it is
measured once, through the first store's proxy. nginx-hop is measured before the first
store and after the last; `req/s ratio` is against the median of both at the same number
of callers, and the two hops' rows show how much the machine drifted meanwhile.

Each cell of req/s reads `req/s ratio`. **Round trips** per request: on Redis the
commands the proxy sent itself (`INFO commandstats`, as above; on the cluster summed over
its 3 primaries); on PostgreSQL the transactions committed in the store's database
(`xact_commit` of `pg_stat_database`, the store's own background work included, read
after 10.5 s without load before and after each run, since a server process may keep
its counts pending that long; every store call is one `SELECT` of a function in a
transaction of its own, so one commit is one round trip; `pg_stat_statements` is not
loaded there); SQLite is a file, with nothing to count ({DASH}). Requests still in
flight when wrk stops are counted by the store and not by wrk, as above.

This run: {{date}}, commit `{{commit}}`, {{started}} to {{ended}} UTC; load average (1, 5,
15 min) at the start {{load_start}}, {{loads}}, at the end {{load_end}}, on {{cores}} cores.

{{busy}}

{{stores}}

{{table}}\
"""

OFFLOAD_SKIPPED = """\
## Large responses (offload)

Not measured in this run (`bench/run --no-offload`).\
"""

OFFLOAD_DOC = """\
## Large responses (offload)

The same proxy, configured with
`offload: {{url: "file:///<temporary directory>/objects", threshold_bytes: 102400}}`,
and a third route, `/big`, guarded like `/tool` on the same Redis store. No network
object store is available on this machine, so the objects are local files (obstore's
local file store): these numbers leave out the network round trip and bandwidth of S3,
GCS or Azure, which a real deployment adds to every replay of an offloaded body.

- **big-direct**: wrk calls the upstream nginx server for a static 1 MiB JSON file
  (`/big/1m.json`, written into nginx's temporary prefix; nginx refuses a `POST` to a
  static file with 405, and `error_page 405 =200 $uri` turns it into a `GET` of the file).
- **big-replay**: the same file through tool-proxy's `/big` route, with one key executed
  once before the measurement: the 1 MiB body went to the object store, and the record
  in Redis keeps only its path, size and SHA-256. Every request is a replay that reads the
  object back and checks its digest (a body of exactly 1 MiB is read whole and checked
  before the answer starts; larger ones stream in 256 KiB chunks, the last one held back
  until the digest is checked). Before measuring, the script checks that the object was
  written and that the replayed body is the file, byte for byte.

`req/s ratio` here is against **big-direct** at the same number of callers; at 1 MiB a
response, req/s is also MiB/s of body. Each measurement is, as above, a 1 s warm-up and
{duration} s; Redis round trips are counted as above.

{offload}

### Peak memory

{callers} callers (`wrk -t2 -c{callers}`) replay one offloaded {body} response (`{path}`,
executed once beforehand by the main proxy) for a 1 s warm-up and {duration} s. They go
to a **fresh tool-proxy process**, started for this scenario alone with the same
configuration on a port of its own, so that its peak RSS is this scenario's: `VmHWM`
from `/proc/<pid>/status`, read at the end of the load while the process is still up,
covers its whole life (start-up, warm-up and the measurement) and nothing else. RSS at
rest is its `VmRSS` {rest_seconds} s after it answered its readiness check, before the
load. MB = 10^6 bytes.

{memory}

Target: peak RSS under {target} MB while {callers} callers fetch {body} responses at once:
{rss} ({peak:.1f} MB).\
"""
