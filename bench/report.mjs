// bench/report.mjs: turns one bench/run's per-target results into bench/results/<stamp>.json and a
// Markdown report, printed and (optionally) written to docs/benchmarks.md.
//
//   node bench/report.mjs --stamp S --results DIR --scratch DIR --docs auto|yes|no --doc-file F
//        [--python VERSION] [--python-packages a=1,b=2] [--git REV] [--mock chunks=50,delay_ms=0] -- FILE...
//
// In docs/benchmarks.md only the part between the `bench:begin` and `bench:end` markers is
// generated; text outside the markers (notes, profiles) is kept across runs.
import fs from "node:fs";
import os from "node:os";
import path from "node:path";

const argv = process.argv.slice(2);
const dash = argv.indexOf("--");
const files = dash >= 0 ? argv.slice(dash + 1) : [];
const opts = {};
for (let i = 0; i < (dash >= 0 ? dash : argv.length); i += 2) opts[argv[i].replace(/^--/, "")] = argv[i + 1];

const LABEL = {
  python: "ours (Python, AG-UI)",
  "ts-agui": "TS 1.75.0 (AG-UI)",
  "ts-graphql": "TS 1.10.6 (GraphQL)",
  "python-graphql": "ours (Python, GraphQL)",
  mock: "mock LLM alone",
};
const runs = {};
for (const f of files) {
  try { const r = JSON.parse(fs.readFileSync(f, "utf8")); runs[r.target] = r; } catch (e) { console.error(`report: cannot read ${f}: ${e.message}`); }
}

// ---------------------------------------------------------------------------------------------
// metadata
const readVersion = (dir, pkg) => {
  try { return JSON.parse(fs.readFileSync(path.join(dir, "node_modules", pkg, "package.json"), "utf8")).version; } catch { return null; }
};
const scratch = opts.scratch ?? "bench/.scratch";
const versions = {
  node: process.version,
  python: opts.python ?? null,
  pythonPackages: Object.fromEntries((opts["python-packages"] ?? "").split(",").filter(Boolean).map((kv) => kv.split("="))),
  "ts-agui": Object.fromEntries(["@copilotkit/runtime", "@ai-sdk/openai", "ai", "@ag-ui/core", "@ag-ui/client", "zod"]
    .map((p) => [p, readVersion(path.join(scratch, "ts-agui"), p)]).filter(([, v]) => v)),
  "ts-graphql": Object.fromEntries(["@copilotkit/runtime", "@copilotkit/runtime-client-gql", "@copilotkit/react-core", "openai", "graphql-yoga", "graphql"]
    .map((p) => [p, readVersion(path.join(scratch, "ts-graphql"), p)]).filter(([, v]) => v)),
};
const cpus = os.cpus();
const machine = {
  cpuModel: cpus[0]?.model?.trim() ?? "unknown", cores: cpus.length,
  memGiB: Math.round(os.totalmem() / 2 ** 30), kernel: `${os.type()} ${os.release()}`, arch: os.arch(),
};
const first = Object.values(runs)[0];
const settings = first?.settings ?? {};
const date = (first?.startedAt ?? new Date().toISOString()).slice(0, 10);

const combined = { stamp: opts.stamp, date, git: opts.git ?? null, machine, versions, mock: opts.mock ?? null, settings, targets: runs };
if (opts.results && opts.stamp) {
  const out = path.join(opts.results, `${opts.stamp}.json`);
  fs.writeFileSync(out, JSON.stringify(combined, null, 2) + "\n");
  console.log(`results: ${out}`);
}

// ---------------------------------------------------------------------------------------------
// formatting
const num = (x) => (typeof x === "number" && Number.isFinite(x) ? x : null);
function fmt(x, unit = "") {
  x = num(x);
  if (x === null) return "–";
  const s = Math.abs(x) >= 100 ? x.toFixed(0) : Math.abs(x) >= 10 ? x.toFixed(1) : x.toFixed(2);
  return s + unit;
}
const ratio = (a, b) => (num(a) !== null && num(b) ? num(a) / num(b) : null);
const fmtRatio = (r) => (r === null ? "–" : `${r.toFixed(2)}×`);
const level = (r, c) => r?.levels?.find((l) => l.concurrency === c);
const levels = settings.levels ?? [1, 10, 50];

