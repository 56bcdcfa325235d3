// Drives copilot-runtime's GraphQL protocol with the real @copilotkit/runtime-client-gql 1.10.6
// carrying a bearer token (tests/test_trust_real_clients.py).
//
//   node drive_trust.mjs <runtimeUrl> <options-json>
//
// options: {token?, threadId, text, agentName?, publicApiKey?, rules?}. Prints ONE JSON line:
// the merged generateCopilotResponse result, loadAgentState, and the errors the client reported.
import { createRequire } from "node:module";

const require = createRequire(import.meta.url);
const gql = require("@copilotkit/runtime-client-gql");

const [url, optionsArg] = process.argv.slice(2);
const options = JSON.parse(optionsArg ?? "{}");
const CREATED = new Date("2025-01-01T00:00:00.000Z");

async function main() {
  const headers = {};
  if (options.token) headers.Authorization = `Bearer ${options.token}`;
  if (options.publicApiKey) headers["X-CopilotCloud-Public-API-Key"] = options.publicApiKey;
  const errors = [];
  const client = new gql.CopilotRuntimeClient({
    url, headers,
    handleGQLErrors: (error) => errors.push({
      message: String(error?.message ?? error),
      codes: (error?.graphQLErrors ?? []).map((e) => e?.extensions?.code ?? null),
    }),
    handleGQLWarning: () => {},
  });
  const message = new gql.TextMessage({ id: `msg-${crypto.randomUUID()}`, createdAt: CREATED,
                                        role: gql.Role.User, content: options.text ?? "Hello" });
  const data = {
    frontend: { actions: [], url: "http://localhost:3000/" },
    threadId: options.threadId,
    messages: gql.convertMessagesToGqlInput([message]),
    metadata: { requestType: gql.CopilotRequestType.Chat },
    forwardedParameters: {}, context: [], metaEvents: [], agentStates: [], extensions: {},
  };
  if (options.rules) data.cloud = { guardrails: { inputValidationRules: options.rules } };
  let last = null;
  try {
    const reader = client.asStream(client.generateCopilotResponse({ data, properties: {} })).getReader();
    for (;;) {
      const { done, value } = await reader.read();
      if (done) break;
      last = value;
    }
  } catch (error) {
    errors.push({ message: String(error?.message ?? error), codes: [] });
  }
  const response = last?.generateCopilotResponse ?? null;
  const messages = response ? gql.convertGqlOutputToMessages(response.messages ?? []).map(
    (m) => ({ role: m.role ?? null, content: m.content ?? null })) : null;
  const state = await client.loadAgentState({ threadId: options.threadId,
                                               agentName: options.agentName ?? "default" });
  return { status: response?.status ?? null, messages, errors,
           loadAgentState: state?.data?.loadAgentState ?? null,
           loadAgentStateError: state?.error ? String(state.error.message ?? state.error) : null };
}

const timer = setTimeout(() => {
  process.stdout.write(`${JSON.stringify({ error: "driver timed out" })}\n`, () => process.exit(2));
}, 20000);
try {
  const result = await main();
  clearTimeout(timer);
  process.stdout.write(`${JSON.stringify(result)}\n`, () => process.exit(0));
} catch (error) {
  clearTimeout(timer);
  process.stdout.write(`${JSON.stringify({ error: String(error?.stack ?? error) })}\n`, () => process.exit(1));
}
