// One chat turn through the real client, @copilotkit/runtime-client-gql 1.10.6, against a
// runtime that refuses it (tests/test_graphql_refusals.py).
//
//   node drive_refusal.mjs <runtimeUrl> <options-json>
//
// options: {threadId, text, token?}. Prints ONE JSON line: each error the client handed to
// handleGQLErrors as react-core 1.10.6's handler routes it to the page's banner and onError:
// the words it shows (`extensions.originalError.message`, else `message`) and the outcome of
// the CopilotKitError it builds from `extensions.code` (which throws on a code it lacks).
import { createRequire } from "node:module";

const require = createRequire(import.meta.url);
const gql = require("@copilotkit/runtime-client-gql");
const { CopilotKitError } = require("@copilotkit/shared");

const [url, optionsArg] = process.argv.slice(2);
const options = JSON.parse(optionsArg ?? "{}");
const CREATED = new Date("2025-01-01T00:00:00.000Z");

function routed(gqlError) {
  const extensions = gqlError?.extensions ?? {};
  const shown = extensions.originalError?.message || gqlError?.message;
  let structured;
  try {
    structured = extensions.code ? new CopilotKitError({ message: shown, code: extensions.code }).message : null;
  } catch (error) {
    structured = `threw: ${error}`;
  }
  return { shown, structured, code: extensions.code ?? null, statusCode: extensions.statusCode ?? null,
           runtimeCode: extensions.runtimeCode ?? null };
}

async function main() {
  const headers = {};
  if (options.token) headers.Authorization = `Bearer ${options.token}`;
  const handled = [];
  const client = new gql.CopilotRuntimeClient({
    url, headers,
    handleGQLErrors: (error) => handled.push({
      message: String(error?.message ?? error),
      graphQLErrors: (error?.graphQLErrors ?? []).map(routed),
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
  let last = null;
  let streamError = null;
  try {
    const reader = client.asStream(client.generateCopilotResponse({ data, properties: {} })).getReader();
    for (;;) {
      const { done, value } = await reader.read();
      if (done) break;
      last = value;
    }
  } catch (error) {
    streamError = String(error?.message ?? error);
  }
  return { status: last?.generateCopilotResponse?.status ?? null, handled, streamError };
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
