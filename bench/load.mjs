// bench/load.mjs: closed-loop load generator for bench/run (no dependencies beyond Node itself).
//
//   node bench/load.mjs --target name=N,protocol=P,url=U[,pid=PID][,template=FILE][,token=T] [--target ...]
//   (token: a bearer token the target's requests carry)
//        [--pid mock=PID] [--conc 1,10,50] [--seconds 10] [--rounds 2] [--warmup 300] [--serial 100]
//        [--text-len 200] [--history 0] [--clk-tck 100] [--quiet-wait 30] [--quiet-cores 0.15]
//        [--noisy-cores 0.3] [--retries 2] [--retry-budget 60] [--out-prefix PATH]
//
// Several targets are measured in one process, interleaved: each concurrency level is cut into
// --rounds slices of --seconds/--rounds, and the slices of the targets alternate (the order rotates
// from slice to slice). CPU used by anything else on the machine comes and goes; interleaving
// spreads it over all targets instead of letting it land on one, and a slice during which other
// processes used more than --noisy-cores is thrown away and run again (at most --retries times,
// and for at most --retry-budget seconds over the whole run; the discarded slices are listed in
// the JSON). A target's `pid` is its server,
// sampled in /proc together with its descendants; `--pid mock=PID` is sampled for every target.
//
// Protocols (every request is a new conversation, so no server keeps growing one history):
//   agui     POST url: an AG-UI RunAgentInput, what @copilotkit/core sends for the first message of
//            a chat: {threadId, runId, tools:[], context:[], forwardedProps:{}, state:{}, messages:[user]},
//            fresh UUIDs for the thread, the run and the message. With --history N, N earlier
//            messages (user and assistant in turn, each as long as the user's) come first, as a
//            client sends a conversation's history with each new message.
//   graphql  POST url: the generateCopilotResponse mutation exactly as @copilotkit/runtime-client-gql
//            1.10.6 sends it when react-core 1.10.6 starts a chat (template from
//            bench/ts-graphql/make-request.mjs), with fresh thread and message ids per request.
//   openai   POST url (a chat/completions endpoint): the mock LLM on its own, the floor.
//
// Each response is validated, and a response that fails any check counts as a failure:
//   agui     200, text/event-stream, RUN_STARTED first, RUN_FINISHED last, no RUN_ERROR, and the
//            TEXT_MESSAGE_CONTENT (or _CHUNK) deltas join to exactly "echo: " + text;
//   graphql  200, multipart/mixed, every part parses, no `errors` anywhere, the increments applied
//            in order give status Success and an assistant TextMessageOutput whose content pieces
//            join to exactly "echo: " + text, and the last part says hasNext:false;
//   openai   200, the content deltas join to "echo: " + text, and [DONE] ends the stream.
//
// Phases: a quiet check (wait up to --quiet-wait s for the rest of the machine to use less than
// --quiet-cores), the idle sample, then per target: warm-up (--warmup requests on 4 workers;
// a target whose warm-up mostly fails is dropped), --serial sequential requests (latency, time to
// headers / first complete event / first text); then the interleaved closed loops of c workers.
// Sockets are keep-alive (one node:http Agent per slice, maxSockets = workers). Per slice it
// samples the CPU time (utime+stime) of the server and the mock, this process's own CPU and the
// machine's busy time, so CPU used by anything else ("other") is visible as noise.
import http from "node:http";
import fs from "node:fs";
import { randomUUID } from "node:crypto";

