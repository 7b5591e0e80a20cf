// The official TypeScript MCP client 2.x (@modelcontextprotocol/client) with the Tasks
// extension's requester (@modelcontextprotocol/ext-tasks), run by
// tests/test_mcp_tasks_2026.py with node. It reads a plan as JSON on stdin and prints
// what happened as JSON:
//
//     {"url": "...", "tasksUrl": "...", "sessions": [[{"tool": "hold", "arguments": {...},
//       "key": "...", "preference": "require"}]]}
//
// Each session is a new Client (negotiated: server/discover, revision 2026-07-28) and a
// task session on it (createTaskSessionFromClient). The extension's wire shapes at
// 2026-07-28 go through rawDispatch (the package requires it: the SDK's codecs do not
// know them): a JSON-RPC POST of our own, to `url`, or, for tasks/*, to `tasksUrl` (another
// replica) when given, with the headers the SDK's transport would send. Each call sends its key in params._meta.idempotencyKey.
// Printed: per session, the negotiated revision, whether the server offered the extension,
// and per call: its kind ("task" or "immediate"), the task id, the milliseconds to the
// tools/call answer, the methods sent, and its result (or its error).
import { Client, StreamableHTTPClientTransport } from "@modelcontextprotocol/client";
import {
  createTaskSessionFromClient,
  resultFromTaskOutcome,
} from "@modelcontextprotocol/ext-tasks/client";

const REVISION = "2026-07-28";
const clientInfo = { name: "tool-proxy-tests", version: "1.0.0" };

async function readStdin() {
  const chunks = [];
  for await (const chunk of process.stdin) chunks.push(chunk);
  return JSON.parse(Buffer.concat(chunks).toString("utf8"));
}

function rawDispatcher(plan, sent) {
  let next = 1;
  return async (request, options = {}) => {
    const id = `raw-${next++}`;
    const target = request.method.startsWith("tasks/") && plan.tasksUrl ? plan.tasksUrl : plan.url;
    sent.push({ method: request.method, to: target === plan.url ? "url" : "tasksUrl" });
    const response = await fetch(target, {
      method: "POST",
      headers: {
        "content-type": "application/json",
        accept: "application/json, text/event-stream",
        "mcp-protocol-version": REVISION,
        "mcp-method": request.method,
        // The routing header a 2026-07-28 server requires of a tools/call (ASCII names here;
        // the ext-tasks package sets it to the task id for tasks/*, in the context's headers).
        ...(request.method === "tools/call" ? { "mcp-name": request.params.name } : {}),
        ...(options.context?.headers ?? {}),
      },
      body: JSON.stringify({ jsonrpc: "2.0", id, ...request }),
      signal: options.signal,
    });
    const text = await response.text();
    const type = response.headers.get("content-type") ?? "";
    let answer;
    if (type.startsWith("text/event-stream")) {
      for (const event of text.split(/\r?\n\r?\n/)) {
        const data = event
          .split(/\r?\n/)
          .filter((line) => line.startsWith("data:"))
          .map((line) => line.slice(5).trimStart())
          .join("\n");
        if (!data) continue;
        const message = JSON.parse(data);
        if (message.id === id) answer = message;
      }
    } else if (text) {
      answer = JSON.parse(text);
    }
    if (answer === undefined) throw new Error(`no answer to ${request.method}: HTTP ${response.status} ${text.slice(0, 300)}`);
    if (answer.error !== undefined) return { kind: "error", error: answer.error };
    return { kind: "result", result: answer.result };
  };
}

async function runCall(session, call, sent) {
  const started = performance.now();
  const from = sent.length;
  try {
    const execution = await session.callTool(call.tool, call.arguments, {
      metadata: call.key === undefined ? undefined : { idempotencyKey: call.key },
      task: { preference: call.preference ?? "allow" },
    });
    const answeredMs = performance.now() - started;
    const { outcome } = await execution.settle();
    return {
      kind: execution.kind,
      taskId: execution.handle?.taskId,
      answeredMs,
      settledMs: performance.now() - started,
      sent: sent.slice(from),
      result: resultFromTaskOutcome(outcome),
    };
  } catch (error) {
    return {
      error: { message: String(error?.message ?? error), code: error?.error?.code ?? error?.code },
      sent: sent.slice(from),
    };
  }
}

async function runSession(plan, calls) {
  const client = new Client(clientInfo, {
    capabilities: {},
    versionNegotiation: { mode: { pin: REVISION } },
  });
  await client.connect(new StreamableHTTPClientTransport(new URL(plan.url)));
  const negotiated = { protocol_version: client.getNegotiatedProtocolVersion(), era: client.getProtocolEra() };
  const sent = [];
  const extensions = client.getServerCapabilities()?.extensions ?? {};
  const session = createTaskSessionFromClient(client, {
    endpointId: plan.url,
    rawDispatch: rawDispatcher(plan, sent),
    v2RequestFraming: { protocolVersion: REVISION, clientInfo, clientCapabilities: {} },
  });
  const results = [];
  try {
    for (const call of calls) results.push(await runCall(session, call, sent));
  } finally {
    await session.close();
    await client.close();
  }
  return {
    ...negotiated,
    offered: "io.modelcontextprotocol/tasks" in extensions,
    results,
  };
}

const plan = await readStdin();
const answers = [];
for (const calls of plan.sessions) answers.push(await runSession(plan, calls));
process.stdout.write(JSON.stringify(answers));
