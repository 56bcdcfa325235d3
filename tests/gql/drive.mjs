// Drives a CopilotKit GraphQL runtime with the real client, @copilotkit/runtime-client-gql
// 1.10.6, building requests the way react-core 1.10's chat does, and prints one JSON object:
// for every case, what the client library returned (the merged result after the last
// increment, the errors it reported) or, for raw HTTP cases, what the server answered.
//
//   node drive.mjs <runtime url> [case,case,...]
//
// The package is loaded through require(): its ES module build imports a CommonJS-only
// dependency (untruncate-json) in a way plain Node gets wrong, which empties every streamed
// tool-call `arguments`. Bundlers, and so real React apps, load it correctly.
import { createRequire } from "node:module";

const require = createRequire(import.meta.url);
const gql = require("@copilotkit/runtime-client-gql");
const graphql = require("graphql");

const CLIENT_ACCEPT =
  "application/graphql-response+json, application/graphql+json, application/json, text/event-stream, multipart/mixed";
const CREATED = new Date("2025-01-01T00:00:00.000Z");
const FRONTEND_URL = "http://localhost:3000/";
const SYSTEM_PROMPT = "You are the test assistant. Keep answers short.";
const CASE_TIMEOUT_MS = 15000;

// A frontend action as useCopilotAction declares it, with the JSON schema react-core derives.
const SHOW_NOTIFICATION = {
  name: "showNotification",
  description: "Shows a notification in the page.",
  jsonSchema: JSON.stringify({
    type: "object",
    properties: {
      message: { type: "string", description: "What to show" },
      level: { type: "string", enum: ["info", "warning", "error"] },
    },
    required: ["message"],
  }),
  available: "enabled",
  handler: ({ message, level }) => `notified: ${message} (${level ?? "info"})`,
};

const url = process.argv[2];
const only = process.argv[3] ? new Set(process.argv[3].split(",")) : null;

// ---- building requests ------------------------------------------------------------------

let counter = 0;
const nextId = (kind) => `${kind}-${String(++counter).padStart(3, "0")}`;

function text(role, content) {
  return new gql.TextMessage({ id: nextId("msg"), createdAt: CREATED, role, content });
}

function chatData(name, history, { actions = [], runId = null } = {}) {
  return {
    frontend: {
      actions: actions.map(({ name: n, description, jsonSchema, available }) => ({
        name: n, description, jsonSchema, available,
      })),
      url: FRONTEND_URL,
    },
    threadId: `gql-${name}`,
    runId,
    extensions: {},
    metaEvents: [],
    messages: gql.convertMessagesToGqlInput(gql.filterAgentStateMessages(history)),
    metadata: { requestType: gql.CopilotRequestType.Chat },
    agentStates: [],
    forwardedParameters: {},
    context: [],
  };
}

function newClient(errors) {
  return new gql.CopilotRuntimeClient({
    url,
    handleGQLErrors: (error) => errors.push(describeError(error)),
    handleGQLWarning: () => {},
  });
}

function describeError(error) {
  const codes = (error?.graphQLErrors ?? []).map((e) => e?.extensions?.code ?? null);
  return { message: String(error?.message ?? error), codes };
}

function withTimeout(promise, what) {
  let timer;
  const timeout = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new Error(`${what} timed out`)), CASE_TIMEOUT_MS);
  });
  return Promise.race([promise, timeout]).finally(() => clearTimeout(timer));
}

// generateCopilotResponse through the client's stream, as react-core's chat reads it.
async function chat(data, properties = {}) {
  const errors = [];
  const client = newClient(errors);
  const reader = client.asStream(client.generateCopilotResponse({ data, properties })).getReader();
  let last = null;
  let parts = 0;
  try {
    for (;;) {
      const { done, value } = await withTimeout(reader.read(), "reading the response");
      if (done) break;
      parts += 1;
      last = value;
    }
  } catch (error) {
    errors.push(describeError(error));
  }
  return { parts, errors, result: last };
}

