// What both pages share, plain React with no CopilotKit import: the page frame, the agent
// picker, the thread list (from the runtime's thread routes), the weather card and the approval
// panel. Each page wires them to its own generation's CopilotKit hooks.
import { useCallback, useEffect, useRef, useState } from "react";

export const AGENTS = [
  { id: "default", label: "Assistant (default)" },
  { id: "review_loop", label: "Review loop" },
  { id: "account_review", label: "Account review" },
];

export const ACCENTS = ["teal", "crimson", "indigo", "orange", "green", "purple"];

// The runtime's URL: the server writes it into the page's meta tag (same origin).
export const RUNTIME_URL =
  document.querySelector('meta[name="copilot-runtime-url"]')?.getAttribute("content") || "/copilotkit";

// Threads this page started: the runtime has none of them before their first run.
const startedHere = new Set();
const newThreadId = () => {
  const id = crypto.randomUUID();
  startedHere.add(id);
  return id;
};

// The agent and thread the address names (?agent=&thread=); a new thread when it names none.
function readAddress() {
  const query = new URLSearchParams(window.location.search);
  const agent = AGENTS.some((a) => a.id === query.get("agent")) ? query.get("agent") : "default";
  return { agent, threadId: query.get("thread") || newThreadId() };
}

// The agent the runtime lists the thread under (GET /threads gives each thread's agent), or
// null: looked for in the newest threads of all agents, a few pages at most.
async function listedAgent(threadId) {
  let cursor = null;
  for (let pages = 0; pages < 4; pages += 1) {
    // (archived threads too: an address may name one)
    const query = new URLSearchParams({ limit: "500", includeArchived: "true", ...(cursor ? { cursor } : {}) });
    const response = await fetch(`${RUNTIME_URL}/threads?${query}`);
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    const page = await response.json();
    const found = page.threads.find((t) => t.id === threadId);
    if (found || !page.nextCursor) return found?.agentId ?? null;
    cursor = page.nextCursor;
  }
  return null;
}

// The agent and thread live in the address (?agent=&thread=), so a reload keeps them. What
// the person chooses (a thread, a new thread, an agent) is a step in the browser's history,
// so Back and Forward go through them; the address read again then. An address naming a
// thread the runtime lists under another agent (edited by hand, or from before) is shown as
// that agent's: under the one named, the chat would mix in that agent's messages.
export function useThreadAddress() {
  const [address, setAddress] = useState(readAddress);
  // Whether the next change of the address is the person's (a step in the history) or the
  // page's own (the address completed or corrected in place).
  const chosen = useRef(false);
  // The address came from the location (opened, or Back/Forward): its agent is checked.
  const [fromLocation, setFromLocation] = useState(1);
  const shown = useRef(address);
  useEffect(() => {
    shown.current = address;
    const search = `?${new URLSearchParams({ agent: address.agent, thread: address.threadId })}`;
    const push = chosen.current;
    chosen.current = false;
    if (window.location.search === search) return; // Back/Forward: the browser is there already
    window.history[push ? "pushState" : "replaceState"](null, "", `${window.location.pathname}${search}`);
  }, [address]);
  useEffect(() => {
    const onPopState = () => {
      chosen.current = false;
      setAddress(readAddress());
      setFromLocation((n) => n + 1);
    };
    window.addEventListener("popstate", onPopState);
    return () => window.removeEventListener("popstate", onPopState);
  }, []);
  useEffect(() => {
    const { agent, threadId } = address;
    if (startedHere.has(threadId)) return undefined;
    let cancelled = false;
    const movedOn = () => cancelled || shown.current.threadId !== threadId || shown.current.agent !== agent;
    retried(() => listedAgent(threadId), movedOn).then((listed) => {
      if (movedOn() || !listed || listed === agent || !AGENTS.some((a) => a.id === listed)) return;
      setAddress((a) => (a.threadId === threadId && a.agent === agent ? { agent: listed, threadId } : a));
    });
    return () => { cancelled = true; };
  }, [fromLocation]); // eslint-disable-line react-hooks/exhaustive-deps
  const choose = (change) => {
    chosen.current = true;
    setAddress(change);
  };
  return {
    ...address,
    selectAgent: (agent) => choose({ agent, threadId: newThreadId() }),
    selectThread: (threadId, agent) => choose((a) => ({ agent: agent || a.agent, threadId })),
    newThread: () => choose((a) => ({ ...a, threadId: newThreadId() })),
  };
}

export function useAccent() {
  const [accent, setAccent] = useState("teal");
  useEffect(() => {
    document.documentElement.style.setProperty("--demo-accent", accent);
    document.documentElement.dataset.accent = accent;
  }, [accent]);
  return [accent, setAccent];
}

