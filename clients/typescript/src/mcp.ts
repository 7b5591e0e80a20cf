/**
 * MCP through tool-proxy with `@modelcontextprotocol/sdk`: the step's key in
 * `params._meta` of `client.callTool`, and the proxy's JSON-RPC errors thrown as the same
 * errors as on HTTP routes. The SDK is an optional peer: this module only needs a client
 * with `callTool`.
 */

import { PROBLEM_BASE, type ProblemDocument, type ProxyProblem, RecordIdentity, isProxyProblem, problemError } from "./errors.js";
import { DEFAULT_RETRIED, type Waits } from "./client.js";
import type { Step } from "./session.js";

export const KEY_META = "idempotencyKey";

/** The proxy's JSON-RPC codes and their problem types; -32019 is any other (error.data.type). */
export const CODES: ReadonlyMap<number, string> = new Map([
  [-32010, "request-in-progress"],
  [-32011, "args-hash-mismatch"],
  [-32012, "idempotency-key-reused"],
  [-32013, "idempotency-key-missing"],
  [-32014, "idempotency-key-invalid"],
  [-32015, "outcome-unknown"],
  [-32016, "response-not-stored"],
]);
export const OTHER_CODE = -32019;

/** What callTool needs of a client: the SDK's `Client.callTool`. */
export type CallsTools = {
  callTool(params: { name: string; arguments?: Record<string, unknown>; _meta?: Record<string, unknown> }, ...rest: never[]): Promise<unknown>;
};

/** `_meta` of a tools/call of `step` with `args` (the key is the digest of the arguments). */
export function metaFor(step: Step, args: Record<string, unknown> | undefined, name = KEY_META): Promise<Record<string, string>> {
  return step.meta(args ?? {}, name);
}

/** The error for an MCP error that is the proxy's (its code and error.data), else undefined. */
export function problemOfError(error: unknown, record?: RecordIdentity): ProxyProblem | undefined {
  const { code, data, message } = (error ?? {}) as { code?: number; data?: unknown; message?: string };
  if (code === undefined || (!CODES.has(code) && code !== OTHER_CODE)) return undefined;
  let document: ProblemDocument;
  if (isProxyProblem(data)) document = data;
  else if (code !== OTHER_CODE) document = { type: PROBLEM_BASE + CODES.get(code), detail: message ?? "" };
  else return undefined;
  const wait = document.retry_after;
  return problemError(document, { retryAfter: typeof wait === "number" ? wait : undefined, record });
}

/** `client.callTool({name, arguments, _meta})` as `step` of its plan; -32010 waited out. */
export async function callTool(
  client: CallsTools,
  step: Step,
  name: string,
  args: Record<string, unknown> = {},
  options: { waits?: Waits; key?: string; meta?: Record<string, unknown>; keyMeta?: string } = {},
): Promise<unknown> {
  const waits = { total: 60, cap: 30, base: 0.25, retried: DEFAULT_RETRIED, ...options.waits };
  const keyMeta = options.keyMeta ?? KEY_META;
  const key = options.key ?? (await step.key(args));
  const record = new RecordIdentity(key, "tools/call", name);
  const started = Date.now();
  for (let attempt = 0; ; attempt++) {
    try {
      return await client.callTool({ name, arguments: args, _meta: { ...options.meta, [keyMeta]: key } });
    } catch (error) {
      const problem = problemOfError(error, record);
      if (problem === undefined) throw error;
      if (!waits.retried.has(problem.type.slice(PROBLEM_BASE.length))) throw problem;
      const delay = problem.retryAfter !== undefined ? Math.min(problem.retryAfter, waits.cap) : Math.min(waits.base * 2 ** attempt, waits.cap);
      if ((Date.now() - started) / 1000 + delay > waits.total) throw problem;
      await new Promise((resolve) => setTimeout(resolve, delay * 1000));
    }
  }
}