// The client's messages after a response, as react-core keeps them for the next request.
function outputMessages(result) {
  const messages = gql.convertGqlOutputToMessages(result?.generateCopilotResponse?.messages ?? []);
  for (const message of messages) message.createdAt = CREATED;
  return messages;
}

function runFrontendActions(messages, actions) {
  const results = [];
  for (const message of messages) {
    if (!message.isActionExecutionMessage()) continue;
    const action = actions.find((a) => a.name === message.name);
    if (!action) continue;
    results.push(new gql.ResultMessage({
      id: nextId("result"), createdAt: CREATED, actionExecutionId: message.id,
      actionName: message.name, result: gql.ResultMessage.encodeResult(action.handler(message.arguments)),
    }));
  }
  return results;
}

// A turn, then the follow-up react-core sends after actions (with their results).
async function turnAndFollowUp(name, userText, actions, out) {
  const history = [text(gql.Role.System, SYSTEM_PROMPT), text(gql.Role.User, userText)];
  const first = await chat(chatData(name, history, { actions }));
  out[`${name}.1`] = first;
  const produced = outputMessages(first.result);
  const results = runFrontendActions(produced, actions);
  const followUp = [...history, ...produced, ...results];
  out[`${name}.2`] = await chat(chatData(name, followUp, {
    actions, runId: first.result?.generateCopilotResponse?.runId ?? null,
  }));
}

async function singleTurn(name, userText, { actions = [], mutate } = {}) {
  const data = chatData(name, [text(gql.Role.System, SYSTEM_PROMPT), text(gql.Role.User, userText)],
    { actions });
  if (mutate) mutate(data);
  return chat(data);
}

async function raw(init, query = "") {
  const response = await fetch(url + query, init);
  const body = await response.text();
  let json = null;
  try { json = JSON.parse(body); } catch { /* not JSON */ }
  return {
    status: response.status,
    contentType: response.headers.get("content-type"),
    runtimeVersion: response.headers.get("x-copilotkit-runtime-version"),
    json,
  };
}

const rawHeaders = {
  "content-type": "application/json",
  accept: CLIENT_ACCEPT,
  "x-copilotkit-runtime-client-gql-version": "1.10.6",
};

// ---- cases --------------------------------------------------------------------------------

const LONG_TEXT = Array.from({ length: 60 }, (_, i) => `word${i}`).join(" ") + ".";
const UNICODE_TEXT = "naïve café 👋🏽 family 👨‍👩‍👧 flags 🇫🇷🇯🇵 e\u0301 ∑ 漢字 🎉";

