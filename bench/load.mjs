// bench/load.mjs: closed-loop load generator for bench/run (no dependencies beyond Node itself).
//
//   node bench/load.mjs --target NAME --protocol agui|graphql|openai --url URL
//        [--template FILE]          graphql: the request the real client sends (bench/ts-graphql/make-request.mjs)
//        [--conc 1,10,50] [--seconds 10] [--warmup 300] [--serial 100] [--text-len 200]
//        [--pid server=PID] [--pid mock=PID] [--clk-tck 100] [--json OUT]
//
// Protocols (every request is a new conversation, so no server keeps growing one history):
//   agui     POST URL: an AG-UI RunAgentInput, what @copilotkit/core sends for the first message of
//            a chat: {threadId, runId, tools:[], context:[], forwardedProps:{}, state:{}, messages:[user]},
//            fresh UUIDs for the thread, the run and the message.
//   graphql  POST URL: the generateCopilotResponse mutation exactly as @copilotkit/runtime-client-gql
//            1.10.6 (driven the way react-core 1.10.6 drives it) sends it: react-core's default
//            system message plus the user message, fresh thread and message ids, the client's headers.
//   openai   POST URL (a chat/completions endpoint): the mock LLM on its own, the floor.
//
// Each response is validated, and a response that fails any check counts as a failure:
//   agui     200, text/event-stream, RUN_STARTED first, RUN_FINISHED last, no RUN_ERROR, and the
//            TEXT_MESSAGE_CONTENT (or _CHUNK) deltas join to exactly "echo: " + text;
//   graphql  200, multipart/mixed, every part parses, no `errors` anywhere, the increments applied
//            in order give status Success and an assistant TextMessageOutput whose content pieces
//            join to exactly "echo: " + text, and the last part says hasNext:false;
//   openai   200, the content deltas join to "echo: " + text, and [DONE] ends the stream.
//
// Phases: warm-up (--warmup requests on 4 workers; aborts if most fail), --serial sequential
// requests (latency, time to headers / first complete event / first text), then one closed loop
// of c workers for --seconds per concurrency level. Sockets are keep-alive (one node:http Agent
// per phase, maxSockets = workers). From /proc it samples, per phase, the CPU time (utime+stime)
// of each --pid and its descendants, VmRSS, VmHWM, this process's own CPU and the whole machine's
// busy time, so CPU used by anything else ("other") is visible as noise.
import http from "node:http";
import fs from "node:fs";
import { randomUUID } from "node:crypto";

// ---------------------------------------------------------------------------------------------
// options
const args = process.argv.slice(2);
const pidSpecs = [];
const opts = {};
for (let i = 0; i < args.length; i++) {
  const a = args[i];
  if (!a.startsWith("--")) throw new Error(`unexpected argument ${a}`);
  const key = a.slice(2);
  const value = args[++i];
  if (value === undefined) throw new Error(`--${key} needs a value`);
  if (key === "pid") pidSpecs.push(value.split("=").map((s, j) => (j ? Number(s) : s)));
  else opts[key] = value;
}
const TARGET = opts.target ?? "target";
const PROTOCOL = opts.protocol ?? "agui";
if (!["agui", "graphql", "openai"].includes(PROTOCOL)) throw new Error(`unknown --protocol ${PROTOCOL}`);
const URL_ = new URL(opts.url ?? "http://127.0.0.1:4100/api/copilotkit/agent/default/run");
if (!["127.0.0.1", "localhost", "[::1]"].includes(URL_.hostname)) throw new Error("loopback targets only");
const LEVELS = (opts.conc ?? "1,10,50").split(",").filter(Boolean).map(Number);
const SECONDS = Number(opts.seconds ?? 10);
const WARMUP = Number(opts.warmup ?? 300);
const SERIAL = Number(opts.serial ?? 100);
const TEXT_LEN = Number(opts["text-len"] ?? 200);
const CLK_TCK = Number(opts["clk-tck"] ?? 100);
const REQUEST_TIMEOUT_MS = Number(opts["timeout-ms"] ?? 30000);
const MAX_PER_LEVEL = 200000;

