// Drives agent sessions of a CopilotKit GraphQL runtime with the real client,
// @copilotkit/runtime-client-gql 1.10.6, keeping a chat's state the way react-core 1.10's
// useChat does between requests (its agent session, its agents' states, its history, the
// frontend actions it runs and the follow-up it sends), and prints one JSON object: for
// every case, what the client saw and what the chat held afterwards.
//
//   node drive_agents.mjs <runtime url> [case,case,...]
//
// Loaded through require() for the reason drive.mjs gives.
import { createRequire } from "node:module";

const require = createRequire(import.meta.url);
const gql = require("@copilotkit/runtime-client-gql");

const CREATED = new Date("2025-01-01T00:00:00.000Z");
const SYSTEM_PROMPT = "You are the test assistant. Keep answers short.";
const CASE_TIMEOUT_MS = 20000;

const SAY_HELLO = {
  name: "sayHello",
  description: "Says hello to someone.",
  jsonSchema: JSON.stringify({
    type: "object", properties: { name: { type: "string" } }, required: ["name"],
  }),
  available: "enabled",
  handler: ({ name }) => ({ greeting: `Hello, ${name}!` }),
};

const url = process.argv[2];
const only = process.argv[3] ? new Set(process.argv[3].split(",")) : null;

let counter = 0;
const nextId = (kind) => `${kind}-${String(++counter).padStart(3, "0")}`;

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

function newClient(errors) {
  return new gql.CopilotRuntimeClient({
    url,
    handleGQLErrors: (error) => errors.push(describeError(error)),
    handleGQLWarning: () => {},
  });
}

// A chat as useChat keeps it: `history` (client Message objects), `agentSession`, and the
// agents' states by name (`coagentStates`, what useCoAgent reads and writes).
class Chat {
  constructor(threadId, { agent = null, actions = [] } = {}) {
    this.threadId = threadId;
    this.agentLock = agent;
    this.agentSession = agent ? { agentName: agent } : null;
    this.actions = actions;
    this.history = [];
    this.coagentStates = {};
  }

  request() {
    const system = new gql.TextMessage({ id: "system", createdAt: CREATED, role: gql.Role.System,
      content: SYSTEM_PROMPT });
    return {
      frontend: {
        actions: this.actions.map(({ name, description, jsonSchema, available }) => ({
          name, description, jsonSchema, available })),
        url: "http://localhost:3000/",
      },
      threadId: this.threadId,
      runId: null,
      extensions: {},
      metaEvents: [],
      messages: gql.convertMessagesToGqlInput(gql.filterAgentStateMessages([system, ...this.history])),
      metadata: { requestType: gql.CopilotRequestType.Chat },
      ...(this.agentSession ? { agentSession: this.agentSession } : {}),
      agentStates: Object.values(this.coagentStates).map((s) => ({
        agentName: s.name, state: JSON.stringify(s.state),
        ...(s.config !== undefined ? { config: JSON.stringify(s.config) } : {}),
      })),
      forwardedParameters: {},
      context: [],
    };
  }

  // One request and what useChat does with its answer; then, if it ran frontend actions,
  // the follow-up. Returns what the client saw of each response.
  async send(userText) {
    if (userText !== undefined) {
      this.history.push(new gql.TextMessage({ id: nextId("user"), createdAt: CREATED,
        role: gql.Role.User, content: userText }));
    }
    const seen = [];
    for (let round = 0; round < 3; round++) {
      const { response, ranActions } = await this.round();
      seen.push(response);
      if (!ranActions) break;
    }
    return seen;
  }

  async round() {
    const errors = [];
    const client = newClient(errors);
    const reader = client.asStream(client.generateCopilotResponse({ data: this.request() })).getReader();
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
    const result = last?.generateCopilotResponse ?? null;
    const raw = result?.messages ?? [];
    const produced = gql.convertGqlOutputToMessages(gql.filterAdjacentAgentStateMessages(raw));
    const failed = result?.status?.__typename === "FailedResponseStatus";
    let ranActions = false;
    if (!failed) {
      let synced = [];
      const lastState = [...produced].reverse().find((m) => m.isAgentStateMessage());
      if (lastState) {
        if (lastState.state.messages && lastState.state.messages.length > 0) {
          synced = gql.loadMessagesFromJsonRepresentation(lastState.state.messages);
        }
        this.coagentStates[lastState.agentName] = {
          name: lastState.agentName, state: lastState.state, running: lastState.running,
          active: lastState.active, threadId: lastState.threadId,
          nodeName: lastState.nodeName, runId: lastState.runId,
          config: this.coagentStates[lastState.agentName]?.config,
        };
        if (lastState.running) {
          this.agentSession = { threadId: lastState.threadId, agentName: lastState.agentName,
            nodeName: lastState.nodeName };
        } else {
          this.agentSession = this.agentLock
            ? { threadId: nextId("thread"), agentName: this.agentLock } : null;
        }
      }
      const final = synced.length > 0 ? synced : [...this.history, ...produced];
      for (const message of final) message.createdAt = CREATED;
      ranActions = this.runActions(final);
      this.history = final;
    }
    return {
      ranActions,
      response: {
        parts, errors,
        status: result?.status ?? null,
        metaEvents: result?.metaEvents ?? [],
        messages: raw.map(summarize),
      },
    };
  }

