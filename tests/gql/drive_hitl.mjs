// Drives the human-in-the-loop workflows of a CopilotKit GraphQL runtime with the real
// client, @copilotkit/runtime-client-gql 1.10.6, for tests/test_hitl_graphql.py.
//
//   node drive_hitl.mjs <scenario> <runtime url> [options-json]
//
// A chat is kept the way react-core 1.10's useChat keeps it (its agent session, its agents'
// states, the history the last agent-state message syncs) and an interrupt the way its
// useLangGraphInterrupt does: the response's `LangGraphInterruptEvent` (or
// `CopilotKitLangGraphInterruptEvent`, whose messages join the chat) becomes the pending
// interrupt action; resolving it sets its `response` and runs the chat again, the request
// carrying `metaEvents: [{name, value, response}]` (value and response as JSON strings).
//
// Writes JSON lines to stdout; the last one is {scenario, ok, error?, ...}. The `restart`
// scenario first writes {"waiting": true, ...} and reads a line from stdin before answering
// (the page stays open while the server is killed and restarted).
import { createRequire } from "node:module";
import readline from "node:readline";

const require = createRequire(import.meta.url);
const gql = require("@copilotkit/runtime-client-gql");

const writeStdout = process.stdout.write.bind(process.stdout);
for (const level of ["log", "info", "warn", "debug"]) console[level] = (...args) => console.error(...args);

const CREATED = new Date("2025-01-01T00:00:00.000Z");
const TIMEOUT_MS = 20000;
const [scenarioName, urlArg, optionsArg] = process.argv.slice(2);
const options = optionsArg ? JSON.parse(optionsArg) : {};
const url = urlArg;

let counter = 0;
const nextId = (kind) => `${kind}-${String(++counter).padStart(3, "0")}`;
const parseJson = (value) => {
  if (typeof value !== "string") return value;
  try { return JSON.parse(value); } catch { return value; }
};
const describeError = (error) => ({ message: String(error?.message ?? error),
  codes: (error?.graphQLErrors ?? []).map((e) => e?.extensions?.code ?? null) });

function withTimeout(promise, what) {
  let timer;
  const timeout = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new Error(`${what} timed out`)), TIMEOUT_MS);
  });
  return Promise.race([promise, timeout]).finally(() => clearTimeout(timer));
}

class Chat {
  constructor(threadId, agent, state) {
    this.answered = null;
    this.threadId = threadId;
    this.agentLock = agent;
    this.agentSession = { agentName: agent };
    this.history = [];
    this.coagentStates = state ? { [agent]: { name: agent, state } } : {};
    this.interrupt = null; // useLangGraphInterrupt's action: {event: {name, value, response?}}
  }

  request() {
    const event = this.interrupt?.event;
    const answering = Boolean(event?.response);
    return {
      frontend: { actions: [], url: "http://localhost:3000/" },
      threadId: this.threadId,
      runId: null,
      extensions: {},
      metaEvents: answering ? [{
        name: event.name,
        value: typeof event.value === "string" ? event.value : JSON.stringify(event.value),
        response: typeof event.response === "string" ? event.response : JSON.stringify(event.response),
      }] : undefined,
      messages: gql.convertMessagesToGqlInput(gql.filterAgentStateMessages(this.history)),
      metadata: { requestType: gql.CopilotRequestType.Chat },
      agentSession: this.agentSession,
      agentStates: Object.values(this.coagentStates).map((s) => ({
        agentName: s.name, state: JSON.stringify(s.state) })),
      forwardedParameters: {},
      context: [],
    };
  }

  send(text) {
    this.history.push(new gql.TextMessage({ id: nextId("user"), createdAt: CREATED,
      role: gql.Role.User, content: text }));
    return this.round();
  }

  // The interrupt's resolve(): the response goes with the next run of the chat.
  answer(response) {
    if (!this.interrupt) throw new Error("no interrupt to answer");
    this.answered = { ...this.interrupt.event, response };
    this.interrupt = { event: this.answered };
    return this.round();
  }

  // The last answer sent once more (a second click, a retried request).
  answerAgain() {
    if (!this.answered) throw new Error("nothing answered yet");
    this.interrupt = { event: this.answered };
    return this.round();
  }