// ---------------------------------------------------------------------------------------------
// options
const args = process.argv.slice(2);
const targetSpecs = [], pidSpecs = [];
const opts = {};
for (let i = 0; i < args.length; i++) {
  const a = args[i];
  if (!a.startsWith("--")) throw new Error(`unexpected argument ${a}`);
  const key = a.slice(2), value = args[++i];
  if (value === undefined) throw new Error(`--${key} needs a value`);
  if (key === "target") targetSpecs.push(Object.fromEntries(value.split(",").map((kv) => { const j = kv.indexOf("="); return [kv.slice(0, j), kv.slice(j + 1)]; })));
  else if (key === "pid") { const [n, p] = value.split("="); pidSpecs.push([n, Number(p)]); }
  else opts[key] = value;
}
if (!targetSpecs.length) throw new Error("at least one --target name=...,protocol=...,url=... is needed");
const LEVELS = (opts.conc ?? "1,10,50").split(",").filter(Boolean).map(Number);
const SECONDS = Number(opts.seconds ?? 10);
const ROUNDS = Math.max(1, Number(opts.rounds ?? 2));
const WARMUP = Number(opts.warmup ?? 300);
const SERIAL = Number(opts.serial ?? 100);
const TEXT_LEN = Number(opts["text-len"] ?? 200);
const HISTORY = Number(opts.history ?? 0);
const CLK_TCK = Number(opts["clk-tck"] ?? 100);
const REQUEST_TIMEOUT_MS = Number(opts["timeout-ms"] ?? 30000);
const MAX_PER_SLICE = 200000;
const NOISY_CORES = Number(opts["noisy-cores"] ?? 0.3); // a slice is repeated when others used more
const RETRIES = Number(opts.retries ?? 2); //                 ... at most this many times
const RETRY_BUDGET = Number(opts["retry-budget"] ?? 60); //   ... and for at most this many seconds in all
let retrySeconds = 0;

// The user's message: plain ASCII (no JSON escapes), no surrounding whitespace (some servers trim).
const SENTENCE = "Please summarise the quarterly figures for the northern region and list three risks. ";
const TEXT = SENTENCE.repeat(Math.ceil(TEXT_LEN / SENTENCE.length) + 1).slice(0, TEXT_LEN).trim().padEnd(TEXT_LEN, "x");
const EXPECTED = "echo: " + TEXT;
// The earlier messages of --history, serialised once: "[...," ready for the new message.
const HISTORY_JSON = "[" + Array.from({ length: HISTORY }, (_, i) => JSON.stringify({
  id: `history-${i}`, role: i % 2 ? "assistant" : "user", content: (i % 2 ? "echo: " : "") + TEXT,
}) + ",").join("");
// the first streamed piece of the answer, as each protocol carries it
const FIRST_TEXT_PROBE = { agui: /"TEXT_MESSAGE_(?:CONTENT|CHUNK)"/, graphql: /"content",0\]/, openai: /"content":"[^"]/ };

// ---------------------------------------------------------------------------------------------
// request bodies
function requestMaker(protocol, template, token) {
  const auth = token ? { Authorization: `Bearer ${token}` } : {};
  if (protocol === "agui") {
    return () => {
      const body = Buffer.from(JSON.stringify({
        threadId: randomUUID(), runId: randomUUID(), tools: [], context: [], forwardedProps: {}, state: {},
      }).slice(0, -1) + ',"messages":' + HISTORY_JSON
        + JSON.stringify({ id: randomUUID(), role: "user", content: TEXT }) + "]}");
      return { body, headers: { "Content-Type": "application/json", Accept: "text/event-stream", "content-length": body.length, ...auth } };
    };
  }
  if (protocol === "openai") {
    return () => {
      const body = Buffer.from(JSON.stringify({
        model: "gpt-4o", messages: [{ role: "user", content: TEXT }], stream: true, stream_options: { include_usage: true },
      }));
      return { body, headers: { "content-type": "application/json", accept: "application/json", "content-length": body.length } };
    };
  }
  if (protocol !== "graphql") throw new Error(`unknown protocol ${protocol}`);
  if (!template) throw new Error("a graphql target needs template=FILE (made by bench/ts-graphql/make-request.mjs)");
  const tpl = JSON.parse(fs.readFileSync(template, "utf8"));
  // The template is the client's exact body with placeholders where a real session differs:
  // thread id, message ids, createdAt and the user's text. They sit inside JSON strings.
  const userText = JSON.stringify(TEXT).slice(1, -1);
  const parts = tpl.body.split(/(__BENCH_[A-Z0-9_]+__)/);
  const headerEntries = tpl.headers.filter(([k]) => !["host", "connection", "content-length"].includes(k.toLowerCase()));
  return () => {
    const values = {
      __BENCH_THREAD_ID__: randomUUID(), __BENCH_SYSTEM_ID__: "ck-" + randomUUID(), __BENCH_USER_ID__: "ck-" + randomUUID(),
      __BENCH_CREATED_AT__: new Date().toISOString(), __BENCH_USER_TEXT__: userText,
    };
    const body = Buffer.from(parts.map((p) => (p in values ? values[p] : p)).join(""));
    const headers = { ...Object.fromEntries(headerEntries), ...auth };
    headers["content-length"] = body.length;
    return { body, headers };
  };
}

