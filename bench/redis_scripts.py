"""How many instructions Redis runs per first execution (a claim and its complete), counted
by callgrind: the same count from run to run, where time on a shared machine moves by
10 to 20%.

    PYTHONPATH=. .venv/bin/python bench/redis_scripts.py [/path/to/other/checkout ...]

For each checkout (this one first) a ``redis-server`` runs under ``valgrind
--tool=callgrind``, counting only inside ``EVALSHA`` (``--toggle-collect``), while that
checkout's own ``RedisStore`` (from its source, through ``PYTHONPATH``) claims and
completes ``--calls`` new keys, each a new plan as in bench/run's first executions, with
a 200-byte outcome. Needs valgrind (Debian's ``valgrind`` package) and redis-server.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Run in the checkout's own source: its store, its scripts, its argument lists.
DRIVER = """
import asyncio, secrets, sys
from proxy.store.base import RecordKey, State
from proxy.store.redis import RedisStore

async def main(url: str, calls: int) -> None:
    store = RedisStore(url)
    run = secrets.token_hex(4)
    for i in range(calls):
        key = RecordKey(f"bench|anon|{run}p{i}|1", "h" * 64)
        claim = await store.claim(key, "fp", "owner", 30, 330)
        assert claim.record is None, claim
        assert await store.complete(key, "owner", "fp", State.COMPLETED, b"x" * 200, 300)
    await store.close()

asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""

TOTALS = re.compile(r"^([\d,]+) \(100.0%\)\s+PROGRAM TOTALS", re.MULTILINE)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for(port: int, proc: subprocess.Popen[bytes], seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("redis-server under valgrind exited")
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise RuntimeError("redis-server under valgrind did not start")


def count(checkout: Path, calls: int, work: Path) -> float:
    """Instructions inside EVALSHA per claim and complete of ``checkout``'s store."""
    port = free_port()
    out = work / f"callgrind.{len(list(work.glob('callgrind.*')))}.out"
    argv = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}"]
    argv += ["--toggle-collect=evalShaCommand", "redis-server", "--port", str(port)]
    argv += ["--save", "", "--appendonly", "no", "--dir", str(work)]
    server = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(port, server)
        env = {**os.environ, "PYTHONPATH": str(checkout)}
        driver = [sys.executable, "-c", DRIVER, f"redis://127.0.0.1:{port}/0", str(calls)]
        subprocess.run(driver, env=env, check=True, cwd=work, timeout=600)
        subprocess.run(["redis-cli", "-p", str(port), "shutdown", "nosave"], check=False)
        server.wait(60)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    annotated = subprocess.run(
        ["callgrind_annotate", str(out)], capture_output=True, text=True, check=True
    ).stdout
    found = TOTALS.search(annotated)
    if found is None:
        raise RuntimeError(f"no PROGRAM TOTALS in callgrind_annotate's output of {out}")
    return int(found[1].replace(",", "")) / calls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("others", type=Path, nargs="*", help="other checkouts to count")
    parser.add_argument("--calls", type=int, default=1000)
    args = parser.parse_args()
    for tool in ("valgrind", "callgrind_annotate", "redis-server", "redis-cli"):
        if shutil.which(tool) is None:
            parser.error(f"{tool} is missing (Debian packages valgrind, redis-server)")
    with tempfile.TemporaryDirectory(prefix="tool-proxy-scripts-") as tmp:
        counts = {c: count(c, args.calls, Path(tmp)) for c in [ROOT, *args.others]}
    mine = counts[ROOT]
    for checkout, instructions in counts.items():
        ratio = instructions / mine
        print(f"{instructions:10,.0f} instructions per claim+complete ({ratio:.2f}x)  {checkout}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
