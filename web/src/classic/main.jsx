// The classic generation: @copilotkit/react-core and @copilotkit/react-ui 1.10.6, over GraphQL.
// (The build points these names at the 1.10.6 packages; see build.mjs.)
import { useCallback, useEffect, useRef, useState } from "react";
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
import { CopilotChat, useChatContext } from "@copilotkit/react-ui";
import { loadMessagesFromJsonRepresentation } from "@copilotkit/runtime-client-gql";
import "@copilotkit/react-ui/styles.css";
import Markdown from "react-markdown";
import remarkGfm from "remark-gfm";
import {
  ACCENTS, ApprovalPanel, Frame, MessageImage, RUNTIME_URL, RunError, WeatherCard, deadlineAnswered,
  retried, storedMessages, useAccent, useReloadOnceAnswered, useRunEdges, useThreadAddress,
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

// The chat's input, where the keyboard's focus goes back once an approval is answered.
const CHAT_INPUT = ".copilotKitInput textarea";

// The workflows' approval step, from the LangGraph interrupt meta event. Past its deadline the
// runtime has answered it: the page then shows the thread again.
function useApprovals(address, reload) {
  useLangGraphInterrupt({
    render: ({ event, resolve }) => (
      <ApprovalPanel value={event.value} answer={(decision) => resolve(JSON.stringify(decision))}
                     chatInput={CHAT_INPUT}
                     onExpired={() => deadlineAnswered(address.agent, address.threadId).then(reload)} />
    ),
  });
}

// react-ui 1.10.6 renders an assistant message's markdown with rehype-raw: HTML in a message
// (one a model was talked into writing, or one planted in a thread's history) would be live
// HTML in this page, and `<iframe srcdoc="<script>…">` runs script in its origin. So the page
// renders assistant messages itself: the same markdown (react-markdown and GitHub's extensions,
// the versions react-ui uses; see build.mjs), without raw HTML, which shows as text, and
// without images from elsewhere (MessageImage).
const markdownElement = (Tag) => function MarkdownElement({ node, ...props }) {
  return <Tag className="copilotKitMarkdownElement" {...props} />; // react-ui's markdown styles
};
const MARKDOWN_ELEMENTS = Object.fromEntries(["p", "h1", "h2", "h3", "h4", "h5", "h6", "ul", "ol",
  "li", "pre", "blockquote"].map((tag) => [tag, markdownElement(tag)]).concat([["img", MessageImage]]));

function AssistantMessage({ message, isLoading, subComponent }) {
  const { icons } = useChatContext();
  const content = message?.content || "";
  return (
    <>
      {content && (
        <div className="copilotKitMessage copilotKitAssistantMessage">
          <div className="copilotKitMarkdown">
            <Markdown remarkPlugins={[remarkGfm]} components={MARKDOWN_ELEMENTS}>{content}</Markdown>
          </div>
        </div>
      )}
      <div style={{ marginBottom: "0.5rem" }}>{subComponent}</div>
      {isLoading && <span>{icons.activityIcon}</span>}
    </>
  );
}

// The thread's messages as the runtime has them, for the chat (asked directly, so no client
// cache answers instead).
async function loadThread(agentName, threadId) {
  const messages = await storedMessages(agentName, threadId);
  return messages ? loadMessagesFromJsonRepresentation(messages) : null;
}

// react-core 1.10 reloads a thread by itself only for agents (through loadAgentState); for the
// default agent the page asks the runtime the same way and hands the messages to the chat.
// A thread opened mid-answer holds the answer so far: it is read again once its run has ended
// (`runEnded`: at once when none runs), else that part stayed shown, and sent as the history,
// as it was then. Not over what the chat shows by then (a message sent meanwhile).
function useRestoreDefaultThread(agent, threadId) {
  const { messages, setMessages } = useCopilotMessagesContext();
  const shown = useRef(messages);
  shown.current = messages;
  useEffect(() => {
    if (agent !== "default") return undefined;
    let cancelled = false;
    const stopped = () => cancelled;
    const ending = new AbortController();
    (async () => {
      const first = await retried(() => loadThread("default", threadId), stopped);
      if (cancelled || !first) return;
      setMessages(first);
      await retried(() => runEnded("default", threadId, ending.signal), stopped);
      const last = await retried(() => loadThread("default", threadId), stopped);
      if (!cancelled && last && shown.current === first) setMessages(last);
    })();
    return () => { cancelled = true; ending.abort(); };
  }, [agent, threadId]); // eslint-disable-line react-hooks/exhaustive-deps
}

// The thread's first pending approval, or null.
async function pendingApproval(agent, threadId) {
  const query = new URLSearchParams({ threadId, agentId: agent });
  const response = await fetch(`${RUNTIME_URL}/approvals?${query}`);
  return response.ok ? ((await response.json()).approvals[0] ?? null) : null;
}

// react-core 1.10 hears of an interrupt only in the response of the run that reached it. After
// a reload (or a restart of the server) the page finds the thread's pending approval through
// the runtime's approvals route, answers it there, and reloads the thread.
// The answer's thread is shown by a remount (`reload`), not by setMessages: a remount already
// under way (the page's reload after a refused message or an outage) would drop the messages
// set in the chat it replaces, and the new chat's own load of the thread, asked before the
// answer was applied, would then show the thread without it.
function PendingApproval({ agent, threadId, reload, showError }) {
  const { langGraphInterruptAction } = useCopilotContext();
  const [pending, setPending] = useState(null);
  useEffect(() => {
    if (agent === "default") return undefined;
    let cancelled = false;
    pendingApproval(agent, threadId).then((found) => { if (!cancelled) setPending(found); });
    return () => { cancelled = true; };
  }, [agent, threadId]);
  if (!pending || langGraphInterruptAction?.event) return null;
  const answer = async ({ action, feedback }) => {
    const response = await fetch(`${RUNTIME_URL}/approvals/${encodeURIComponent(pending.id)}`, {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ action, payload: feedback }),
    });
    // An answer taken puts away the error of what came before (a message refused meanwhile).
    showError(response.ok ? null : (await response.json().catch(() => ({}))).error ?? `HTTP ${response.status}`);
    // A revision leads to a new draft and a new approval: wait until it is listed, so that
    // the remounted chat offers it.
    for (let tries = action === "revise" ? 20 : 0; tries > 0; tries -= 1) {
      const found = await pendingApproval(agent, threadId).catch(() => null);
      if (found && found.id !== pending.id) break;
      if (tries > 1) await new Promise((resolve) => setTimeout(resolve, 250));
    }
    reload();
  };
  return (
    <div className="pending-approval">
      <ApprovalPanel key={pending.id} value={pending.value} expiresAt={pending.expiresAt} answer={answer}
                     chatInput={CHAT_INPUT}
                     onExpired={() => deadlineAnswered(agent, threadId).then(reload)} />
    </div>
  );
}