export function Frame({ generation, other, accent, address, refreshKey, children }) {
  return (
    <div className="demo">
      <header className="demo-header">
        <div>
          <h1>copilot-runtime demo</h1>
          <p className="generation">{generation}</p>
        </div>
        <div className="header-side">
          <span className="accent-chip" data-testid="accent">accent: {accent}</span>
          <a href={other.href} data-testid="other-page">{other.label}</a>
        </div>
      </header>
      <div className="demo-body">
        <aside className="demo-side">
          <AgentPicker address={address} />
          <ThreadList address={address} refreshKey={refreshKey} />
          <Hints agent={address.agent} />
        </aside>
        <main className="demo-chat">{children}</main>
      </div>
    </div>
  );
}

// The agent is switched (a new thread, a history entry) when it is chosen: with the mouse, at
// once; with the keyboard, on Enter or on leaving the list, not on each arrow key passing
// over the others (each pass switched and started a thread).
function AgentPicker({ address }) {
  // An agent the arrow keys are on, not chosen yet (null: none; the picker shows the address's).
  const [pending, setPending] = useState(null);
  const keyed = useRef(false);
  useEffect(() => setPending(null), [address.agent]);
  const choose = (agent) => {
    keyed.current = false;
    setPending(null);
    address.selectAgent(agent);
  };
  // The arrows may have come back to the agent already chosen: nothing to switch to.
  const choosePending = () => {
    if (pending === null) return;
    if (pending === address.agent) {
      keyed.current = false;
      setPending(null);
    } else {
      choose(pending);
    }
  };
  return (
    <label className="picker">
      Agent
      <select data-testid="agent-picker" value={pending ?? address.agent}
              onKeyDown={(e) => {
                if (e.key === "Enter" && pending !== null) {
                  e.preventDefault();
                  choosePending();
                } else if (e.key !== "Tab" && e.key !== "Enter") {
                  keyed.current = true;
                }
              }}
              onPointerDown={() => { keyed.current = false; }}
              onChange={(e) => {
                if (keyed.current) setPending(e.target.value);
                else choose(e.target.value);
              }}
              onBlur={choosePending}>
        {AGENTS.map((a) => <option key={a.id} value={a.id}>{a.label}</option>)}
      </select>
    </label>
  );
}

function Hints({ agent }) {
  const hints = {
    default: ["What is the weather in Paris?", "Set the accent colour to crimson", "Roll a die"],
    review_loop: ["Draft an invoice for ACME, 3 hours of consulting"],
    account_review: ["Review account ACME-001"],
  }[agent];
  return (
    <div className="hints">
      <h2>Try</h2>
      <ul>{hints.map((h) => <li key={h}>{h}</li>)}</ul>
    </div>
  );
}

// One page of the agent's threads, newest first, from GET {runtime}/threads?agentId=: the
// newest, or those after `cursor` (a page's nextCursor).
async function threadPage(agent, cursor) {
  const query = new URLSearchParams({ agentId: agent, ...(cursor ? { cursor } : {}) });
  const response = await fetch(`${RUNTIME_URL}/threads?${query}`);
  if (!response.ok) throw new Error(`HTTP ${response.status}`);
  return response.json();
}

// `first`, then those of `then` not in it: a thread that moved up is listed where it is now.
const joined = (first, then) => {
  const ids = new Set(first.map((t) => t.id));
  return [...first, ...then.filter((t) => !ids.has(t.id))];
};

// The newest pages of the agent's threads, as many as hold `count` threads (at least one
// page), and the cursor past them: older pages loaded are read again, so a thread deleted
// or renamed since shows as it is now.
async function threadPages(agent, count) {
  let page = await threadPage(agent);
  let threads = page.threads;
  while (threads.length < count && page.nextCursor) {
    page = await threadPage(agent, page.nextCursor);
    threads = joined(threads, page.threads);
  }
  return { threads, nextCursor: page.nextCursor };
}

const shortTime = (iso) => new Date(iso).toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" });

// The first user message's text, the runtime's title of a thread (as GET /threads gives it).
function firstUserText(messages) {
  const content = messages.find((m) => m.role === "user")?.content;
  if (typeof content === "string") return content;
  return (content ?? []).map((part) => part.text ?? "").join(" ").trim();
}

