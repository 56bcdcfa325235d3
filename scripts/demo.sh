#!/usr/bin/env bash
# Set up and serve the demo on http://127.0.0.1:8000/ (the web pages) and /copilotkit (the
# runtime); extra args go to `copilot-runtime demo`, e.g. --port 9000. No API key needed;
# threads are kept in SQLite.
set -euo pipefail
source "$(dirname "$0")/_venv.sh" "langgraph"
# The web pages at / and /classic: built on first use (Node.js 20+ and npm), then when
# web/ changes. Without them the demo still serves the runtime's API.
"$(dirname "$0")/build_web.sh" || echo "(the web pages were not built; serving the API only)" >&2
exec .venv/bin/copilot-runtime demo "$@"