const cols = ["python", "ts-agui", "ts-graphql", "python-graphql"].filter((t) => runs[t]);
const ours = runs.python;
// ratio columns: [ours, theirs, header]
const ratioCols = [
  ...(ours && runs["ts-agui"] ? [["python", "ts-agui", "ours ÷ 1.75"]] : []),
  ...(ours && runs["ts-graphql"] ? [["python", "ts-graphql", "ours ÷ 1.10.6"]] : []),
  ...(runs["python-graphql"] && runs["ts-graphql"] ? [["python-graphql", "ts-graphql", "ours GraphQL ÷ 1.10.6"]] : []),
];

// one row: label, getter(run) -> number|[numbers], unit, whether to add ratio columns
function row(label, get, unit = "") {
  const cells = cols.map((t) => {
    const v = get(runs[t]);
    return Array.isArray(v) ? v.map((x) => fmt(x, unit)).join(" / ") : fmt(v, unit);
  });
  const ratios = ratioCols.map(([o, t]) => {
    const a = get(runs[o]), b = get(runs[t]);
    if (Array.isArray(a)) return a.map((x, i) => fmtRatio(ratio(x, b?.[i]))).join(" / ");
    return fmtRatio(ratio(a, b));
  });
  return `| ${label} | ${cells.join(" | ")} |${ratios.length ? ` ${ratios.join(" | ")} |` : ""}`;
}

const lines = [];
const p = (s = "") => lines.push(s);
const header = ["", ...cols.map((t) => LABEL[t]), ...ratioCols.map(([, , h]) => h)];
p(`| ${header.join(" | ")} |`);
p(`|${header.map(() => " --- ").join("|")}|`);
for (const c of levels) p(row(`requests/s, c=${c}`, (r) => level(r, c)?.rps));
for (const c of levels) p(row(`latency p50 / p99, c=${c} (ms)`, (r) => [level(r, c)?.p50Ms, level(r, c)?.p99Ms]));
for (const c of levels) p(row(`server CPU per request, c=${c} (ms)`, (r) => level(r, c)?.cpu?.server?.cpuMsPerReq));
p(row("time to first event, sequential median (ms)", (r) => r?.serial?.medianFirstEventMs));
p(row("time to first text, sequential median (ms)", (r) => r?.serial?.medianFirstTextMs));
p(row("full response, sequential median (ms)", (r) => r?.serial?.medianMs));
p(row("idle memory, VmRSS after start-up (MB)", (r) => r?.idle?.server?.rssMB));
p(row("peak memory, VmHWM at the end (MB)", (r) => r?.peak?.server?.hwmMB));
p(row("start-up to first HTTP answer (s)", (r) => r?.startupS));
const blanks = ratioCols.map(() => " |").join("");
p(`| request / response size (bytes) | ${cols.map((t) => `${runs[t].requestBytes ?? "–"} / ${runs[t].serial?.responseBytes ?? "–"}`).join(" | ")} |${blanks}`);
p(`| failed responses / total | ${cols.map((t) => `${runs[t].failures} / ${totalRequests(runs[t])}`).join(" | ")} |${blanks}`);
const mainTable = lines.splice(0);

function totalRequests(r) {
  return (r.warmup?.requests ?? 0) + (r.serial?.n ?? 0) + (r.levels ?? []).reduce((s, l) => s + l.completed + l.failed, 0);
}

