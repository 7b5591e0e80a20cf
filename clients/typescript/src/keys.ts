/**
 * Idempotency keys: `<plan_session_id>:<step_index>:<args_hash>`, as tool-proxy computes
 * them. `args_hash` is the SHA-256 (hex) of the RFC 8785 (JCS) form of the arguments;
 * clients/test-vectors/keys.json holds the digests every implementation checks.
 */

import { InvalidKey } from "./errors.js";

const PART = /^[A-Za-z0-9._-]{1,128}$/;
export const MAX_KEY_LENGTH = 255;

/** True if `value` may be a plan_session_id or a step_index. */
export function isKeyPart(value: string): boolean {
  return PART.test(value);
}

/** The RFC 8785 (JCS) text of a JSON-compatible value (as JSON.stringify would send it). */
export function canonicalJson(value: unknown): string {
  const text = JSON.stringify(value, finite);
  if (text === undefined) throw new InvalidKey(`not a JSON value: ${typeof value}`);
  return jcs(JSON.parse(text));
}

function finite(_name: string, value: unknown): unknown {
  if (typeof value === "number" && !Number.isFinite(value)) {
    throw new InvalidKey(`RFC 8785 has no form for ${value} (JSON.stringify would send null)`);
  }
  return value;
}

function jcs(value: unknown): string {
  if (value === null || typeof value === "boolean") return JSON.stringify(value);
  if (typeof value === "number") return number(value);
  if (typeof value === "string") return string(value);
  if (Array.isArray(value)) return `[${value.map(jcs).join(",")}]`;
  const object = value as Record<string, unknown>;
  const names = Object.keys(object).sort(); // UTF-16 code units, as RFC 8785 sorts
  return `{${names.map((name) => `${string(name)}:${jcs(object[name])}`).join(",")}}`;
}

function number(value: number): string {
  const text = JSON.stringify(value); // ECMAScript's Number::toString: RFC 8785's form
  // An integer past 2^53 written without an exponent (1e20 is "100000000000000000000") is
  // read by the proxy as an integer RFC 8785 has no form for: it refuses the body (400).
  if (Math.abs(value) > Number.MAX_SAFE_INTEGER && !text.includes("e")) {
    throw new InvalidKey(`the proxy refuses the number ${text}: an integer beyond 2^53`);
  }
  return text;
}

function string(value: string): string {
  if (!(value as string & { isWellFormed(): boolean }).isWellFormed()) {
    throw new InvalidKey("a string holds a lone surrogate: not I-JSON");
  }
  return JSON.stringify(value);
}

/** SHA-256 (hex) of the canonical form of `arguments`. */
export async function argsHash(args: unknown): Promise<string> {
  return sha256(new TextEncoder().encode(canonicalJson(args)));
}

/** SHA-256 (hex) of bytes (Web Crypto: Node 20+, browsers, Deno, Bun). */
export async function sha256(bytes: Uint8Array): Promise<string> {
  const digest = await globalThis.crypto.subtle.digest("SHA-256", bytes as Uint8Array<ArrayBuffer>);
  return Array.from(new Uint8Array(digest), (b) => b.toString(16).padStart(2, "0")).join("");
}

/** The key for `arguments` at `step` of plan `plan`. */
export async function compositeKey(plan: string, step: number | string, args: unknown): Promise<string> {
  return keyOf(plan, step, await argsHash(args));
}

/** `plan:step:digest`, checked as the proxy checks it. */
export function keyOf(plan: string, step: number | string, digest: string): string {
  const key = `${plan}:${step}:${digest}`;
  if (!isKeyPart(plan) || !isKeyPart(String(step)) || key.length > MAX_KEY_LENGTH) {
    throw new InvalidKey(
      "plan_session_id and step_index must be 1..128 characters of [A-Za-z0-9._-], the key at most 255",
    );
  }
  return key;
}
