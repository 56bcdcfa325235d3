// The messages and state a real client holds after applying event streams.
//
//   node apply_events.mjs < cases.json
//
// Reads a JSON array of cases, each {events, state}: AG-UI events (a thread's runs one after
// the other, as `connect` replays them) and the state the client holds before them; applies
// each with @ag-ui/client's own `defaultApplyEvents` (what HttpAgent and CopilotKit's agents
// do with a stream), and writes one JSON line: an array of {messages, state}, one per case.
// Library warnings go to stderr.
import { defaultApplyEvents } from "@ag-ui/client";
import { from, lastValueFrom, toArray } from "rxjs";

for (const level of ["log", "info", "warn", "debug"]) console[level] = (...args) => console.error(...args);

const chunks = [];
for await (const chunk of process.stdin) chunks.push(chunk);
const cases = JSON.parse(Buffer.concat(chunks).toString("utf8"));

const results = [];
for (const { events, state: before } of cases) {
  const agent = { messages: [], state: before };
  const input = { threadId: "t", runId: "r", state: before, messages: [], tools: [], context: [] };
  const mutations = await lastValueFrom(
    defaultApplyEvents(input, from(events), agent, []).pipe(toArray()));
  let { messages, state } = agent;
  for (const mutation of mutations) {
    if (mutation.messages !== undefined) messages = mutation.messages;
    if (mutation.state !== undefined) state = mutation.state;
  }
  results.push({ messages, state });
}
process.stdout.write(JSON.stringify(results) + "\n");
