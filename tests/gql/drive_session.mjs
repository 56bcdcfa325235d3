// One agent-session request through the real client, @copilotkit/runtime-client-gql 1.10.6,
// and prints one JSON object: every result the client yielded, as react-core 1.10's useChat
// reads it (the text messages, and the agent-state message it takes the agent's state from:
// the last one of each agent, `filterAdjacentAgentStateMessages`), the errors it reported,
// and the raw body as it came over the wire (read from a copy of the stream, so the client
// reads the original untouched).
//
//   node drive_session.mjs <runtime url> <agent name> [thread id]
//
// Loaded through require() for the reason drive.mjs gives.
import { createRequire } from "node:module";

const require = createRequire(import.meta.url);
const gql = require("@copilotkit/runtime-client-gql");

const [url, agent, threadId = "session-thread"] = process.argv.slice(2);
const started = Date.now();
const chunks = [];
let copied = Promise.resolve();

const realFetch = globalThis.fetch;
globalThis.fetch = async (...args) => {
  const response = await realFetch(...args);
  if (!response.body) return response;
  const [forClient, forUs] = response.body.tee();
  copied = (async () => {
    const decoder = new TextDecoder();
    for await (const chunk of forUs) {
      chunks.push({ at: Date.now() - started, text: decoder.decode(chunk, { stream: true }) });
    }
  })();
  return new Response(forClient, { status: response.status, headers: response.headers });
};

const errors = [];
const client = new gql.CopilotRuntimeClient({
  url,
  handleGQLErrors: (error) => errors.push(String(error?.message ?? error)),
  handleGQLWarning: () => {},
});
const system = new gql.TextMessage({ id: "system", createdAt: new Date(0), role: gql.Role.System,
  content: "Be brief." });
const user = new gql.TextMessage({ id: "user-1", createdAt: new Date(0), role: gql.Role.User,
  content: "Take your time." });
const data = {
  frontend: { actions: [], url: "http://localhost:3000/" },
  threadId,
  runId: null,
  extensions: {},
  metaEvents: [],
  messages: gql.convertMessagesToGqlInput([system, user]),
  metadata: { requestType: gql.CopilotRequestType.Chat },
  agentSession: { agentName: agent },
  agentStates: [],
  forwardedParameters: {},
  context: [],
};

const results = [];
try {
  const reader = client.asStream(client.generateCopilotResponse({ data })).getReader();
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    const response = value.generateCopilotResponse;
    const messages = gql.convertGqlOutputToMessages(
      gql.filterAdjacentAgentStateMessages(response.messages ?? []));
    results.push({
      at: Date.now() - started,
      status: response.status ?? null,
      messages: messages.filter((m) => m.isTextMessage())
        .map((m) => ({ role: m.role, content: m.content, status: m.status?.code ?? null })),
      agentStates: messages.filter((m) => m.isAgentStateMessage()).map((m) => ({
        id: m.id, agentName: m.agentName, nodeName: m.nodeName, active: m.active,
        running: m.running, runId: m.runId, threadId: m.threadId, state: m.state })),
    });
  }
} catch (error) {
  errors.push(String(error?.message ?? error));
}
await copied;
console.log(JSON.stringify({ results, errors, chunks }));