  // useChat's walk over the trailing action executions and results.
  runActions(final) {
    const trailing = [];
    for (let i = final.length - 1; i >= 0; i--) {
      const message = final[i];
      if ((message.isActionExecutionMessage() || message.isResultMessage())
          && message.status.code !== gql.MessageStatusCode.Pending) {
        trailing.unshift(message);
      } else if (!message.isAgentStateMessage()) {
        break;
      }
    }
    let ran = false;
    for (const message of trailing) {
      const action = message.isActionExecutionMessage()
        && this.actions.find((a) => a.name === message.name);
      if (!action) continue;
      const result = new gql.ResultMessage({
        id: nextId("result"), createdAt: CREATED, actionExecutionId: message.id,
        actionName: message.name, result: gql.ResultMessage.encodeResult(action.handler(message.arguments)),
      });
      final.splice(final.indexOf(message) + 1, 0, result);
      ran = true;
    }
    return ran;
  }

  summary() {
    // A copy: the chat goes on changing after the summary is taken.
    return structuredClone({
      agentSession: this.agentSession,
      coagentStates: this.coagentStates,
      history: this.history.filter((m) => !m.isAgentStateMessage()).map((m) => {
        if (m.isTextMessage()) return { role: m.role, content: m.content };
        if (m.isActionExecutionMessage()) return { call: m.name, arguments: m.arguments };
        if (m.isResultMessage()) return { result: m.result, actionName: m.actionName };
        return { other: m.type };
      }),
    });
  }
}

function summarize(message) {
  switch (message.__typename) {
    case "TextMessageOutput":
      return { type: "text", role: message.role, content: message.content.join(""),
        status: message.status?.code ?? null };
    case "ActionExecutionMessageOutput":
      return { type: "call", id: message.id, name: message.name,
        arguments: message.arguments.join(""), status: message.status?.code ?? null };
    case "ResultMessageOutput":
      return { type: "result", actionExecutionId: message.actionExecutionId,
        actionName: message.actionName, result: message.result,
        status: message.status?.code ?? null };
    case "AgentStateMessageOutput":
      return { type: "state", id: message.id, agentName: message.agentName,
        threadId: message.threadId, runId: message.runId, nodeName: message.nodeName,
        active: message.active, running: message.running, role: message.role,
        state: JSON.parse(message.state), status: message.status?.code ?? null };
    default:
      return { type: message.__typename };
  }
}

// ---- cases --------------------------------------------------------------------------------

const CASES = {
  available_agents: async (out) => {
    const result = await newClient([]).availableAgents().toPromise();
    out.available_agents = { data: result.data ?? null,
      error: result.error ? describeError(result.error) : null };
  },
  // A LangGraph chat over two turns: the second goes to the session the first left open.
  lg_chat: async (out) => {
    const chat = new Chat("gql-agents-chat", { agent: "lg" });
    const first = await chat.send("Hello agent");
    const afterFirst = chat.summary();
    const second = await chat.send("And again");
    const loaded = await newClient([]).loadAgentState({ threadId: chat.threadId, agentName: "lg" })
      .toPromise();
    out.lg_chat = { first, afterFirst, second, after: chat.summary(),
      loaded: loaded.data?.loadAgentState ?? null,
      loadError: loaded.error ? describeError(loaded.error) : null };
  },
  // The graph's own tool, then a frontend action the client runs before its follow-up.
  lg_tools: async (out) => {
    const chat = new Chat("gql-agents-tools", { agent: "lg", actions: [SAY_HELLO] });
    const server = await chat.send('call:get_weather {"city": "Paris"}');
    const frontend = await chat.send('call:sayHello {"name": "Ada"}');
    out.lg_tools = { server, frontend, after: chat.summary() };
  },
  // The page writes the agent's state, the agent reads it and writes it back.
  shared_state: async (out) => {
    const chat = new Chat("gql-agents-state", { agent: "planner" });
    chat.coagentStates.planner = { name: "planner", state: { items: ["from the page"], counter: 5 } };
    const first = await chat.send("Plan");
    const afterFirst = chat.summary();
    chat.coagentStates.planner.state = { ...chat.coagentStates.planner.state,
      items: ["edited", "by the user"], counter: 10 };
    const second = await chat.send("Plan again");
    out.shared_state = { first, afterFirst, second, after: chat.summary() };
  },
  // Two agents at once, each on its own thread.
  two_agents: async (out) => {
    const lg = new Chat("gql-agents-pair-lg", { agent: "lg" });
    const planner = new Chat("gql-agents-pair-planner", { agent: "planner" });
    const [a, b] = await Promise.all([lg.send("Hi from the left"), planner.send("Plan right")]);
    out.two_agents = { lg: a, planner: b, lgAfter: lg.summary(), plannerAfter: planner.summary() };
  },
  // A remote AG-UI agent whose process dies after three events.
  remote_dies: async (out) => {
    const chat = new Chat("gql-agents-remote-dies", { agent: "remote" });
    const seen = await chat.send("die:3 hello");
    out.remote_dies = { seen, after: chat.summary() };
  },
  remote_ok: async (out) => {
    const chat = new Chat("gql-agents-remote-ok", { agent: "remote" });
    const seen = await chat.send("hello remote");
    out.remote_ok = { seen, after: chat.summary() };
  },
  // The agent calls another agent, offered to it as a tool: that agent takes the turn.
  handoff: async (out) => {
    const chat = new Chat("gql-agents-handoff", { agent: "lg" });
    const seen = await chat.send("call:planner {}");
    out.handoff = { seen, after: chat.summary() };
  },
  load_unknown_thread: async (out) => {
    const result = await newClient([]).loadAgentState({ threadId: "gql-agents-never", agentName: "lg" })
      .toPromise();
    out.load_unknown_thread = { data: result.data ?? null,
      error: result.error ? describeError(result.error) : null };
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
