// Runs against a real tool-proxy in front of tests/servers.py's CountingTool, started by
// tests/test_client_typescript.py, which passes its URL in TOOL_PROXY_URL. Routes:
// /tools (guarded), /short (timeout 300ms), /long and /long1 (async), /mcp (an MCP server),
// /demo and /demolong (the demo tool, plain and async).
import assert from "node:assert/strict";
import { test } from "node:test";

import {
  ArgsHashMismatch, Operation, OperationCancelled, OperationState, OutcomeUnknown, PlanSession,
  RequestInProgress, RouteNotFound, ToolProxy, TransportError,
} from "../src/index.js";

const URL_ = process.env.TOOL_PROXY_URL;
if (!URL_) throw new Error("TOOL_PROXY_URL is not set: run these tests through tests/test_client_typescript.py");
const BASE: string = URL_;
const ARGS = { account: "acme", amount: 42 };
type Counted = { execution: number };

test("a step runs once and its retry is a replay", async () => {
  const proxy = new ToolProxy(BASE);
  const step = PlanSession.create().step(3);
  const first = await proxy.call(step, "/tools/charge", ARGS);
  const again = await proxy.call(step, "/tools/charge", { amount: 42, account: "acme" });
  const replanned = await proxy.call(step, "/tools/charge", { ...ARGS, amount: 43 });
  assert.equal(first.status, 200);
  assert.equal(first.replayed, false);
  assert.equal(again.replayed, true);
  assert.equal(again.text(), first.text());
  assert.equal((first.json() as Counted).execution, 1);
  assert.equal(first.key, await step.key(ARGS));
  assert.equal(replanned.replayed, false);
});

test("a raw body is keyed as the proxy hashes it", async () => {
  const proxy = new ToolProxy(BASE);
  const step = PlanSession.create().step(1);
  const headers = { "Content-Type": "application/json" };
  const first = await proxy.call(step, "/tools/raw", undefined, { body: '{ "b": 2, "a": 1 }', headers });
  const again = await proxy.call(step, "/tools/raw", undefined, { body: '{"a":1,"b":2}', headers });
  assert.equal(first.replayed, false);
  assert.equal(again.replayed, true);
});

test("a 409 is waited out, and the wait is bounded", async () => {
  const proxy = new ToolProxy(BASE);
  const hasty = new ToolProxy(BASE, { waits: { total: 0.5 } });
  const step = PlanSession.create().step(1);
  const first = proxy.call(step, "/tools/slow?delay=1.5", ARGS);
  await new Promise((resolve) => setTimeout(resolve, 300));
  await assert.rejects(hasty.call(step, "/tools/slow?delay=1.5", ARGS), (error: unknown) => {
    assert.ok(error instanceof RequestInProgress);
    assert.equal(error.status, 409);
    assert.equal(error.retryAfter, 1);
    return true;
  });
  const waited = await proxy.call(step, "/tools/slow?delay=1.5", ARGS);
  assert.equal(waited.replayed, true);
  assert.equal(waited.text(), (await first).text());
});

test("outcome unknown names the record; other problems are their own errors", async () => {
  const proxy = new ToolProxy(BASE);
  const step = PlanSession.create().step(7);
  await assert.rejects(proxy.call(step, "/short/charge?delay=1", ARGS), (error: unknown) => {
    assert.ok(error instanceof OutcomeUnknown);
    assert.equal(error.status, 504);
    assert.equal(error.record?.plan, step.plan.id);
    assert.equal(error.record?.step, "7");
    assert.equal(error.record?.method, "POST");
    return true;
  });
  await assert.rejects(proxy.call(step, "/tools/a", ARGS, { key: await step.key({ other: 1 }) }), ArgsHashMismatch);
  await assert.rejects(proxy.call(step, "/elsewhere", ARGS), RouteNotFound);
  const tools = await proxy.call(step, "/tools/a?status=502", ARGS);
  assert.equal(tools.status, 502); // the tool's own error is its answer
});

test("no proxy is a transport error once the wait is spent", async () => {
  const proxy = new ToolProxy("http://127.0.0.1:9", { waits: { total: 0.5 } });
  await assert.rejects(proxy.call(PlanSession.create().step(1), "/tools/a", ARGS), TransportError);
});

for (const follow of ["sse", "poll"] as const) {
  test(`a long call is followed to its result (${follow})`, async () => {
    const proxy = new ToolProxy(BASE, { follow });
    const step = PlanSession.create().step(2);
    const states: string[] = [];
    const answer = await proxy.call(step, "/long/review?delay=1", ARGS, {
      respondAsync: true,
      onStatus: (status) => states.push(String(status.state)),
    });
    assert.ok(answer.operation);
    assert.equal((answer.json() as Counted).execution, 1);
    const again = await proxy.call(step, "/long/review?delay=1", ARGS, { respondAsync: true });
    assert.equal(again.replayed, true);
    assert.equal(again.text(), answer.text());
    if (follow === "sse") assert.equal(states.at(-1), "completed");
  });
}

test("a queued operation is cancelled, a running one is not", async () => {
  const proxy = new ToolProxy(BASE);
  const plan = PlanSession.create();
  const running = await proxy.submit(plan.step(1), "/long1/review?delay=1", ARGS);
  assert.ok(running instanceof Operation);
  while ((await proxy.status(running)).state !== "running") await new Promise((r) => setTimeout(r, 50));
  const queued = await proxy.submit(plan.step(2), "/long1/review", ARGS);
  assert.ok(queued instanceof Operation);
  assert.equal((await proxy.cancel(queued)).state, "cancelled");
  await assert.rejects(proxy.cancel(running), OperationState);
  await assert.rejects(proxy.follow(queued), OperationCancelled);
  assert.equal(((await proxy.follow(running)).json() as Counted).execution, 1);
});
