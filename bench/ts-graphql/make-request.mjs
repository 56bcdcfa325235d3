// bench/ts-graphql/make-request.mjs: asks the real GraphQL client, @copilotkit/runtime-client-gql
// 1.10.6, for the exact request it sends for the first message of a chat, and writes it as a
// template for bench/load.mjs (--protocol graphql --template FILE).
//
//   node make-request.mjs URL OUT.json        (run from bench/.scratch/ts-graphql, next to node_modules)
//
// The `data` is built the way @copilotkit/react-core 1.10.6's useChat builds it for a bare chat
// (no frontend actions, no readables, no agent): react-core's default system message, then the
// user's message. The system message text is taken from the installed react-core package at run
// time (its `defaultSystemMessage` is not exported, so its source is evaluated), not kept here.
// The client is given a fetch stub that records the call instead of sending it; the body is what
// urql serialises (sorted keys, the printed document with __typename added, @defer/@stream kept).
// Values a real session changes per chat become placeholders that load.mjs fills per request:
// __BENCH_THREAD_ID__, __BENCH_SYSTEM_ID__, __BENCH_USER_ID__, __BENCH_CREATED_AT__, __BENCH_USER_TEXT__.
import fs from "node:fs";
import { createRequire } from "node:module";

const [url, out] = process.argv.slice(2);
if (!url || !out) throw new Error("usage: node make-request.mjs URL OUT.json");
const require = createRequire(import.meta.url);

// The CommonJS build of the client (its ESM build mis-imports a CJS dependency under plain Node).
const gql = require("@copilotkit/runtime-client-gql");

// react-core's default system message, from the package's own code.
function loadDefaultSystemMessage() {
  const file = require.resolve("@copilotkit/react-core"); // dist/index.js (CJS)
  const src = fs.readFileSync(file, "utf8");
  const start = src.indexOf("function defaultSystemMessage(");
  const end = src.indexOf("\n}\n", start);
  if (start < 0 || end < 0) throw new Error(`defaultSystemMessage not found in ${file}`);
  return new Function(`${src.slice(start, end + 2)}\nreturn defaultSystemMessage;`)();
}
const defaultSystemMessage = loadDefaultSystemMessage();
// useChat calls it with getContextString([], categories): "" documents + "\n\n" + "" (empty tree),
// and the chat's instructions (none for a bare chat).
const systemText = defaultSystemMessage("\n\n", undefined);

const EPOCH = new Date(0);
const messages = [
  new gql.TextMessage({ id: "__BENCH_SYSTEM_ID__", createdAt: EPOCH, role: gql.Role.System, content: systemText }),
  new gql.TextMessage({ id: "__BENCH_USER_ID__", createdAt: EPOCH, role: gql.Role.User, content: "__BENCH_USER_TEXT__" }),
];
const data = {
  frontend: { actions: [], url: "http://localhost:3000/" },
  threadId: "__BENCH_THREAD_ID__",
  runId: null,
  extensions: {},
  metaEvents: [],
  messages: gql.convertMessagesToGqlInput(gql.filterAgentStateMessages(messages)),
  metadata: { requestType: gql.CopilotRequestType.Chat },
  agentStates: [],
  forwardedParameters: {},
  context: [],
};

let sent;
const realFetch = globalThis.fetch;
globalThis.fetch = async (u, init) => {
  sent = { url: String(u), method: init.method, headers: init.headers, body: init.body };
  return new Response('{"data":null}', { headers: { "content-type": "application/json" } });
};
try {
  const client = new gql.CopilotRuntimeClient({ url, handleGQLErrors: () => {}, handleGQLWarning: () => {} });
  await client.generateCopilotResponse({ data, properties: {} }).toPromise();
} finally {
  globalThis.fetch = realFetch;
}
if (!sent) throw new Error("the client sent nothing");

const headerEntries = sent.headers instanceof Headers ? [...sent.headers.entries()] : Object.entries(sent.headers ?? {});
// Node's fetch (undici) adds these on the wire when the caller does not set them.
for (const [k, v] of [["accept-language", "*"], ["sec-fetch-mode", "cors"], ["user-agent", "node"], ["accept-encoding", "gzip, deflate"]]) {
  if (!headerEntries.some(([name]) => name.toLowerCase() === k)) headerEntries.push([k, v]);
}
const body = String(sent.body).replaceAll(EPOCH.toISOString(), "__BENCH_CREATED_AT__");
for (const p of ["__BENCH_THREAD_ID__", "__BENCH_SYSTEM_ID__", "__BENCH_USER_ID__", "__BENCH_CREATED_AT__", "__BENCH_USER_TEXT__"]) {
  if (!body.includes(p)) throw new Error(`placeholder ${p} is missing from the request body`);
}
const parsed = JSON.parse(body);
fs.writeFileSync(out, JSON.stringify({
  method: sent.method, url: sent.url, headers: headerEntries, body,
  operationName: parsed.operationName, variablesKeys: Object.keys(parsed.variables?.data ?? {}),
  clientVersion: JSON.parse(fs.readFileSync("node_modules/@copilotkit/runtime-client-gql/package.json", "utf8")).version,
}, null, 2) + "\n");
console.log(`graphql request template: ${body.length} bytes of body, ${headerEntries.length} headers -> ${out}`);
