"""How many instructions Redis runs per first execution (a claim and its complete) and per
replay (a claim that finds the outcome), counted by callgrind: the same count from run to
run, where time on a shared machine moves by 10 to 20%.

    PYTHONPATH=. .venv/bin/python bench/redis_scripts.py [/path/to/other/checkout ...]

For each checkout (this one first) a ``redis-server`` runs under ``valgrind
--tool=callgrind``, counting only inside ``EVALSHA`` (``--toggle-collect``), while that
checkout's own ``RedisStore`` (from its source, through ``PYTHONPATH``) claims and
completes ``--calls`` new keys, each a new plan as in bench/run's first executions, with
a 200-byte outcome, then claims one finished key ``--calls`` times. The counters are
zeroed before each phase and dumped after it (``callgrind_control``). Needs valgrind
(Debian's ``valgrind`` package) and redis-server.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from processes import ROOT, free_port

# Run in the checkout's own source: its store, its scripts, its argument lists. It says
# "ready" once set up, and starts the counted calls when a line comes on its stdin.
DRIVER = """
import asyncio, secrets, sys
from proxy.store.base import RecordKey, State
from proxy.store.redis import RedisStore

async def main(url: str, phase: str, calls: int) -> None:
    store = RedisStore(url)
    run = secrets.token_hex(4)
    done = RecordKey(f"bench|anon|{run}|1", "h" * 64)
    await store.claim(done, "fp", "owner", 30, 330)
    await store.complete(done, "owner", "fp", State.COMPLETED, b"x" * 200, 300)
    print("ready", flush=True)
    sys.stdin.readline()
    for i in range(calls):
        if phase == "replay":
            claim = await store.claim(done, "fp", "other", 30, 330)
            assert claim.record is not None and claim.record.state is State.COMPLETED
            continue
        key = RecordKey(f"bench|anon|{run}p{i}|1", "h" * 64)
        assert (await store.claim(key, "fp", "owner", 30, 330)).record is None
        assert await store.complete(key, "owner", "fp", State.COMPLETED, b"x" * 200, 300)
    await store.close()

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
"""
PHASES = {"first execution": "first", "replay": "replay"}
SUMMARY = re.compile(r"^summary: (\d+)$", re.MULTILINE)


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


def callgrind_control(option: str, pid: int) -> None:
    subprocess.run(["callgrind_control", option, str(pid)], check=True, capture_output=True)


def run_phase(url: str, phase: str, calls: int, checkout: Path, pid: int, work: Path) -> None:
    """The driver's ``phase``, with Redis's counters zeroed before it and dumped after."""
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    argv = [sys.executable, "-c", DRIVER, url, phase, str(calls)]
    pipe = subprocess.PIPE
    with subprocess.Popen(argv, env=env, cwd=work, stdin=pipe, stdout=pipe) as driver:
        assert driver.stdin is not None and driver.stdout is not None
        driver.stdout.readline()  # ready: its own claim and complete are not counted
        callgrind_control("-z", pid)
        driver.stdin.write(b"go\n")
        driver.stdin.flush()
        if driver.wait(600) != 0:
            raise RuntimeError(f"the {phase} driver failed")
    callgrind_control("-d", pid)


def count(checkout: Path, calls: int, work: Path) -> dict[str, float]:
    """Instructions inside EVALSHA per first execution and per replay of ``checkout``."""
    port = free_port()
    out = work / f"callgrind.{len(list(work.glob('callgrind.*')))}.out"
    argv = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}"]
    argv += ["--toggle-collect=evalShaCommand", "redis-server", "--port", str(port)]
    argv += ["--save", "", "--appendonly", "no", "--dir", str(work)]
    server = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    counts: dict[str, float] = {}
    try:
        wait_for(port, server)
        for name, phase in PHASES.items():
            run_phase(f"redis://127.0.0.1:{port}/0", phase, calls, checkout, server.pid, work)
            dumps = sorted(work.glob(f"{out.name}.*"), key=lambda p: int(p.suffix[1:]))
            found = SUMMARY.search(dumps[-1].read_text())
            if found is None:
                raise RuntimeError(f"no summary line in {dumps[-1]}")
            counts[name] = int(found[1]) / calls
    finally:
        server.kill()
        server.wait()
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("others", type=Path, nargs="*", help="other checkouts to count")
    parser.add_argument("--calls", type=int, default=1000)
    args = parser.parse_args()
    for tool in ("valgrind", "callgrind_control", "redis-server"):
        if shutil.which(tool) is None:
            parser.error(f"{tool} is missing (Debian packages valgrind, redis-server)")
    with tempfile.TemporaryDirectory(prefix="tool-proxy-scripts-") as tmp:
        counts = {c: count(c.resolve(), args.calls, Path(tmp)) for c in [ROOT, *args.others]}
    for name in PHASES:
        print(f"Redis's instructions per {name} (inside EVALSHA), and against this checkout:")
        for checkout, found in counts.items():
            ratio = found[name] / counts[ROOT][name]
            print(f"  {found[name]:10,.0f}  {ratio:.2f}x  {checkout}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
