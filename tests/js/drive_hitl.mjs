// Real-client driver for tests/test_hitl_real_client.py (human-in-the-loop workflows).
//
//   node drive_hitl.mjs <scenario> <runtimeUrl> [options-json]
//
// Two client generations, as real apps use them:
//   "legacy": CopilotKitCore from @copilotkit/core 1.75 (agents are @ag-ui/client 0.0.59
//             HttpAgents). Interrupts arrive as the `on_interrupt` custom event; the answer
//             goes back the way react-core's useInterrupt sends it: through the core's
//             ɵInterruptState (setLegacy/resolve), then runAgent with
//             forwardedProps.command = {resume, interruptEvent}.
//   "v1":     HttpAgent from @ag-ui/client 1.0.0 (sends protocolVersion). Interrupts arrive
//             as RUN_FINISHED.outcome and land in agent.pendingInterrupts; the answer is
//             runAgent({resume: buildResumeArray(...)}).
// Writes ONE JSON line to stdout: {scenario, ok, error?, coreErrors, ...}. Exit 0 when the
// scenario ran to its end (what the client saw is data), 1 otherwise.

const writeStdout = process.stdout.write.bind(process.stdout);
for (const level of ["log", "info", "warn", "debug"]) console[level] = (...args) => console.error(...args);
globalThis.window ??= {}; // CopilotKitCore only fetches /info when a `window` exists

const [scenarioName, runtimeUrlArg, optionsArg] = process.argv.slice(2);
const options = optionsArg ? JSON.parse(optionsArg) : {};
const runtimeUrl = (runtimeUrlArg ?? "").replace(/\/+$/, "");
const coreErrors = [];

const { CopilotKitCore, ɵInterruptState: InterruptState } = await import("@copilotkit/core");
const { HttpAgent: HttpAgentV1, buildResumeArray } = await import("agui-client-1");

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
const uid = (prefix) => `${prefix}-${crypto.randomUUID()}`;
const clone = (value) => (value === undefined ? null : JSON.parse(JSON.stringify(value)));
const parse = (value) => {
  if (typeof value !== "string") return value;
  try { return JSON.parse(value); } catch { return value; }
};

// ---- the legacy client: CopilotKitCore + @ag-ui/client 0.0.59 --------------------------------
class LegacyClient {
  static async open(agentId, threadId, state = {}) {
    const core = new CopilotKitCore({ runtimeUrl, runtimeTransport: "rest" });
    core.subscribe({ onError: ({ code, error }) => coreErrors.push({ code, message: String(error?.message ?? error) }) });
    const deadline = Date.now() + 8000;
    while (!["connected", "error"].includes(core.runtimeConnectionStatus)) {
      if (Date.now() > deadline) throw new Error("the runtime connection (/info) timed out");
      await sleep(10);
    }
    const agent = core.getAgent(agentId);
    if (!agent) throw new Error(`agent '${agentId}' not discovered: ${Object.keys(core.agents)}`);
    agent.threadId = threadId;
    agent.setMessages([]);
    agent.setState(state);
    return new LegacyClient(core, agent);
  }

  constructor(core, agent) {
    this.core = core;
    this.agent = agent;
    this.interrupts = new InterruptState();
  }

  // Like useInterrupt: remember the run's on_interrupt event; hand it over when the run ends.
  async #observe(work) {
    const events = [];
    let interrupt = null;
    const subscription = this.agent.subscribe({
      onEvent: ({ event }) => { const { rawEvent, ...rest } = event; events.push(clone(rest)); },
      onCustomEvent: ({ event }) => { if (event.name === "on_interrupt") interrupt = { name: event.name, value: event.value }; },
    });
    try { await work(); } finally { subscription.unsubscribe(); }
    if (interrupt) this.interrupts.setLegacy(interrupt); else this.interrupts.clear();
    return this.#step(events, interrupt);
  }

  #step(events, interrupt) {
    return {
      events,
      interrupt: interrupt ? parse(interrupt.value) : null,
      messages: clone(this.agent.messages),
      state: clone(this.agent.state),
      pendingInterrupts: clone(this.agent.pendingInterrupts ?? []),
    };
  }

  send(text) {
    return this.#observe(async () => {
      this.agent.addMessage({ id: uid("user"), role: "user", content: text });
      await this.core.runAgent({ agent: this.agent });
    });
  }

  // A page reload: the thread's history replayed (its interrupt event included).
  connect() {
    return this.#observe(() => this.core.connectAgent({ agent: this.agent }));
  }

  answer(response) {
    const action = this.interrupts.resolve(response);
    if (action.kind !== "legacy-resume") throw new Error(`no legacy interrupt to answer (${action.kind})`);
    return this.#observe(() => this.core.runAgent({
      agent: this.agent,
      forwardedProps: { command: { resume: action.payload, interruptEvent: action.interruptValue } },
    }));
  }
}

