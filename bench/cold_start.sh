#!/usr/bin/env bash
# Time the README's first command from a fresh clone of HEAD until /info answers, with an
# empty pip cache (cold) and then with the cache that run filled (warm).
# Usage: bench/cold_start.sh [port]
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PORT="${1:-8765}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

one() {  # $1: label, $2: pip cache dir
    local clone="$WORK/clone-$1"
    git clone --quiet "$ROOT" "$clone"
    local start end pid
    start=$(date +%s.%N)
    (cd "$clone" && PIP_CACHE_DIR="$2" setsid ./scripts/demo.sh --port "$PORT" \
        >"$WORK/$1.log" 2>&1) &
    pid=$!
    until curl -sf "http://127.0.0.1:$PORT/copilotkit/info" >/dev/null; do
        if ! kill -0 "$pid" 2>/dev/null; then cat "$WORK/$1.log"; exit 1; fi
        sleep 0.2
    done
    end=$(date +%s.%N)
    pkill -TERM -f "copilot-runtime demo --port $PORT" || true
    wait "$pid" || true
    printf '%s: %.1f s\n' "$1" "$(echo "$end - $start" | bc)"
}

one cold "$WORK/pip-cache"
one warm "$WORK/pip-cache"
