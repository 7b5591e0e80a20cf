"""How many instructions a serving proxy runs per request, counted by callgrind: the same
count from run to run (within about 3%), where its CPU time on a shared machine moves by
10 to 20%.

    PYTHONPATH=. .venv/bin/python bench/proxy_instructions.py [/path/to/other/checkout ...]
        [--scenarios passthrough,first-exec,replay] [--requests 500]

For each checkout (this one first) and scenario, ``tool-proxy serve`` from that
checkout's source (this checkout's virtualenv, through ``PYTHONPATH``) runs under
``valgrind --tool=callgrind`` on bench/run's set-up (nginx as the tool, a private
Redis); an aiohttp client sends 300 requests to warm it up, then ``--requests`` more, 32
in flight, with the counters zeroed before and dumped after (``callgrind_control``).
Every instruction of the process counts: uvicorn, aiohttp, redis-py, the event loop and
tool-proxy's own code (not the kernel's). Needs valgrind (Debian's ``valgrind``), nginx
and redis-server; a run takes about a minute per checkout and scenario.
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import shutil
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import aiohttp

from proxy.keys import composite_key

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run as grid  # bench/run.py: its processes
from compare import start_proxy, start_tool_and_store
from redis_scripts import SUMMARY, callgrind_control

SCENARIOS = ("passthrough", "first-exec", "replay")
IN_FLIGHT = 32
WARM_UP = 300
START_SECONDS = 300.0  # Python under valgrind starts slowly


async def send_all(url: str, keys: list[str | None]) -> None:
    """POST bench/run's body once per key (None: no Idempotency-Key), 32 in flight."""
    gate = asyncio.Semaphore(IN_FLIGHT)
    async with aiohttp.ClientSession() as session:

        async def one(key: str | None) -> None:
            headers = {"Content-Type": "application/json"}
            if key is not None:
                headers["Idempotency-Key"] = key
            async with gate, session.post(url, data=grid.BODY.encode(), headers=headers) as r:
                await r.read()
                if r.status != 200:
                    raise RuntimeError(f"{url}: {r.status}")

        await asyncio.gather(*(one(key) for key in keys))


def keys_for(scenario: str, count: int, tag: str) -> list[str | None]:
    args_hash = composite_key("bench", 1, grid.BODY.encode()).rsplit(":", 1)[1]
    if scenario == "first-exec":
        return [f"{tag}{i}:1:{args_hash}" for i in range(count)]
    if scenario == "replay":
        return [f"fixed-{tag[:6]}:1:{args_hash}"] * count
    return [None] * count


def count(checkout: Path, scenario: str, requests: int) -> float:
    """Instructions of ``checkout``'s serving proxy per request of ``scenario``."""
    with tempfile.TemporaryDirectory(prefix="tool-proxy-ir-") as tmp, ExitStack() as stack:
        work = Path(tmp)
        ports, _, config = start_tool_and_store(stack, work)
        out = work / "callgrind.out"
        wrapper = ("valgrind", "--tool=callgrind", f"--callgrind-out-file={out}")
        pid = start_proxy(stack, work, checkout, ports["proxy"], config, wrapper, START_SECONDS)
        path = "/pass" if scenario == "passthrough" else "/tool"
        url = f"http://127.0.0.1:{ports['proxy']}{path}"
        tag = secrets.token_hex(4)
        asyncio.run(send_all(url, keys_for(scenario, 1, tag)))  # a replay's key, recorded
        asyncio.run(send_all(url, keys_for(scenario, WARM_UP, f"{tag}w")))
        callgrind_control("-z", pid)
        asyncio.run(send_all(url, keys_for(scenario, requests, f"{tag}m")))
        callgrind_control("-d", pid)
        time.sleep(0.5)
        dumps = sorted(work.glob("callgrind.out.*"), key=lambda p: int(p.suffix[1:]))
        found = SUMMARY.search(dumps[-1].read_text()) if dumps else None
        if found is None:
            raise RuntimeError(f"no callgrind dump with a summary in {work}")
        return int(found[1]) / requests


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("others", type=Path, nargs="*", help="other checkouts to count")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--requests", type=int, default=500)
    args = parser.parse_args()
    for tool in ("valgrind", "callgrind_control", "redis-server"):
        if shutil.which(tool) is None:
            parser.error(f"{tool} is missing (Debian packages valgrind, redis-server)")
    scenarios = args.scenarios.split(",")
    if unknown := set(scenarios) - set(SCENARIOS):
        parser.error(f"--scenarios: unknown {sorted(unknown)} (known: {', '.join(SCENARIOS)})")
    checkouts = [grid.ROOT, *(c.resolve() for c in args.others)]
    for scenario in scenarios:
        counts = {c: count(c, scenario, args.requests) for c in checkouts}
        print(f"{scenario}: the proxy's instructions per request, and against this checkout:")
        for checkout, found in counts.items():
            print(f"  {found:12,.0f}  {found / counts[grid.ROOT]:.2f}x  {checkout}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
