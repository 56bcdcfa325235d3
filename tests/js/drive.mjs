// Real-client driver for tests/test_real_clients.py.
//
//   node drive.mjs <scenario> <runtimeUrl> [options-json]
//
// Runs one scenario with the real client packages from npm (CopilotKitCore from @copilotkit/core,
// HttpAgent from @ag-ui/client 0.0.59 and, aliased as "agui-client-1", from @ag-ui/client 1.0.0)
// against a CopilotKit runtime, then writes exactly ONE JSON line to stdout describing what the
// client observed: {scenario, ok, error?, coreErrors, http, ...scenario fields}. Everything the
// libraries log goes to stderr. `http` lists every fetch the client made (method, url, parsed
// request body, status, response content type and, for non-SSE answers, the parsed body).
// Exit code: 0 when the scenario ran to the end (even if the client saw errors: those are data),
// 1 when the driver itself failed, 2 on timeout.

// Keep stdout for the result line only.
const writeStdout = process.stdout.write.bind(process.stdout);
for (const level of ["log", "info", "warn", "debug"]) console[level] = (...args) => console.error(...args);

// CopilotKitCore's agent registry only starts its /info request when a `window` exists.
globalThis.window ??= {};

const [scenarioName, runtimeUrlArg, optionsArg] = process.argv.slice(2);
const options = optionsArg ? JSON.parse(optionsArg) : {};
const runtimeUrl = (runtimeUrlArg ?? "").replace(/\/+$/, "");
const TIMEOUT_MS = Number(options.timeoutMs ?? 20000);

const coreErrors = [];
const http = [];
const pendingRequests = new Set();

// ---- fetch recorder ---------------------------------------------------------------------------
const nativeFetch = globalThis.fetch;

function headerValue(headers, name) {
  if (!headers) return undefined;
  if (typeof headers.get === "function") return headers.get(name) ?? undefined;
  if (Array.isArray(headers)) {
    const found = headers.find(([k]) => k.toLowerCase() === name);
    return found ? found[1] : undefined;
  }
  for (const [key, value] of Object.entries(headers)) if (key.toLowerCase() === name) return value;
  return undefined;
}

function parseMaybeJson(text) {
  if (typeof text !== "string") return text ?? null;
  try {
    return JSON.parse(text);
  } catch {
    return text;
  }
}

globalThis.fetch = (input, init = {}) => {
  const url = typeof input === "string" ? input : input instanceof URL ? input.href : input.url;
  const entry = {
    method: String(init.method ?? input?.method ?? "GET").toUpperCase(),
    url,
    requestContentType: headerValue(init.headers, "content-type") ?? null,
    requestBody: init.body === undefined ? null : parseMaybeJson(init.body),
  };
  http.push(entry);
  const settled = nativeFetch(input, init).then(
    async (response) => {
      entry.status = response.status;
      entry.contentType = response.headers.get("content-type");
      if (!String(entry.contentType ?? "").includes("text/event-stream")) {
        entry.responseBody = parseMaybeJson(await response.clone().text().catch(() => null));
      }
      return response;
    },
    (error) => {
      entry.fetchError = String(error?.message ?? error);
      throw error;
    },
  );
  const tracked = settled.catch(() => undefined);
  pendingRequests.add(tracked);
  tracked.finally(() => pendingRequests.delete(tracked));
  return settled;
};

const { CopilotKitCore, ProxiedCopilotRuntimeAgent, ɵcreateThreadStore } = await import("@copilotkit/core");
const { HttpAgent } = await import("@ag-ui/client");
const { HttpAgent: HttpAgentV1 } = await import("agui-client-1");
const { z } = await import("zod");

// ---- helpers ----------------------------------------------------------------------------------
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
const uid = (prefix) => `${prefix}-${crypto.randomUUID()}`;
const clone = (value) => (value === undefined ? null : JSON.parse(JSON.stringify(value)));

function errorText(error) {
  if (error === undefined || error === null) return null;
  return String(error?.message ?? error);
}

async function waitFor(predicate, ms, what) {
  const deadline = Date.now() + ms;
  while (!predicate()) {
    if (Date.now() > deadline) throw new Error(`timed out after ${ms} ms waiting for ${what}`);
    await sleep(10);
  }
}

