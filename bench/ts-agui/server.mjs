// bench/ts-agui/server.mjs: the TypeScript CopilotKit runtime 1.75.0 (AG-UI protocol), as
// bench/run measures it. bench/run copies this file next to its npm install in
// bench/.scratch/ts-agui/ and starts it with `node server.mjs` (the node process is the server).
//
// One agent, "default": a BuiltInAgent on the AI SDK's OpenAI provider in Chat Completions mode
// (`.chat("gpt-4o")`), pointed at the mock LLM, with one server-side tool, getWeather(city).
// Served multi-route under BASE_PATH by createCopilotNodeListener on node:http, so a chat run
// is `POST {BASE_PATH}/agent/default/run`.
//
// Environment: HOST (127.0.0.1), PORT (4110), BASE_PATH (/api/copilotkit),
//              LLM_BASE_URL (http://127.0.0.1:8090/v1)

// The runtime's telemetry client reads these when its module is evaluated, so they are set
// before the dynamic imports below.
process.env.COPILOTKIT_TELEMETRY_DISABLED = "true";
process.env.DO_NOT_TRACK = "1";

import http from "node:http";

const runtimeV2 = await import("@copilotkit/runtime/v2");
const { createCopilotNodeListener } = await import("@copilotkit/runtime/v2/node");
const { createOpenAI } = await import("@ai-sdk/openai");
const { z } = await import("zod");

const host = process.env.HOST ?? "127.0.0.1";
const port = Number(process.env.PORT ?? 4110);
const basePath = process.env.BASE_PATH ?? "/api/copilotkit";
const llmBaseUrl = process.env.LLM_BASE_URL ?? "http://127.0.0.1:8090/v1";

const loopback = new Set(["127.0.0.1", "localhost", "::1", "[::1]"]);
if (!loopback.has(host) || !loopback.has(new URL(llmBaseUrl).hostname)) {
  throw new Error("bench servers bind to and call loopback addresses only");
}

const weatherTool = runtimeV2.defineTool({
  name: "getWeather",
  description: "Get the current weather for a city.",
  parameters: z.object({ city: z.string().describe("Name of the city") }),
  execute: async ({ city }) => ({ city, temperature: 21, unit: "celsius", conditions: "sunny" }),
});

const provider = createOpenAI({ baseURL: llmBaseUrl, apiKey: "sk-mock" });
const agent = new runtimeV2.BuiltInAgent({
  // `.chat()` selects Chat Completions, which the mock speaks (the bare provider call would
  // select the Responses API).
  model: provider.chat("gpt-4o"),
  tools: [weatherTool],
  maxRetries: 0,
});

const runtime = new runtimeV2.CopilotRuntime({
  agents: { default: agent },
  runner: new runtimeV2.InMemoryAgentRunner(),
});
const listener = createCopilotNodeListener({ runtime, basePath, cors: true });

const server = http.createServer(listener);
server.listen(port, host, () => {
  console.log(`ts-agui: @copilotkit/runtime ${runtimeV2.VERSION ?? "?"} on node ${process.version}, ` +
    `http://${host}:${port}${basePath}, LLM ${llmBaseUrl}`);
});

const stop = () => {
  server.closeAllConnections?.();
  server.close(() => process.exit(0));
  setTimeout(() => process.exit(0), 2000).unref();
};
process.on("SIGTERM", stop);
process.on("SIGINT", stop);
