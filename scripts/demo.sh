#!/usr/bin/env bash
# Set up and serve the demo on http://127.0.0.1:8000/ (the web pages) and /copilotkit (the
# runtime); extra args go to `copilot-runtime demo`, e.g. --port 9000. No API key needed;
# threads are kept in SQLite.
set -euo pipefail
source "$(dirname "$0")/_venv.sh" "langgraph"
# The web pages at / and /classic: built on first use (Node.js 20+ and npm), and again when
# web/ changes, in the background, so the runtime serves at once; / shows the pages when
# they are ready (a build under way goes on after Ctrl-C, to its end).
status=0
./scripts/build_web.sh --check || status=$?
if [ "$status" = 1 ]; then
    echo "building the demo's web pages in the background (a few minutes the first time;" \
         "log: web/build.log); the demo's / shows them when they are ready" >&2
    { ./scripts/build_web.sh >web/build.log 2>&1 \
        || echo "building the web pages failed: see web/build.log" >&2; } &
fi
exec .venv/bin/copilot-runtime demo "$@"
