// The current generation: @copilotkit/react-core 1.74 and its v2 chat, over AG-UI.
import { useCallback, useEffect, useRef, useState } from "react";
import { createRoot } from "react-dom/client";
import {
  CopilotChat,
  CopilotKitProvider,
  useAgent,
  useCopilotKit,
  useFrontendTool,
  useInterrupt,
  useRenderTool,
} from "@copilotkit/react-core/v2";
import "@copilotkit/react-core/v2/styles.css";
import { defaultRehypePlugins } from "streamdown";
import { z } from "zod";
import {
  ACCENTS, ApprovalPanel, Frame, MessageImage, RUNTIME_URL, RunError, WeatherCard, deadlineAnswered,
  useAccent, useReloadOnceAnswered, useRunEdges, useThreadAddress,
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

// The chat's input, where the keyboard's focus goes back once an approval is answered.
const CHAT_INPUT = '[data-testid="copilot-chat-textarea"]';

// The workflows' approval step, from the agent's interrupt (on_interrupt or the AG-UI outcome).
// Past its deadline the runtime has answered it: the page then shows the thread again. Says
// whether one is pending: the page places it in the chat itself, as useInterrupt would.
// `answered` is set as the person answers: 1.74 drops the question then, whether or not the
// run carrying the answer gets through.
function useApprovals(address, reload, answered) {
  const { copilotkit } = useCopilotKit();
  const approval = useInterrupt({
    agentId: address.agent,
    renderInChat: false,
    render: ({ event, interrupt, resolve }) => {
      const value = interrupt ? (interrupt.metadata?.langgraph?.raw ?? interrupt.value ?? interrupt) : event.value;
      const answer = (decision) => { answered.current = true; resolve(decision); };
      return <ApprovalPanel value={value} answer={answer} chatInput={CHAT_INPUT}
                            onExpired={() => deadlineAnswered(address.agent, address.threadId).then(reload)} />;
    },
  });
  useEffect(() => copilotkit.setInterruptElement(approval), [copilotkit, approval]);
  useEffect(() => () => copilotkit.setInterruptElement(null), [copilotkit]);
  return approval !== null;
}

// A message sent while an approval waits is refused by the runtime after its run started, and
// 1.74 then drops the approval until a reload: the input waits for the answer, as the classic
// page's does.
// 1.74's "+" (add menu) offers attaching files and a tools menu: the demo has neither, and the
// button stood there disabled, without a label. The slot renders nothing instead.
const NO_ADD_MENU = () => null;
const INPUT = { addMenuButton: NO_ADD_MENU };
const INPUT_WHILE_APPROVAL_PENDING = { ...INPUT, textArea: { disabled: true }, sendButton: { disabled: true } };

// 1.74's chat renders assistant markdown with Streamdown, whose default plugins make raw HTML
// in a message real elements (scripts stripped, but an outside image is fetched as the thread
// is shown, and a link or form is drawn by whoever steered the model). The page keeps its
// other plugins (math, sanitizing, hardening links) and shows raw HTML as the text it is, as
// the classic page does; a markdown image from elsewhere shows as text too (MessageImage).
// (Streamdown is react-core's own dependency, hoisted by npm.)
function rawHtmlAsText() {
  const asText = (node) => {
    for (const child of node.children ?? []) {
      if (child.type === "raw") child.type = "text";
      else asText(child);
    }
  };
  return asText;
}
// Streamdown's hardening makes a protocol-relative image address (//host/x) a path on this
// origin: image addresses are made absolute first, so MessageImage sees where they point.
function imageAddressesAbsolute() {
  const resolve = (node) => {
    for (const child of node.children ?? []) {
      if (child.tagName === "img" && typeof child.properties?.src === "string") {
        try { child.properties.src = new URL(child.properties.src, window.location.href).href; } catch { /* kept */ }
      }
      resolve(child);
    }
  };
  return resolve;
}
const { raw, ...otherRehypePlugins } = defaultRehypePlugins; // eslint-disable-line no-unused-vars
const MESSAGE_VIEW = { assistantMessage: { markdownRenderer: {
  rehypePlugins: [rawHtmlAsText, imageAddressesAbsolute, ...Object.values(otherRehypePlugins)],
  components: { img: MessageImage } } } };

// Whether the agent runs now (a run of this page, or `connect` replaying the thread).
function useRunning(agentId) {
  const { agent } = useAgent({ agentId });
  return Boolean(agent?.isRunning);
}

// A run the runtime refused with an HTTP error (409 for a thread another tab runs, 400 for an
// id too long) reaches onError as "HTTP 409: {its JSON body}": the banner shows the body's
// words, as the classic page does.
function errorText(error, code) {
  const text = error?.message || String(code);
  const answer = /^HTTP \d+: (\{.*\})$/s.exec(text);
  try {
    const body = JSON.parse(answer[1]);
    const [detail] = typeof body.details === "string" ? JSON.parse(body.details) : [];
    return body.message || [body.error, detail?.path?.join("."), detail?.message].filter(Boolean).join(": ") || text;
  } catch {
    return text; // no HTTP error, or a body that is no JSON of the runtime's
  }
}

function Chat({ address, setAccent, onRunFinished, showError, reload, reconnect }) {
  useWeatherCard(address.agent);
  useAccentTool(setAccent);
  const answered = useRef(false);
  const approvalPending = useApprovals(address, reload, answered);
  // The chat shows no run error itself: the page shows it above the chat. Only errors after
  // the person did something here: `connect` replays a thread's failed runs with their errors.
  const touched = useRef(false);
  // A run's start puts the last run's error away (not `connect` replaying the thread, as after
  // a failed answer: its error stays); its end tells the thread list (a new thread shows up),
  // and ends what an answer's run could still make fail.
  useRunEdges(useRunning(address.agent), () => { if (touched.current) showError(null); },
              () => { answered.current = false; onRunFinished(); });
  const reconnectOnceAnswered = useReloadOnceAnswered(reconnect);
  const onError = ({ error, code }) => {
    // A failed fetch: the runtime is away (a restart, a network blip), or was for this request.
    const unreachable = error instanceof TypeError;
    if (code === "agent_connect_failed") {
      // A thread opened while the runtime is away is connected again once it answers (an
      // HTTP error answer would only be given again).
      if (unreachable) reconnectOnceAnswered();
    } else if (answered.current) {
      // The run carrying an answer failed (the runtime away, or a stale question another tab
      // answered): the thread still asks, and is shown again once the runtime answers.
      answered.current = false;
      reconnectOnceAnswered();
    }
    if (touched.current) showError(errorText(error, code), unreachable);
  };
  return (
    <div className="chat-column" onKeyDownCapture={() => { touched.current = true; }}
         onPointerDownCapture={() => { touched.current = true; }}>
      <CopilotChat
        agentId={address.agent}
        threadId={address.threadId}
        labels={{ chatInputPlaceholder: "Ask the demo…" }}
        messageView={MESSAGE_VIEW}
        input={approvalPending ? INPUT_WHILE_APPROVAL_PENDING : INPUT}
        onError={onError}
      />
    </div>
  );
}

function App() {
  const address = useThreadAddress();
  const [accent, setAccent] = useAccent();
  const [finishedRuns, setFinishedRuns] = useState(0);
  const [onRunFinished] = useState(() => () => setFinishedRuns((n) => n + 1));
  // A remount of the chat connects to the thread again: it shows it as the runtime has it.
  const [reloads, setReloads] = useState(0);
  const reload = useCallback(() => setReloads((n) => n + 1), []);
  // A remount of the provider asks the runtime again what it serves: one that could not be
  // reached knows no agent, and its chat sends nothing.
  const [connections, setConnections] = useState(0);
  const reconnect = useCallback(() => setConnections((n) => n + 1), []);
  // The last run's error, for the banner; one of a runtime away goes once it answers again.
  const [runError, setRunError] = useState(null);
  useEffect(() => setRunError(null), [address.agent, address.threadId]);
  const awayErrorGone = useReloadOnceAnswered(useCallback(
    () => setRunError((shown) => (shown?.unreachable ? null : shown)), []));
  const showError = useCallback((message, unreachable = false) => {
    setRunError(message && { message, unreachable });
    if (message && unreachable) awayErrorGone();
  }, [awayErrorGone]);
  return (
    <CopilotKitProvider key={connections} runtimeUrl={RUNTIME_URL}>
      <Frame generation="CopilotKit react-core 1.74 · v2 chat · AG-UI"
             other={{ href: "/classic", label: "classic page (1.10.6, GraphQL) →" }}
             accent={accent} address={address} refreshKey={finishedRuns}>
        <div className="chat-column">
          {runError && <RunError message={runError.message} onDismiss={() => setRunError(null)} />}
          <Chat key={`${address.agent}:${address.threadId}:${reloads}`} address={address}
                setAccent={setAccent} onRunFinished={onRunFinished} showError={showError} reload={reload}
                reconnect={reconnect} />
        </div>
      </Frame>
    </CopilotKitProvider>
  );
}

createRoot(document.getElementById("root")).render(<App />);
