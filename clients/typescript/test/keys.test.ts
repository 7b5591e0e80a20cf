import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { test } from "node:test";

import { InvalidKey, PlanSession, argsHash, bodyHash, canonicalJson, compositeKey } from "../src/index.js";

type Vectors = {
  vectors: { plan: string; step: number | string; arguments: unknown; canonical: string; args_hash: string; key: string }[];
  bodies: { body: string; content_type: string | null; args_hash: string }[];
};

// dist/test/keys.test.js -> clients/test-vectors/keys.json
const vectors = JSON.parse(readFileSync(new URL("../../../test-vectors/keys.json", import.meta.url), "utf-8")) as Vectors;

test("the shared key vectors", async () => {
  assert.ok(vectors.vectors.length > 10);
  for (const v of vectors.vectors) {
    assert.equal(canonicalJson(v.arguments), v.canonical);
    assert.equal(await argsHash(v.arguments), v.args_hash);
    assert.equal(await compositeKey(v.plan, v.step, v.arguments), v.key);
    assert.equal(await new PlanSession(v.plan).step(v.step).key(v.arguments), v.key);
  }
});

test("the shared body vectors", async () => {
  for (const b of vectors.bodies) {
    const bytes = new TextEncoder().encode(b.body);
    assert.equal(await bodyHash(bytes, b.content_type ?? undefined), b.args_hash, b.body);
  }
});

test("what the proxy refuses to hash is refused", () => {
  for (const value of [1e20, 2 ** 53, Number.NaN, "\ud800"]) {
    assert.throws(() => canonicalJson(value), InvalidKey, String(value));
  }
  assert.equal(canonicalJson(1e21), "1e+21");
  assert.equal(canonicalJson({ b: undefined, a: new Date(0) }), '{"a":"1970-01-01T00:00:00.000Z"}');
});

test("plan sessions and steps", async () => {
  assert.equal((await PlanSession.derive("thread-42")).id, (await PlanSession.derive("thread-42")).id);
  assert.notEqual(PlanSession.create().id, PlanSession.create().id);
  const step = new PlanSession("plan-1").step(3);
  assert.equal(await step.key({ a: 1 }), await step.key({ a: 1 }));
  assert.notEqual(await step.key({ a: 1 }), await step.key({ a: 2 }));
  assert.ok((await step.sub(2).key({})).startsWith("plan-1:3.2:"));
  assert.deepEqual(await step.meta({ a: 1 }), { idempotencyKey: await step.key({ a: 1 }) });
  assert.throws(() => new PlanSession("thread 42"), InvalidKey);
  assert.throws(() => new PlanSession("p").step("call_abc:1"), InvalidKey);
});