// A thread's messages as the runtime's `loadAgentState` query gives them (the query
// react-core 1.10 sends; {role, content} items for text), or null for a thread not started
// yet. It answers such a thread without an error, where GET /threads/{id}/messages answers
// 404, which the browser logs as one (a new thread reloaded before its first message).
export async function storedMessages(agent, threadId) {
  const response = await fetch(RUNTIME_URL, {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify({
      query: "query loadAgentState($data: LoadAgentStateInput!) { loadAgentState(data: $data) "
        + "{ threadId threadExists messages } }",
      variables: { data: { threadId, agentName: agent } },
    }),
  });
  const loaded = response.ok ? (await response.json()).data?.loadAgentState : null;
  return loaded?.threadExists ? JSON.parse(loaded.messages || "[]") : null;
}

// The title of a thread not among the pages loaded (an older one opened by its address): from
// its messages, as the list routes give no single thread. null while unknown or for a new one.
function useUnlistedTitle(agent, threadId, unlisted) {
  const [title, setTitle] = useState(null);
  useEffect(() => {
    setTitle(null);
    if (!unlisted || startedHere.has(threadId)) return undefined;
    let cancelled = false;
    storedMessages(agent, threadId)
      .then((messages) => { if (!cancelled && messages) setTitle(firstUserText(messages) || threadId.slice(0, 8)); })
      .catch(() => {});
    return () => { cancelled = true; };
  }, [agent, threadId, unlisted]);
  return title;
}

// Threads of the chosen agent, newest first, each shown by its name or title (the runtime's:
// the first user message, known as soon as a run starts); "more" loads the next page.
function ThreadList({ address, refreshKey }) {
  const [list, setList] = useState({ agent: address.agent, threads: [], nextCursor: null });
  const [error, setError] = useState(null);
  const failed = (e) => setError(String(e.message || e));
  // How many threads the pages loaded by "More threads" hold, to load as many again.
  const shown = useRef({ agent: address.agent, count: 0 });
  const load = useCallback(async () => {
    try {
      const count = shown.current.agent === address.agent ? shown.current.count : 0;
      const pages = await threadPages(address.agent, count);
      setList({ agent: address.agent, ...pages });
      setError(null);
    } catch (e) {
      failed(e);
    }
  }, [address.agent]);
  // A list that failed (the runtime away: a restart) is asked again, less often each time,
  // until it answers.
  const [retries, setRetries] = useState(0);
  const failures = useRef(0);
  useEffect(() => {
    if (!error) {
      failures.current = 0;
      return undefined;
    }
    const timer = setTimeout(() => setRetries((n) => n + 1), Math.min(250 * 2 ** failures.current, 4000));
    failures.current += 1;
    return () => clearTimeout(timer);
  }, [error, retries]);
  useEffect(() => { load(); }, [load, refreshKey, address.threadId, retries]);
  const loadOlder = async () => {
    try {
      const page = await threadPage(list.agent, list.nextCursor);
      setList((old) => {
        if (old.agent !== list.agent) return old;
        const threads = joined(old.threads, page.threads);
        shown.current = { agent: old.agent, count: threads.length };
        return { ...old, threads, nextCursor: page.nextCursor };
      });
    } catch (e) {
      failed(e);
    }
  };
  const loaded = list.agent === address.agent ? list : { threads: [], nextCursor: null };
  const listed = loaded.threads.some((t) => t.id === address.threadId);
  const unlistedTitle = useUnlistedTitle(address.agent, address.threadId, !listed && Boolean(loaded.nextCursor));
  return (
    <div className="threads">
      <div className="threads-head">
        <h2>Threads</h2>
        <button type="button" data-testid="new-thread" onClick={address.newThread}>New thread</button>
      </div>
      {error && <p className="error">Threads unavailable: {error}</p>}
      <ul data-testid="thread-list">
        {!listed && (
          <li className="thread current" data-testid="thread-item" data-thread-id={address.threadId}>
            <span><span className="thread-title">{unlistedTitle ?? "new thread"}</span>
              <small>{address.threadId.slice(0, 8)}</small></span>
          </li>
        )}
        {loaded.threads.map((t) => (
          <li key={t.id} data-testid="thread-item" data-thread-id={t.id}
              className={`thread${t.id === address.threadId ? " current" : ""}`}>
            <button type="button" title={t.id} onClick={() => address.selectThread(t.id, t.agentId)}>
              <span className="thread-title">{t.name || t.title || t.id.slice(0, 8)}</span>
              <small>{shortTime(t.updatedAt)}</small>
            </button>
          </li>
        ))}
      </ul>
      {loaded.nextCursor && (
        <button type="button" className="threads-more" data-testid="more-threads" onClick={loadOlder}>
          More threads
        </button>
      )}
    </div>
  );
}

