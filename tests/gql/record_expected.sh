#!/usr/bin/env bash
# Records what the real client gets from the TypeScript runtime 1.10.6 for every case of
# drive.mjs, into expected/cases.json: the fixtures tests/test_graphql_real_client.py compares
# our runtime with. Both runtimes use the same loopback mock LLM (python -m
# copilot_runtime.testing, 5 pieces per answer).
#
#   tests/gql/record_expected.sh                  # copies ../shared/anchor-graphql, npm ci there
#   ANCHOR_DIR=/tmp/anchor tests/gql/record_expected.sh   # an anchor copy already installed
#
# ANCHOR_SRC overrides where the anchor (the TypeScript runtime's server.mjs and lockfile) is
# copied from. Nothing is installed inside the anchor's own directory.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
python=${PYTHON:-$repo/.venv/bin/python}
work=$(mktemp -d)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT

anchor=${ANCHOR_DIR:-}
if [ -z "$anchor" ]; then
  anchor="$work/anchor"
  cp -r "${ANCHOR_SRC:-$repo/../shared/anchor-graphql}" "$anchor"
  chmod -R u+w "$anchor"
  (cd "$anchor" && npm ci --no-audit --no-fund >/dev/null)
fi
[ -d "$here/node_modules" ] || (cd "$here" && npm ci --no-audit --no-fund >/dev/null)

free_port() { "$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
mock_port=$(free_port)
port=$(free_port)
url="http://127.0.0.1:$port/copilotkit"

(cd "$repo" && exec "$python" -m copilot_runtime.testing --port "$mock_port" --chunks 5) \
  >"$work/mock.log" 2>&1 &
pids+=($!)
(cd "$anchor" && PORT=$port LLM_BASE_URL="http://127.0.0.1:$mock_port/v1" exec node server.mjs) \
  >"$work/anchor.log" 2>&1 &
pids+=($!)

for _ in $(seq 150); do
  if curl -s -o /dev/null -H 'content-type: application/json' -d '{"query":"{hello}"}' "$url"; then
    break
  fi
  sleep 0.2
done

node "$here/drive.mjs" "$url" >"$work/cases.json"
mkdir -p "$here/expected"
# The TypeScript runtime puts stack traces (with its install path) in error details; they are
# not part of the comparison and do not belong in the repository.
"$python" - "$work/cases.json" "$here/expected/cases.json" <<'EOF'
import json
import sys


def strip(value):
    if isinstance(value, dict):
        return {k: strip(v) for k, v in value.items() if k != "stack"}
    if isinstance(value, list):
        return [strip(v) for v in value]
    return value


with open(sys.argv[1], encoding="utf-8") as source:
    cases = strip(json.load(source))
with open(sys.argv[2], "w", encoding="utf-8") as target:
    json.dump(cases, target, indent=1, ensure_ascii=False, sort_keys=True)
    target.write("\n")
EOF
echo "recorded $(grep -c '' "$here/expected/cases.json") lines into $here/expected/cases.json"
