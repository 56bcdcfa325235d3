// What each real client's own event checker says of event streams.
//
//   node verify_events.mjs < streams.json
//
// Reads a JSON array of streams (each an array of AG-UI events, a whole run), passes each
// through `verifyEvents` of @ag-ui/client 0.0.59 and of 1.0.0 (`agui-client-1`, stricter),
// and writes one JSON line: an array of {"0.0.59": error or null, "1.0.0": error or null}.
import * as current from "@ag-ui/client";
import * as next from "agui-client-1";
import { from, lastValueFrom, toArray } from "rxjs";

for (const level of ["log", "info", "warn", "debug"]) console[level] = (...args) => console.error(...args);

const chunks = [];
for await (const chunk of process.stdin) chunks.push(chunk);
const streams = JSON.parse(Buffer.concat(chunks).toString("utf8"));

async function verdict(client, events) {
  try {
    await lastValueFrom(from(events).pipe(client.verifyEvents(false), toArray()));
    return null;
  } catch (error) {
    return error instanceof Error ? error.message : String(error);
  }
}

const results = [];
for (const events of streams) {
  results.push({ "0.0.59": await verdict(current, events), "1.0.0": await verdict(next, events) });
}
process.stdout.write(JSON.stringify(results) + "\n");
