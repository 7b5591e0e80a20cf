/**
 * HTTP calls through tool-proxy on `fetch`: the step's key, 409 (and the other "nothing
 * ran, try later" answers) waited out within bounds, a 202 operation followed to its
 * result (SSE with Last-Event-ID, or polling), problems thrown as their classes.
 */

import {
  OperationCancelled,
  OperationDead,
  type ProblemDocument,
  type ProxyProblem,
  RecordIdentity,
  StillRunning,
  TransportError,
  isProxyProblem,
  problemError,
} from "./errors.js";
import { argsHash, keyOf, sha256 } from "./keys.js";
import type { Step } from "./session.js";

export const OPERATIONS_PATH = "/_proxy/operations/";
const TERMINAL = new Set(["completed", "failed", "cancelled", "dead"]);

/** Problem types a call waits out and sends again with the same key: nothing ran. */
export const DEFAULT_RETRIED: ReadonlySet<string> = new Set([
  "request-in-progress", "resource-locked", "rate-limited", "upstream-unreachable", "lease-lost",
  "not-executed", "store-unavailable", "limits-unavailable", "locks-unavailable",
  "identity-provider-unavailable",
]);

/** How long a call waits out the proxy's "not now" answers (seconds, as Retry-After). */
export type Waits = {
  /** Seconds a call may spend waiting, in all (default 60). */
  total?: number;
  /** One wait at most this long (default 30). */
  cap?: number;
  /** Without Retry-After: base * 2^attempt, half random (default 0.25). */
  base?: number;
  retried?: ReadonlySet<string>;
  /** Send again, with the same key, after a network error (default true). */
  transport?: boolean;
};

export type StatusDocument = { id?: string; state?: string; error?: ProblemDocument; [name: string]: unknown };

export type ToolProxyOptions = {
  fetch?: typeof fetch;
  /** Headers of every request (e.g. Authorization). */
  headers?: Record<string, string>;
  waits?: Waits;
  follow?: "sse" | "poll";
  followTimeoutMs?: number;
};

export type CallOptions = {
  method?: string;
  headers?: Record<string, string>;
  /** A raw body instead of JSON arguments (keyed as the proxy hashes it). */
  body?: string | Uint8Array;
  key?: string;
  /** Ask for a 202 (Prefer: respond-async); a number: `wait=N` seconds. */
  respondAsync?: boolean | number;
  onStatus?: (status: StatusDocument) => void;
};

/** The tool's answer (first or replayed). */
export class Answer {
  constructor(
    readonly status: number,
    readonly headers: Headers,
    readonly body: Uint8Array,
    readonly key: string | undefined,
    readonly operation?: string,
  ) {}

  /** True if the proxy replayed a recorded answer (an operation's result always is). */
  get replayed(): boolean {
    return this.headers.get("idempotent-replayed")?.toLowerCase() === "true";
  }

  text(): string {
    return new TextDecoder().decode(this.body);
  }

  json(): unknown {
    return JSON.parse(this.text());
  }
}

/** A long call the proxy answered 202. */
export class Operation {
  constructor(
    readonly id: string,
    readonly location: string,
    readonly key: string | undefined,
    readonly record: RecordIdentity | undefined,
    readonly document: StatusDocument,
  ) {}

  get state(): string {
    return String(this.document.state ?? "");
  }
}

type Prepared = { method: string; url: string; headers: Record<string, string>; body?: Uint8Array; key?: string };

export class ToolProxy {
  readonly baseUrl: string;
  private readonly fetch: typeof fetch;
  private readonly waits: Required<Waits>;

  constructor(baseUrl: string, private readonly options: ToolProxyOptions = {}) {
    this.baseUrl = baseUrl.replace(/\/+$/, "");
    this.fetch = options.fetch ?? globalThis.fetch.bind(globalThis);
    this.waits = { total: 60, cap: 30, base: 0.25, retried: DEFAULT_RETRIED, transport: true, ...options.waits };
  }

