// Real-client driver for tests/test_trust_real_clients.py: CopilotKitCore 1.75 (and a plain
// AG-UI HttpAgent) carrying a bearer token.
//
//   node drive_trust.mjs <runtimeUrl> <options-json>
//
// options: {token?, threadId, text?, connectOnly?}. Prints ONE JSON line: what the client
// saw (connection status, agent messages, errors it reported, HTTP statuses of its fetches).
const writeStdout = process.stdout.write.bind(process.stdout);
for (const level of ["log", "info", "warn", "debug"]) console[level] = (...args) => console.error(...args);
globalThis.window ??= {};

const [runtimeUrl, optionsArg] = process.argv.slice(2);
const options = JSON.parse(optionsArg ?? "{}");
const statuses = [];
const nativeFetch = globalThis.fetch;
globalThis.fetch = async (input, init = {}) => {
  const url = typeof input === "string" ? input : input instanceof URL ? input.href : input.url;
  const response = await nativeFetch(input, init);
  statuses.push({ url: url.slice(runtimeUrl.length) || "/", status: response.status });
  return response;
};

const { CopilotKitCore } = await import("@copilotkit/core");
const { HttpAgent } = await import("agui-client-1");
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
const clone = (value) => (value === undefined ? null : JSON.parse(JSON.stringify(value)));

async function main() {
  const headers = options.token ? { Authorization: `Bearer ${options.token}` } : {};
  const errors = [];
  const core = new CopilotKitCore({ runtimeUrl, runtimeTransport: "rest", headers });
  core.subscribe({ onError: ({ code, error }) => errors.push({ code, message: String(error?.message ?? error) }) });
  const deadline = Date.now() + 8000;
  while (!["connected", "error"].includes(core.runtimeConnectionStatus) && Date.now() < deadline) await sleep(10);
  const out = { status: core.runtimeConnectionStatus, errors, statuses };
  if (core.runtimeConnectionStatus !== "connected") return out;
  const agent = core.getAgent("default");
  agent.threadId = options.threadId;
  if (options.connectOnly) {
    try {
      await core.connectAgent({ agent });
    } catch (error) {
      out.connectError = String(error?.message ?? error);
    }
    out.messages = clone(agent.messages);
    return out;
  }
  agent.setMessages([]);
  agent.addMessage({ id: `user-${crypto.randomUUID()}`, role: "user", content: options.text ?? "Hello" });
  try {
    await core.runAgent({ agent });
  } catch (error) {
    out.runError = String(error?.message ?? error);
  }
  out.messages = clone(agent.messages);
  // The same thread through a plain AG-UI HttpAgent with the same token.
  const plain = new HttpAgent({ url: `${runtimeUrl}/agent/default/run`, threadId: options.threadId, headers });
  plain.addMessage({ id: `user-${crypto.randomUUID()}`, role: "user", content: "And again" });
  try {
    await plain.runAgent({});
  } catch (error) {
    out.httpAgentError = String(error?.message ?? error);
  }
  out.httpAgentMessages = clone(plain.messages);
  return out;
}

const timer = setTimeout(() => {
  writeStdout(`${JSON.stringify({ error: "driver timed out", statuses })}\n`, () => process.exit(2));
}, 20000);
try {
  const result = await main();
  clearTimeout(timer);
  writeStdout(`${JSON.stringify(result)}\n`, () => process.exit(0));
} catch (error) {
  clearTimeout(timer);
  writeStdout(`${JSON.stringify({ error: String(error?.stack ?? error), statuses })}\n`, () => process.exit(1));
}