// A run the runtime refused because one runs on the thread already (the thread was opened
// again mid-run: 1.10.6 shows it as stored, without that run): resolves once that run has
// ended, as `connect` (the runtime's AG-UI route, which replays the thread and follows its
// live run) tells, so the page can show the thread as it is then.
const isThreadBusy = (error) => error?.extensions?.runtimeCode === "THREAD_BUSY"
  || /already has an active run/.test(error?.message ?? "");
async function runEnded(agent, threadId, signal) {
  const response = await fetch(`${RUNTIME_URL}/agent/${encodeURIComponent(agent)}/connect`, {
    method: "POST",
    signal,
    headers: { "Content-Type": "application/json", Accept: "text/event-stream" },
    body: JSON.stringify({ threadId, runId: crypto.randomUUID(), state: {}, messages: [], tools: [],
                           context: [], forwardedProps: {} }),
  });
  if (!response.ok) throw new Error(`HTTP ${response.status}`);
  await response.text(); // the stream ends with the live run
}

// react-core 1.10.6 throws a failed run's error on after handing it to onError (its
// useAsyncCallback), and nothing catches it: one the page's banner shows is no page error.
const shownInBanner = new Set();
window.addEventListener("unhandledrejection", (event) => {
  if (shownInBanner.has(event.reason?.message)) event.preventDefault();
});

// The stock input keeps its text in its own state: `draft` is put there as typing would, once.
function useDraftRestored(chat, draft, setDraft) {
  useEffect(() => {
    const textarea = chat.current?.querySelector(".copilotKitInput textarea");
    if (!draft || !textarea) return;
    Object.getOwnPropertyDescriptor(HTMLTextAreaElement.prototype, "value").set.call(textarea, draft);
    textarea.dispatchEvent(new Event("input", { bubbles: true }));
    setDraft(null);
  }, [draft]); // eslint-disable-line react-hooks/exhaustive-deps
}

// `reload`, after keeping the message last sent as the draft when the runtime has not got it
// (the run failed before it arrived: the runtime was away, or refused it), as the current
// page keeps it shown.
function useReloadKeepingUnsent(address, reload, setDraft) {
  const lastSent = useRef(null);
  const reloadKeepingUnsent = useCallback(async () => {
    const sent = lastSent.current;
    lastSent.current = null;
    if (sent) {
      const messages = await storedMessages(address.agent, address.threadId).catch(() => null);
      if (messages?.findLast((m) => m.role === "user")?.content !== sent) setDraft(sent);
    }
    reload();
  }, [address.agent, address.threadId, reload, setDraft]);
  return [(text) => { lastSent.current = text; }, reloadKeepingUnsent];
}