  /** Call the tool at `path` as `step` of its plan; a 202 is followed to its result. */
  async call(step: Step | undefined, path: string, args?: unknown, options: CallOptions = {}): Promise<Answer> {
    const got = await this.send(await this.prepare(step, path, args, options));
    return got instanceof Operation ? this.follow(got, options.onStatus) : got;
  }

  /** Send a long call asking for 202: the Operation, or the answer if it ended within `wait`. */
  async submit(
    step: Step | undefined, path: string, args?: unknown, options: CallOptions & { wait?: number } = {},
  ): Promise<Answer | Operation> {
    const respondAsync = options.wait === undefined ? true : options.wait;
    return this.send(await this.prepare(step, path, args, { ...options, respondAsync }));
  }

  /** Wait for an operation to end: its answer, or the error of how it ended. */
  async follow(operation: Operation, onStatus?: (status: StatusDocument) => void): Promise<Answer> {
    const deadline = Date.now() + (this.options.followTimeoutMs ?? 3_600_000);
    if ((this.options.follow ?? "sse") === "sse") await this.stream(operation, deadline, onStatus);
    else await this.poll(operation, deadline, onStatus);
    return this.result(operation);
  }

  /** The operation's status document now. */
  async status(operation: Operation): Promise<StatusDocument> {
    const response = await this.request("GET", operation.location);
    return (await statusOf(response, operation)) ?? { ...operation.document, state: "completed" };
  }

  /** Cancel a queued operation (its key is released); a running one: OperationState. */
  async cancel(operation: Operation): Promise<StatusDocument> {
    const response = await this.request("DELETE", operation.location);
    return (await statusOf(response, operation)) ?? {};
  }

  private async prepare(step: Step | undefined, path: string, args: unknown, options: CallOptions): Promise<Prepared> {
    const headers: Record<string, string> = { ...this.options.headers };
    for (const [name, value] of Object.entries(options.headers ?? {})) headers[name.toLowerCase()] = value;
    let body: Uint8Array | undefined;
    if (args !== undefined) {
      body = new TextEncoder().encode(JSON.stringify(args));
      headers["content-type"] ??= "application/json";
    } else if (options.body !== undefined) {
      body = typeof options.body === "string" ? new TextEncoder().encode(options.body) : options.body;
    }
    let key = options.key;
    if (key === undefined && step !== undefined) {
      key = args !== undefined ? await step.key(args) : keyOf(step.plan.id, step.index, await bodyHash(body, headers["content-type"]));
    }
    if (key !== undefined) headers["idempotency-key"] = key;
    if (options.respondAsync !== undefined && options.respondAsync !== false) {
      headers["prefer"] = options.respondAsync === true ? "respond-async" : `respond-async, wait=${Math.trunc(options.respondAsync)}`;
    }
    return { method: (options.method ?? "POST").toUpperCase(), url: this.url(path), headers, body, key };
  }

  private async send(prepared: Prepared): Promise<Answer | Operation> {
    const started = Date.now();
    const record = prepared.key ? new RecordIdentity(prepared.key, prepared.method, prepared.url) : undefined;
    for (let attempt = 0; ; attempt++) {
      let delay: number | undefined;
      try {
        const init: RequestInit = { method: prepared.method, headers: prepared.headers, redirect: "manual" };
        if (prepared.body !== undefined) init.body = prepared.body as Uint8Array<ArrayBuffer>;
        const response = await this.fetch(prepared.url, init);
        const got = await read(response, prepared.key, record);
        if (!isProblem(got)) return got;
        delay = this.retrying(got, attempt, started);
        if (delay === undefined) throw got;
      } catch (error) {
        if (!isNetworkError(error)) throw error;
        delay = this.waits.transport ? this.budget(this.delay(attempt, undefined), started) : undefined;
        if (delay === undefined) throw new TransportError(`no answer from the proxy: ${error.message}`, { cause: error });
      }
      await sleep(delay);
    }
  }

  private retrying(problem: ProxyProblem, attempt: number, started: number): number | undefined {
    if (!this.waits.retried.has(problem.type.slice(problem.type.lastIndexOf(":") + 1))) return undefined;
    return this.budget(this.delay(attempt, problem.retryAfter), started);
  }

