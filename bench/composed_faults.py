"""The composed fault test, run longer: agents, replicas on Redis and SQLite, faults,
invariants checked from the history (the harness is tests/composed.py; a short seed runs
in the suite as tests/test_composed.py).

Prints the requests, the faults by kind, the executions at the tool and every violation;
exits 1 if there is one. ``--harsh`` lets freezes and pauses outlast the leases (past
``lock_ttl``), which finds the open items of issue 20 rather than checking the documented
guarantees.

    PYTHONPATH=. .venv/bin/python bench/composed_faults.py --seed N --seconds S
        [--agents A] [--replicas R] [--harsh] [--nemesis-log]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.composed import Shape, run


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=120)
    parser.add_argument("--agents", type=int, default=12)
    parser.add_argument("--replicas", type=int, default=3, choices=(2, 3))
    parser.add_argument("--harsh", action="store_true")
    parser.add_argument("--nemesis-log", action="store_true", help="print every fault")
    options = parser.parse_args()
    shape = Shape(
        seed=options.seed,
        seconds=options.seconds,
        agents=options.agents,
        replicas=options.replicas,
        max_steps=100_000,  # bounded by the time instead
        harsh=options.harsh,
    )
    with tempfile.TemporaryDirectory(prefix="composed-") as tmp:
        report = run(shape, Path(tmp))
    if options.nemesis_log:
        print("\n".join(report.nemesis_log))
    print("\n".join(report.lines()))
    return 1 if report.violations else 0


if __name__ == "__main__":
    sys.exit(main())
