// A scripted agent loop through tool-proxy, with no LLM (as examples/agent_loop.py): the
// plan's first attempt times out, the agent replans and runs the plan again, every step
// runs once.
//
//   node dist/examples/agent_loop.js http://127.0.0.1:8080 [long-call prefix]
//
// Against the demo tool (`tool-proxy demo`; tests/test_client_typescript.py also serves it
// under /demo, and under /demolong as an async route).
import { PlanSession, ToolProxy, TransportError } from "../src/index.js";

const CHARGE = { account: "acme", amount: 42, delay: 1.5 };

/** One attempt of the plan: step 1 charges; an impatient worker gives up after `patienceMs`. */
async function attempt(url: string, prefix: string, plan: PlanSession, patienceMs: number) {
  const impatient: typeof fetch = (input, init) => fetch(input, { ...init, signal: AbortSignal.timeout(patienceMs) });
  const proxy = new ToolProxy(url, { fetch: impatient, waits: { transport: false } });
  return proxy.call(plan.step(1), `${prefix}/tools/charge`, CHARGE);
}

export async function main(url: string, prefix = "", longPrefix = "/long"): Promise<string[]> {
  const plan = PlanSession.create(); // the orchestrator keeps plan.id with the plan
  const lines: string[] = [];
  try {
    await attempt(url, prefix, plan, 300);
  } catch (error) {
    if (!(error instanceof TransportError)) throw error;
    lines.push("attempt 1, step 1: timed out (the charge goes on)");
  }
  const answer = await attempt(url, prefix, plan, 30_000); // the replan: same step, same key
  lines.push(`attempt 2, step 1: ${answer.status}, replayed=${answer.replayed} (409 waited out)`);
  const again = await attempt(url, prefix, plan, 30_000);
  lines.push(`attempt 3, step 1: ${again.status}, replayed=${again.replayed}`);
  const proxy = new ToolProxy(url);
  const states: string[] = [];
  const long = await proxy.call(plan.step(2), `${longPrefix}/tools/charge`, { account: "acme", amount: 7, delay: 1 }, {
    respondAsync: true,
    onStatus: (status) => states.push(String(status.state)),
  });
  lines.push(`step 2 (long call): ${long.status}, its operation ended ${states.at(-1)}`);
  const count = (await (await fetch(`${url}${prefix}/tools/charge/executions`)).json()) as { executions: number };
  lines.push(`the tool ran ${count.executions} charges`);
  return lines;
}

if (process.argv[1]?.endsWith("agent_loop.js") && process.argv[2]) {
  for (const line of await main(process.argv[2], process.argv[3] ?? "", process.argv[4] ?? "/long")) console.log(line);
}