// ---------------------------------------------------------------------------------------------
// response validation; returns null when the response is right, else the reason
function validate(protocol, status, contentType, text) {
  if (status !== 200) return `HTTP ${status}`;
  if (protocol === "graphql") return validateMultipart(contentType, text);
  if (!/text\/event-stream/i.test(contentType ?? "")) return `content-type ${contentType}`;
  const frames = [];
  for (const block of text.split(/\r?\n\r?\n/)) {
    const data = block.split(/\r?\n/).filter((l) => l.startsWith("data:")).map((l) => l.slice(l[5] === " " ? 6 : 5));
    if (data.length) frames.push(data.join("\n"));
  }
  if (protocol === "openai") {
    if (frames.at(-1) !== "[DONE]") return "no [DONE]";
    const got = frames.slice(0, -1).map((f) => JSON.parse(f).choices?.[0]?.delta?.content ?? "").join("");
    return got === EXPECTED ? null : `text mismatch: ${JSON.stringify(got.slice(0, 80))}`;
  }
  const events = frames.map((f) => JSON.parse(f));
  if (events[0]?.type !== "RUN_STARTED") return `first event ${events[0]?.type}`;
  if (events.at(-1)?.type !== "RUN_FINISHED") return `last event ${events.at(-1)?.type}`;
  const err = events.find((e) => e.type === "RUN_ERROR");
  if (err) return `RUN_ERROR ${JSON.stringify(err).slice(0, 200)}`;
  const got = events.filter((e) => e.type === "TEXT_MESSAGE_CONTENT" || e.type === "TEXT_MESSAGE_CHUNK").map((e) => e.delta ?? "").join("");
  return got === EXPECTED ? null : `text mismatch: ${JSON.stringify(got.slice(0, 80))}`;
}

function validateMultipart(contentType, text) {
  const m = /multipart\/mixed.*boundary="?([^";]+)"?/i.exec(contentType ?? "");
  if (!m) return `content-type ${contentType}`;
  const segments = text.split("\r\n--" + m[1]);
  // segments[0] is the preamble; the last one starts with "--" (the closing delimiter)
  if (!segments.at(-1).startsWith("--")) return "no closing delimiter";
  const parts = [];
  for (const seg of segments.slice(1, -1)) {
    const split = seg.indexOf("\r\n\r\n");
    if (split < 0) return "part without headers";
    parts.push(JSON.parse(seg.slice(split + 4)));
  }
  if (!parts.length) return "no parts";
  let result;
  for (const part of parts) {
    if (part.errors) return `errors: ${JSON.stringify(part.errors).slice(0, 200)}`;
    if (part.data !== undefined) result = part.data;
    for (const inc of part.incremental ?? []) {
      if (inc.errors) return `errors: ${JSON.stringify(inc.errors).slice(0, 200)}`;
      if (inc.items) {
        const list = walk(result, inc.path.slice(0, -1));
        if (!Array.isArray(list)) return `stream path ${inc.path} is not a list`;
        list.splice(inc.path.at(-1), inc.items.length, ...inc.items);
      } else if (inc.data) {
        const obj = walk(result, inc.path);
        if (!obj || typeof obj !== "object") return `defer path ${inc.path} missing`;
        deepMerge(obj, inc.data);
      }
    }
  }
  if (parts.at(-1).hasNext !== false) return "last part has no hasNext:false";
  const r = result?.generateCopilotResponse;
  if (r?.status?.code !== "Success") return `status ${JSON.stringify(r?.status)}`;
  const msg = (r.messages ?? []).find((x) => x.__typename === "TextMessageOutput" && x.role === "assistant");
  if (!msg) return "no assistant TextMessageOutput";
  const got = (msg.content ?? []).join("");
  return got === EXPECTED ? null : `text mismatch: ${JSON.stringify(got.slice(0, 80))}`;
}
const walk = (obj, path) => path.reduce((o, k) => (o == null ? o : o[k]), obj);
function deepMerge(dst, src) {
  for (const [k, v] of Object.entries(src)) {
    if (v && typeof v === "object" && !Array.isArray(v) && dst[k] && typeof dst[k] === "object") deepMerge(dst[k], v);
    else dst[k] = v;
  }
}

