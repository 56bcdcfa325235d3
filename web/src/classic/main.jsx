// The classic generation: @copilotkit/react-core and @copilotkit/react-ui 1.10.6, over GraphQL.
// (The build points these names at the 1.10.6 packages; see build.mjs.)
import { useEffect, useRef, useState } from "react";
import { createRoot } from "react-dom/client";
import {
  CopilotKit,
  useCopilotAction,
  useCopilotChat,
  useCopilotContext,
  useCopilotMessagesContext,
  useLangGraphInterrupt,
  useDefaultTool,
} from "@copilotkit/react-core";
import { CopilotChat } from "@copilotkit/react-ui";
import { loadMessagesFromJsonRepresentation } from "@copilotkit/runtime-client-gql";
import "@copilotkit/react-ui/styles.css";
import {
  ACCENTS, ApprovalPanel, Frame, RUNTIME_URL, WeatherCard, useAccent, useThreadAddress,
} from "../shared/demo.jsx";
import "../shared/demo.css";

// The server-side action `get_weather`, rendered as a card. A catch-all renderer: an action
// of the same name on the page would make react-core 1.10 run it in the browser too.
function useWeatherCard() {
  useDefaultTool({
    render: ({ name, status, args, result }) => (name === "get_weather"
      ? <WeatherCard args={args} result={result} done={status === "complete"} />
      : <div className="tool-call">{name}: {status}</div>),
  });
}

// A frontend action: the model calls it, the page runs it.
function useAccentTool(setAccent) {
  useCopilotAction({
    name: "set_accent_color",
    description: "Change the accent colour of the demo page.",
    parameters: [{ name: "color", type: "string", enum: ACCENTS, required: true,
                   description: "the new accent colour" }],
    handler: async ({ color }) => {
      setAccent(color);
      return { accent: color };
    },
  }, [setAccent]);
}

// The workflows' approval step, from the LangGraph interrupt meta event.
function useApprovals() {
  useLangGraphInterrupt({
    render: ({ event, resolve }) => (
      <ApprovalPanel value={event.value} answer={(decision) => resolve(JSON.stringify(decision))} />
    ),
  });
}

// react-core 1.10 reloads a thread by itself only for agents (through loadAgentState); for the
// default agent this asks the runtime the same way and hands the messages to the chat.
function useRestoreDefaultThread(agent, threadId) {
  const { runtimeClient } = useCopilotContext();
  const { setMessages } = useCopilotMessagesContext();
  useEffect(() => {
    if (agent !== "default") return undefined;
    let cancelled = false;
    runtimeClient.loadAgentState({ threadId, agentName: "default" }).then((result) => {
      const loaded = result.data?.loadAgentState;
      if (cancelled || !loaded?.threadExists) return;
      setMessages(loadMessagesFromJsonRepresentation(JSON.parse(loaded.messages || "[]")));
    });
    return () => { cancelled = true; };
  }, [agent, threadId]); // eslint-disable-line react-hooks/exhaustive-deps
}

function useRunsFinished(onFinished) {
  const { isLoading } = useCopilotChat();
  const wasLoading = useRef(false);
  useEffect(() => {
    if (wasLoading.current && !isLoading) onFinished();
    wasLoading.current = isLoading;
  }, [isLoading, onFinished]);
}

function Chat({ address, setAccent, onRunFinished }) {
  useWeatherCard();
  useAccentTool(setAccent);
  useApprovals();
  useRestoreDefaultThread(address.agent, address.threadId);
  useRunsFinished(onRunFinished);
  return <CopilotChat labels={{ placeholder: "Ask the demo…", initial: "Hi! Ask me something." }} />;
}

function App() {
  const address = useThreadAddress();
  const [accent, setAccent] = useAccent();
  const [finishedRuns, setFinishedRuns] = useState(0);
  const [onRunFinished] = useState(() => () => setFinishedRuns((n) => n + 1));
  return (
    <Frame generation="CopilotKit react-core + react-ui 1.10.6 · classic chat · GraphQL"
           other={{ href: "/", label: "← current page (1.74, AG-UI)" }}
           accent={accent} address={address} refreshKey={finishedRuns}>
      <CopilotKit key={`${address.agent}:${address.threadId}`} runtimeUrl={RUNTIME_URL}
                  threadId={address.threadId}
                  agent={address.agent === "default" ? undefined : address.agent}
                  showDevConsole={false}>
        <Chat address={address} setAccent={setAccent} onRunFinished={onRunFinished} />
      </CopilotKit>
    </Frame>
  );
}

createRoot(document.getElementById("root")).render(<App />);