// the floor
if (runs.mock) {
  const m = runs.mock;
  p("| mock LLM alone | " + levels.map((c) => `c=${c}`).join(" | ") + " |");
  p("|---|" + levels.map(() => "---").join("|") + "|");
  p("| requests/s | " + levels.map((c) => fmt(level(m, c)?.rps)).join(" | ") + " |");
  p("| latency p50 / p99 (ms) | " + levels.map((c) => `${fmt(level(m, c)?.p50Ms)} / ${fmt(level(m, c)?.p99Ms)}`).join(" | ") + " |");
  p("| mock CPU per request (ms) | " + levels.map((c) => fmt(level(m, c)?.cpu?.mock?.cpuMsPerReq)).join(" | ") + " |");
  p("| load generator CPU per request (ms) | " + levels.map((c) => { const l = level(m, c); return fmt(l ? (l.cpu.loadgenS * 1000) / (l.completed + l.failed) : null); }).join(" | ") + " |");
}
const floorTable = lines.splice(0);

// noise and the other processes
p("| target, level | server CPU (cores) | mock CPU per request (ms) | load generator CPU (s) | other processes CPU (s) | wall (s) |");
p("|---|---|---|---|---|---|");
for (const t of [...cols, ...(runs.mock ? ["mock"] : [])]) {
  for (const l of runs[t].levels ?? []) {
    p(`| ${t}, c=${l.concurrency} | ${fmt(l.cpu.server?.coresBusy)} | ${fmt(l.cpu.mock?.cpuMsPerReq)} | ${fmt(l.cpu.loadgenS)} | ${fmt(l.cpu.otherS)} | ${fmt(l.cpu.wallS)} |`);
  }
}
const q = Object.values(runs).find((r) => r.quiet?.otherCoresBeforeStart != null)?.quiet;
if (q) p(`\nJust before the load started, other processes used ${fmt(q.otherCoresBeforeStart)} cores` +
  `${q.waitedS > 1.5 ? ` (after waiting ${fmt(q.waitedS)} s for the machine to quieten)` : ""}${q.reached ? "" : " (**the machine was not quiet**)"}.`);
const noiseTable = lines.splice(0);

// goal: >= 1.5x the requests/s of 1.10.6 at c=10 and c=50, with less than half its memory
const goal = [];
if (ours && runs["ts-graphql"]) {
  const g = runs["ts-graphql"];
  for (const c of [10, 50]) {
    const r = ratio(level(ours, c)?.rps, level(g, c)?.rps);
    if (r !== null) goal.push(`- requests/s at c=${c}: ${fmt(level(ours, c).rps)} vs ${fmt(level(g, c).rps)} = **${fmtRatio(r)}** (goal ≥ 1.5×): ${r >= 1.5 ? "met" : "**not met**"}`);
  }
  const pm = ratio(ours.peak?.server?.hwmMB, g.peak?.server?.hwmMB);
  const im = ratio(ours.idle?.server?.rssMB, g.idle?.server?.rssMB);
  if (pm !== null) goal.push(`- peak memory: ${fmt(ours.peak.server.hwmMB)} MB vs ${fmt(g.peak.server.hwmMB)} MB = **${fmtRatio(pm)}** (goal < 0.5×): ${pm < 0.5 ? "met" : "**not met**"}` +
    (im !== null ? `; idle ${fmt(ours.idle.server.rssMB)} MB vs ${fmt(g.idle.server.rssMB)} MB = ${fmtRatio(im)}` : ""));
  const failed = cols.filter((t) => runs[t].failures);
  goal.push(failed.length ? `- failed responses: ${failed.map((t) => `${t} ${runs[t].failures}`).join(", ")} (samples in the JSON)` : "- every response was valid (0 failures)");
}

const noisy = [...cols, ...(runs.mock ? ["mock"] : [])].flatMap((t) => (runs[t].levels ?? [])
  .filter((l) => (l.cpu.otherS ?? 0) > 0.05 * l.cpu.wallS * machine.cores).map((l) => `${t} c=${l.concurrency} (${fmt(l.cpu.otherS)} s)`));

const discarded = Object.values(runs).reduce((n, r) => n + (r.discardedSlices?.length ?? 0), 0);
const v = versions;
const pyPk = Object.entries(v.pythonPackages).map(([k, x]) => `${k} ${x}`).join(", ");
const agPk = Object.entries(v["ts-agui"]).map(([k, x]) => `\`${k}\` ${x}`).join(", ");
const gqPk = Object.entries(v["ts-graphql"]).map(([k, x]) => `\`${k}\` ${x}`).join(", ");
const aborted = Object.values(runs).filter((r) => r.aborted).map((r) => `- **${r.target} aborted**: ${r.aborted}`);