// time to the first complete event: an SSE frame ends with a blank line; a multipart part ends
// where the next delimiter starts (after the first part's JSON)
const firstEventCheck = (protocol) => (protocol === "graphql"
  ? (s) => { const a = s.indexOf("\r\n\r\n{"); return a >= 0 && s.indexOf("\r\n--", a) >= 0; }
  : (s) => /\n\r?\n/.test(s));

// ---------------------------------------------------------------------------------------------
// targets
const targets = targetSpecs.map((s) => {
  if (!s.name || !s.protocol || !s.url) throw new Error(`a target needs name, protocol and url: ${JSON.stringify(s)}`);
  const url = new URL(s.url);
  if (!["127.0.0.1", "localhost", "[::1]"].includes(url.hostname)) throw new Error("loopback targets only");
  const t = { name: s.name, protocol: s.protocol, url, pid: s.pid ? Number(s.pid) : null,
    makeRequest: requestMaker(s.protocol, s.template, s.token), firstEventDone: firstEventCheck(s.protocol) };
  t.procs = [...(t.pid ? [["server", t.pid]] : []), ...pidSpecs];
  t.result = { target: t.name, protocol: t.protocol, url: url.href, textLen: TEXT.length, requestBytes: t.makeRequest().body.length,
    node: process.version, startedAt: new Date().toISOString(),
    settings: { levels: LEVELS, seconds: SECONDS, rounds: ROUNDS, warmup: WARMUP, serial: SERIAL, clkTck: CLK_TCK,
      noisyCores: NOISY_CORES, retries: RETRIES, retryBudgetS: RETRY_BUDGET },
    failures: 0, failureSamples: [] };
  return t;
});

// ---------------------------------------------------------------------------------------------
// one request
function once(t, agent) {
  const { body, headers } = t.makeRequest();
  return new Promise((resolve) => {
    const t0 = performance.now();
    let tHeaders = NaN, tFirstEvent = NaN, tFirstText = NaN, head = "", done = false;
    const chunks = [];
    const finish = (reason, status, ctype, text, nbytes = 0) => {
      if (done) return;
      done = true;
      resolve({ ok: reason === null, total: performance.now() - t0, headers: tHeaders - t0,
        firstEvent: tFirstEvent - t0, firstText: tFirstText - t0, bytes: nbytes, ctype,
        sample: reason === null ? undefined : `${reason} | ${String(text ?? "").slice(0, 600)}` });
    };
    const req = http.request({ host: t.url.hostname, port: t.url.port, path: t.url.pathname + t.url.search,
      method: "POST", headers, agent }, (res) => {
      tHeaders = performance.now();
      res.on("data", (d) => {
        chunks.push(d);
        if (Number.isNaN(tFirstText)) {
          // The probes look at the first 16 KB, past the echo of the request's input (which
          // an AG-UI RUN_STARTED carries) when that is longer.
          if (head.length < 16384 + body.length) head += d.toString("latin1");
          const now = performance.now();
          if (Number.isNaN(tFirstEvent) && t.firstEventDone(head)) tFirstEvent = now;
          if (FIRST_TEXT_PROBE[t.protocol].test(head)) tFirstText = now;
        }
      });
      res.on("end", () => {
        const raw = Buffer.concat(chunks), text = raw.toString("utf8");
        let reason;
        try { reason = validate(t.protocol, res.statusCode, res.headers["content-type"], text); } catch (e) { reason = `unparsable: ${e.message}`; }
        finish(reason, res.statusCode, res.headers["content-type"], text, raw.length);
      });
      res.on("error", (e) => finish(`response error: ${e.message}`, res.statusCode, undefined, Buffer.concat(chunks).toString("utf8")));
    });
    req.setTimeout(REQUEST_TIMEOUT_MS, () => req.destroy(new Error(`timeout after ${REQUEST_TIMEOUT_MS} ms`)));
    req.on("error", (e) => finish(`request error: ${e.message}`, 0, undefined, ""));
    req.end(body);
  });
}

// closed loop: `workers` loops, each sending its next request when the last one has ended
async function closedLoop(t, workers, stop) {
  const agent = new http.Agent({ keepAlive: true, maxSockets: workers });
  const lat = [], fails = [];
  let sent = 0;
  const t0 = performance.now();
  await Promise.all(Array.from({ length: workers }, async () => {
    while (!stop(sent, t0) && sent < MAX_PER_SLICE) {
      sent++;
      const r = await once(t, agent);
      if (r.ok) lat.push(r.total); else fails.push(r);
    }
  }));
  const seconds = (performance.now() - t0) / 1000;
  agent.destroy();
  return { lat, fails, seconds };
}

