"""The composed fault test (tests/composed.py): a short seed against real replicas on
Redis and SQLite with faults injected, and the checker on histories made by hand (it
must see each kind of violation it is there for). bench/composed_faults.py runs longer
seeds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.composed import Answer, History, Read, Request, Shape, Tool, check, run

IDENT = ("", "ledger", "alice", "plan-1:1:" + "0" * 64)


def answer(status: int = 200, body: object = None, *, at: float = 1.0, **fields: object) -> Answer:
    made = {"exec": "r-1", "principal": "alice"} if body is None else body
    spec: dict[str, object] = {
        "ident": IDENT,
        "agent": "agent-0",
        "replica": "1",
        "status": status,
        "problem": None,
        "replayed": False,
        "body": json.dumps(made).encode(),
        "sent": at,
        "got": at + 0.1,
        "phase": "run",
    }
    spec.update(fields)
    return Answer(**spec)  # type: ignore[arg-type]


def violations(*answers: Answer, tool: Tool | None = None) -> list[str]:
    history = History(answers=list(answers))
    return sorted({v.invariant for v in check(history, tool or Tool(0, 0.0))})


def test_the_checker_accepts_a_recorded_answer_and_its_replays() -> None:
    unknown = answer(502, {"type": "x"}, at=0.0, problem="outcome-unknown")
    assert violations(unknown, answer(at=1.0), answer(at=2.0, replayed=True)) == []


def test_the_checker_sees_another_answer_or_an_unknown_after_the_tool_answered() -> None:
    other = answer(at=2.0, body={"exec": "r-2", "principal": "alice"}, replayed=True)
    assert violations(answer(), other) == ["replay"]
    late = answer(502, {"type": "x"}, at=2.0, problem="outcome-unknown")
    assert violations(answer(), late) == ["replay"]
    forgotten = answer(409, {"type": "x"}, at=2.0, problem="request-in-progress")
    assert violations(answer(), forgotten) == ["replay"]


def test_the_checker_sees_crossed_principals_and_stuck_keys() -> None:
    assert violations(answer(body={"exec": "r-1", "principal": "bob"})) == ["principals"]
    stuck = answer(409, {}, problem="request-in-progress", phase="stuck")
    assert violations(stuck) == ["in-progress"]
    assert violations(answer(500, {}, problem="internal-error")) == ["internal-error"]


def test_the_checker_sees_an_operation_that_failed_while_its_key_has_the_answer() -> None:
    failed = answer(0, {}, problem="failed", phase="operation")
    assert violations(failed, answer(at=3.0, replayed=True, phase="final")) == ["replay"]


def test_the_tool_log_shows_second_executions_stale_fences_and_lost_updates() -> None:
    tool = Tool(0, 0.0)
    key = IDENT[3]
    for fence in ("5", "4"):
        tool.execute(IDENT, {"fencing-token": fence}, b'{"account": "acc-0"}')
    doc = ("", "doc", "bob", "k")
    for _ in range(2):
        tool.execute(doc, {"x-doc": "doc-0"}, b'{"based_on": 0}')
    assert violations(tool=tool) == ["at-most-once", "fencing", "lost-update"]
    assert [e["key"] for e in tool.executions][:2] == [key, key]


def test_the_checker_sees_a_read_older_than_a_write_its_caller_had_the_answer_of() -> None:
    doc = ("", "doc", "alice", "plan-1:2:" + "1" * 64)
    wrote = answer(body={"exec": "r-1", "principal": "alice", "rev": 3}, at=1.0, ident=doc)
    history = History(answers=[wrote])
    history.requests[doc] = Request(
        "", "doc", "alice", doc[3], "POST", "/doc/write", {"x-doc": "doc-0"}, b"{}"
    )
    history.reads = [
        Read("", "doc-0", 2, 1.05, "tool-proxy; hit"),  # sent while the write ran: fine
        Read("", "doc-0", 3, 2.0, "tool-proxy; hit"),
        Read("sq", "doc-0", 0, 2.0, "tool-proxy; hit"),  # another store's document
    ]
    assert check(history, Tool(0, 0.0)) == []
    history.reads.append(Read("", "doc-0", 2, 2.0, "tool-proxy; hit"))
    assert [v.invariant for v in check(history, Tool(0, 0.0))] == ["stale-read"]


@pytest.mark.timeout(400)
def test_a_short_seed_keeps_every_invariant(tmp_path: Path) -> None:
    """Two replicas on Redis and one on SQLite, ten agents, 40 s of faults that stay
    within the documented margins (freezes and pauses below a quarter of lock_ttl and
    below the store client's timeout)."""
    report = run(Shape(seed=20, seconds=40.0, agents=10), tmp_path)
    lines = "\n".join(report.lines() + report.nemesis_log)
    assert report.executions > 50, lines
    assert report.cached_reads > 0, lines  # the cache of a versioned resource is exercised
    assert {"kill", "stop", "redis-pause", "redis-stop", "tool-storm"} <= set(report.faults), lines
    assert not report.violations, lines


@pytest.mark.timeout(600)
def test_a_harsh_seed_keeps_every_invariant(tmp_path: Path) -> None:
    """Freezes and Redis pauses past lock_ttl and the store client's timeout, and Redis
    connections reset with their commands dropped: beyond the documented margins."""
    report = run(Shape(seed=11, seconds=60.0, agents=12, harsh=True), tmp_path)
    lines = "\n".join(report.lines() + report.nemesis_log)
    assert report.executions > 50, lines  # the agents ran (a run that did nothing passes)
    assert {"kill", "stop", "redis-pause", "redis-stop", "redis-drop"} <= set(report.faults), lines
    assert not report.violations, lines
