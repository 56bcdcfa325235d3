// The current generation: @copilotkit/react-core 1.74 and its v2 chat, over AG-UI.
import { useEffect, useRef, useState } from "react";
import { createRoot } from "react-dom/client";
import {
  CopilotChat,
  CopilotKitProvider,
  useAgent,
  useFrontendTool,
  useInterrupt,
  useRenderTool,
} from "@copilotkit/react-core/v2";
import "@copilotkit/react-core/v2/styles.css";
import { z } from "zod";
import {
  ACCENTS, ApprovalPanel, Frame, RUNTIME_URL, WeatherCard, useAccent, useThreadAddress,
} from "../shared/demo.jsx";
import "../shared/demo.css";

// The server-side action `get_weather`, rendered as a card from its tool call and result.
function useWeatherCard(agentId) {
  useRenderTool({
    name: "get_weather",
    agentId,
    parameters: z.object({ city: z.string() }),
    render: ({ status, parameters, result }) => (
      <WeatherCard args={parameters} result={result} done={status === "complete"} />
    ),
  }, [agentId]);
}

// A frontend tool: the model calls it, the page runs it.
function useAccentTool(setAccent) {
  useFrontendTool({
    name: "set_accent_color",
    description: "Change the accent colour of the demo page.",
    parameters: z.object({ color: z.enum(ACCENTS).describe("the new accent colour") }),
    handler: async ({ color }) => {
      setAccent(color);
      return { accent: color };
    },
  }, [setAccent]);
}

// The workflows' approval step, from the agent's interrupt (on_interrupt or the AG-UI outcome).
function useApprovals(agentId) {
  useInterrupt({
    agentId,
    render: ({ event, interrupt, resolve }) => {
      const value = interrupt ? (interrupt.metadata?.langgraph?.raw ?? interrupt.value ?? interrupt) : event.value;
      return <ApprovalPanel value={value} answer={(decision) => resolve(decision)} />;
    },
  });
}

// Tells the thread list when a run ends, so a new thread shows up.
function useRunsFinished(agentId, onFinished) {
  const { agent } = useAgent({ agentId });
  const wasRunning = useRef(false);
  const running = Boolean(agent?.isRunning);
  useEffect(() => {
    if (wasRunning.current && !running) onFinished();
    wasRunning.current = running;
  }, [running, onFinished]);
}

function Chat({ address, setAccent, onRunFinished }) {
  useWeatherCard(address.agent);
  useAccentTool(setAccent);
  useApprovals(address.agent);
  useRunsFinished(address.agent, onRunFinished);
  return (
    <CopilotChat
      key={`${address.agent}:${address.threadId}`}
      agentId={address.agent}
      threadId={address.threadId}
      labels={{ chatInputPlaceholder: "Ask the demo…" }}
    />
  );
}

function App() {
  const address = useThreadAddress();
  const [accent, setAccent] = useAccent();
  const [finishedRuns, setFinishedRuns] = useState(0);
  const [onRunFinished] = useState(() => () => setFinishedRuns((n) => n + 1));
  return (
    <CopilotKitProvider runtimeUrl={RUNTIME_URL}>
      <Frame generation="CopilotKit react-core 1.74 · v2 chat · AG-UI"
             other={{ href: "/classic", label: "classic page (1.10.6, GraphQL) →" }}
             accent={accent} address={address} refreshKey={finishedRuns}>
        <Chat address={address} setAccent={setAccent} onRunFinished={onRunFinished} />
      </Frame>
    </CopilotKitProvider>
  );
}

createRoot(document.getElementById("root")).render(<App />);
