"""A scripted agent loop through tool-proxy, with no LLM: the plan's first attempt times
out, the agent replans and runs the plan again, and every step runs once.

    python examples/agent_loop.py http://127.0.0.1:8080 [long-call prefix]

Against the demo tool (``tool-proxy demo``, or tests/test_examples.py, which also serves
``/long`` as an ``async`` route in front of it). Prints what happened, one line each.
"""

from __future__ import annotations

import sys
from typing import Any

import httpx
from tool_proxy_client import PlanSession, ToolProxy, TransportError, Waits

CHARGE = {"account": "acme", "amount": 42, "delay": 1.5}


def attempt(url: str, plan: PlanSession, patience: float) -> Any:
    """One attempt of the plan: step 1 charges; an impatient worker gives up after
    ``patience`` seconds (its call goes on in the proxy and the tool)."""
    http = httpx.Client(timeout=patience)
    with ToolProxy(url, http=http, waits=Waits(transport=False)) as proxy:
        return proxy.call(plan.step(1), "/tools/charge", CHARGE)


def main(url: str, long_prefix: str = "/long") -> list[str]:
    plan = PlanSession.new()  # the orchestrator keeps plan.id with the plan
    lines = []
    try:
        attempt(url, plan, patience=0.3)
    except TransportError:
        lines.append("attempt 1, step 1: timed out (the charge goes on)")
    # The agent replans; the same plan reaches step 1 with the same arguments: same key.
    answer = attempt(url, plan, patience=30)
    lines.append(
        f"attempt 2, step 1: {answer.status_code}, replayed={answer.replayed} (409 waited out)"
    )
    again = attempt(url, plan, patience=30)
    lines.append(f"attempt 3, step 1: {again.status_code}, replayed={again.replayed}")
    with ToolProxy(url) as proxy:
        states: list[str] = []
        long = proxy.call(
            plan.step(2),
            f"{long_prefix}/tools/charge",
            {"account": "acme", "amount": 7, "delay": 1},
            respond_async=True,
            on_status=lambda status: states.append(str(status["state"])),
        )
        lines.append(f"step 2 (long call): {long.status_code}, its operation ended {states[-1]}")
        executions = proxy.http.get(f"{url}/tools/charge/executions").json()["executions"]
    lines.append(f"the tool ran {executions} charges")
    return lines


if __name__ == "__main__":
    for line in main(*sys.argv[1:]):
        print(line)
