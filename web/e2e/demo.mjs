// Drives the demo's two pages in Debian's headless chromium with playwright-core (no browser
// download), as a person would click them. Used by tests/test_demo_web.py.
//
//   node e2e/demo.mjs <baseUrl> <phase> [options-json]
//
//   phase "main":    on both pages: a chat answer, the weather card, the frontend tool's
//                    effect, a refresh restoring the thread, new thread (its item's id label
//                    within it) and switching back, Back and Forward through the threads
//                    and agents chosen (the agent picker by keyboard: arrows pass over
//                    agents, Enter chooses), stop mid-answer (no error shown), a failed run's
//                    message kept and its error banner gone once a later run answers, the
//                    review loop revised twice then approved (by keyboard: the question
//                    takes the focus, an answer gives it back to the input), a thread
//                    opened under another agent shown as its own agent's, the account
//                    review approved (its timeout shown), a thread opened while the runtime
//                    refuses connections shown once it is back, an approval's answer whose
//                    run failed (offline) asked again, and a message refused meanwhile
//                    (classic) its banner gone once answered, the banners of an outage (the
//                    thread list's, the run's) gone once the runtime is back; leaves a
//                    review-loop approval pending on each page for the restart phase.
//   phase "restart": after the server was restarted: the threads of phase one come back on
//                    both pages, and the pending approvals are revised, then approved.
//   phase "edges":   against a server whose approvals time out in a few seconds: HTML planted
//                    in a thread's messages stays text (markdown still renders), a thread of
//                    the list's second page shown by its title and listed by "more" (read
//                    again when the list refreshes: renames show, deletions go; and a
//                    new thread opened by its address then asks nothing that fails), a run
//                    the runtime refuses (400) shows the runtime's words, a thread
//                    listed mid-run shows its title, a thread opened mid-answer shows the
//                    whole answer once its run ends, an expired approval cannot be answered
//                    and its outcome shows, and a stale answer (another tab answered) shows
//                    the run's error while that tab, and one opened then, is asked the
//                    current question.
//   phase "phone":   both pages at a phone's size (390x844, touch): the page no wider or
//                    higher than the screen, the chat keeps the width and half the height or
//                    more, its send button and the side panel's controls on the screen.
//
// Writes ONE JSON line: {phase, steps: [{page, step, ok, error?, ms}], consoleErrors,
// failedRequests, threads}. Screenshots go to options.screenshots (a directory).
import { chromium } from "playwright-core";

const writeStdout = process.stdout.write.bind(process.stdout);
for (const level of ["log", "info", "warn", "debug"]) console[level] = (...args) => console.error(...args);

const [baseArg, phase, optionsArg] = process.argv.slice(2);
const base = (baseArg ?? "").replace(/\/+$/, "");
const options = optionsArg ? JSON.parse(optionsArg) : {};
const TIMEOUT = options.timeoutMs ?? 20000;

const BROWSER_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
  "--disable-component-update", "--disable-sync", "--no-first-run"];

const consoleErrors = [];
const failedRequests = [];
const steps = [];
const threads = { ...(options.threads ?? {}) };

// What each generation's stock chat looks like in the DOM.
const UI = {
  current: {
    path: "/",
    input: '[data-testid="copilot-chat-textarea"]',
    assistant: '[data-testid="copilot-assistant-message"]',
    user: '[data-testid="copilot-user-message"]',
    idle: '[data-testid="copilot-chat"][data-copilot-running="false"]',
    running: '[data-testid="copilot-chat"][data-copilot-running="true"]',
    stop: '[data-testid="copilot-send-button"]',
    sendButton: '[data-testid="copilot-send-button"]',
  },
  classic: {
    path: "/classic/",
    input: ".copilotKitInput textarea",
    assistant: ".copilotKitAssistantMessage",
    user: ".copilotKitUserMessage",
    idle: '[data-test-id="copilot-chat-ready"]',
    running: '[data-test-id="copilot-chat-request-in-progress"]',
    stop: '[data-test-id="copilot-chat-request-in-progress"]',
    sendButton: ".copilotKitInputControls button >> nth=-1",
  },
};