// The user's message: plain ASCII, no JSON escapes, no "ech" (so the first-text probe below only
// fires on the answer), no surrounding whitespace (some servers trim).
const SENTENCE = "Please summarise the quarterly figures for the northern region and list three risks. ";
const TEXT = SENTENCE.repeat(Math.ceil(TEXT_LEN / SENTENCE.length) + 1).slice(0, TEXT_LEN).trim().padEnd(TEXT_LEN, "x");
const EXPECTED = "echo: " + TEXT;
const FIRST_TEXT_PROBE = '"ech'; // the first streamed piece of the answer, in any of the protocols

// ---------------------------------------------------------------------------------------------
// request bodies
let makeRequest; // () => { body: Buffer, headers }
if (PROTOCOL === "agui") {
  makeRequest = () => {
    const body = Buffer.from(JSON.stringify({
      threadId: randomUUID(), runId: randomUUID(), tools: [], context: [], forwardedProps: {}, state: {},
      messages: [{ id: randomUUID(), role: "user", content: TEXT }],
    }));
    return { body, headers: { "Content-Type": "application/json", Accept: "text/event-stream", "content-length": body.length } };
  };
} else if (PROTOCOL === "openai") {
  makeRequest = () => {
    const body = Buffer.from(JSON.stringify({
      model: "gpt-4o", messages: [{ role: "user", content: TEXT }], stream: true, stream_options: { include_usage: true },
    }));
    return { body, headers: { "content-type": "application/json", accept: "application/json", "content-length": body.length } };
  };
} else {
  if (!opts.template) throw new Error("--protocol graphql needs --template (made by bench/ts-graphql/make-request.mjs)");
  const tpl = JSON.parse(fs.readFileSync(opts.template, "utf8"));
  // The template is the client's exact body with placeholders where a real session differs:
  // thread id, message ids, createdAt and the user's text. They sit inside JSON strings.
  const userText = JSON.stringify(TEXT).slice(1, -1);
  const parts = tpl.body.split(/(__BENCH_[A-Z0-9_]+__)/);
  const headerEntries = tpl.headers.filter(([k]) => !["host", "connection", "content-length"].includes(k.toLowerCase()));
  makeRequest = () => {
    const values = {
      __BENCH_THREAD_ID__: randomUUID(), __BENCH_SYSTEM_ID__: "ck-" + randomUUID(), __BENCH_USER_ID__: "ck-" + randomUUID(),
      __BENCH_CREATED_AT__: new Date().toISOString(), __BENCH_USER_TEXT__: userText,
    };
    const body = Buffer.from(parts.map((p) => (p in values ? values[p] : p)).join(""));
    const headers = Object.fromEntries(headerEntries);
    headers["content-length"] = body.length;
    return { body, headers };
  };
}

