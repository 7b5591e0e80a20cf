/**
 * The Vercel AI SDK: `execute` functions for its `tool()` that call a tool through
 * tool-proxy as a step of a plan, with the key, the waits and the long calls in one line.
 *
 *   const plan = await PlanSession.derive(conversationId);
 *   const charge = tool({
 *     description: "Charge an account",
 *     inputSchema: z.object({ account: z.string(), cents: z.number() }),
 *     execute: httpExecute(proxy, "/tools/charge", plan),
 *   });
 *
 * The step is the model response the call is in (counted from the conversation's
 * messages, which the SDK hands to `execute`) and the tool: a request sent again with the
 * same messages (a retried HTTP request, a resumed chat) sends the same keys, whatever
 * `toolCallId` the model gives its calls this time; a later response makes new calls.
 * Nothing here imports `ai`: the functions fit its `execute` by their shape.
 */

import { type Answer, type CallOptions, type ToolProxy, type Waits } from "./client.js";
import { isKeyPart, sha256 } from "./keys.js";
import { type CallsTools, callTool } from "./mcp.js";
import { PlanSession, type Step } from "./session.js";

/** What `execute` is given besides the input (the SDK's `ToolExecutionOptions`). */
export type ToolExecutionOptions = {
  toolCallId: string;
  /** The messages sent to the model for the response with the call (not that response). */
  messages: readonly { role: string }[];
  abortSignal?: AbortSignal;
  experimental_context?: unknown;
};

/** Where a call's step comes from: a plan (the step from the response and the tool), or a
 * function of the call's options (`experimental_context` is yours) to a plan or a step. */
export type Steps = PlanSession | ((options: ToolExecutionOptions, tool: string) => PlanSession | Step | Promise<PlanSession | Step>);

/** An `execute` of the SDK's `tool()`. */
export type Execute<Input, Output> = (input: Input, options: ToolExecutionOptions) => Promise<Output>;

/** The step of a tool call in `plan`: `<response>.<tool>`, the response counted from the
 * messages the model was sent for it (1 + the assistant messages among them). */
export async function responseStep(plan: PlanSession, tool: string, options: ToolExecutionOptions): Promise<Step> {
  const response = 1 + (options.messages ?? []).filter((message) => message.role === "assistant").length;
  return plan.step(response).sub(await keyPart(tool));
}

/** A tool's name (or path) as a key part: its runs of other characters as `-`, or a digest. */
async function keyPart(name: string): Promise<string> {
  const part = name.replace(/[^A-Za-z0-9._-]+/g, "-").replace(/^-+|-+$/g, "");
  return isKeyPart(part) && part.length <= 64 ? part : (await sha256(new TextEncoder().encode(name))).slice(0, 16);
}

async function stepOf(steps: Steps, tool: string, options: ToolExecutionOptions): Promise<Step> {
  const found = steps instanceof PlanSession ? steps : await steps(options, tool);
  return found instanceof PlanSession ? responseStep(found, tool, options) : found;
}

/** The `execute` of a tool that is an HTTP route of the proxy: `proxy.call(step, path, input)`
 * (409 waited out, a 202 followed to its result); the tool's answer as `result` makes it
 * (default: its JSON, or its text). Errors are the client's (OutcomeUnknown, ...). */
export function httpExecute<Input, Output = unknown>(
  proxy: ToolProxy,
  path: string,
  steps: Steps,
  options: CallOptions & { tool?: string; result?: (answer: Answer) => Output | Promise<Output> } = {},
): Execute<Input, Output> {
  const { tool = path, result = answerValue as (answer: Answer) => Output, ...call } = options;
  return async (input, execution) => {
    const step = await stepOf(steps, tool, execution);
    return result(await proxy.call(step, path, input, call));
  };
}

/** The `execute` of a tool of an MCP server behind the proxy, called with the official
 * SDK's `Client` (`callTool` of tool_proxy_client: the key in `_meta`, -32010 waited out);
 * the `CallToolResult` as `result` makes it (default: the result itself). */
export function mcpExecute<Input extends Record<string, unknown>, Output = unknown>(
  client: CallsTools,
  name: string,
  steps: Steps,
  options: { waits?: Waits; keyMeta?: string; result?: (result: unknown) => Output | Promise<Output> } = {},
): Execute<Input, Output> {
  const { result = (value: unknown) => value as Output, ...call } = options;
  return async (input, execution) => {
    const step = await stepOf(steps, name, execution);
    return result(await callTool(client, step, name, input, call));
  };
}

/** An answer's JSON when it is JSON, else its text. */
export function answerValue(answer: Answer): unknown {
  const type = answer.headers.get("content-type") ?? "";
  return /[/+]json\b/.test(type) ? answer.json() : answer.text();
}