  private delay(attempt: number, retryAfter: number | undefined): number {
    if (retryAfter !== undefined) return Math.min(Math.max(retryAfter, 0), this.waits.cap);
    const backoff = Math.min(this.waits.base * 2 ** attempt, this.waits.cap);
    return backoff / 2 + Math.random() * (backoff / 2);
  }

  private budget(delay: number, started: number): number | undefined {
    return (Date.now() - started) / 1000 + delay <= this.waits.total ? delay : undefined;
  }

  private async poll(op: Operation, deadline: number, onStatus?: (s: StatusDocument) => void): Promise<void> {
    for (;;) {
      const response = await this.request("GET", op.location);
      const document = await statusOf(response, op);
      if (document === undefined || seen(op, document, onStatus)) return;
      if (Date.now() > deadline) throw new StillRunning(op.id);
      await sleep(Math.min(retryAfter(response) ?? 1, this.waits.cap));
    }
  }

  private async stream(op: Operation, deadline: number, onStatus?: (s: StatusDocument) => void): Promise<void> {
    const parser = new EventParser();
    for (;;) {
      if (Date.now() > deadline) throw new StillRunning(op.id);
      const headers: Record<string, string> = { accept: "text/event-stream" };
      if (parser.lastId !== undefined) headers["last-event-id"] = parser.lastId;
      let response: Response;
      try {
        response = await this.request("GET", op.location, headers);
      } catch (error) {
        if (!(error instanceof TransportError)) throw error;
        await sleep(this.delay(0, undefined));
        continue;
      }
      if (response.status !== 200 || !(response.headers.get("content-type") ?? "").includes("event-stream")) {
        const document = await statusOf(response, op);
        if (document === undefined || seen(op, document, onStatus)) return;
        await sleep(1);
        continue;
      }
      try {
        for await (const data of parser.events(response)) {
          if (seen(op, parseJson(data), onStatus)) return;
        }
      } catch (error) {
        if (error instanceof OperationCancelled || error instanceof OperationDead) throw error;
        await sleep(this.delay(0, undefined)); // the stream broke: reconnect with Last-Event-ID
      }
    }
  }

  private async result(op: Operation): Promise<Answer> {
    const response = await this.request("GET", `${op.location}/result`);
    const document = await problemOf(response);
    if (document !== undefined) throw problemError(document, { status: response.status, retryAfter: retryAfter(response, document), record: op.record });
    return new Answer(response.status, response.headers, new Uint8Array(await response.arrayBuffer()), op.key, op.id);
  }

  private async request(method: string, path: string, headers: Record<string, string> = {}): Promise<Response> {
    try {
      return await this.fetch(this.url(path), { method, headers: { ...this.options.headers, ...headers }, redirect: "manual" });
    } catch (error) {
      throw new TransportError(`no answer from the proxy: ${String(error)}`, { cause: error });
    }
  }

  private url(path: string): string {
    return path.includes("://") ? path : `${this.baseUrl}/${path.replace(/^\/+/, "")}`;
  }
}

/** SHA-256 (hex) of a raw body, hashed as the proxy hashes it. */
export async function bodyHash(body: Uint8Array | undefined, contentType: string | undefined): Promise<string> {
  if (body === undefined || body.length === 0) return sha256(new Uint8Array());
  const media = (contentType ?? "").split(";")[0]?.trim().toLowerCase() ?? "";
  const json = media === "application/json" || media.endsWith("+json");
  if (contentType && !json) return sha256(body);
  let value: unknown;
  try {
    value = JSON.parse(new TextDecoder("utf-8", { fatal: true }).decode(body));
  } catch {
    return sha256(body); // no Content-Type and not JSON: the bytes (a JSON type: the proxy refuses it)
  }
  return argsHash(value);
}

/** Server-sent events of a response, as `data` strings (the WHATWG rules, minus `retry`). */
export class EventParser {
  lastId: string | undefined;