  async round() {
    const errors = [];
    const client = new gql.CopilotRuntimeClient({ url,
      handleGQLErrors: (error) => errors.push(describeError(error)), handleGQLWarning: () => {} });
    const request = this.request();
    if (request.metaEvents) this.interrupt = null; // answered: the action is done
    const reader = client.asStream(client.generateCopilotResponse({ data: request })).getReader();
    let last = null;
    try {
      for (;;) {
        const { done, value } = await withTimeout(reader.read(), "reading the response");
        if (done) break;
        last = value;
      }
    } catch (error) {
      errors.push(describeError(error));
    }
    const result = last?.generateCopilotResponse ?? null;
    const raw = result?.messages ?? [];
    const metaEvents = result?.metaEvents ?? [];
    const failed = result?.status?.__typename === "FailedResponseStatus";
    const produced = gql.convertGqlOutputToMessages(gql.filterAdjacentAgentStateMessages(raw));
    if (!failed) {
      let synced = [];
      const lastState = [...produced].reverse().find((m) => m.isAgentStateMessage());
      if (lastState) {
        if (lastState.state.messages && lastState.state.messages.length > 0) {
          synced = gql.loadMessagesFromJsonRepresentation(lastState.state.messages);
        }
        this.coagentStates[lastState.agentName] = { name: lastState.agentName, state: lastState.state };
        this.agentSession = lastState.running
          ? { threadId: lastState.threadId, agentName: lastState.agentName, nodeName: lastState.nodeName }
          : { threadId: nextId("thread"), agentName: this.agentLock };
      }
      let final = synced.length > 0 ? synced : [...this.history, ...produced];
      for (const meta of metaEvents) {
        if (meta.name === "LangGraphInterruptEvent") {
          this.interrupt = { event: { name: meta.name, value: parseJson(meta.value) } };
        } else if (meta.name === "CopilotKitLangGraphInterruptEvent") {
          this.interrupt = { event: { name: "LangGraphInterruptEvent", value: parseJson(meta.data.value) } };
          final = [...final, ...gql.convertGqlOutputToMessages(meta.data.messages)];
        }
      }
      for (const message of final) message.createdAt = CREATED;
      this.history = final;
    }
    return {
      errors,
      status: result?.status ?? null,
      metaEvents: metaEvents.map((m) => ({ name: m.name, value: parseJson(m.value) ?? null,
        data: m.data ? { value: parseJson(m.data.value), messages: m.data.messages.length } : null })),
      states: raw.filter((m) => m.__typename === "AgentStateMessageOutput").map((m) => ({
        agentName: m.agentName, threadId: m.threadId, nodeName: m.nodeName, active: m.active,
        running: m.running, state: JSON.parse(m.state) })),
      texts: raw.filter((m) => m.__typename === "TextMessageOutput").map((m) => m.content.join("")),
      interrupt: this.interrupt ? structuredClone(this.interrupt.event) : null,
      history: this.history.filter((m) => m.isTextMessage()).map((m) => ({ role: m.role, content: m.content })),
      agentSession: structuredClone(this.agentSession),
    };
  }
}

async function waitForGo() {
  const lines = readline.createInterface({ input: process.stdin });
  for await (const line of lines) { lines.close(); return line; }
  throw new Error("stdin closed before the go-ahead");
}

const scenarios = {
  // A task, then the given answers in turn (one per interrupt).
  // With `again`, the last answer is then sent a second time.
  async converse({ agentId = "review_loop", threadId = `thread-${crypto.randomUUID()}`, task, answers = [], state = null, again = false }) {
    const chat = new Chat(threadId, agentId, state);
    const steps = [await chat.send(task)];
    for (const answer of answers) steps.push(await chat.answer(answer));
    if (again) steps.push(await chat.answerAgain());
    return { threadId, steps };
  },
  // A task that stops at an interrupt; then, with the page still open, the test does what
  // it must (kills and restarts the server, or waits for a timeout) and says "go" on stdin,
  // and the answers are given.
  async restart({ agentId = "review_loop", threadId = `thread-${crypto.randomUUID()}`, task, answers = [] }) {
    const chat = new Chat(threadId, agentId, null);
    const steps = [await chat.send(task)];
    writeStdout(`${JSON.stringify({ waiting: true, threadId, steps })}\n`);
    await waitForGo();
    for (const answer of answers) steps.push(await chat.answer(answer));
    return { threadId, steps };
  },
};

function emit(payload, code) {
  writeStdout(`${JSON.stringify(payload)}\n`, () => process.exit(code));
}

const scenario = scenarios[scenarioName];
if (!scenario) {
  emit({ scenario: scenarioName, ok: false, error: `unknown scenario '${scenarioName}'` }, 1);
} else {
  try {
    emit({ scenario: scenarioName, ok: true, ...(await scenario(options)) }, 0);
  } catch (error) {
    emit({ scenario: scenarioName, ok: false, error: String(error?.stack ?? error) }, 1);
  }
}