const section = [
  `Measured ${date} (run \`${opts.stamp}\`, git \`${opts.git ?? "?"}\`) on ${machine.cores} × ${machine.cpuModel}, ${machine.memGiB} GiB, ${machine.kernel}; ` +
    `the load generator, the mock LLM and the server under test share those ${machine.cores} cores.`,
  "",
  `Versions: Node ${v.node}${v.python ? `, Python ${v.python}` : ""}${pyPk ? ` (${pyPk})` : ""}. ` +
    (agPk ? `TS AG-UI: ${agPk}. ` : "") + (gqPk ? `TS GraphQL: ${gqPk}.` : ""),
  "",
  `Load: mock LLM \`${opts.mock ?? "?"}\`, ${settings.warmup} warm-up requests, ${settings.serial} sequential requests, ` +
    `then closed loops of ${levels.join(" / ")} workers for ${settings.seconds} s per level and server, run as ${settings.rounds ?? 1} interleaved slices ` +
    `(the servers take turns, so load from elsewhere on the machine is spread over all of them), keep-alive sockets` +
    (settings.noisyCores != null ? `; a slice during which other processes used more than ${settings.noisyCores} cores was thrown away and run again ` +
      `(at most ${settings.retries} times and ${settings.retryBudgetS ?? "?"} s in all; ${discarded ? `${discarded} slice${discarded > 1 ? "s" : ""} discarded in this run` : "none was needed in this run"})` : "") + ". " +
    `Ratios are ours ÷ theirs: above 1 is better for requests/s, below 1 is better for latency, CPU and memory.`,
  "",
  ...aborted, ...(aborted.length ? [""] : []),
  ...mainTable,
  "",
  ...(goal.length ? ["Goal for our server (against TS 1.10.6):", "", ...goal, ""] : []),
  ...(floorTable.length ? ["The floor: the mock LLM on its own (what any server's numbers sit on top of):", "", ...floorTable, ""] : []),
  "CPU used per level, for noise: *other processes* is the machine's busy time minus the server, the mock and the load generator." +
    (noisy.length ? ` **Noisy levels** (other processes above 5 % of the machine): ${noisy.join(", ")}; rerun to confirm.` : " No level had more than 5 % of the machine used by other processes."),
  "",
  ...noiseTable,
].join("\n");

console.log("\n" + section + "\n");

// ---------------------------------------------------------------------------------------------
// docs/benchmarks.md
const complete = ["python", "ts-agui", "ts-graphql"].every((t) => runs[t] && !runs[t].aborted);
const writeDocs = opts.docs === "yes" || (opts.docs !== "no" && complete);
if (writeDocs && opts["doc-file"]) {
  const BEGIN = "<!-- bench:begin (generated by bench/run; edits inside are overwritten) -->";
  const END = "<!-- bench:end -->";
  const docFile = opts["doc-file"];
  let doc = fs.existsSync(docFile) ? fs.readFileSync(docFile, "utf8") : "";
  const a = doc.indexOf("<!-- bench:begin"), b = doc.indexOf(END);
  if (a >= 0 && b > a) {
    doc = doc.slice(0, a) + `${BEGIN}\n${section}\n${END}` + doc.slice(b + END.length);
  } else {
    doc = `# Benchmarks\n\n${BEGIN}\n${section}\n${END}\n` + (doc ? `\n${doc}` : "");
  }
  fs.mkdirSync(path.dirname(docFile), { recursive: true });
  fs.writeFileSync(docFile, doc);
  console.log(`written: ${docFile}`);
} else if (opts.docs !== "no") {
  console.log(`(${opts["doc-file"] ?? "docs"} not written: ${complete ? "--no-docs" : "not all of python, ts-agui and ts-graphql ran; use --docs to force"})`);
}
