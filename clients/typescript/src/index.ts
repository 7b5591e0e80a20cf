/** tool-proxy-client: the agent's side of tool-proxy, for TypeScript and JavaScript. */

export * from "./errors.js";
export { MAX_KEY_LENGTH, argsHash, canonicalJson, compositeKey, isKeyPart, keyOf, sha256 } from "./keys.js";
export { PlanSession, Step } from "./session.js";
export {
  Answer, type CallOptions, DEFAULT_RETRIED, EventParser, Operation, type StatusDocument, ToolProxy,
  type ToolProxyOptions, type Waits, bodyHash,
} from "./client.js";
export { CODES, type CallsTools, KEY_META, OTHER_CODE, callTool, metaFor, problemOfError } from "./mcp.js";
export {
  type Execute, type Steps, type ToolExecutionOptions, answerValue, httpExecute, mcpExecute, responseStep,
} from "./ai-sdk.js";
