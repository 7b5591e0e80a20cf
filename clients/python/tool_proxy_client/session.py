"""Plan sessions and their steps: where a key's ``plan_session_id`` and ``step_index`` come from.

The orchestrator numbers the steps of its plan, deterministically: a replan that reaches
step 3 again with the same arguments sends the key it sent before (and gets the recorded
answer), one with other arguments sends a new key (a new call). Never number steps from
an LLM's output (a ``tool_call_id`` is new on every replan).
"""

from __future__ import annotations

import hashlib
import threading
import uuid
from dataclasses import dataclass
from typing import Any

from tool_proxy_client.errors import InvalidKey
from tool_proxy_client.keys import body_hash, composite_key, is_key_part, key_of


@dataclass(frozen=True, slots=True)
class PlanSession:
    """One plan of an agent: the ``plan_session_id`` of every key its steps send."""

    id: str

    def __post_init__(self) -> None:
        if not is_key_part(self.id):
            raise InvalidKey(
                f"a plan_session_id is 1..128 characters of [A-Za-z0-9._-], not {self.id!r}: "
                "use PlanSession.derive(...) for any other name"
            )

    @classmethod
    def derive(cls, *parts: str) -> PlanSession:
        """The plan session of a durable name (a graph's thread id, a conversation id, a
        job id): the same parts give the same id, so a resumed run sends the same keys."""
        digest = hashlib.sha256("\x00".join(parts).encode()).hexdigest()
        return cls(f"plan-{digest[:32]}")

    @classmethod
    def new(cls) -> PlanSession:
        """A fresh plan session (keep its ``id`` where the plan is kept, to resume it)."""
        return cls(f"plan-{uuid.uuid4().hex}")

    def step(self, index: int | str) -> Step:
        """Step ``index`` of this plan, as the orchestrator numbers it."""
        return Step(self, str(index))

    def counter(self, start: int = 1) -> StepCounter:
        """Steps numbered in the order of the calls of one run of the plan (for frameworks
        that call tools themselves): a run made again from its start numbers them alike."""
        return StepCounter(self, start)


@dataclass(frozen=True, slots=True)
class Step:
    """One step of a plan: its key follows from the arguments of the call it makes."""

    plan: PlanSession
    index: str

    def __post_init__(self) -> None:
        if not is_key_part(self.index):
            raise InvalidKey(
                f"a step_index is 1..128 characters of [A-Za-z0-9._-], not {self.index!r}"
            )

    def key(self, arguments: Any) -> str:
        """The Idempotency-Key of this step for ``arguments`` (a JSON-compatible value)."""
        return composite_key(self.plan.id, self.index, arguments)

    def key_for_body(self, body: bytes, content_type: str | None = None) -> str:
        """The key of this step for a raw request body, hashed as the proxy hashes it."""
        return key_of(self.plan.id, self.index, body_hash(body, content_type))

    def meta(self, arguments: Any, name: str = "idempotencyKey") -> dict[str, str]:
        """``params._meta`` of an MCP ``tools/call`` of this step (``mcp.key_meta``)."""
        return {name: self.key(arguments)}

    def sub(self, index: int | str) -> Step:
        """A step within this one (``3.1``, ``3.2``): several tool calls of one plan step."""
        return Step(self.plan, f"{self.index}.{index}")


class StepCounter:
    """Numbers the guarded tool calls of one run of a plan ``start``, ``start + 1``, ...

    For agent frameworks that make the tool calls themselves: a run started again from its
    beginning (a resumed graph, an agent loop replayed after a crash) makes its calls in the
    same order, so the same call gets the same step and its recorded answer. Calls made in
    parallel must be made in a fixed order for that to hold.
    """

    def __init__(self, plan: PlanSession, start: int = 1) -> None:
        self.plan = plan
        self._next = start
        self._lock = threading.Lock()

    def next(self) -> Step:
        """The step of the next call."""
        with self._lock:
            index, self._next = self._next, self._next + 1
        return self.plan.step(index)
