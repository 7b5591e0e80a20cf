"""bench/run's core grid for two checkouts, run alternately on one machine.

    PYTHONPATH=. .venv/bin/python bench/compare.py /path/to/other/checkout [--rounds 4]

Each round starts nginx (the upstream and the hop), a private Redis and one ``tool-proxy
serve`` per checkout in turn (this checkout first in odd rounds, the other in even ones:
a drift of the machine's load favours neither), and measures the nginx hop,
pass-through, first executions and replays at 1 and 32 callers with wrk. It prints each
run's req/s over the same run's nginx hop, then per scenario: the median of those ratios
for each checkout, the median of the pairwise ratios (this / other, higher is faster),
the CPU per request of the proxy process and of Redis (the least seen), and the share
of the time the proxy's event loop was on a CPU (``/proc/<pid>/schedstat``): below 100%
at 32 callers it sat waiting, for Redis's replies mostly.

A shared 2-core machine moves a single run by 10 to 20%, so read the medians of many
rounds; ``--only first-exec@32`` (repeatable) measures just those scenarios and their
hop, so a round takes seconds and many rounds fit in a few minutes. ``--pin`` puts the
proxy alone on the second CPU and everything else on the first: what then differs is
the proxy's own speed, not what Redis's or nginx's work takes from the proxy's core
(the 1-caller hops are not comparable with unpinned runs).
The other checkout runs from its own source with this checkout's virtualenv
(``PYTHONPATH``), so it needs no install of its own.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import redis

from proxy.keys import composite_key

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run as grid  # bench/run.py: its processes and wrk

SCENARIOS = ("passthrough", "first-exec", "replay")
CALLERS = (1, 32)


@dataclass(frozen=True)
class Sample:
    rps: float
    proxy_us: float
    """CPU of the proxy process per request (user and system)."""
    redis_us: float
    running: float
    """The share of the run's time the proxy's event loop was on a CPU (the rest it
    waited: for Redis, the tool or a caller, or, rarely, for a CPU)."""


def process_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_running(pid: int) -> float:
    """Seconds the process's main thread (its event loop) has been on a CPU."""
    return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0]) / 1e9


def redis_cpu(client: redis.Redis) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def start_tool_and_store(stack: ExitStack, work: Path) -> tuple[dict[str, int], redis.Redis, Path]:
    """bench/run's set-up without the proxy: nginx (the tool and the hop) and a private
    Redis; the ports, the Redis client and the proxy's configuration."""
    ports = {name: grid.free_port() for name in ("upstream", "hop", "proxy", "redis")}
    grid.write_big_bodies(work)
    grid.start_nginx(stack, work, ports["upstream"], ports["hop"])
    store = grid.start_redis(stack, work, ports["redis"])
    return ports, store, grid.write_proxy_config(work, ports, offload=False)


def start_proxy(
    stack: ExitStack,
    work: Path,
    checkout: Path,
    port: int,
    config: Path,
    wrapper: tuple[str, ...] = (),
    start_seconds: float = grid.START_TIMEOUT,
) -> int:
    """``tool-proxy serve`` from ``checkout``'s source, one worker, run under ``wrapper``
    (e.g. valgrind) if given, ready within ``start_seconds``; its pid."""
    argv = [*wrapper, sys.executable, "-c", "from proxy.cli import main; main()", "serve"]
    argv += ["--config", str(config), "--port", str(port), "--workers", "1"]
    os.environ["PYTHONPATH"] = str(checkout)
    started, grid.START_TIMEOUT = grid.START_TIMEOUT, start_seconds
    try:
        ready = grid.urls_ok(f"http://127.0.0.1:{port}/_proxy/readyz")
        return stack.enter_context(grid.service("proxy", argv, work, ready)).pid
    finally:
        del os.environ["PYTHONPATH"]
        grid.START_TIMEOUT = started


def pin(pid: int, cpu: int) -> None:
    """Every thread of process ``pid`` onto ``cpu`` alone."""
    for thread in Path(f"/proc/{pid}/task").iterdir():
        os.sched_setaffinity(int(thread.name), {cpu})