  async *events(response: Response): AsyncGenerator<string> {
    if (response.body === null) return;
    const decoder = new TextDecoder();
    let buffer = "";
    let data: string[] = [];
    for await (const chunk of response.body as unknown as AsyncIterable<Uint8Array>) {
      buffer += decoder.decode(chunk, { stream: true });
      const lines = buffer.split(/\r\n|\r|\n/);
      buffer = lines.pop() ?? "";
      for (const line of lines) {
        if (line === "") {
          if (data.length > 0) yield data.join("\n");
          data = [];
        } else if (!line.startsWith(":")) {
          const colon = line.indexOf(":");
          const name = colon < 0 ? line : line.slice(0, colon);
          const value = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
          if (name === "data") data.push(value);
          else if (name === "id" && !value.includes("\u0000")) this.lastId = value;
        }
      }
    }
  }
}

async function read(response: Response, key: string | undefined, record: RecordIdentity | undefined): Promise<Answer | Operation | ProxyProblem> {
  const document = await problemOf(response);
  if (document !== undefined) return problemError(document, { status: response.status, retryAfter: retryAfter(response, document), record });
  const location = response.headers.get("location") ?? "";
  const body = new Uint8Array(await response.arrayBuffer());
  if (response.status === 202 && location.includes(OPERATIONS_PATH)) {
    const path = new URL(location, "http://proxy").pathname;
    const id = path.slice(path.lastIndexOf("/") + 1);
    const withOp = record ? new RecordIdentity(record.key, record.method, record.target, id) : undefined;
    return new Operation(id, path, key, withOp, parseJson(new TextDecoder().decode(body)));
  }
  return new Answer(response.status, response.headers, body, key);
}

/** fetch's network errors are TypeErrors; a timeout (AbortSignal.timeout) a TimeoutError. */
function isNetworkError(error: unknown): error is Error {
  return error instanceof TypeError || (error instanceof Error && error.name === "TimeoutError");
}

function isProblem(got: Answer | Operation | ProxyProblem): got is ProxyProblem {
  return !(got instanceof Answer) && !(got instanceof Operation);
}

async function problemOf(response: Response): Promise<ProblemDocument | undefined> {
  const media = (response.headers.get("content-type") ?? "").split(";")[0]?.trim().toLowerCase();
  if (media !== "application/problem+json") return undefined;
  const document = parseJson(await response.clone().text());
  return isProxyProblem(document) ? document : undefined;
}

async function statusOf(response: Response, op: Operation): Promise<StatusDocument | undefined> {
  if (response.status === 303) return undefined;
  const document = await problemOf(response);
  if (document !== undefined) throw problemError(document, { status: response.status, record: op.record });
  return parseJson(await response.text());
}

/** Report a status document; true once the operation ended with an answer to fetch. */
function seen(op: Operation, document: StatusDocument, onStatus?: (s: StatusDocument) => void): boolean {
  onStatus?.(document);
  const refusal = document.error?.detail ? ` (${document.error.detail})` : "";
  if (document.state === "cancelled") {
    throw new OperationCancelled({ ...document, type: "", detail: "the operation ended cancelled: never sent" }, { record: op.record });
  }
  if (document.state === "dead") {
    throw new OperationDead({ ...document, type: "", detail: `the operation ended dead: nothing ran${refusal}` }, { record: op.record });
  }
  return TERMINAL.has(String(document.state));
}

function retryAfter(response: Response, document?: ProblemDocument): number | undefined {
  if (typeof document?.retry_after === "number") return document.retry_after;
  const value = response.headers.get("retry-after");
  if (value === null) return undefined;
  const seconds = Number(value);
  if (!Number.isNaN(seconds)) return seconds;
  const date = Date.parse(value);
  return Number.isNaN(date) ? undefined : (date - Date.now()) / 1000;
}

function parseJson(text: string): StatusDocument {
  try {
    const value: unknown = JSON.parse(text);
    return typeof value === "object" && value !== null ? (value as StatusDocument) : {};
  } catch {
    return {};
  }
}

function sleep(seconds: number): Promise<void> {
  return new Promise((resolve) => setTimeout(resolve, seconds * 1000));
}