// ---- the v1 client: @ag-ui/client 1.0 HttpAgent -------------------------------------------------
class V1Client {
  static async open(agentId, threadId, state = {}) {
    return new V1Client(new HttpAgentV1({ url: `${runtimeUrl}/agent/${agentId}/run`, threadId, initialState: state }));
  }

  constructor(agent) {
    this.agent = agent;
  }

  async #observe(work) {
    const events = [];
    const errors = [];
    const subscription = this.agent.subscribe({
      onEvent: ({ event }) => { const { rawEvent, ...rest } = event; events.push(clone(rest)); },
    });
    try { await work(); } catch (error) { errors.push(String(error?.message ?? error)); } finally { subscription.unsubscribe(); }
    const pending = clone(this.agent.pendingInterrupts ?? []);
    return {
      events,
      errors,
      interrupt: pending.length ? pending[0] : null,
      messages: clone(this.agent.messages),
      state: clone(this.agent.state),
      pendingInterrupts: pending,
    };
  }

  send(text) {
    return this.#observe(async () => {
      this.agent.addMessage({ id: uid("user"), role: "user", content: text });
      await this.agent.runAgent();
    });
  }

  // An answer to the pending interrupt; after a restart a fresh agent knows it only by id.
  answer(response, interruptId) {
    const pending = this.agent.pendingInterrupts?.length
      ? this.agent.pendingInterrupts
      : [{ id: interruptId, reason: "review" }];
    const resume = buildResumeArray(pending, Object.fromEntries(
      pending.map((i) => [i.id, { status: "resolved", payload: response }])));
    return this.#observe(() => this.agent.runAgent({ resume }));
  }
}

const open = (client, ...args) => (client === "v1" ? V1Client : LegacyClient).open(...args);

// ---- scenarios -------------------------------------------------------------------------------------
const scenarios = {
  // A task, then the given answers in turn (an answer per interrupt).
  async converse({ client, agentId = "review_loop", threadId = uid("thread"), task, answers = [], state = {} }) {
    const c = await open(client, agentId, threadId, state);
    const steps = [await c.send(task)];
    for (const answer of answers) steps.push(await c.answer(answer));
    return { threadId, steps };
  },

  // Phase one of a restart: a task that stops at an interrupt. Then the server is killed.
  async start({ client, agentId = "review_loop", threadId = uid("thread"), task, state = {} }) {
    const c = await open(client, agentId, threadId, state);
    return { threadId, steps: [await c.send(task)] };
  },

  // Phase two, in a new process against the restarted server: reload the thread (legacy
  // client: connect replays it; v1 knows the interrupt id from phase one) and answer.
  async resume({ client, agentId = "review_loop", threadId, interruptId, answers = [] }) {
    const c = await open(client, agentId, threadId);
    const steps = [];
    if (client !== "v1") steps.push(await c.connect());
    for (const answer of answers) steps.push(await c.answer(answer, interruptId));
    return { threadId, steps };
  },

  // A reload: what a fresh CopilotKitCore shows for the thread.
  async connect({ agentId = "review_loop", threadId }) {
    const c = await LegacyClient.open(agentId, threadId);
    return { threadId, steps: [await c.connect()] };
  },
};

function emit(payload, code) {
  writeStdout(`${JSON.stringify(payload)}\n`, () => process.exit(code));
}

const scenario = scenarios[scenarioName];
if (!scenario) {
  emit({ scenario: scenarioName, ok: false, error: `unknown scenario '${scenarioName}'`, coreErrors }, 1);
} else {
  try {
    const result = await scenario(options);
    emit({ scenario: scenarioName, ok: true, coreErrors, ...result }, 0);
  } catch (error) {
    emit({ scenario: scenarioName, ok: false, error: String(error?.stack ?? error), coreErrors }, 1);
  }
}
