"""The servers a benchmark script starts: each in a process of its own, on a free port."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def spawn(script: str, *args: str) -> subprocess.Popen[bytes]:
    """``script`` (a benchmark's own file) run again with ``args``, from the repository."""
    return subprocess.Popen([sys.executable, script, *args], cwd=ROOT)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_up(url: str, seconds: float = 20) -> None:
    """Once ``url`` answers at all; ``SystemExit`` if it does not within ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            httpx.get(url, timeout=0.5)
            return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise SystemExit(f"{url} did not start")