const CASES = {
  hello: async (out) => {
    const errors = [];
    const result = await newClient(errors).client.query("query hello { hello }", {}).toPromise();
    out.hello = { data: result.data ?? null, error: result.error ? describeError(result.error) : null };
  },
  available_agents: async (out) => {
    const result = await newClient([]).availableAgents().toPromise();
    out.available_agents = { data: result.data ?? null, error: result.error ? describeError(result.error) : null };
  },
  load_agent_state: async (out) => {
    const result = await newClient([]).loadAgentState({ threadId: "gql-none", agentName: "nope" }).toPromise();
    out.load_agent_state = { data: result.data ?? null, error: result.error ? describeError(result.error) : null };
  },
  chat: async (out) => { out.chat = await singleTurn("chat", "Hello, CopilotKit!"); },
  server_action: (out) => turnAndFollowUp("server_action", 'call:getWeather {"city": "Paris"}', [], out),
  frontend_action: (out) => turnAndFollowUp("frontend_action",
    'call:showNotification {"message": "Build finished", "level": "info"}', [SHOW_NOTIFICATION], out),
  llm_error: async (out) => { out.llm_error = await singleTurn("llm_error", "error:500"); },
  malformed_variables: async (out) => {
    out.malformed_variables = await singleTurn("malformed_variables", "hi",
      { mutate: (data) => { delete data.frontend; } });
  },
  malformed_role: async (out) => {
    out.malformed_role = await singleTurn("malformed_role", "hi",
      { mutate: (data) => { data.messages[1].textMessage.role = "robot"; } });
  },
  malformed_json: async (out) => {
    out.malformed_json = await raw({ method: "POST", headers: rawHeaders, body: '{"query": "query { hello }", "variables": {' });
  },
  graphql_syntax_error: async (out) => {
    out.graphql_syntax_error = await raw({ method: "POST", headers: rawHeaders,
      body: JSON.stringify({ query: "mutation { generateCopilotResponse( }" }) });
  },
  unknown_field: async (out) => {
    out.unknown_field = await raw({ method: "POST", headers: rawHeaders, body: JSON.stringify({ query: "query { hello nope }" }) });
  },
  get_hello: async (out) => {
    out.get_hello = await raw({ headers: { accept: "application/json" } }, `?query=${encodeURIComponent("{ hello }")}`);
  },
  cors_preflight: async (out) => {
    const response = await fetch(url, { method: "OPTIONS", headers: {
      origin: "http://localhost:3000", "access-control-request-method": "POST",
      "access-control-request-headers": "content-type,x-copilotkit-runtime-client-gql-version",
    } });
    const headers = Object.fromEntries([...response.headers].filter(([k]) => k.startsWith("access-control-")));
    out.cors_preflight = { status: response.status, headers };
  },
  // The served schema as introspection shows it, printed sorted.
  schema: async (out) => {
    const response = await fetch(url, { method: "POST", headers: rawHeaders, body: JSON.stringify({
      query: graphql.getIntrospectionQuery({ descriptions: true, specifiedByUrl: true,
        directiveIsRepeatable: true, inputValueDeprecation: true }) }) });
    const { data } = await response.json();
    out.schema = graphql.printSchema(graphql.lexicographicSortSchema(graphql.buildClientSchema(data)));
  },
  get_graphiql: async (out) => {
    const response = await fetch(url, { headers: { accept: "text/html" } });
    await response.arrayBuffer();
    out.get_graphiql = { status: response.status, contentType: response.headers.get("content-type") };
  },
  // Cases the captures lack.
  two_tool_calls: (out) => turnAndFollowUp("two_tool_calls",
    'call:getWeather {"city": "Paris"}\ncall:getWeather {"city": "Rome"}', [], out),
  server_and_frontend_calls: async (out) => {
    out.server_and_frontend_calls = await singleTurn("server_and_frontend_calls",
      'call:getWeather {"city": "Oslo"}\ncall:showNotification {"message": "Looked it up"}',
      { actions: [SHOW_NOTIFICATION] });
  },
  long_answer: async (out) => { out.long_answer = await singleTurn("long_answer", `chunks:500 ${LONG_TEXT.repeat(3)}`); },
  // More pieces than code points: the mock sends every code point on its own, which splits
  // grapheme clusters (skin tones, families, flags, combining accents) across pieces.
  unicode_pieces: async (out) => {
    out.unicode_pieces = await singleTurn("unicode_pieces", `chunks:1000 ${UNICODE_TEXT}`);
  },
  llm_failure_after_text: async (out) => {
    out.llm_failure_after_text = await singleTurn("llm_failure_after_text", "breaks:2 this answer will break off");
  },
  agent_session_unknown: async (out) => {
    out.agent_session_unknown = await singleTurn("agent_session_unknown", "hi",
      { mutate: (data) => { data.agentSession = { agentName: "nope" }; } });
  },
};

const out = {};
for (const [name, run] of Object.entries(CASES)) {
  if (only && !only.has(name)) continue;
  counter = 0;
  try {
    await run(out);
  } catch (error) {
    out[name] = { driverError: String(error?.stack ?? error) };
  }
}
process.stdout.write(JSON.stringify(out) + "\n");
process.exit(0);