def one_run(
    checkout: Path, seconds: int, proxy_cpu: int | None = None, only: frozenset[str] = frozenset()
) -> dict[str, Sample]:
    """The grid once against ``checkout``, keyed ``<scenario>@<callers>`` (with ``only``,
    those and their callers' hop); with ``proxy_cpu``, the proxy runs on that CPU alone
    (``--pin``)."""
    out: dict[str, Sample] = {}
    with tempfile.TemporaryDirectory(prefix="tool-proxy-compare-") as tmp, ExitStack() as stack:
        work = Path(tmp)
        ports, store, config = start_tool_and_store(stack, work)
        pid = start_proxy(stack, work, checkout, ports["proxy"], config)
        if proxy_cpu is not None:
            pin(pid, proxy_cpu)
        args_hash = composite_key("bench", 1, grid.BODY.encode()).rsplit(":", 1)[1]
        proxy = f"http://127.0.0.1:{ports['proxy']}"
        replay_key = grid.fixed_key("replay", args_hash)
        grid.prime(f"{proxy}/tool", replay_key)
        scenarios = {
            "nginx-hop": grid.Scenario("nginx-hop", f"http://127.0.0.1:{ports['hop']}/tool"),
            "passthrough": grid.Scenario("passthrough", f"{proxy}/pass"),
            "first-exec": grid.Scenario("first-exec", f"{proxy}/tool", "unique", "b"),
            "replay": grid.Scenario("replay", f"{proxy}/tool", "fixed", replay_key),
        }
        for callers in CALLERS:
            for name, scenario in scenarios.items():
                if only and f"{name}@{callers}" not in measured(only):
                    continue
                key_args = scenario.wrk_args(args_hash)
                grid.wrk(scenario.url, callers, grid.WARMUP_SECONDS, key_args)
                time.sleep(grid.SETTLE_SECONDS)
                cpu, redis_before = process_cpu(pid), redis_cpu(store)
                running, started = thread_running(pid), time.monotonic()
                data = grid.wrk(scenario.url, callers, seconds, scenario.wrk_args(args_hash))
                running = (thread_running(pid) - running) / (time.monotonic() - started)
                requests = max(data["requests"], 1)
                out[f"{name}@{callers}"] = Sample(
                    rps=requests / (data["duration_us"] / 1e6),
                    proxy_us=(process_cpu(pid) - cpu) / requests * 1e6,
                    redis_us=(redis_cpu(store) - redis_before) / requests * 1e6,
                    running=running,
                )
    return out


def measured(only: frozenset[str]) -> set[str]:
    """The scenarios ``--only`` asks for and the hop at each of their callers."""
    return {*only, *(f"nginx-hop@{key.partition('@')[2]}" for key in only)}


def least_cpu(samples: list[Sample]) -> str:
    proxy, store = min(s.proxy_us for s in samples), min(s.redis_us for s in samples)
    running = statistics.median(s.running for s in samples)
    return f"{proxy:.0f} + {store:.0f} ({running:.0%})"


def report(runs: dict[str, list[dict[str, Sample]]], only: frozenset[str]) -> list[str]:
    this, other = runs
    lines = [
        f"scenario         {this:>10} {other:>10}  this/other  CPU µs per request "
        "(proxy + Redis, least seen; the proxy's loop on a CPU, median)"
    ]
    for callers in CALLERS:
        for name in SCENARIOS:
            key, hop = f"{name}@{callers}", f"nginx-hop@{callers}"
            if only and key not in only:
                continue
            ratios = {n: [r[key].rps / r[hop].rps for r in rs] for n, rs in runs.items()}
            pairs = [a / b for a, b in zip(ratios[this], ratios[other], strict=True)]
            cpu = {n: least_cpu([r[key] for r in rs]) for n, rs in runs.items()}
            lines.append(
                f"{key:16} {statistics.median(ratios[this]):10.4f} "
                f"{statistics.median(ratios[other]):10.4f}  {statistics.median(pairs):10.3f}  "
                f"{cpu[this]} against {cpu[other]}"
            )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("other", type=Path, help="the other checkout (e.g. a git worktree)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=int, default=5, help="per measurement (5)")
    parser.add_argument(
        "--pin",
        action="store_true",
        help="the proxy alone on one CPU, wrk, nginx and Redis on another: the proxy's "
        "own speed, apart from what the processes beside it take from its core",
    )
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="SCENARIO@CALLERS",
        help="measure only this scenario (e.g. first-exec@32) and its hop; repeatable",
    )
    args = parser.parse_args()
    only = frozenset(args.only)
    if unknown := only - {f"{n}@{c}" for n in SCENARIOS for c in CALLERS}:
        parser.error(f"--only: no scenario {', '.join(sorted(unknown))}")
    proxy_cpu = None
    if args.pin:
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2:
            parser.error("--pin needs two CPUs")
        os.sched_setaffinity(0, {cpus[0]})  # inherited by nginx, Redis and wrk
        proxy_cpu = cpus[1]
    checkouts = {"this": grid.ROOT, "other": args.other.resolve()}
    runs: dict[str, list[dict[str, Sample]]] = {name: [] for name in checkouts}
    for n in range(args.rounds):
        order = list(checkouts.items())
        for name, checkout in order if n % 2 == 0 else reversed(order):  # ABBA: drift cancels
            runs[name].append(one_run(checkout, args.seconds, proxy_cpu, only))
            shown = min(only or {"first-exec@32"})
            run = runs[name][-1]
            ratio = run[shown].rps / run[f"nginx-hop@{shown.partition('@')[2]}"].rps
            print(f"round {n + 1}/{args.rounds} {name}: {shown} {ratio:.4f} of the hop")
    print(f"load average at the end: {os.getloadavg()}")
    print("\n".join(report(runs, only)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
