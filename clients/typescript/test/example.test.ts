// examples/agent_loop.ts against the demo tool behind the proxy of tests/test_client_typescript.py.
import assert from "node:assert/strict";
import { test } from "node:test";

import { main } from "../examples/agent_loop.js";

test("the agent loop example", async () => {
  const base = process.env.TOOL_PROXY_URL;
  assert.ok(base, "TOOL_PROXY_URL is not set: run through tests/test_client_typescript.py");
  assert.deepEqual(await main(base, "/demo", "/demolong"), [
    "attempt 1, step 1: timed out (the charge goes on)",
    "attempt 2, step 1: 201, replayed=true (409 waited out)",
    "attempt 3, step 1: 201, replayed=true",
    "step 2 (long call): 201, its operation ended completed",
    "the tool ran 2 charges",
  ]);
});