export function WeatherCard({ args, result, done }) {
  const data = typeof result === "string" ? safeParse(result) : result;
  return (
    <div className="weather-card" data-testid="weather-card" data-status={done ? "complete" : "running"}>
      <div className="weather-city">{data?.city || args?.city || "…"}</div>
      {done && data ? (
        <div className="weather-body">
          <span className="weather-temp">{data.temperature}°{data.unit === "celsius" ? "C" : "F"}</span>
          <span className="weather-conditions">{data.conditions}</span>
        </div>
      ) : <div className="weather-body">fetching the weather…</div>}
    </div>
  );
}

// An image in a message is loaded only from this page's origin or a data: URL: one from
// elsewhere would be fetched as the thread is shown (a tracking pixel a steered model
// planted). It shows as text instead, its alt and address, and is not a link either.
const isOwnImage = (src) => {
  if (typeof src !== "string") return false;
  if (/^\s*data:image\//i.test(src)) return true;
  try { return new URL(src, window.location.href).origin === window.location.origin; } catch { return false; }
};

export function MessageImage({ node, src, alt, ...props }) { // eslint-disable-line no-unused-vars
  if (isOwnImage(src)) return <img src={src} alt={alt} {...props} />;
  return <span className="outside-image" data-testid="outside-image">[image: {alt || "no alt"}] {src}</span>;
}

export function safeParse(value) {
  if (typeof value !== "string") return value;
  try { return JSON.parse(value); } catch { return value; }
}

const describe = (value) => (typeof value === "string" ? value : Object.entries(value ?? {})
  .map(([key, item]) => `${key}: ${typeof item === "string" ? item : JSON.stringify(item)}`)
  .join("\n"));

// The approval request of either workflow, as the graph's interrupt value carries it.
export function describeRequest(value) {
  const v = safeParse(value) || {};
  if (v.type === "user_clarification_request") {
    return {
      kind: "review_loop",
      title: `${v.data?.agent ?? "Specialist"} result, iteration ${v.data?.iteration ?? 1}`,
      body: v.data?.agent_result ?? "",
      notice: v.data?.notice ?? v.notice,
      expiresAt: v.expiresAt ?? v.data?.expiresAt,
    };
  }
  const recommendation = v.recommendation ?? v.data?.recommendation;
  return {
    kind: "approval",
    title: `${v.message ?? "Approval needed"}${v.account_id ? ` (account ${v.account_id})` : ""}`,
    body: describe(recommendation ?? v.data ?? v),
    notice: v.notice,
    expiresAt: v.expiresAt ?? v.expires_at,
  };
}

function useSecondsLeft(expiresAt) {
  const [now, setNow] = useState(Date.now());
  useEffect(() => {
    if (!expiresAt) return undefined;
    const timer = setInterval(() => setNow(Date.now()), 1000);
    return () => clearInterval(timer);
  }, [expiresAt]);
  if (!expiresAt) return null;
  return Math.max(0, Math.ceil((Date.parse(expiresAt) - now) / 1000));
}

// `work` again, with back-off, until it succeeds: it fails while the runtime is away (a restart
// of the server), and succeeds once it is back. Nothing more is tried once `stopped()`.
export async function retried(work, stopped = () => false) {
  for (let wait = 250; !stopped(); wait = Math.min(2 * wait, 4000)) {
    try {
      return await work();
    } catch {
      await new Promise((resolve) => setTimeout(resolve, wait));
    }
  }
  return undefined;
}

async function runtimeInfo() {
  const response = await fetch(`${RUNTIME_URL}/info`);
  if (!response.ok) throw new Error(`HTTP ${response.status}`);
}

// A function that calls `reload` once the runtime answers (at once while it is up): once for
// however many errors called it meanwhile, and not once the component is gone (the person
// moved on; a late reload would remount the chat they are using).
export function useReloadOnceAnswered(reload) {
  const state = useRef({ mounted: true, waiting: false });
  useEffect(() => {
    state.current.mounted = true;
    return () => { state.current.mounted = false; };
  }, []);
  return useCallback(() => {
    const current = state.current;
    if (current.waiting) return;
    current.waiting = true;
    retried(runtimeInfo, () => !current.mounted).then(() => {
      current.waiting = false;
      if (current.mounted) reload();
    });
  }, [reload]);
}

// Calls `onStarted` when `running` turns true and `onFinished` when it turns false again.
export function useRunEdges(running, onStarted, onFinished) {
  const wasRunning = useRef(false);
  useEffect(() => {
    if (running && !wasRunning.current) onStarted();
    if (!running && wasRunning.current) onFinished();
    wasRunning.current = running;
  }, [running]); // eslint-disable-line react-hooks/exhaustive-deps
}

// At an approval's deadline the runtime answers "timeout" itself (and refuses any later
// answer), and a run carries the workflow on. Resolves once that run has ended (no approval of
// the thread is past its deadline and not yet applied), so the page can show the thread as it
// is now.
export async function deadlineAnswered(agentId, threadId) {
  const query = new URLSearchParams({ threadId, agentId, status: "all" });
  for (let tries = 0; tries < 60; tries += 1) {
    const response = await fetch(`${RUNTIME_URL}/approvals?${query}`);
    const approvals = response.ok ? (await response.json()).approvals : [];
    if (!approvals.some((a) => (a.status === "expired" && !a.applied) || (a.status === "pending"
        && a.expiresAt && Date.parse(a.expiresAt) <= Date.now()))) return;
    await new Promise((resolve) => setTimeout(resolve, 250));
  }
}

// Gives the keyboard's focus to the chat's input (`selector`) once it can take it: the answer's
// run may keep it disabled, or a remount replace it, for a while. Only while the focus is
// nowhere (on the page's body, or a button the answer disabled): a question shown meanwhile,
// or whatever the person moved to, keeps it.
function focusChatInput(selector) {
  let tries = 0;
  const attempt = () => {
    const focused = document.activeElement;
    if (focused && focused !== document.body && !focused.disabled) return;
    const input = document.querySelector(selector);
    if (input && !input.disabled) input.focus();
    else if (tries < 100) {
      tries += 1;
      setTimeout(attempt, 100);
    }
  };
  setTimeout(attempt, 0); // after the panel's own removal or disabling took the focus away
}

// Approve, revise with feedback (as often as wanted), or reject. `answer` gets
// {action: "approve" | "revise" | "reject", feedback?}. At its deadline the buttons go off
// and `onExpired` is called. A question shown takes the keyboard's focus (its feedback box);
// once answered, timed out or gone, the focus goes back to the chat's input (`chatInput`, a
// selector): a keyboard's user would otherwise be left on the page's body.
export function ApprovalPanel({ value, answer, expiresAt, onExpired, chatInput }) {
  const request = describeRequest(value);
  if (expiresAt) request.expiresAt = expiresAt;
  const [feedback, setFeedback] = useState("");
  const [sent, setSent] = useState(false);
  const secondsLeft = useSecondsLeft(request.expiresAt);
  const expired = secondsLeft === 0;
  useEffect(() => { if (expired) onExpired?.(); }, [expired]); // eslint-disable-line react-hooks/exhaustive-deps
  const closed = sent || expired;
  const send = (decision) => { setSent(true); answer(decision); };
  const feedbackBox = useRef(null);
  const closedAtMount = useRef(closed);
  useEffect(() => {
    if (!closedAtMount.current) feedbackBox.current?.focus();
    return () => focusChatInput(chatInput);
  }, []); // eslint-disable-line react-hooks/exhaustive-deps
  useEffect(() => {
    if (closed && !closedAtMount.current) focusChatInput(chatInput);
  }, [closed]); // eslint-disable-line react-hooks/exhaustive-deps
  return (
    <div className="approval" data-testid="approval-panel" data-kind={request.kind}>
      <div className="approval-title">{request.title}</div>
      <pre className="approval-body" data-testid="approval-body">{request.body}</pre>
      {request.notice && <p className="approval-notice">{request.notice}</p>}
      {secondsLeft !== null && (
        <p className="approval-timeout" data-testid="approval-timeout">
          {expired ? "Timed out" : `Answer within ${secondsLeft} s (then it times out)`}
        </p>
      )}
      <textarea ref={feedbackBox} data-testid="approval-feedback" placeholder="What should change?"
                value={feedback} onChange={(e) => setFeedback(e.target.value)} disabled={closed} />
      <div className="approval-buttons">
        <button type="button" data-testid="approve" disabled={closed}
                onClick={() => send({ action: "approve" })}>Approve</button>
        <button type="button" data-testid="revise" disabled={closed || !feedback.trim()}
                onClick={() => send({ action: "revise", feedback: feedback.trim() })}>Revise</button>
        <button type="button" data-testid="reject" disabled={closed}
                onClick={() => send({ action: "reject" })}>Reject</button>
      </div>
    </div>
  );
}

// A run's error, shown as plain text (it may quote what a client sent).
export function RunError({ message, onDismiss }) {
  return (
    <div className="run-error" role="alert" data-testid="run-error">
      <span>{message}</span>
      <button type="button" onClick={onDismiss} aria-label="Dismiss">×</button>
    </div>
  );
}
