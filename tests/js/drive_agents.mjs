// Real-client driver for tests/test_agents_real_client.py (agent kinds behind our runtime).
//
//   node drive_agents.mjs <scenario> <runtimeUrl> [options-json]
//
// Uses CopilotKitCore from @copilotkit/core (with its ProxiedCopilotRuntimeAgent, i.e.
// @ag-ui/client's HttpAgent) exactly as a browser app would, and writes ONE JSON line to
// stdout: {scenario, ok, error?, coreErrors, ...scenario fields}. Library logs go to stderr.
// Exit code 0 when the scenario ran to its end (client-side errors are data), 1 otherwise.

const writeStdout = process.stdout.write.bind(process.stdout);
for (const level of ["log", "info", "warn", "debug"]) console[level] = (...args) => console.error(...args);
globalThis.window ??= {}; // CopilotKitCore only fetches /info when a `window` exists

const [scenarioName, runtimeUrlArg, optionsArg] = process.argv.slice(2);
const options = optionsArg ? JSON.parse(optionsArg) : {};
const runtimeUrl = (runtimeUrlArg ?? "").replace(/\/+$/, "");
const coreErrors = [];

const { CopilotKitCore } = await import("@copilotkit/core");
const { z } = await import("zod");

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
const uid = (prefix) => `${prefix}-${crypto.randomUUID()}`;
const clone = (value) => (value === undefined ? null : JSON.parse(JSON.stringify(value)));

async function startCore() {
  const core = new CopilotKitCore({ runtimeUrl, runtimeTransport: "rest" });
  core.subscribe({
    onError: ({ code, error }) => coreErrors.push({ code, message: String(error?.message ?? error) }),
  });
  const deadline = Date.now() + 8000;
  while (!["connected", "error"].includes(core.runtimeConnectionStatus)) {
    if (Date.now() > deadline) throw new Error("the runtime connection (/info) timed out");
    await sleep(10);
  }
  return core;
}

function agentOn(core, agentId, threadId, state = {}) {
  const agent = core.getAgent(agentId);
  if (!agent) throw new Error(`agent '${agentId}' not discovered: ${Object.keys(core.agents)}`);
  agent.threadId = threadId;
  agent.setMessages([]);
  agent.setState(state);
  return agent;
}

// One user message through CopilotKitCore.runAgent (which also runs frontend tools and the
// follow-up run they need); what the client ended up with.
async function converse(core, agent, text) {
  const events = [];
  const subscription = agent.subscribe({
    onEvent: ({ event }) => {
      const { rawEvent, ...rest } = event;
      events.push(clone(rest));
    },
  });
  agent.addMessage({ id: uid("user"), role: "user", content: text });
  try {
    await core.runAgent({ agent });
  } finally {
    subscription.unsubscribe();
  }
  return { messages: clone(agent.messages), state: clone(agent.state), events };
}

const scenarios = {
  // A LangGraph graph in the runtime's process: chat, a frontend tool, shared state.
  async langgraph() {
    const core = await startCore();
    const handlerCalls = [];
    core.addTool({
      name: "sayHello",
      description: "Greet a person by name.",
      parameters: z.object({ name: z.string() }),
      handler: async (args) => {
        handlerCalls.push(clone(args));
        return { greeting: `Hello, ${args.name}!` };
      },
    });
    const chat = await converse(core, agentOn(core, "lg", uid("thread")), "Hello");
    const tool = await converse(core, agentOn(core, "lg", uid("thread")), 'call:sayHello {"name":"Ada"}');
    const planner = agentOn(core, "planner", uid("thread"), { items: ["from the browser"], counter: 1 });
    const firstPlan = await converse(core, planner, "Plan");
    planner.setState({ ...planner.state, items: ["edited in the browser"] });
    const secondPlan = await converse(core, planner, "Again");
    return {
      agents: Object.keys(core.agents),
      chat,
      tool: { ...tool, handlerCalls },
      firstPlan,
      secondPlan,
    };
  },

  // A remote AG-UI agent (HttpAgent) through the runtime; then one that dies mid-stream.
  async remote() {
    const core = await startCore();
    const chat = await converse(core, agentOn(core, "remote", uid("thread"), { runs: 4 }), "Hello");
    const errorsBefore = coreErrors.length;
    const dies = await converse(core, agentOn(core, "remote", uid("thread")), "die:5 tell me more");
    return { chat, dies: { ...dies, errors: coreErrors.slice(errorsBefore) } };
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
