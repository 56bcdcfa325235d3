// bench/ts-graphql/server.mjs: the TypeScript CopilotKit runtime 1.10.6 (GraphQL protocol), as
// bench/run measures it. bench/run copies this file next to its npm install in
// bench/.scratch/ts-graphql/ and starts it with `node server.mjs` (the node process is the server).
//
// CopilotRuntime with one server-side action, getWeather(city), and the OpenAIAdapter whose
// `openai` client points at the mock LLM; served by copilotRuntimeNodeHttpEndpoint on node:http
// at ENDPOINT, where the client POSTs its `generateCopilotResponse` mutation.
//
// Environment: HOST (127.0.0.1), PORT (4120), ENDPOINT (/api/copilotkit),
//              LLM_BASE_URL (http://127.0.0.1:8090/v1)

// Telemetry (read by the runtime when its module is evaluated) is switched off before the
// dynamic imports below.
process.env.COPILOTKIT_TELEMETRY_DISABLED = "true";
process.env.DO_NOT_TRACK = "1";

import http from "node:http";

const { CopilotRuntime, OpenAIAdapter, copilotRuntimeNodeHttpEndpoint } = await import("@copilotkit/runtime");
const { default: OpenAI } = await import("openai");

const host = process.env.HOST ?? "127.0.0.1";
const port = Number(process.env.PORT ?? 4120);
const endpoint = process.env.ENDPOINT ?? "/api/copilotkit";
const llmBaseUrl = process.env.LLM_BASE_URL ?? "http://127.0.0.1:8090/v1";

const loopback = new Set(["127.0.0.1", "localhost", "::1", "[::1]"]);
if (!loopback.has(host) || !loopback.has(new URL(llmBaseUrl).hostname)) {
  throw new Error("bench servers bind to and call loopback addresses only");
}

const runtime = new CopilotRuntime({
  actions: [
    {
      name: "getWeather",
      description: "Get the current weather for a city.",
      parameters: [{ name: "city", type: "string", description: "Name of the city", required: true }],
      handler: async ({ city }) => ({ city, temperature: 21, unit: "celsius", conditions: "sunny" }),
    },
  ],
});
const serviceAdapter = new OpenAIAdapter({
  openai: new OpenAI({ baseURL: llmBaseUrl, apiKey: "sk-mock", maxRetries: 0 }),
  model: "gpt-4o",
});

const server = http.createServer(copilotRuntimeNodeHttpEndpoint({ endpoint, runtime, serviceAdapter }));
server.listen(port, host, () => {
  console.log(`ts-graphql: @copilotkit/runtime 1.10.6 on node ${process.version}, ` +
    `http://${host}:${port}${endpoint}, LLM ${llmBaseUrl}`);
});

const stop = () => {
  server.closeAllConnections?.();
  server.close(() => process.exit(0));
  setTimeout(() => process.exit(0), 2000).unref();
};
process.on("SIGTERM", stop);
process.on("SIGINT", stop);