class DemoPage {
  constructor(kind, page) {
    this.kind = kind;
    this.ui = UI[kind];
    this.page = page;
    // A request the client aborts itself after reading all it needed (the classic client
    // aborts its fetch once the last multipart part is in; the current one may abort a
    // `connect` when a run starts), or that the browser dropped because the test went to
    // another page meanwhile (a thread list's title fetches), is not a failure; one the
    // server failed is.
    const answered = new Map();
    const openedIn = new Map();
    this.pagesOpened = 0;
    page.on("request", (request) => openedIn.set(request, this.pagesOpened));
    page.on("response", (response) => {
      answered.set(response.request(), response.status());
      if (response.status() >= 400) {
        failedRequests.push({ page: kind, url: response.url(), status: response.status() });
      }
    });
    page.on("requestfailed", (request) => {
      const error = request.failure()?.errorText ?? "";
      const status = answered.get(request);
      const leftBehind = (openedIn.get(request) ?? this.pagesOpened) < this.pagesOpened;
      // A GraphQL query (not a run's mutation) the classic page's client dropped as the chat
      // remounted (urql cancels what a torn-down client asked) is no failure of the runtime.
      const droppedQuery = kind === "classic" && /"query":"query /.test(request.postData() ?? "");
      const selfAborted = error === "net::ERR_ABORTED" && (status === 200 || leftBehind || droppedQuery
        || /\/agent\/[^/]+\/connect$/.test(request.url()));
      if (!selfAborted) {
        const operation = /"operationName":"(\w+)"|^\{"query":"(\w+ \w+)/.exec(request.postData() ?? "");
        failedRequests.push({ page: kind, url: request.url(), error, status,
                              operation: operation?.[1] ?? operation?.[2] });
      }
    });
    page.on("console", (message) => {
      if (message.type() === "error") consoleErrors.push({ page: kind, text: message.text().slice(0, 500) });
    });
    page.on("pageerror", (error) => consoleErrors.push({ page: kind, text: String(error).slice(0, 500), uncaught: true }));
  }

  async open(query = "") {
    this.pagesOpened += 1;
    await this.page.goto(`${base}${this.ui.path}${query}`);
    await this.page.locator(this.ui.input).waitFor({ timeout: TIMEOUT });
    await this.idle();
  }

  address() {
    const url = new URL(this.page.url());
    return { agent: url.searchParams.get("agent"), thread: url.searchParams.get("thread") };
  }

  async idle() {
    await this.page.locator(this.ui.idle).first().waitFor({ timeout: TIMEOUT });
  }

  async send(text, { wait = true } = {}) {
    // (1.10.6 ignores Enter while a request of its own is in flight: a step that began as
    // the last answer's words were shown, before its run had ended, sent nothing under load)
    await this.idle();
    const input = this.page.locator(this.ui.input);
    await input.fill(text);
    await input.press("Enter");
    if (wait) {
      await this.page.locator(this.ui.user, { hasText: text.slice(0, 40) }).last().waitFor({ timeout: TIMEOUT });
      await this.settled();
    }
  }

  // The run and any follow-up run (after a tool) have ended.
  async settled() {
    await this.page.waitForTimeout(300);
    await this.idle();
    await this.page.waitForTimeout(300);
    await this.idle();
  }

  assistantTexts() {
    return this.page.locator(this.ui.assistant).allInnerTexts();
  }

  async expectAssistant(pattern) {
    await this.page.locator(this.ui.assistant, { hasText: pattern }).last().waitFor({ timeout: TIMEOUT });
  }

  async chooseAgent(agent) {
    await this.page.locator('[data-testid="agent-picker"]').selectOption(agent);
    await this.page.waitForURL((url) => url.searchParams.get("agent") === agent, { timeout: TIMEOUT });
    await this.page.locator(this.ui.input).waitFor({ timeout: TIMEOUT });
    await this.idle();
  }

  panel() {
    return this.page.locator('[data-testid="approval-panel"]').last();
  }

  // Waits for the approval panel showing `pattern`, and answers it.
  async answer(pattern, decision, feedback) {
    const panel = this.page.locator('[data-testid="approval-panel"]', { hasText: pattern }).last();
    await panel.waitFor({ timeout: TIMEOUT });
    if (feedback) await panel.locator('[data-testid="approval-feedback"]').fill(feedback);
    await panel.locator(`[data-testid="${decision}"]`).click();
    await this.settled();
  }

  async shot(name) {
    if (!options.screenshots) return;
    await this.page.screenshot({ path: `${options.screenshots}/${name}.png` });
  }
}

// Leaves out the console errors and failed requests since the counts given that a step
// provoked on purpose.
function forget(errorsBefore, failedBefore, isProvokedError, isProvokedRequest) {
  consoleErrors.splice(errorsBefore, Infinity, ...consoleErrors.slice(errorsBefore).filter((e) => !isProvokedError(e)));
  failedRequests.splice(failedBefore, Infinity, ...failedRequests.slice(failedBefore).filter((r) => !isProvokedRequest(r)));
}

function assert(condition, message) {
  if (!condition) throw new Error(message);
}

// Waits until the element focused matches `selector`; says what has the focus if none does.
async function focusOn(p, selector, what, timeout = TIMEOUT) {
  try {
    await p.page.waitForFunction((s) => document.activeElement?.matches(s), selector, { timeout });
  } catch {
    const has = await p.page.evaluate(() => {
      const e = document.activeElement;
      return e ? `${e.tagName.toLowerCase()}${e.dataset.testid ? `#${e.dataset.testid}` : ""}` : "nothing";
    });
    throw new Error(`${what}: the focus is on ${has}`);
  }
}

async function step(page, name, work) {
  const started = Date.now();
  try {
    await work();
    steps.push({ page: page.kind, step: name, ok: true, ms: Date.now() - started });
  } catch (error) {
    steps.push({ page: page.kind, step: name, ok: false, ms: Date.now() - started,
                 error: String(error?.message ?? error).slice(0, 1500) });
    await page.shot(`failed-${page.kind}-${name}`).catch(() => {});
  }
}

// ---- phase one ------------------------------------------------------------------------------
async function mainPhase(p) {
  const kind = p.kind;
  await step(p, "chat", async () => {
    await p.open("?agent=default");
    await p.send("Hello, who are you?");
    await p.expectAssistant("offline demo model");
    // 1.74's "+" (add menu) offers nothing here: no attachments, no tools menu.
    if (kind === "current") {
      assert(await p.page.locator('[data-testid="copilot-add-menu-button"]').count() === 0,
             "a disabled add menu button is shown");
    }
  });

  await step(p, "weather card", async () => {
    await p.send("What is the weather in Paris?");
    const card = p.page.locator('[data-testid="weather-card"][data-status="complete"]').last();
    await card.waitFor({ timeout: TIMEOUT });
    const text = await card.innerText();
    assert(/Paris/.test(text) && /°C/.test(text), `the card shows ${JSON.stringify(text)}`);
    await p.expectAssistant("get_weather returned");
  });

  await step(p, "frontend tool", async () => {
    await p.send("Set the accent colour to crimson");
    await p.page.locator('[data-testid="accent"]', { hasText: "accent: crimson" }).waitFor({ timeout: TIMEOUT });
    const background = await p.page.locator(".demo-header").evaluate((e) => getComputedStyle(e).backgroundColor);
    assert(background === "rgb(220, 20, 60)", `the header is ${background}, not crimson`);
    await p.expectAssistant("set_accent_color returned");
    await p.shot(kind);
    threads[`${kind}:chat`] = p.address().thread;
  });

  await step(p, "refresh restores the thread", async () => {
    const before = p.address().thread;
    p.pagesOpened += 1;
    await p.page.reload();
    await p.page.locator(p.ui.user, { hasText: "What is the weather in Paris?" }).waitFor({ timeout: TIMEOUT });
    await p.page.locator('[data-testid="weather-card"]').first().waitFor({ timeout: TIMEOUT });
    await p.expectAssistant("get_weather returned");
    assert(p.address().thread === before, "the thread changed on reload");
  });

  await step(p, "new thread and switching back", async () => {
    const first = p.address().thread;
    await p.page.locator('[data-testid="new-thread"]').click();
    await p.page.waitForURL((url) => url.searchParams.get("thread") !== first, { timeout: TIMEOUT });
    await p.page.locator(p.ui.input).waitFor({ timeout: TIMEOUT });
    assert((await p.page.locator(p.ui.user).count()) === 0, "the new thread is not empty");
    // The new thread's item shows its id's start within the side panel.
    const item = p.page.locator('[data-testid="thread-item"].current', { hasText: "new thread" });
    const itemBox = await item.boundingBox();
    const labelBox = await item.locator("small").boundingBox();
    assert(labelBox.x + labelBox.width <= itemBox.x + itemBox.width + 0.5,
           `the new thread's id sticks out of its item: ${JSON.stringify({ itemBox, labelBox })}`);
    await p.send("Roll a die");
    await p.expectAssistant("roll_dice returned");
    const second = p.address().thread;
    const listed = p.page.locator(`[data-testid="thread-item"][data-thread-id="${first}"] button`);
    await listed.waitFor({ timeout: TIMEOUT });
    await p.page.locator(`[data-testid="thread-item"][data-thread-id="${second}"]`).waitFor({ timeout: TIMEOUT });
    await listed.click();
    await p.page.waitForURL((url) => url.searchParams.get("thread") === first, { timeout: TIMEOUT });
    await p.page.locator(p.ui.user, { hasText: "What is the weather in Paris?" }).waitFor({ timeout: TIMEOUT });
    assert((await p.page.locator(p.ui.user, { hasText: "Roll a die" }).count()) === 0,
           "the other thread's messages are shown");
  });

  await step(p, "Back and Forward go through the threads and agents", async () => {
    // New thread, then the first one from the list: two steps in the history, each a thread.
    const first = p.address().thread;
    const thread = (id) => (url) => url.searchParams.get("thread") === id;
    await p.page.goBack();
    const second = p.address().thread;
    const left = p.page.url();
    if (!left.startsWith(base)) {
      // Back left the demo: back to it, so that the steps after this one go on.
      p.pagesOpened += 1;
      await p.page.goForward();
      await p.page.locator(p.ui.input).waitFor({ timeout: TIMEOUT });
      throw new Error(`Back went to ${left}, not the thread before`);
    }
    assert(second && second !== first, `Back went to ${p.page.url()}, not the thread before`);
    await p.page.locator(p.ui.user, { hasText: "Roll a die" }).waitFor({ timeout: TIMEOUT });
    assert((await p.page.locator(p.ui.user, { hasText: "What is the weather in Paris?" }).count()) === 0,
           "Back shows the other thread's messages");
    await p.page.goForward();
    await p.page.waitForURL(thread(first), { timeout: TIMEOUT });
    await p.page.locator(p.ui.user, { hasText: "What is the weather in Paris?" }).waitFor({ timeout: TIMEOUT });
    await p.page.goBack();
    await p.page.waitForURL(thread(second), { timeout: TIMEOUT });
    await p.page.locator(p.ui.user, { hasText: "Roll a die" }).waitFor({ timeout: TIMEOUT });
    // Another agent is a step too.
    await p.chooseAgent("review_loop");
    await p.page.goBack();
    await p.page.waitForURL((url) => url.searchParams.get("agent") === "default" && thread(second)(url),
                            { timeout: TIMEOUT });
    const picked = await p.page.locator('[data-testid="agent-picker"]').inputValue();
    assert(picked === "default", `the picker shows ${picked} after Back`);
    await p.page.locator(p.ui.user, { hasText: "Roll a die" }).waitFor({ timeout: TIMEOUT });
    await p.idle();
    // By keyboard, arrow keys pass over the agents without switching to each (a new thread
    // and a history entry apiece); Enter chooses.
    const entries = await p.page.evaluate(() => window.history.length);
    await p.page.locator('[data-testid="agent-picker"]').focus();
    await p.page.keyboard.press("ArrowDown");
    await p.page.keyboard.press("ArrowDown");
    await p.page.waitForTimeout(300);
    const passed = p.address();
    assert(passed.agent === "default" && passed.thread === second, `arrow keys switched to ${p.page.url()}`);
    assert(await p.page.evaluate(() => window.history.length) === entries, "arrow keys added history entries");
    await p.page.keyboard.press("Enter");
    await p.page.waitForURL((url) => url.searchParams.get("agent") === "account_review", { timeout: TIMEOUT });
    await p.page.locator(p.ui.input).waitFor({ timeout: TIMEOUT });
    await p.idle();
    await p.page.goBack();
    await p.page.waitForURL((url) => url.searchParams.get("agent") === "default" && thread(second)(url),
                            { timeout: TIMEOUT });
    await p.page.locator(p.ui.user, { hasText: "Roll a die" }).waitFor({ timeout: TIMEOUT });
    await p.idle();
  });

  await step(p, "stop mid-answer", async () => {
    await p.page.locator('[data-testid="new-thread"]').click();
    await p.page.locator(p.ui.input).waitFor({ timeout: TIMEOUT });
    // The demo model quotes the first 200 characters of what it was told, word by word: short
    // words give its longest answer (~2 s).
    const long = `Please repeat this: ${"a b c d e ".repeat(40)}the end.`;
    await p.send(long, { wait: false });
    await p.page.locator(p.ui.assistant, { hasText: "offline demo model" }).last().waitFor({ timeout: TIMEOUT });
    await p.page.locator(p.ui.stop).click();
    await p.idle();
    // A remount of the chat (as after an error) would replace the message marked here.
    await p.page.locator(p.ui.assistant).last().evaluate((e) => { e.dataset.e2eStopped = "1"; });
    await p.page.waitForTimeout(1500); // had the run gone on, more words would arrive now
    assert(await p.page.locator('[data-testid="run-error"]').count() === 0,
           `a stop shows an error: ${await p.page.locator('[data-testid="run-error"]').allInnerTexts()}`);
    assert(await p.page.locator(`${p.ui.assistant}[data-e2e-stopped]`).count() === 1, "the chat was remounted after stop");
    const texts = await p.assistantTexts();
    const last = texts[texts.length - 1] ?? "";
    assert(!last.includes("the end."), "the answer was not stopped");
    assert(!last.includes("Roll a die"), "the answer ran to its end");
    const again = (await p.assistantTexts()).at(-1);
    assert(again === last, "words still arrive after stop");
    await p.send("Are you still there?");
    await p.expectAssistant("Are you still there?");
  });

  await step(p, "a failed run: its message kept, its error gone once a later run answers", async () => {
    // One run fails (the runtime answers 503 to its request), the next one answers.
    const isRun = (request) => request.method() === "POST" && (kind === "current"
      ? /\/agent\/[^/]+\/run$/.test(request.url()) : /generateCopilotResponse/.test(request.postData() ?? ""));
    const [errorsBefore, failedBefore] = [consoleErrors.length, failedRequests.length];
    const runtime = (url) => url.pathname.startsWith("/copilotkit");
    await p.page.route(runtime, (route) => (isRun(route.request())
      ? route.fulfill({ status: 503, json: { error: "unavailable", message: "Try again (e2e)" } })
      : route.fallback()));
    try {
      // (once the page is idle: 1.10.6 ignores Enter while a request of its own is in flight)
      await p.idle();
      await p.send("This one fails", { wait: false });
      await p.page.locator('[data-testid="run-error"]').waitFor({ timeout: TIMEOUT });
    } finally {
      await p.page.unroute(runtime);
    }
    await p.idle();
    // The message the run failed to send is not lost: the chat shows it (current), or it is
    // back in the input once the chat shows the thread as the runtime has it (classic).
    const input = p.page.locator(p.ui.input);
    const kept = async () => (await p.page.locator(p.ui.user, { hasText: "This one fails" }).count()) > 0
      || (await input.inputValue()) === "This one fails";
    for (let tries = 0; !(await kept()) && tries < 20; tries += 1) await p.page.waitForTimeout(100);
    await p.page.waitForTimeout(500); // a remount after the error would drop it now
    assert(await kept(), "the message of the failed run is gone");
    await p.send("And this one answers");
    await p.expectAssistant("And this one answers");
    forget(errorsBefore, failedBefore, (e) => /status of 503|HTTP 503/.test(e.text), (r) => r.status === 503);
    assert(await p.page.locator('[data-testid="run-error"]').count() === 0, "the error banner stays after an answer");
  });

  await step(p, "review loop: revise twice, then approve", async () => {
    await p.chooseAgent("review_loop");
    await p.send("Draft an invoice for ACME, 3 hours of consulting");
    threads[`${kind}:review`] = p.address().thread;
    // The question takes the keyboard's focus (its feedback box), and an answer gives it back
    // to the chat's input.
    await p.panel().filter({ hasText: "draft 1" }).waitFor({ timeout: TIMEOUT });
    await focusOn(p, '[data-testid="approval-feedback"]', "the approval panel shown");
    await p.page.keyboard.type("Add the VAT line");
    await p.page.keyboard.press("Tab");
    await p.page.keyboard.press("Tab");
    await focusOn(p, '[data-testid="revise"]', "Tab from the feedback box twice");
    await p.page.keyboard.press("Enter");
    await p.settled();
    await p.answer("draft 2", "revise", "Make the due date 30 days");
    await p.shot(`${kind}-approval`);
    // The current chat's input waits while an approval does (the runtime would refuse a
    // message); the classic one keeps its text area and refuses to send.
    const waits = kind === "current" ? [`${p.ui.input}:disabled`, `${p.ui.input}:enabled`] : null;
    await p.page.locator('[data-testid="approval-panel"]', { hasText: "draft 3" }).last().waitFor({ timeout: TIMEOUT });
    if (waits) await p.page.locator(waits[0]).waitFor({ timeout: TIMEOUT });
    await focusOn(p, '[data-testid="approval-feedback"]', "the next approval panel shown");
    await p.page.keyboard.press("Tab");
    await focusOn(p, '[data-testid="approve"]', "Tab from the feedback box");
    await p.page.keyboard.press("Enter");
    await p.settled();
    await p.expectAssistant("Approved");
    if (waits) await p.page.locator(waits[1]).waitFor({ timeout: TIMEOUT });
    await focusOn(p, p.ui.input, "the approval answered");
    assert((await p.page.locator('[data-testid="approval-panel"] [data-testid="approve"]:enabled').count()) === 0,
           "an approval is still offered");
  });

  await step(p, "a thread opened under another agent is shown as its agent's", async () => {
    // An address naming the review loop's thread with the default agent (edited, or old).
    const thread = threads[`${kind}:review`];
    await p.open(`?agent=default&thread=${thread}`);
    await p.page.waitForURL((url) => url.searchParams.get("agent") === "review_loop", { timeout: TIMEOUT });
    const picked = await p.page.locator('[data-testid="agent-picker"]').inputValue();
    assert(picked === "review_loop", `the picker shows ${picked}`);
    assert(p.address().thread === thread, "another thread is shown");
    await p.page.locator(`[data-testid="thread-item"][data-thread-id="${thread}"] button`).waitFor({ timeout: TIMEOUT });
    await p.page.locator(p.ui.user, { hasText: "Draft an invoice for ACME" }).waitFor({ timeout: TIMEOUT });
    await p.expectAssistant("Invoice specialist");
    await p.idle();
  });

  await step(p, "account review: approve", async () => {
    await p.chooseAgent("account_review");
    await p.send("Review account ACME-001");
    const panel = p.page.locator('[data-testid="approval-panel"]').last();
    await panel.waitFor({ timeout: TIMEOUT });
    const timeout = await panel.locator('[data-testid="approval-timeout"]').innerText({ timeout: TIMEOUT });
    assert(/Answer within \d+ s/.test(timeout), `no visible timeout: ${timeout}`);
    await p.shot(`${kind}-account-review`);
    await p.answer("ACME-001", "approve");
    await p.expectAssistant(/approv/i);
  });

  await step(p, "a thread opened while the runtime is away shows once it is back", async () => {
    // The runtime refuses connections, as while the server restarts.
    const runtime = (url) => url.pathname.startsWith("/copilotkit");
    const [errorsBefore, failedBefore] = [consoleErrors.length, failedRequests.length];
    await p.page.route(runtime, (route) => route.abort("connectionrefused"));
    try {
      p.pagesOpened += 1;
      await p.page.goto(`${base}${p.ui.path}?agent=default&thread=${threads[`${kind}:chat`]}`);
      await p.page.locator(p.ui.input).waitFor({ timeout: TIMEOUT });
      await p.page.waitForTimeout(500); // the page's first asks are refused meanwhile
    } finally {
      await p.page.unroute(runtime);
    }
    await p.page.locator(p.ui.user, { hasText: "What is the weather in Paris?" }).waitFor({ timeout: TIMEOUT });
    await p.idle();
    await p.chooseAgent("review_loop"); // the page knows the runtime's agents again
    await p.send("Draft an invoice for INITECH, two hours of support");
    await p.panel().waitFor({ timeout: TIMEOUT });
    // What the outage itself made fail is no failure of the page.
    const refused = /ERR_CONNECTION_REFUSED|Failed to fetch/;
    forget(errorsBefore, failedBefore, (e) => refused.test(e.text), (r) => refused.test(r.error ?? ""));
  });

  await step(p, "an answer that failed is asked again", async () => {
    await p.chooseAgent("review_loop");
    await p.send("Draft an invoice for UMBRELLA, a week of training");
    await p.panel().waitFor({ timeout: TIMEOUT });
    // The answer's run fails (the network is gone): the question is still the runtime's.
    const [errorsBefore, failedBefore] = [consoleErrors.length, failedRequests.length];
    const runtime = (url) => url.pathname.startsWith("/copilotkit");
    await p.page.route(runtime, (route) => route.abort("internetdisconnected"));
    try {
      await p.panel().locator('[data-testid="approve"]').click();
      await p.page.locator('[data-testid="run-error"]').waitFor({ timeout: TIMEOUT });
    } finally {
      await p.page.unroute(runtime);
    }
    // Back online, the page asks it again (and the current page's banner of the outage goes);
    // answered, the thread moves on and the banner is gone.
    await p.panel().locator('[data-testid="approve"]:enabled').waitFor({ timeout: TIMEOUT });
    if (kind === "current") await p.page.locator('[data-testid="run-error"]').waitFor({ state: "detached", timeout: TIMEOUT });
    // The classic page reloads its chat after the message refused below once the runtime
    // answers (`info`, held 1 s here), and the answer is held 3 s: that reload lands while
    // the answer is on its way, and the answer shows all the same.
    const held = (url) => url.pathname === "/copilotkit/info" || url.pathname.startsWith("/copilotkit/approvals/");
    if (kind === "classic") {
      await p.page.route(held, async (route) => {
        await new Promise((resolve) => setTimeout(resolve, route.request().method() === "POST" ? 3000 : 1000));
        await route.fallback();
      });
    }
    try {
      if (kind === "classic") {
        // The classic input sends while the question waits: the runtime refuses the message.
        // (Once the page is idle: 1.10.6 ignores Enter while a request of its own is in flight.)
        await p.idle();
        await p.send("Make it two weeks", { wait: false });
        await p.page.locator('[data-testid="run-error"]', { hasText: "waits for an answer" }).waitFor({ timeout: TIMEOUT });
        await p.idle();
      }
      await p.answer("draft 1", "approve");
      await p.expectAssistant("Approved");
    } finally {
      if (kind === "classic") await p.page.unroute(held);
    }
    assert(await p.page.locator('[data-testid="run-error"]').count() === 0,
           `the banner stays: ${await p.page.locator('[data-testid="run-error"]').allInnerTexts()}`);
    const offline = /ERR_INTERNET_DISCONNECTED|Failed to fetch|Failed to load resource|waits for an answer/;
    forget(errorsBefore, failedBefore, (e) => !e.uncaught && offline.test(e.text), (r) => offline.test(r.error ?? ""));
  });

  await step(p, "after an outage its banners go once the runtime is back", async () => {
    await p.open("?agent=default");
    const [errorsBefore, failedBefore] = [consoleErrors.length, failedRequests.length];
    const runtime = (url) => url.pathname.startsWith("/copilotkit");
    await p.page.route(runtime, (route) => route.abort("connectionrefused"));
    const unavailable = p.page.locator(".threads .error", { hasText: "Threads unavailable" });
    try {
      await p.send("Sent while the runtime is away", { wait: false });
      await p.page.locator('[data-testid="run-error"]').waitFor({ timeout: TIMEOUT });
      await unavailable.waitFor({ timeout: TIMEOUT }); // the list's refresh after the run failed
    } finally {
      await p.page.unroute(runtime);
    }
    await unavailable.waitFor({ state: "detached", timeout: TIMEOUT });
    await p.page.locator('[data-testid="run-error"]').waitFor({ state: "detached", timeout: TIMEOUT });
    const refused = /ERR_CONNECTION_REFUSED|Failed to fetch|Failed to load resource/;
    forget(errorsBefore, failedBefore, (e) => !e.uncaught && refused.test(e.text), (r) => refused.test(r.error ?? ""));
  });

  {
    await step(p, "an approval left pending for the restart", async () => {
      await p.chooseAgent("review_loop");
      await p.send("Draft an invoice for GLOBEX, one day of auditing");
      await p.panel().waitFor({ timeout: TIMEOUT });
      threads[`${kind}:pending`] = p.address().thread;
    });
  }
}

// ---- phase two: after a restart of the server -------------------------------------------------
async function restartPhase(p) {
  const kind = p.kind;
  await step(p, "restart restores the thread", async () => {
    const thread = threads[`${kind}:chat`];
    assert(thread, "no thread from phase one");
    await p.open(`?agent=default&thread=${thread}`);
    await p.page.locator(p.ui.user, { hasText: "What is the weather in Paris?" }).waitFor({ timeout: TIMEOUT });
    await p.expectAssistant("set_accent_color returned");
    await p.page.locator(`[data-testid="thread-item"][data-thread-id="${thread}"]`).waitFor({ timeout: TIMEOUT });
  });

  await step(p, "restart restores the review loop", async () => {
    const thread = threads[`${kind}:review`];
    await p.open(`?agent=review_loop&thread=${thread}`);
    await p.expectAssistant("Approved");
  });

  await step(p, "a pending approval survives the restart", async () => {
    await p.open(`?agent=review_loop&thread=${threads[`${kind}:pending`]}`);
    await p.page.locator(p.ui.user, { hasText: "Draft an invoice for GLOBEX" }).waitFor({ timeout: TIMEOUT });
    await p.answer("draft 1", "revise", "Add the purchase order number");
    await p.answer("draft 2", "approve");
    await p.expectAssistant("Approved");
    await p.expectAssistant("purchase order number");
    assert((await p.page.locator('[data-testid="approve"]:enabled').count()) === 0,
           "an approval is still offered");
  });
}

// ---- a phone's screen (phase "phone") ------------------------------------------------------
const PHONE = { width: 390, height: 844 };

async function phonePhase(p) {
  const kind = p.kind;
  await step(p, "fits a phone's width", async () => {
    await p.open("?agent=default");
    await p.send("What is the weather in Paris?");
    await p.page.locator('[data-testid="weather-card"][data-status="complete"]').last().waitFor({ timeout: TIMEOUT });
    await p.shot(`${kind}-phone`);
    const page = await p.page.evaluate(() => {
      const { scrollWidth, clientWidth, scrollHeight, clientHeight } = document.documentElement;
      return { scrollWidth, clientWidth, scrollHeight, clientHeight };
    });
    assert(page.scrollWidth <= page.clientWidth, `the page is ${page.scrollWidth} px wide on a ${page.clientWidth} px screen`);
    // The chat scrolls its messages itself: were the page taller, its input would go off the screen.
    assert(page.scrollHeight <= page.clientHeight, `the page is ${page.scrollHeight} px high on a ${page.clientHeight} px screen`);
    const chat = p.page.locator(".demo-chat");
    const chatBox = await chat.boundingBox();
    assert(chatBox.width >= 300, `the chat is ${Math.round(chatBox.width)} px wide`);
    assert(chatBox.height >= PHONE.height / 2, `the chat is ${Math.round(chatBox.height)} px high`);
    const [chatContentWidth, chatWidth] = await chat.evaluate((e) => [e.scrollWidth, e.clientWidth]);
    assert(chatContentWidth <= chatWidth, `the chat's content is ${chatContentWidth} px wide in ${chatWidth} px`);
    const onScreen = async (selector, what) => {
      const box = await p.page.locator(selector).first().boundingBox();
      assert(box && box.x >= 0 && box.y >= 0 && box.x + box.width <= PHONE.width && box.y + box.height <= PHONE.height,
             `${what} is off the screen: ${JSON.stringify(box)}`);
    };
    await onScreen(p.ui.sendButton, "the send button");
    await onScreen('[data-testid="agent-picker"]', "the agent picker");
    await onScreen('[data-testid="new-thread"]', "the new-thread button");
  });
}

// ---- phase three: edges (a server with a short approval timeout) ----------------------------
// Raw HTML in a message: an iframe whose srcdoc runs script, an image whose onerror does, and
// an outside image (a tracking pixel, fetched as the thread is shown) and link (phishing); and
// outside markdown images, absolute and protocol-relative.
const PLANTED_HOST = "tracker.invalid";
const PLANTED = 'Summary. <iframe srcdoc="<script>parent.__pwned = 1</script>"></iframe> '
  + `<img src="x" onerror="window.__pwned = 2"> <img src="https://${PLANTED_HOST}/pixel.png"> `
  + `<a href="https://${PLANTED_HOST}/login">log in again</a>`
  + `\n\n![md pixel](https://${PLANTED_HOST}/md.png) ![md relative](//${PLANTED_HOST}/md2.png)`
  + '\n\n**bold words**\n\n- first item\n- second item\n\n`inline code`';

async function edgesPhase(p) {
  const kind = p.kind;
  await step(p, "planted HTML stays text", async () => {
    const thread = `planted-${kind}-${Date.now()}`;
    const response = await fetch(`${base}/copilotkit/agent/default/run`, {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ threadId: thread, runId: "r1", messages: [
        { id: "u0", role: "user", content: "Summarise my account" },
        { id: "a0", role: "assistant", content: PLANTED },
        { id: "u1", role: "user", content: "thanks" }] }),
    });
    await response.text();
    threads[`${kind}:planted`] = thread;
    const outside = [];
    const toOutside = (request) => { if (request.url().includes(PLANTED_HOST)) outside.push(request.url()); };
    p.page.on("request", toOutside);
    await p.open(`?agent=default&thread=${thread}`);
    const message = p.page.locator(p.ui.assistant, { hasText: "bold words" }).first();
    await message.waitFor({ timeout: TIMEOUT });
    await p.page.waitForTimeout(1000); // time for a planted script to run
    p.page.off("request", toOutside);
    assert(await p.page.evaluate(() => window.__pwned === undefined), "the planted script ran");
    assert(outside.length === 0, `the page asked ${outside.join(", ")}`);
    const planted = await p.page.locator(`iframe[srcdoc], img[src="x"], img[src*="${PLANTED_HOST}"], `
      + `a[href*="${PLANTED_HOST}"]`).count();
    assert(planted === 0, `${planted} planted elements are in the page`);
    assert(await message.locator(".outside-image", { hasText: "md pixel" }).count() === 1, "no outside image's text");
    assert(await message.locator('strong, [data-streamdown="strong"]', { hasText: "bold words" }).count() === 1, "no bold");
    assert(await message.locator("li").count() === 2, "no list");
    assert(await message.locator("code", { hasText: "inline code" }).count() === 1, "no code");
  });

  await step(p, "older threads are a click away", async () => {
    // A list of two pages (the runtime's come 100 a page), the thread opened on the second.
    const thread = threads[`${kind}:planted`];
    // Later, another thread of the second page is deleted and this one renamed.
    const listed = (id, title, name = null) => ({ id, title, name, agentId: "default", updatedAt: new Date().toISOString() });
    let changed = false;
    const secondPage = () => (changed ? [listed(thread, "Summarise my account", "Renamed (e2e)")]
      : [listed(thread, "Summarise my account"), listed("deleted-thread", "An older thread")]);
    const list = (url) => url.pathname === "/copilotkit/threads";
    await p.page.route(list, (route) => route.fulfill({ json: new URL(route.request().url()).searchParams.get("cursor")
      ? { threads: secondPage(), nextCursor: null }
      : { threads: [listed("newer-thread", "A newer thread")], nextCursor: "page-2" } }));
    try {
      await p.open(`?agent=default&thread=${thread}`);
      const item = p.page.locator(`[data-testid="thread-item"][data-thread-id="${thread}"]`);
      await item.filter({ hasText: "Summarise my account" }).waitFor({ timeout: TIMEOUT });
      await p.page.locator('[data-testid="more-threads"]').click();
      await item.locator("button", { hasText: "Summarise my account" }).waitFor({ timeout: TIMEOUT });
      assert(await p.page.locator('[data-testid="thread-item"]').count() === 3, "a thread is listed twice");
      assert(await p.page.locator('[data-testid="more-threads"]').count() === 0, "more is offered past the end");
      // The list's refresh (here on a new thread) reads the older page again.
      changed = true;
      await p.page.locator('[data-testid="new-thread"]').click();
      await item.locator("button", { hasText: "Renamed (e2e)" }).waitFor({ timeout: TIMEOUT });
      assert(await p.page.locator('[data-testid="thread-item"][data-thread-id="deleted-thread"]').count() === 0,
             "a deleted thread stays listed");
      // A new thread opened by its address (a reload before its first message) is no older
      // thread: nothing fails while the page looks for its title.
      const [errorsBefore, failedBefore] = [consoleErrors.length, failedRequests.length];
      const fresh = crypto.randomUUID();
      await p.open(`?agent=default&thread=${fresh}`);
      await p.page.locator(`[data-testid="thread-item"][data-thread-id="${fresh}"]`, { hasText: "new thread" })
        .waitFor({ timeout: TIMEOUT });
      await p.page.waitForTimeout(500); // the title's question answered
      // A list read of the page before (its refresh after a `connect`) may be cut off by this one.
      forget(errorsBefore, failedBefore, () => false, (r) => r.error === "net::ERR_ABORTED" && /\/threads\?/.test(r.url));
      assert(consoleErrors.length === errorsBefore && failedRequests.length === failedBefore,
             `a new thread's title failed: ${JSON.stringify([...consoleErrors.slice(errorsBefore), ...failedRequests.slice(failedBefore)])}`);
    } finally {
      await p.page.unroute(list);
    }
  });

  await step(p, "a refused run shows the runtime's words", async () => {
    const [errorsBefore, failedBefore] = [consoleErrors.length, failedRequests.length];
    await p.open(`?agent=default&thread=${"t".repeat(300)}`);
    await p.send("Hello", { wait: false });
    const banner = p.page.locator('[data-testid="run-error"]', { hasText: "The id is longer than 256 characters" });
    await banner.waitFor({ timeout: TIMEOUT });
    const text = await banner.innerText();
    assert(!text.includes("{"), `the banner shows ${JSON.stringify(text)}`);
    // (an uncaught error is the page's: the banner showed the run's error already)
    await p.page.waitForTimeout(300);
    forget(errorsBefore, failedBefore, (e) => !e.uncaught && /status of 400|longer than 256/.test(e.text),
           (r) => r.status === 400);
  });

  await step(p, "a thread listed mid-run shows its title", async () => {
    await p.open("?agent=default");
    const first = p.address().thread;
    await p.send(`Please repeat this: ${"lorem ipsum dolor sit amet ".repeat(40)}the end.`, { wait: false });
    await p.page.locator(p.ui.assistant, { hasText: "offline demo model" }).last().waitFor({ timeout: TIMEOUT });
    await p.page.locator('[data-testid="new-thread"]').click();
    // (the run's answer takes ~2 s: a shorter bound proved nothing more, and failed under load)
    await p.page.locator(`[data-testid="thread-item"][data-thread-id="${first}"]`, { hasText: "Please repeat this" })
      .waitFor({ timeout: TIMEOUT });
  });

  await step(p, "a thread opened mid-answer shows the whole answer once it ends", async () => {
    // The run is another tab's (here: the runtime's route), the page opened while it streams.
    // The classic page reads the thread (the current one follows its run): read after the run
    // ended, it proved nothing, so it is tried again (a loaded machine can take the ~2 s the
    // answer streams to load the page). (The current page, slower to load, often shows it ended.)
    for (let attempt = 1; ; attempt += 1) {
      const thread = `midrun-${kind}-${Date.now()}`;
      const ran = fetch(`${base}/copilotkit/agent/default/run`, {
        method: "POST", headers: { "Content-Type": "application/json" },
        body: JSON.stringify({ threadId: thread, runId: "r1", messages: [{ id: "u1", role: "user",
          content: `Please repeat this: ${"a b c d e ".repeat(40)}the end.` }] }),
      }).then((response) => response.text());
      let ended = false;
      ran.then(() => { ended = true; });
      const stored = async () => {
        const response = await fetch(`${base}/copilotkit/threads/${thread}/messages`);
        return response.ok ? (await response.json()).messages : [];
      };
      while (!(await stored()).some((m) => m.role === "assistant")) await p.page.waitForTimeout(50);
      p.pagesOpened += 1;
      await p.page.goto(`${base}${p.ui.path}?agent=default&thread=${thread}`);
      await p.page.locator(p.ui.assistant, { hasText: "offline demo model" }).last().waitFor({ timeout: TIMEOUT });
      const openedMidRun = !ended;
      await ran;
      const answer = (await stored()).findLast((m) => m.role === "assistant").content.trim();
      // (its last words: the whole answer, not the part streamed when the page read the thread)
      await p.page.locator(p.ui.assistant, { hasText: answer.slice(-30) }).last().waitFor({ timeout: TIMEOUT });
      await p.idle();
      if (kind !== "classic" || openedMidRun) break;
      assert(attempt < 3, "the run ended before the page showed it, three times: nothing was proved");
    }
  });

  await step(p, "an expired approval shows its outcome", async () => {
    await p.chooseAgent("account_review");
    await p.send("Review account ACME-001");
    await p.panel().waitFor({ timeout: TIMEOUT });
    // At the deadline the buttons go off, and the runtime's own answer shows.
    await p.expectAssistant("approval: timeout");
    assert(await p.page.locator('[data-testid="approval-panel"] button:enabled').count() === 0,
           "the expired approval can still be answered");
  });

  await step(p, "a stale answer shows the error", async () => {
    await p.chooseAgent("review_loop");
    await p.send("Draft an invoice for ACME, 3 hours of consulting");
    await p.panel().waitFor({ timeout: TIMEOUT });
    const other = new DemoPage(kind, await p.page.context().newPage());
    await other.open(`?agent=review_loop&thread=${p.address().thread}`);
    await other.panel().waitFor({ timeout: TIMEOUT });
    await p.answer("draft 1", "revise", "Add the VAT line");
    await p.panel().filter({ hasText: "draft 2" }).waitFor({ timeout: TIMEOUT });
    await other.panel().locator('[data-testid="approve"]').click();
    await other.page.locator('[data-testid="run-error"]', { hasText: /answered already|already answered/ }).waitFor({ timeout: TIMEOUT });
    // The tab is asked the current question again, its error still shown.
    await other.page.locator('[data-testid="approval-panel"]', { hasText: "draft 2" })
      .locator('[data-testid="approve"]:enabled').waitFor({ timeout: TIMEOUT });
    assert(await other.page.locator('[data-testid="run-error"]').count() === 1, "the stale answer's error is gone");
    await other.page.close();
    // The refused run changed nothing: a tab opened now is asked about draft 2.
    const fresh = new DemoPage(kind, await p.page.context().newPage());
    await fresh.open(`?agent=review_loop&thread=${p.address().thread}`);
    await fresh.page.locator('[data-testid="approval-panel"]', { hasText: "draft 2" })
      .locator('[data-testid="approve"]:enabled').waitFor({ timeout: TIMEOUT });
    await fresh.page.close();
  });
}

const browser = await chromium.launch({ executablePath: options.chromium ?? "/usr/bin/chromium",
                                        args: BROWSER_FLAGS });
let exitCode = 0;
try {
  const kinds = options.pages ?? ["current", "classic"];
  for (const kind of kinds) {
    const context = await browser.newContext(phase === "phone"
      ? { viewport: PHONE, isMobile: true, hasTouch: true }
      : { viewport: { width: 1280, height: 860 } });
    const page = new DemoPage(kind, await context.newPage());
    page.page.setDefaultTimeout(TIMEOUT);
    await ({ main: mainPhase, restart: restartPhase, edges: edgesPhase, phone: phonePhase })[phase](page);
    await context.close();
  }
} catch (error) {
  steps.push({ page: null, step: "driver", ok: false, error: String(error?.stack ?? error) });
  exitCode = 1;
} finally {
  await browser.close();
}
writeStdout(`${JSON.stringify({ phase, steps, consoleErrors, failedRequests, threads })}\n`,
            () => process.exit(exitCode));
