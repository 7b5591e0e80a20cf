"""The composed fault test, run longer: agents, replicas on Redis and SQLite, faults,
invariants checked from the history (the harness is tests/composed.py; a short seed runs
in the suite as tests/test_composed.py).

Prints the requests, the faults by kind, the executions at the tool and every violation;
exits 1 if there is one. ``--harsh`` lets freezes and pauses outlast the leases (past
``lock_ttl``), which looks for the open items of issue 20 rather than checking the
documented guarantees. ``--calibrate`` runs the routes with ``on_lapsed_lease:
reexecute``, the documented way to run a call twice after a crash: the checker must
report second executions (exit 1 if it does not).

    PYTHONPATH=. .venv/bin/python bench/composed_faults.py --seed N --seconds S
        [--agents A] [--replicas R] [--harsh] [--calibrate] [--nemesis-log]
"""

from __future__ import annotations

import argparse
import shutil
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
    parser.add_argument(
        "--calibrate",
        action="store_true",
        help="on_lapsed_lease: reexecute: the checker must report second executions",
    )
    parser.add_argument("--nemesis-log", action="store_true", help="print every fault")
    options = parser.parse_args()
    shape = Shape(
        seed=options.seed,
        seconds=options.seconds,
        agents=options.agents,
        replicas=options.replicas,
        max_steps=100_000,  # bounded by the time instead
        harsh=options.harsh,
        reexecute=options.calibrate,
    )
    tmp = Path(tempfile.mkdtemp(prefix="composed-"))
    report = run(shape, tmp)
    if options.nemesis_log:
        print("\n".join(report.nemesis_log))
    print("\n".join(report.lines()))
    if report.violations:
        print(f"the replicas' logs are in {tmp}")
        return 0 if shape.reexecute else 1
    shutil.rmtree(tmp)
    return 1 if shape.reexecute else 0


if __name__ == "__main__":
    sys.exit(main())
