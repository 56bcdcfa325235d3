#!/usr/bin/env bash
# Build the demo's web pages (web/ -> copilot_runtime/demo_web/) when they are missing or
# their sources changed: needs Node.js 20+ and npm. Installs web/node_modules from its
# lockfile first. Nothing is done when the hash of the lockfile, the sources and the build
# script matches the last build's.
#   --check   only say: exit 0 when the pages are up to date, 1 when a build is needed,
#             3 when one is needed but Node.js 20+ and npm are missing
set -euo pipefail
cd "$(dirname "$0")/.."
out=copilot_runtime/demo_web
built() { [ -f "$out/index.html" ] && [ -f "$out/classic/index.html" ]; }
if ! command -v node >/dev/null || ! command -v npm >/dev/null \
    || [ "$(node -p 'process.versions.node.split(".")[0]')" -lt 20 ]; then
    if built; then
        exit 0  # built before; without Node they cannot be rebuilt, and need not be
    fi
    echo "Building the demo's web pages needs Node.js 20+ and npm (https://nodejs.org)." >&2
    exit 3
fi
lock_hash=$(sha256sum web/package-lock.json | cut -c1-16)
hash=$(cat web/package-lock.json web/build.mjs $(find web/src -type f | sort) | sha256sum | cut -c1-16)
installed=web/node_modules/.installed-from-lockfile
stamp=web/node_modules/.demo-web-build
if built && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$hash" ]; then
    exit 0
fi
if [ "${1:-}" = "--check" ]; then
    exit 1
fi
# One build at a time (two demos started together share the output folder).
exec 9>web/.build.lock
flock 9
if [ ! -f "$installed" ] || [ "$(cat "$installed")" != "$lock_hash" ]; then
    (cd web && npm ci --no-audit --no-fund --loglevel=error)
    echo "$lock_hash" > "$installed"
fi
if ! built || [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$hash" ]; then
    (cd web && node build.mjs)
    echo "$hash" > "$stamp"
fi