async function startCore(url, transport = "rest") {
  const core = new CopilotKitCore({ runtimeUrl: url, runtimeTransport: transport });
  core.subscribe({
    onError: ({ code, error, context }) =>
      coreErrors.push({ code, message: errorText(error), runtimeErrorCode: context?.runtimeErrorCode ?? null }),
  });
  await waitFor(
    () => ["connected", "error"].includes(core.runtimeConnectionStatus),
    8000,
    "the runtime connection (/info)",
  );
  return core;
}

function runtimeAgent(core, agentId = "default") {
  const agent = core.getAgent(agentId);
  if (!agent) {
    throw new Error(
      `agent '${agentId}' not discovered (runtime status ${core.runtimeConnectionStatus}, ` +
        `agents: ${JSON.stringify(Object.keys(core.agents))})`,
    );
  }
  return agent;
}

function freshThread(agent, threadId) {
  agent.threadId = threadId;
  agent.setMessages([]);
  agent.setState({});
  return agent;
}

function recordEvents(agent) {
  const events = [];
  const subscription = agent.subscribe({
    onEvent: ({ event }) => {
      const { rawEvent, ...rest } = event;
      events.push(clone(rest));
    },
  });
  return { events, stop: () => subscription.unsubscribe() };
}

function userMessage(text) {
  return { id: uid("user"), role: "user", content: text };
}

function runInput(threadId, text, extra = {}) {
  return {
    threadId,
    runId: uid("run"),
    tools: [],
    context: [],
    forwardedProps: {},
    state: {},
    messages: [userMessage(text)],
    ...extra,
  };
}

async function rawRequest({ method = "POST", url, path = "", headers, body, json }) {
  const target = url ?? `${runtimeUrl}${path}`;
  const init = { method, headers: { ...(headers ?? {}) } };
  if (json !== undefined) {
    init.body = JSON.stringify(json);
    init.headers["Content-Type"] ??= "application/json";
  } else if (body !== undefined) {
    init.body = body;
  }
  const response = await fetch(target, init);
  const text = await response.text();
  return {
    status: response.status,
    contentType: response.headers.get("content-type"),
    body: parseMaybeJson(text),
  };
}

