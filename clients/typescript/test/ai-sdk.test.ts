// The Vercel AI SDK's generateText with a scripted model (MockLanguageModelV3: no LLM) and
// tools whose execute is httpExecute / mcpExecute, through the real proxy started by
// tests/test_client_typescript.py: a request sent again with the same messages replays.
import assert from "node:assert/strict";
import { test } from "node:test";

import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";
import { type ModelMessage, type ToolSet, generateText, stepCountIs, tool } from "ai";
import { MockLanguageModelV3 } from "ai/test";
import { z } from "zod";

import { type Answer, PlanSession, ToolProxy, httpExecute, mcpExecute, responseStep } from "../src/index.js";

const BASE = process.env.TOOL_PROXY_URL ?? "";
const USAGE = {
  inputTokens: { total: 1, noCache: 1, cacheRead: undefined, cacheWrite: undefined },
  outputTokens: { total: 1, text: 1, reasoning: undefined },
};

/** A model that calls `toolName` with `input` (a new toolCallId each time), then, once it
 * has the tool's result, answers with it as text. */
function scripted(toolName: string, input: unknown): MockLanguageModelV3 {
  return new MockLanguageModelV3({
    doGenerate: async ({ prompt }) => {
      const last = prompt.at(-1);
      if (last?.role === "tool") {
        const part = last.content[0];
        const output = part?.type === "tool-result" ? part.output : undefined;
        return { content: [{ type: "text", text: JSON.stringify(output) }], finishReason: { unified: "stop", raw: "stop" }, usage: USAGE, warnings: [] };
      }
      return {
        content: [{ type: "tool-call", toolCallId: `call_${globalThis.crypto.randomUUID()}`, toolName, input: JSON.stringify(input) }],
        finishReason: { unified: "tool-calls", raw: "tool_calls" },
        usage: USAGE,
        warnings: [],
      };
    },
  });
}

async function run(model: MockLanguageModelV3, tools: ToolSet, messages: ModelMessage[]): Promise<unknown[]> {
  const result = await generateText({ model, tools, messages, stopWhen: stepCountIs(3) });
  return result.steps.flatMap((step) => step.toolResults.map((got) => got.output));
}

type Counted = { execution: number; replayed: boolean; operation?: string };
const counted = (answer: Answer): Counted => ({ ...(answer.json() as Counted), replayed: answer.replayed, operation: answer.operation });

test("an AI SDK tool calling an HTTP tool: the request sent again replays", async () => {
  assert.ok(BASE, "TOOL_PROXY_URL is not set: run through tests/test_client_typescript.py");
  const proxy = new ToolProxy(BASE);
  const plan = await PlanSession.derive("conversation", globalThis.crypto.randomUUID());
  const args = { account: "acme", amount: 42 };
  const charge = tool({
    description: "Charge an account",
    inputSchema: z.object({ account: z.string(), amount: z.number() }),
    execute: httpExecute(proxy, "/tools/charge", plan, { result: counted }),
  });
  const model = scripted("charge", args);
  const messages: ModelMessage[] = [{ role: "user", content: "charge acme 42" }];
  const [first] = (await run(model, { charge }, messages)) as Counted[];
  const [again] = (await run(model, { charge }, messages)) as Counted[]; // a retried request
  assert.deepEqual([first?.execution, first?.replayed], [1, false]);
  assert.deepEqual([again?.execution, again?.replayed], [1, true]);

  // The conversation goes on: its next response is a later step, a new call.
  const later: ModelMessage[] = [
    ...messages,
    { role: "assistant", content: "charged" },
    { role: "user", content: "charge acme 42 again" },
  ];
  const [next] = (await run(model, { charge }, later)) as Counted[];
  assert.equal(next?.replayed, false);
  const step = await responseStep(plan, "/tools/charge", { toolCallId: "x", messages: later });
  assert.equal(step.index, "2.tools-charge");
});

test("an AI SDK tool calling a long HTTP tool: the 202 is followed to its result", async () => {
  const proxy = new ToolProxy(BASE);
  const plan = PlanSession.create();
  const review = tool({
    description: "Review a document (long)",
    inputSchema: z.object({ account: z.string(), amount: z.number() }),
    execute: httpExecute(proxy, "/long/review?delay=1", plan, { respondAsync: true, tool: "review", result: counted }),
  });
  const messages: ModelMessage[] = [{ role: "user", content: "review" }];
  const model = scripted("review", { account: "acme", amount: 1 });
  const [first] = (await run(model, { review }, messages)) as Counted[];
  const [again] = (await run(model, { review }, messages)) as Counted[];
  assert.ok(first?.operation, "answered 202, followed");
  assert.equal(first?.execution, 1);
  assert.deepEqual([again?.execution, again?.replayed], [1, true]);
});

test("an AI SDK tool calling an MCP tool through the proxy: once per step", async () => {
  const client = new Client({ name: "tool-proxy-client-test", version: "0.1.0" });
  await client.connect(new StreamableHTTPClientTransport(new URL(`${BASE}/mcp`)));
  const plan = PlanSession.create();
  const account = `acct-${globalThis.crypto.randomUUID().slice(0, 8)}`;
  const text = (result: unknown): string => (result as { content: { text: string }[] }).content[0]?.text ?? "";
  const charge = tool({
    description: "Charge an account",
    inputSchema: z.object({ account: z.string(), cents: z.number() }),
    execute: mcpExecute(client, "charge", plan, { result: text }),
  });
  const model = scripted("charge", { account, cents: 250 });
  const messages: ModelMessage[] = [{ role: "user", content: "charge" }];
  const first = await run(model, { charge }, messages);
  const again = await run(model, { charge }, messages);
  assert.deepEqual(first, [`charged 250 to ${account} (#1)`]);
  assert.deepEqual(again, first);
  await client.close();
});