// ---------------------------------------------------------------------------------------------
// /proc sampling
function readProc(pid) {
  try {
    const stat = fs.readFileSync(`/proc/${pid}/stat`, "utf8");
    const f = stat.slice(stat.lastIndexOf(")") + 2).split(" ");
    const status = fs.readFileSync(`/proc/${pid}/status`, "utf8");
    const kb = (k) => Number(new RegExp(`^${k}:\\s+(\\d+)`, "m").exec(status)?.[1] ?? 0);
    return { ppid: Number(f[1]), cpuS: (Number(f[11]) + Number(f[12])) / CLK_TCK, rssMB: kb("VmRSS") / 1024, hwmMB: kb("VmHWM") / 1024 };
  } catch { return null; }
}
// a pid and all its descendants (a server that forks workers is measured as a whole)
function tree(root) {
  const byParent = new Map();
  for (const name of fs.readdirSync("/proc")) {
    if (!/^\d+$/.test(name)) continue;
    const p = readProc(name);
    if (p) { if (!byParent.has(p.ppid)) byParent.set(p.ppid, []); byParent.get(p.ppid).push(Number(name)); }
  }
  const out = [root];
  for (let i = 0; i < out.length; i++) out.push(...(byParent.get(out[i]) ?? []));
  return out;
}
function sampleTree(root) {
  let cpuS = 0, rssMB = 0, hwmMB = 0, alive = 0;
  for (const pid of tree(root)) { const p = readProc(pid); if (p) { alive++; cpuS += p.cpuS; rssMB += p.rssMB; hwmMB += p.hwmMB; } }
  return alive ? { cpuS, rssMB, hwmMB, processes: alive } : null;
}
function machineBusyS() {
  const f = fs.readFileSync("/proc/stat", "utf8").split("\n")[0].trim().split(/\s+/).slice(1).map(Number);
  // user nice system irq softirq (idle and iowait are not busy; steal is the hypervisor's)
  return (f[0] + f[1] + f[2] + f[5] + f[6]) / CLK_TCK;
}
const selfCpuS = () => { const u = process.cpuUsage(); return (u.user + u.system) / 1e6; };
// every pid we know of is sampled, so idle servers' CPU is not counted as "other"
const allPids = [...new Map([...targets.filter((t) => t.pid).map((t) => [t.pid, `${t.name}`]), ...pidSpecs.map(([n, p]) => [p, n])])];
function snapshot() {
  const s = { t: performance.now(), machine: machineBusyS(), loadgen: selfCpuS(), byPid: {} };
  for (const [pid] of allPids) s.byPid[pid] = sampleTree(pid);
  return s;
}
const r2 = (x) => (Number.isFinite(x) ? Math.round(x * 100) / 100 : null);
// CPU between two snapshots: the target's named processes, this process, and everything else
function cpuBetween(t, a, b, requests) {
  const wall = (b.t - a.t) / 1000;
  const out = { wallS: r2(wall), machineBusyS: r2(b.machine - a.machine), loadgenS: r2(b.loadgen - a.loadgen) };
  let accounted = b.loadgen - a.loadgen;
  for (const [pid] of allPids) if (a.byPid[pid] && b.byPid[pid]) accounted += b.byPid[pid].cpuS - a.byPid[pid].cpuS;
  for (const [name, pid] of t?.procs ?? []) {
    const x = a.byPid[pid], y = b.byPid[pid];
    if (!x || !y) { out[name] = null; continue; }
    const d = y.cpuS - x.cpuS;
    out[name] = { cpuS: r2(d), cpuMsPerReq: requests ? r2((d * 1000) / requests) : null, coresBusy: r2(d / wall) };
  }
  out.otherS = r2(b.machine - a.machine - accounted);
  return out;
}
const pct = (sorted, p) => (sorted.length ? sorted[Math.min(sorted.length - 1, Math.max(0, Math.ceil((p / 100) * sorted.length) - 1))] : NaN);
const median = (xs) => pct([...xs].filter(Number.isFinite).sort((a, b) => a - b), 50);
const noteFailure = (t, r) => { t.result.failures++; if (t.result.failureSamples.length < 5) t.result.failureSamples.push(r.sample); };
const writeOut = (t) => { if (opts["out-prefix"]) fs.writeFileSync(`${opts["out-prefix"]}${t.name}.json`, JSON.stringify(t.result, null, 2) + "\n"); };
const log = (t, ...m) => console.log(`[${t?.name ?? "load"}]`, ...m);