// ---------------------------------------------------------------------------------------------
// response validation; returns null when the response is right, else the reason
function validate(status, contentType, text) {
  if (status !== 200) return `HTTP ${status}`;
  if (PROTOCOL === "graphql") return validateMultipart(contentType, text);
  if (!/text\/event-stream/i.test(contentType ?? "")) return `content-type ${contentType}`;
  const frames = [];
  for (const block of text.split(/\r?\n\r?\n/)) {
    const data = block.split(/\r?\n/).filter((l) => l.startsWith("data:")).map((l) => l.slice(l[5] === " " ? 6 : 5));
    if (data.length) frames.push(data.join("\n"));
  }
  if (PROTOCOL === "openai") {
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
  const delimiter = "\r\n--" + m[1];
  const segments = text.split(delimiter);
  // segments[0] is the preamble, the last one starts with "--" (the closing delimiter)
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
        const arr = walk(result, inc.path.slice(0, -1));
        if (!Array.isArray(arr)) return `stream path ${inc.path} is not a list`;
        arr.splice(inc.path.at(-1), inc.items.length, ...inc.items);
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
const firstEventDone = PROTOCOL === "graphql"
  ? (s) => { const a = s.indexOf("\r\n\r\n{"); return a >= 0 && s.indexOf("\r\n--", a) >= 0; }
  : (s) => /\n\r?\n/.test(s);

// ---------------------------------------------------------------------------------------------
// one request
function once(agent) {
  const { body, headers } = makeRequest();
  return new Promise((resolve) => {
    const t0 = performance.now();
    let tHeaders = NaN, tFirstEvent = NaN, tFirstText = NaN, head = "", done = false;
    const chunks = [];
    const finish = (reason, status, ctype, text, nbytes = 0) => {
      if (done) return;
      done = true;
      resolve({ ok: reason === null, reason, status, total: performance.now() - t0, headers: tHeaders - t0,
        firstEvent: tFirstEvent - t0, firstText: tFirstText - t0, bytes: nbytes,
        sample: reason === null ? undefined : `${reason} | ${String(text ?? "").slice(0, 600)}`, ctype });
    };
    const req = http.request({ host: URL_.hostname, port: URL_.port, path: URL_.pathname + URL_.search,
      method: "POST", headers, agent }, (res) => {
      tHeaders = performance.now();
      res.on("data", (d) => {
        chunks.push(d);
        if (Number.isNaN(tFirstText)) {
          // probes look at the first few KB only
          if (head.length < 16384) head += d.toString("latin1");
          const now = performance.now();
          if (Number.isNaN(tFirstEvent) && firstEventDone(head)) tFirstEvent = now;
          if (head.includes(FIRST_TEXT_PROBE)) tFirstText = now;
        }
      });
      res.on("end", () => {
        const raw = Buffer.concat(chunks);
        const text = raw.toString("utf8");
        let reason;
        try { reason = validate(res.statusCode, res.headers["content-type"], text); } catch (e) { reason = `unparsable: ${e.message}`; }
        finish(reason, res.statusCode, res.headers["content-type"], text, raw.length);
      });
      res.on("error", (e) => finish(`response error: ${e.message}`, res.statusCode, undefined, Buffer.concat(chunks).toString("utf8")));
    });
    req.setTimeout(REQUEST_TIMEOUT_MS, () => req.destroy(new Error(`timeout after ${REQUEST_TIMEOUT_MS} ms`)));
    req.on("error", (e) => finish(`request error: ${e.message}`, 0, undefined, ""));
    req.end(body);
  });
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
  const pids = tree(root);
  let cpuS = 0, rssMB = 0, hwmMB = 0, alive = 0;
  for (const pid of pids) { const p = readProc(pid); if (p) { alive++; cpuS += p.cpuS; rssMB += p.rssMB; hwmMB += p.hwmMB; } }
  return alive ? { cpuS, rssMB, hwmMB, processes: alive } : null;
}
function machineBusyS() {
  const f = fs.readFileSync("/proc/stat", "utf8").split("\n")[0].trim().split(/\s+/).slice(1).map(Number);
  // user nice system irq softirq (idle and iowait are not busy; steal is the hypervisor's)
  return (f[0] + f[1] + f[2] + f[5] + f[6]) / CLK_TCK;
}
const selfCpuS = () => { const u = process.cpuUsage(); return (u.user + u.system) / 1e6; };
function snapshot() {
  const s = { t: performance.now(), machine: machineBusyS(), loadgen: selfCpuS(), procs: {} };
  for (const [name, pid] of pidSpecs) s.procs[name] = sampleTree(pid);
  return s;
}
const r2 = (x) => (Number.isFinite(x) ? Math.round(x * 100) / 100 : null);
function cpuBetween(a, b, requests) {
  const out = { wallS: r2((b.t - a.t) / 1000), machineBusyS: r2(b.machine - a.machine), loadgenS: r2(b.loadgen - a.loadgen) };
  let accounted = b.loadgen - a.loadgen;
  for (const [name] of pidSpecs) {
    const x = a.procs[name], y = b.procs[name];
    if (!x || !y) { out[name] = null; continue; }
    const d = y.cpuS - x.cpuS;
    accounted += d;
    out[name] = { cpuS: r2(d), cpuMsPerReq: requests ? r2((d * 1000) / requests) : null, coresBusy: r2(d / ((b.t - a.t) / 1000)) };
  }
  out.otherS = r2(b.machine - a.machine - accounted);
  return out;
}
const pct = (sorted, p) => (sorted.length ? sorted[Math.min(sorted.length - 1, Math.max(0, Math.ceil((p / 100) * sorted.length) - 1))] : NaN);
const median = (xs) => pct([...xs].filter(Number.isFinite).sort((a, b) => a - b), 50);

// ---------------------------------------------------------------------------------------------
// phases
const log = (...m) => console.log(`[${TARGET}]`, ...m);
const result = {
  target: TARGET, protocol: PROTOCOL, url: URL_.href, textLen: TEXT.length, expected: EXPECTED.slice(0, 40) + "…",
  requestBytes: makeRequest().body.length, node: process.version, startedAt: new Date().toISOString(),
  settings: { levels: LEVELS, seconds: SECONDS, warmup: WARMUP, serial: SERIAL, clkTck: CLK_TCK },
  failures: 0, failureSamples: [],
};
const noteFailure = (r) => { result.failures++; if (result.failureSamples.length < 5) result.failureSamples.push(r.sample); };
const writeOut = () => { if (opts.json) fs.writeFileSync(opts.json, JSON.stringify(result, null, 2) + "\n"); };

// Before anything else, wait (up to --quiet-wait seconds) until the rest of the machine is quiet:
// less than --quiet-cores of CPU used by processes other than ours over a 1 s window.
{
  const maxWait = Number(opts["quiet-wait"] ?? 0), limit = Number(opts["quiet-cores"] ?? 0.15);
  const t0 = performance.now();
  let busy = null;
  while (maxWait > 0) {
    const a = snapshot();
    await new Promise((r) => setTimeout(r, 1000));
    const b = snapshot();
    const d = cpuBetween(a, b, 0);
    busy = d.otherS / d.wallS;
    if (busy < limit || performance.now() - t0 > maxWait * 1000) break;
  }
  result.quiet = { waitedS: r2((performance.now() - t0) / 1000), otherCoresBeforeStart: r2(busy), limit, reached: busy === null || busy < limit };
  if (maxWait > 0) log(`machine quiet check: other processes used ${r2(busy)} cores (limit ${limit}) after ${result.quiet.waitedS} s${result.quiet.reached ? "" : " - NOT quiet, going on"}`);
}

// idle: before the first request
const idle = snapshot();
result.idle = Object.fromEntries(pidSpecs.map(([n]) => [n, idle.procs[n] && { rssMB: r2(idle.procs[n].rssMB), processes: idle.procs[n].processes }]));
log(`idle RSS: ${pidSpecs.map(([n]) => `${n} ${r2(idle.procs[n]?.rssMB)} MB`).join(", ")}`);

async function closedLoop(workers, stopAt) {
  const agent = new http.Agent({ keepAlive: true, maxSockets: workers });
  const lat = [], fails = [];
  let sent = 0;
  const t0 = performance.now();
  await Promise.all(Array.from({ length: workers }, async () => {
    while (stopAt(sent, t0) === false && sent < MAX_PER_LEVEL) {
      sent++;
      const r = await once(agent);
      if (r.ok) lat.push(r.total); else fails.push(r);
    }
  }));
  const seconds = (performance.now() - t0) / 1000;
  agent.destroy();
  return { lat, fails, seconds };
}

{ // warm-up
  const w = await closedLoop(Math.min(4, Math.max(1, WARMUP)), (sent) => sent >= WARMUP);
  result.warmup = { requests: WARMUP, failed: w.fails.length, seconds: r2(w.seconds) };
  w.fails.forEach(noteFailure);
  log(`warm-up: ${WARMUP} requests in ${r2(w.seconds)} s, ${w.fails.length} failed`);
  if (WARMUP && w.fails.length > WARMUP / 2) {
    result.aborted = `most warm-up requests failed; first: ${w.fails[0].sample}`;
    writeOut();
    console.error(`[${TARGET}] ${result.aborted}`);
    process.exit(2);
  }
}

if (SERIAL > 0) { // sequential requests: latency and time to first event
  const agent = new http.Agent({ keepAlive: true, maxSockets: 1 });
  const a = snapshot(); const rs = [];
  for (let i = 0; i < SERIAL; i++) rs.push(await once(agent));
  const b = snapshot();
  agent.destroy();
  const good = rs.filter((r) => r.ok);
  rs.filter((r) => !r.ok).forEach(noteFailure);
  const tot = good.map((r) => r.total).sort((x, y) => x - y);
  result.serial = { n: SERIAL, failed: SERIAL - good.length, responseBytes: good[0]?.bytes ?? null,
    contentType: good[0]?.ctype ?? null,
    medianMs: r2(pct(tot, 50)), p90Ms: r2(pct(tot, 90)),
    medianHeadersMs: r2(median(good.map((r) => r.headers))), medianFirstEventMs: r2(median(good.map((r) => r.firstEvent))),
    medianFirstTextMs: r2(median(good.map((r) => r.firstText))), cpu: cpuBetween(a, b, SERIAL) };
  const s = result.serial;
  log(`serial x${SERIAL}: median ${s.medianMs} ms (p90 ${s.p90Ms}), headers ${s.medianHeadersMs} ms, first event ${s.medianFirstEventMs} ms, first text ${s.medianFirstTextMs} ms, ${s.failed} failed`);
}

result.levels = [];
for (const c of LEVELS) {
  const a = snapshot();
  const run = await closedLoop(c, (_sent, t0) => performance.now() - t0 >= SECONDS * 1000);
  const b = snapshot();
  run.fails.forEach(noteFailure);
  const lat = run.lat.sort((x, y) => x - y);
  const n = lat.length + run.fails.length;
  const row = { concurrency: c, seconds: r2(run.seconds), completed: lat.length, failed: run.fails.length,
    rps: r2(lat.length / run.seconds), p50Ms: r2(pct(lat, 50)), p90Ms: r2(pct(lat, 90)), p99Ms: r2(pct(lat, 99)),
    maxMs: r2(lat.at(-1)), cpu: cpuBetween(a, b, n),
    rssEndMB: Object.fromEntries(pidSpecs.map(([nm]) => [nm, r2(b.procs[nm]?.rssMB)])) };
  result.levels.push(row);
  const srv = pidSpecs.map(([nm]) => `${nm} ${row.cpu[nm]?.cpuMsPerReq} ms`).join(", ");
  log(`c=${String(c).padStart(3)}: ${row.rps} req/s, p50 ${row.p50Ms} ms, p99 ${row.p99Ms} ms, ${row.completed} ok, ${row.failed} failed; ` +
    `CPU/req ${srv}; loadgen ${row.cpu.loadgenS} s, other processes ${row.cpu.otherS} s`);
}

const end = snapshot();
result.peak = Object.fromEntries(pidSpecs.map(([n]) => [n, end.procs[n] && { hwmMB: r2(end.procs[n].hwmMB), rssMB: r2(end.procs[n].rssMB), processes: end.procs[n].processes }]));
log(`peak RSS (VmHWM): ${pidSpecs.map(([n]) => `${n} ${result.peak[n]?.hwmMB} MB`).join(", ")}; failures ${result.failures}`);
result.finishedAt = new Date().toISOString();
writeOut();