function Chat({ address, setAccent, onRunFinished, showError, reload, reloadKeepingInput, chat, draft,
                setDraft }) {
  useWeatherCard();
  useAccentTool(setAccent);
  useApprovals(address, reload);
  useRestoreDefaultThread(address.agent, address.threadId);
  useDraftRestored(chat, draft, setDraft);
  // A run's error goes to the page's banner (the stock ErrorMessage renders it as markdown
  // with raw HTML too), and the thread is shown again as the runtime has it, once the runtime
  // answers: a reload while it is away (a restart mid-answer) would show an empty chat.
  const [onSubmitMessage, reloadKeepingUnsent] = useReloadKeepingUnsent(address, reload, setDraft);
  // The error of a run that never reached the runtime (away: a restart, the network gone)
  // goes once the runtime answers and the thread is shown again, as the current page's does;
  // one the runtime answered stays until a run answers.
  const awayError = useRef(null);
  const reloadOnceAnswered = useReloadOnceAnswered(useCallback(async () => {
    const away = awayError.current;
    awayError.current = null;
    await reloadKeepingUnsent();
    if (away) showError((shown) => (shown === away ? null : shown));
  }, [reloadKeepingUnsent, showError]));
  // 1.10.6 stops a run by aborting its request, which then fails ("[Network] undefined"): a
  // stop the person asked for is no error.
  const stopped = useRef(false);
  const mounted = useRef(true);
  useEffect(() => {
    mounted.current = true;
    return () => { mounted.current = false; };
  }, []);
  const onStopGeneration = ({ stopGeneration }) => { stopped.current = true; stopGeneration(); };
  // A run's start (a message sent, an approval answered) ends what a stop excused, and puts
  // the last run's error away.
  const onRunStarted = () => { stopped.current = false; showError(null); };
  useRunEdges(useCopilotChat().isLoading, onRunStarted, onRunFinished);
  const onError = ({ error }) => {
    if (stopped.current) return;
    const message = error?.message || String(error);
    shownInBanner.add(message);
    showError(message);
    if (isThreadBusy(error)) {
      // Shown again once the run going has ended: its answer, the message kept as the draft,
      // and no error (the message can be sent now).
      retried(() => runEnded(address.agent, address.threadId), () => !mounted.current).then(() => {
        if (!mounted.current) return;
        showError((shown) => (shown === message ? null : shown));
        reloadKeepingUnsent();
      });
    } else {
      // urql's error of a request that got no answer (a failed fetch, a stream cut off).
      if (error?.networkError || /^\[Network\]/.test(message)) awayError.current = message;
      reloadOnceAnswered();
    }
  };
  return (
    <div className="classic-chat" ref={chat}>
      <PendingApproval agent={address.agent} threadId={address.threadId} reload={reloadKeepingInput}
                       showError={showError} />
      <CopilotChat labels={{ placeholder: "Ask the demo…", initial: "Hi! Ask me something." }}
                   AssistantMessage={AssistantMessage} ErrorMessage={() => null} onError={onError}
                   onStopGeneration={onStopGeneration} onSubmitMessage={onSubmitMessage} />
    </div>
  );
}

function App() {
  const address = useThreadAddress();
  const [accent, setAccent] = useAccent();
  const [finishedRuns, setFinishedRuns] = useState(0);
  const [onRunFinished] = useState(() => () => setFinishedRuns((n) => n + 1));
  // A remount of the provider loads the thread again, as the runtime has it now.
  const [reloads, setReloads] = useState(0);
  const reload = useCallback(() => setReloads((n) => n + 1), []);
  const [runError, setRunError] = useState(null);
  // A message whose run failed before the runtime got it, for the remounted chat's input.
  const [draft, setDraft] = useState(null);
  // The chat mounted now (a late call from one a reload replaced reads the one shown).
  const chat = useRef(null);
  // `reload`, with what is typed in the input put back in the remounted one.
  const reloadKeepingInput = useCallback(() => {
    const typed = chat.current?.querySelector(".copilotKitInput textarea")?.value;
    if (typed) setDraft(typed);
    reload();
  }, [reload]);
  useEffect(() => { setRunError(null); setDraft(null); }, [address.agent, address.threadId]);
  return (
    <Frame generation="CopilotKit react-core + react-ui 1.10.6 · classic chat · GraphQL"
           other={{ href: "/", label: "← current page (1.74, AG-UI)" }}
           accent={accent} address={address} refreshKey={finishedRuns}>
      <div className="chat-column">
        {runError && <RunError message={runError} onDismiss={() => setRunError(null)} />}
        <CopilotKit key={`${address.agent}:${address.threadId}:${reloads}`} runtimeUrl={RUNTIME_URL}
                    threadId={address.threadId}
                    agent={address.agent === "default" ? undefined : address.agent}
                    showDevConsole={false}>
          <Chat address={address} setAccent={setAccent} onRunFinished={onRunFinished}
                showError={setRunError} reload={reload} reloadKeepingInput={reloadKeepingInput}
                chat={chat} draft={draft} setDraft={setDraft} />
        </CopilotKit>
      </div>
    </Frame>
  );
}

createRoot(document.getElementById("root")).render(<App />);
