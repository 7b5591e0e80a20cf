// The MCP helper with the official TypeScript SDK's Client, through the real proxy started
// by tests/test_client_typescript.py (route /mcp) to a FastMCP server (its `charge` tool).
import assert from "node:assert/strict";
import { test } from "node:test";

import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";

import { ArgsHashMismatch, PlanSession, callTool, metaFor } from "../src/index.js";

const BASE = process.env.TOOL_PROXY_URL ?? "";

async function connected(): Promise<Client> {
  const client = new Client({ name: "tool-proxy-client-test", version: "0.1.0" });
  await client.connect(new StreamableHTTPClientTransport(new URL(`${BASE}/mcp`)));
  return client;
}

function text(result: unknown): string {
  return (result as { content: { text: string }[] }).content[0]?.text ?? "";
}

test("a tools/call of a step runs once, from any session", async () => {
  assert.ok(BASE, "TOOL_PROXY_URL is not set: run through tests/test_client_typescript.py");
  const step = PlanSession.create().step(1);
  const account = `acct-${globalThis.crypto.randomUUID().slice(0, 8)}`;
  const args = { account, cents: 250 };
  const first = await connected();
  const one = await callTool(first, step, "charge", args);
  await first.close();
  const second = await connected();
  const two = await callTool(second, step, "charge", args);
  const replanned = await callTool(second, step, "charge", { ...args, cents: 1 });
  assert.equal(text(one), `charged 250 to ${account} (#1)`);
  assert.equal(text(two), text(one));
  assert.equal(text(replanned), `charged 1 to ${account} (#2)`);
  assert.deepEqual(await metaFor(step, args), { idempotencyKey: await step.key(args) });
  await assert.rejects(
    callTool(second, step, "charge", args, { key: await step.key({ other: 1 }) }),
    (error: unknown) => error instanceof ArgsHashMismatch && error.record?.target === "charge",
  );
  await second.close();
});