// ---------------------------------------------------------------------------------------------
// quiet check: wait (up to --quiet-wait s) until the rest of the machine uses less than
// --quiet-cores over a 1 s window
{
  const maxWait = Number(opts["quiet-wait"] ?? 0), limit = Number(opts["quiet-cores"] ?? 0.15);
  const t0 = performance.now();
  let busy = null;
  while (maxWait > 0) {
    const a = snapshot();
    await new Promise((r) => setTimeout(r, 1000));
    const b = snapshot();
    const d = cpuBetween(null, a, b, 0);
    busy = d.otherS / d.wallS;
    if (busy < limit || performance.now() - t0 > maxWait * 1000) break;
  }
  const quiet = { waitedS: r2((performance.now() - t0) / 1000), otherCoresBeforeStart: r2(busy), limit, reached: busy === null || busy < limit };
  for (const t of targets) t.result.quiet = quiet;
  if (maxWait > 0) log(null, `quiet check: other processes used ${r2(busy)} cores (limit ${limit}) after ${quiet.waitedS} s${quiet.reached ? "" : " - NOT quiet, going on"}`);
}

// idle memory: before any target's first request
{
  const idle = snapshot();
  for (const t of targets) {
    t.result.idle = Object.fromEntries(t.procs.map(([n, pid]) => [n, idle.byPid[pid] && { rssMB: r2(idle.byPid[pid].rssMB), processes: idle.byPid[pid].processes }]));
    log(t, `idle RSS: ${t.procs.map(([n]) => `${n} ${t.result.idle[n]?.rssMB} MB`).join(", ")}`);
  }
}

// warm-up and sequential requests, one target after the other
const live = [];
for (const t of targets) {
  const w = await closedLoop(t, Math.min(4, Math.max(1, WARMUP)), (sent) => sent >= WARMUP);
  t.result.warmup = { requests: WARMUP, failed: w.fails.length, seconds: r2(w.seconds) };
  w.fails.forEach((r) => noteFailure(t, r));
  log(t, `warm-up: ${WARMUP} requests in ${r2(w.seconds)} s, ${w.fails.length} failed`);
  if (WARMUP && w.fails.length > WARMUP / 2) {
    t.result.aborted = `most warm-up requests failed; first: ${w.fails[0].sample}`;
    console.error(`[${t.name}] ${t.result.aborted}`);
    writeOut(t);
    continue;
  }
  live.push(t);
  if (SERIAL > 0) {
    const agent = new http.Agent({ keepAlive: true, maxSockets: 1 });
    const a = snapshot(), rs = [];
    for (let i = 0; i < SERIAL; i++) rs.push(await once(t, agent));
    const b = snapshot();
    agent.destroy();
    const good = rs.filter((r) => r.ok);
    rs.filter((r) => !r.ok).forEach((r) => noteFailure(t, r));
    const tot = good.map((r) => r.total).sort((x, y) => x - y);
    t.result.serial = { n: SERIAL, failed: SERIAL - good.length, responseBytes: good[0]?.bytes ?? null, contentType: good[0]?.ctype ?? null,
      medianMs: r2(pct(tot, 50)), p90Ms: r2(pct(tot, 90)),
      medianHeadersMs: r2(median(good.map((r) => r.headers))), medianFirstEventMs: r2(median(good.map((r) => r.firstEvent))),
      medianFirstTextMs: r2(median(good.map((r) => r.firstText))), cpu: cpuBetween(t, a, b, SERIAL) };
    const s = t.result.serial;
    log(t, `serial x${SERIAL}: median ${s.medianMs} ms (p90 ${s.p90Ms}), headers ${s.medianHeadersMs} ms, first event ${s.medianFirstEventMs} ms, first text ${s.medianFirstTextMs} ms, ${s.failed} failed`);
  }
}

