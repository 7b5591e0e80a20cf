/**
 * Plan sessions and their steps. The orchestrator numbers the steps of its plan,
 * deterministically: a replan that reaches step 3 again with the same arguments sends the
 * key it sent before (and gets the recorded answer); other arguments make a new call.
 * Never number steps from an LLM's output (a tool_call_id is new on every replan).
 */

import { InvalidKey } from "./errors.js";
import { compositeKey, isKeyPart, sha256 } from "./keys.js";

export class PlanSession {
  constructor(readonly id: string) {
    if (!isKeyPart(id)) {
      throw new InvalidKey(`a plan_session_id is 1..128 characters of [A-Za-z0-9._-], not ${JSON.stringify(id)}`);
    }
  }

  /** The plan session of a durable name (a thread id, a conversation id): the same parts
   * give the same id, so a resumed run sends the same keys (as PlanSession.derive in Python). */
  static async derive(...parts: string[]): Promise<PlanSession> {
    const digest = await sha256(new TextEncoder().encode(parts.join("\u0000")));
    return new PlanSession(`plan-${digest.slice(0, 32)}`);
  }

  /** A fresh plan session (keep its id where the plan is kept, to resume it). */
  static create(): PlanSession {
    return new PlanSession(`plan-${globalThis.crypto.randomUUID().replaceAll("-", "")}`);
  }

  /** Step `index` of this plan, as the orchestrator numbers it. */
  step(index: number | string): Step {
    return new Step(this, String(index));
  }
}

export class Step {
  constructor(readonly plan: PlanSession, readonly index: string) {
    if (!isKeyPart(index)) {
      throw new InvalidKey(`a step_index is 1..128 characters of [A-Za-z0-9._-], not ${JSON.stringify(index)}`);
    }
  }

  /** The Idempotency-Key of this step for `args`. */
  key(args: unknown): Promise<string> {
    return compositeKey(this.plan.id, this.index, args);
  }

  /** `params._meta` of an MCP tools/call of this step. */
  async meta(args: unknown, name = "idempotencyKey"): Promise<Record<string, string>> {
    return { [name]: await this.key(args ?? {}) };
  }

  /** A step within this one (`3.1`, `3.2`): several tool calls of one plan step. */
  sub(index: number | string): Step {
    return new Step(this.plan, `${this.index}.${index}`);
  }
}
