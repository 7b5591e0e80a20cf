"""The cost of traces on: ``bench/hot_path.py`` with tracing off and on, alternately, in
the same run (the machine is shared and noisy: only ratios measured side by side say
something).

    .venv/bin/python bench/traced.py [--pairs P] [--requests N] [--rounds R] [--ratio F]

Tracing on is ``OTEL_TRACES_SAMPLER=always_on`` (every request sampled: the worst case),
or with ``--ratio F`` ``traceidratio`` sampling that fraction of the requests,
exported by the SDK's batch processor over OTLP/HTTP to a local receiver that takes and
drops the payloads (in a process of its own: its CPU is not counted). The exporter's
thread is in the proxy's process, so its CPU is counted. Prints, per scenario, each
pair's on/off ratio of µs of CPU per request, and the median ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HOT_PATH = ROOT / "bench" / "hot_path.py"

# An OTLP/HTTP receiver that answers 200 to every POST and keeps nothing.
RECEIVER = """
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

class Drop(BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass

server = ThreadingHTTPServer(("127.0.0.1", 0), Drop)
print(server.server_address[1], flush=True)
server.serve_forever()
"""


@contextmanager
def receiver() -> Iterator[str]:
    """A dropping OTLP/HTTP receiver's endpoint, for as long as the block runs."""
    process = subprocess.Popen([sys.executable, "-c", RECEIVER], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        port = int(process.stdout.readline())
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(10)


def hot_path(
    requests: int, rounds: int, endpoint: str | None, ratio: float | None = None
) -> dict[str, float]:
    """One run of ``bench/hot_path.py`` in a process of its own; traced if ``endpoint``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    command = [sys.executable, str(HOT_PATH), "--json"]
    command += ["--requests", str(requests), "--rounds", str(rounds)]
    if endpoint is not None:
        command.append("--traced")
        env |= {
            "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
            "OTEL_TRACES_SAMPLER": "always_on" if ratio is None else "traceidratio",
            "OTEL_TRACES_SAMPLER_ARG": str(ratio or 1.0),
            "OTEL_BSP_MAX_QUEUE_SIZE": str(4 * requests),  # nothing dropped in a round
        }
    ran = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    best: dict[str, float] = json.loads(ran.stdout.splitlines()[-1])
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--ratio", type=float, help="traceidratio sampling of this fraction")
    args = parser.parse_args()
    ratios: dict[str, list[float]] = {}
    with receiver() as endpoint:
        for _ in range(args.pairs):
            off = hot_path(args.requests, args.rounds, None)
            on = hot_path(args.requests, args.rounds, endpoint, args.ratio)
            for scenario, value in off.items():
                ratios.setdefault(scenario, []).append(on[scenario] / value)
            print(f"{time.strftime('%H:%M:%S')} off {off}\n         on  {on}", flush=True)
    for scenario, values in ratios.items():
        pairs = " ".join(f"{v:.2f}" for v in values)
        print(f"{scenario:18} on/off {pairs}  median {statistics.median(values):.2f}")


if __name__ == "__main__":
    main()