// the closed loops, interleaved: level by level, round by round, target by target
const acc = new Map(live.map((t) => [t, new Map(LEVELS.map((c) => [c, { lat: [], fails: 0, seconds: 0, cpu: [] }]))]));
const slice = SECONDS / ROUNDS;
let turn = 0;
for (const c of LEVELS) {
  for (let round = 0; round < ROUNDS; round++) {
    const order = live.map((_, i) => live[(i + turn) % live.length]);
    turn++;
    for (const t of order) {
      let a, b, run;
      for (let attempt = 0; ; attempt++) {
        a = snapshot();
        run = await closedLoop(t, c, (_sent, t0) => performance.now() - t0 >= slice * 1000);
        b = snapshot();
        run.fails.forEach((r) => noteFailure(t, r));
        // a slice during which other processes took a good part of the machine is run again
        const other = cpuBetween(t, a, b, 0);
        if (other.otherS / other.wallS <= NOISY_CORES || attempt >= RETRIES || retrySeconds + slice > RETRY_BUDGET) break;
        retrySeconds += slice;
        (t.result.discardedSlices ??= []).push({ concurrency: c, round: round + 1, otherS: other.otherS, wallS: other.wallS,
          completed: run.lat.length, rps: r2(run.lat.length / run.seconds) });
        log(t, `c=${c} slice ${round + 1}: other processes used ${r2(other.otherS / other.wallS)} cores; running it again`);
      }
      const x = acc.get(t).get(c);
      x.lat.push(...run.lat); x.fails += run.fails.length; x.seconds += run.seconds;
      x.cpu.push(cpuBetween(t, a, b, run.lat.length + run.fails.length));
      x.rssEnd = Object.fromEntries(t.procs.map(([n, pid]) => [n, r2(b.byPid[pid]?.rssMB)]));
    }
  }
  for (const t of live) {
    const x = acc.get(t).get(c);
    const lat = x.lat.sort((p, q) => p - q), n = lat.length + x.fails;
    // CPU of the slices summed
    const sum = (get) => x.cpu.reduce((s, v) => s + (get(v) ?? 0), 0);
    const cpu = { wallS: r2(sum((v) => v.wallS)), machineBusyS: r2(sum((v) => v.machineBusyS)), loadgenS: r2(sum((v) => v.loadgenS)), otherS: r2(sum((v) => v.otherS)) };
    for (const [name] of t.procs) {
      const s = sum((v) => v[name]?.cpuS);
      cpu[name] = { cpuS: r2(s), cpuMsPerReq: n ? r2((s * 1000) / n) : null, coresBusy: r2(s / cpu.wallS) };
    }
    const row = { concurrency: c, seconds: r2(x.seconds), rounds: ROUNDS, completed: lat.length, failed: x.fails,
      rps: r2(lat.length / x.seconds), p50Ms: r2(pct(lat, 50)), p90Ms: r2(pct(lat, 90)), p99Ms: r2(pct(lat, 99)),
      maxMs: r2(lat.at(-1)), cpu, slices: x.cpu.map((v, i) => ({ round: i + 1, otherS: v.otherS, server: v.server?.cpuMsPerReq ?? null })),
      rssEndMB: x.rssEnd };
    (t.result.levels ??= []).push(row);
    const srv = t.procs.map(([nm]) => `${nm} ${cpu[nm]?.cpuMsPerReq} ms`).join(", ");
    log(t, `c=${String(c).padStart(3)}: ${row.rps} req/s, p50 ${row.p50Ms} ms, p99 ${row.p99Ms} ms, ${row.completed} ok, ${row.failed} failed; ` +
      `CPU/req ${srv}; loadgen ${cpu.loadgenS} s, other processes ${cpu.otherS} s`);
  }
}

const end = snapshot();
for (const t of targets) {
  t.result.peak = Object.fromEntries(t.procs.map(([n, pid]) => [n, end.byPid[pid] && { hwmMB: r2(end.byPid[pid].hwmMB), rssMB: r2(end.byPid[pid].rssMB), processes: end.byPid[pid].processes }]));
  if (live.includes(t)) log(t, `peak RSS (VmHWM): ${t.procs.map(([n]) => `${n} ${t.result.peak[n]?.hwmMB} MB`).join(", ")}; failures ${t.result.failures}`);
  t.result.finishedAt = new Date().toISOString();
  writeOut(t);
}