// ---- scenarios ----------------------------------------------------------------------------------
const scenarios = {
  // CopilotKitCore discovers the runtime over the chosen transport.
  async info({ transport = "rest" }) {
    const core = await startCore(runtimeUrl, transport);
    return {
      status: core.runtimeConnectionStatus,
      transport: core.runtimeTransport,
      runtimeVersion: core.runtimeVersion ?? null,
      agents: Object.keys(core.agents),
      agentTypes: Object.fromEntries(
        Object.entries(core.agents).map(([id, agent]) => [id, agent.constructor?.name ?? null]),
      ),
    };
  },

  // One user message through CopilotKitCore.runAgent (frontend tools are followed up automatically).
  async chat({ transport = "rest", threadId = uid("thread"), text = "Hello", agentId = "default" }) {
    const core = await startCore(runtimeUrl, transport);
    const agent = freshThread(runtimeAgent(core, agentId), threadId);
    const recorder = recordEvents(agent);
    agent.addMessage(userMessage(text));
    const result = await core.runAgent({ agent });
    recorder.stop();
    return {
      threadId,
      messages: clone(agent.messages),
      newMessages: clone(result.newMessages),
      events: recorder.events,
    };
  },

  // A frontend tool registered on the core; the model calls it, the core runs the handler and
  // starts the follow-up run by itself.
  async frontend_tool({ transport = "rest", threadId = uid("thread"), text }) {
    const core = await startCore(runtimeUrl, transport);
    const handlerCalls = [];
    const toolExecutions = [];
    core.subscribe({
      onToolExecutionStart: ({ toolName, args }) => toolExecutions.push({ phase: "start", toolName, args: clone(args) }),
      onToolExecutionEnd: ({ toolName, result, error }) =>
        toolExecutions.push({ phase: "end", toolName, result, error: error ?? null }),
    });
    core.addTool({
      name: "sayHello",
      description: "Greet a person by name.",
      parameters: z.object({ name: z.string().describe("The name of the person to greet") }),
      handler: async (args) => {
        handlerCalls.push(clone(args));
        return { greeting: `Hello, ${args.name}!` };
      },
    });
    const agent = freshThread(runtimeAgent(core), threadId);
    const recorder = recordEvents(agent);
    agent.addMessage(userMessage(text ?? 'call:sayHello {"name":"Ada"}'));
    const result = await core.runAgent({ agent });
    recorder.stop();
    return {
      threadId,
      handlerCalls,
      toolExecutions,
      messages: clone(agent.messages),
      newMessages: clone(result.newMessages),
      events: recorder.events,
    };
  },

  // Dynamic chat suggestions (useConfigureSuggestions): a chat turn, then reloadSuggestions;
  // the suggestions the core parsed from the forced copilotkitSuggest call, and the thread as
  // the runtime keeps it before and after (a suggestion is not a chat turn).
  async suggestions({ transport = "rest", threadId = uid("thread"), instructions }) {
    const core = await startCore(runtimeUrl, transport);
    const agent = freshThread(runtimeAgent(core), threadId);
    agent.addMessage(userMessage("Hello"));
    await core.runAgent({ agent });
    const threadMessages = async () =>
      transport === "rest" ? (await rawRequest({ method: "GET", path: `/threads/${threadId}/messages` })).body : null;
    const before = await threadMessages();
    let finished = false;
    core.subscribe({ onSuggestionsFinishedLoading: () => { finished = true; } });
    core.addSuggestionsConfig({ instructions, available: "always", minSuggestions: 1, maxSuggestions: 2 });
    core.reloadSuggestions("default");
    await waitFor(() => finished, 10000, "the suggestions to finish loading");
    return {
      threadId,
      advertised: core.suggestions ?? null,
      suggestions: clone(core.getSuggestions("default").suggestions),
      messages: clone(agent.messages),
      before,
      after: await threadMessages(),
    };
  },

  // A fresh CopilotKitCore (as after a page reload) restores an existing thread.
  async connect({ transport = "rest", threadId }) {
    if (!threadId) throw new Error("connect needs options.threadId");
    const core = await startCore(runtimeUrl, transport);
    const agent = runtimeAgent(core);
    agent.threadId = threadId;
    const recorder = recordEvents(agent);
    const result = await core.connectAgent({ agent });
    recorder.stop();
    return {
      threadId,
      messages: clone(agent.messages),
      newMessages: clone(result.newMessages),
      events: recorder.events,
    };
  },

  // Stop a slow run after its first text piece (CopilotKitCore.stopAgent), then run again.
  async stop({ transport = "rest", threadId = uid("thread"), text = "slow:200 please stop", followUp = "Hello again" }) {
    const core = await startCore(runtimeUrl, transport);
    const agent = freshThread(runtimeAgent(core), threadId);
    const recorder = recordEvents(agent);
    let firstPiece;
    const firstPieceSeen = new Promise((resolve) => {
      firstPiece = resolve;
    });
    const pieceWatch = agent.subscribe({ onTextMessageContentEvent: () => firstPiece() });
    agent.addMessage(userMessage(text));
    const started = Date.now();
    const running = core.runAgent({ agent });
    await Promise.race([firstPieceSeen, sleep(5000)]);
    pieceWatch.unsubscribe();
    const stoppedAfterMs = Date.now() - started;
    core.stopAgent({ agent });
    const result = await running;
    const firstRunMs = Date.now() - started;
    await Promise.allSettled([...pendingRequests]); // the stop request is fire-and-forget
    const firstRun = {
      events: recorder.events.splice(0),
      messages: clone(agent.messages),
      newMessages: clone(result.newMessages),
      stoppedAfterMs,
      durationMs: firstRunMs,
    };
    const errorsBeforeSecondRun = coreErrors.length;
    agent.addMessage(userMessage(followUp));
    const second = await core.runAgent({ agent });
    recorder.stop();
    return {
      threadId,
      firstRun,
      secondRun: {
        events: recorder.events,
        messages: clone(agent.messages),
        newMessages: clone(second.newMessages),
        coreErrors: coreErrors.slice(errorsBeforeSecondRun),
      },
    };
  },

  // A second run on a thread whose run is still streaming: raw fetch, then a plain HttpAgent.
  async busy_thread({ threadId = uid("thread"), text = "slow:150 keep me busy" }) {
    const core = await startCore(runtimeUrl, "rest");
    const agent = freshThread(runtimeAgent(core), threadId);
    const recorder = recordEvents(agent);
    let firstPiece;
    const firstPieceSeen = new Promise((resolve) => {
      firstPiece = resolve;
    });
    const pieceWatch = agent.subscribe({ onTextMessageContentEvent: () => firstPiece() });
    agent.addMessage(userMessage(text));
    const running = core.runAgent({ agent });
    await Promise.race([firstPieceSeen, sleep(5000)]);
    pieceWatch.unsubscribe();
    const raw = await rawRequest({
      path: "/agent/default/run",
      headers: { Accept: "text/event-stream" },
      json: runInput(threadId, "second run while busy"),
    });
    const other = new HttpAgent({ url: `${runtimeUrl}/agent/default/run`, threadId });
    other.addMessage(userMessage("another client, same thread"));
    let httpAgentError = null;
    try {
      await other.runAgent({});
    } catch (error) {
      httpAgentError = errorText(error);
    }
    await running;
    recorder.stop();
    return {
      threadId,
      raw,
      httpAgentError,
      firstRun: { events: recorder.events, messages: clone(agent.messages) },
    };
  },

  // An agent id the runtime does not have: through the core, through HttpAgent, and raw.
  async unknown_agent({ agentId = "nope" }) {
    const core = await startCore(runtimeUrl, "rest");
    const threadId = uid("thread");
    const proxied = new ProxiedCopilotRuntimeAgent({ runtimeUrl, agentId, transport: "rest" });
    proxied.threadId = threadId;
    proxied.addMessage(userMessage("Hello"));
    const result = await core.runAgent({ agent: proxied });
    const plain = new HttpAgent({ url: `${runtimeUrl}/agent/${agentId}/run`, threadId });
    plain.addMessage(userMessage("Hello"));
    let httpAgentError = null;
    try {
      await plain.runAgent({});
    } catch (error) {
      httpAgentError = errorText(error);
    }
    const raw = await rawRequest({
      path: `/agent/${agentId}/run`,
      headers: { Accept: "text/event-stream" },
      json: runInput(threadId, "Hello"),
    });
    return { newMessages: clone(result.newMessages), httpAgentError, raw };
  },

  // Raw fetches, for malformed requests no client would send: options.requests = [{method, path|url,
  // headers, body (string) | json}].
  async raw({ requests = [] }) {
    const responses = [];
    for (const request of requests) responses.push(await rawRequest(request));
    return { responses };
  },

  // A plain AG-UI HttpAgent (no CopilotKitCore) on the REST run route. options.client picks the
  // package: "0.0.59" (@ag-ui/client) or "1.0.0" (agui-client-1). With options.omitOptional the
  // agent's fetch drops every RunAgentInput key the AG-UI 1.0 schema makes optional (tools,
  // context, state, forwardedProps) before the request leaves; the 1.0 client itself fills them
  // in with defaults, but other 1.0 producers may not.
  async agui_chat({ client = "1.0.0", threadId = uid("thread"), text = "Hello", omitOptional = false }) {
    const Agent = client === "1.0.0" ? HttpAgentV1 : HttpAgent;
    const config = { url: `${runtimeUrl}/agent/default/run`, threadId };
    if (omitOptional) {
      config.fetch = (url, init) => {
        const body = JSON.parse(init.body);
        for (const key of ["tools", "context", "state", "forwardedProps"]) delete body[key];
        return fetch(url, { ...init, body: JSON.stringify(body) });
      };
    }
    const agent = new Agent(config);
    const recorder = recordEvents(agent);
    agent.addMessage(userMessage(text));
    let runError = null;
    let result;
    try {
      result = await agent.runAgent({});
    } catch (error) {
      runError = errorText(error);
    }
    recorder.stop();
    return {
      client,
      threadId,
      runError,
      messages: clone(agent.messages),
      newMessages: clone(result?.newMessages),
      events: recorder.events,
    };
  },

  // A frontend tool's loop with a plain AG-UI 1.0 HttpAgent, its second run sent to another
  // runtime (options.secondUrl: another worker, or the same after a restart). The agent runs no
  // tool itself: the driver answers the call and the agent sends back what it kept of the first
  // run (a tool call's encryptedValue from REASONING_ENCRYPTED_VALUE among it).
  async agui_tool_loop({ secondUrl = runtimeUrl, threadId = uid("thread"), text }) {
    const tools = [{
      name: "sayHello",
      description: "Greet a person by name.",
      parameters: { type: "object", properties: { name: { type: "string" } }, required: ["name"] },
    }];
    const agent = new HttpAgentV1({ url: `${runtimeUrl}/agent/default/run`, threadId });
    const recorder = recordEvents(agent);
    agent.addMessage(userMessage(text ?? 'think: call:sayHello {"name":"Ada"}'));
    await agent.runAgent({ tools });
    const firstMessages = clone(agent.messages);
    const asked = agent.messages.findLast((m) => m.role === "assistant" && m.toolCalls?.length);
    if (!asked) throw new Error("the model called no tool");
    const call = asked.toolCalls[0];
    agent.addMessage({ id: uid("tool"), role: "tool", toolCallId: call.id, content: '{"greeting":"Hello, Ada!"}' });
    agent.url = `${secondUrl.replace(/\/+$/, "")}/agent/default/run`;
    await agent.runAgent({ tools });
    recorder.stop();
    return { threadId, firstMessages, messages: clone(agent.messages), events: recorder.events };
  },

  // The core's own thread store (what the threads drawer uses) renames, archives and
  // unarchives a thread; `lists` are the threads it holds ([id, name, archived]) after each
  // step, read again from the runtime (with archived threads once it asks for them).
  async thread_store({ threadId, agentId = "default" }) {
    const errors = [];
    const store = ɵcreateThreadStore({ fetch: (...args) => fetch(...args),
                                       onError: (error) => errors.push(errorText(error)) });
    const lists = {};
    const context = { runtimeUrl, agentId, headers: {} };
    const listRequests = () => http.filter((e) => e.method === "GET" && e.url.includes("/threads?"));
    const reload = async (name, trigger) => {
      const before = listRequests().length;
      trigger();
      await waitFor(() => listRequests().length > before && listRequests().at(-1).status !== undefined,
                    5000, `the thread list (${name})`);
      await waitFor(() => !store.getState().isLoading, 5000, `the thread list applied (${name})`);
      await sleep(50);
      lists[name] = store.getState().threads.map((t) => [t.id, t.name ?? null, Boolean(t.archived)]);
    };
    store.start();
    await reload("first", () => store.setContext(context));
    await store.renameThread(threadId, "My trip");
    await reload("renamed", () => store.refresh());
    await store.archiveThread(threadId);
    await reload("archived", () => store.refresh());
    await reload("archivedIncluded", () => store.setContext({ ...context, includeArchived: true }));
    await store.unarchiveThread(threadId);
    await reload("unarchived", () => store.setContext(context));
    await store.deleteThread(threadId);
    await reload("deleted", () => store.refresh());
    store.stop();
    delete lists.first;
    const mutations = http.filter((e) => e.method !== "GET").map((e) => ({
      method: e.method, path: e.url.slice(runtimeUrl.length), body: e.requestBody, status: e.status,
      answer: e.responseBody ?? null }));
    return { mutations, lists, errors };
  },
};

// ---- main ---------------------------------------------------------------------------------------
function emit(payload, code) {
  writeStdout(`${JSON.stringify(payload)}\n`, () => process.exit(code));
}

const timer = setTimeout(() => {
  emit({ scenario: scenarioName, ok: false, error: `driver timed out after ${TIMEOUT_MS} ms`, coreErrors, http }, 2);
}, TIMEOUT_MS);

const scenario = scenarios[scenarioName];
if (!scenario || !runtimeUrl) {
  clearTimeout(timer);
  emit(
    {
      scenario: scenarioName ?? null,
      ok: false,
      error: `usage: node drive.mjs <${Object.keys(scenarios).join("|")}> <runtimeUrl> [options-json]`,
    },
    1,
  );
} else {
  try {
    const fields = await scenario(options);
    await Promise.race([Promise.allSettled([...pendingRequests]), sleep(2000)]);
    clearTimeout(timer);
    emit({ scenario: scenarioName, ok: true, ...fields, coreErrors, http }, 0);
  } catch (error) {
    clearTimeout(timer);
    emit(
      { scenario: scenarioName, ok: false, error: String(error?.stack ?? error), coreErrors, http },
      1,
    );
  }
}
