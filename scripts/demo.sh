#!/usr/bin/env bash
# Set up and serve the demo runtime on http://127.0.0.1:8000/copilotkit (extra args go to
# `copilot-runtime demo`, e.g. --port 9000). No API key needed; threads are kept in SQLite.
set -euo pipefail
source "$(dirname "$0")/_venv.sh" "langgraph"
exec .venv/bin/copilot-runtime demo "$@"
