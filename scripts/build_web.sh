#!/usr/bin/env bash
# Build the demo's web pages (web/ -> copilot_runtime/demo_web/) when they are missing or
# their sources changed: needs Node.js 20+ and npm. Installs web/node_modules from its
# lockfile first. The build is skipped when the hash of the lockfile, the sources and the
# build script matches the last build's.
set -euo pipefail
cd "$(dirname "$0")/.."
out=copilot_runtime/demo_web
if ! command -v node >/dev/null || ! command -v npm >/dev/null \
    || [ "$(node -p 'process.versions.node.split(".")[0]')" -lt 20 ]; then
    if [ -f "$out/index.html" ] && [ -f "$out/classic/index.html" ]; then
        exit 0  # built before; without Node they cannot be rebuilt, and need not be
    fi
    echo "Building the demo's web pages needs Node.js 20+ and npm (https://nodejs.org)." >&2
    exit 3
fi
if [ ! -d web/node_modules ] || [ web/package-lock.json -nt web/node_modules ]; then
    (cd web && npm ci --no-audit --no-fund --loglevel=error)
    touch web/node_modules
fi
hash=$(cat web/package-lock.json web/build.mjs $(find web/src -type f | sort) | sha256sum | cut -c1-16)
stamp=web/node_modules/.demo-web-build
if [ -f "$out/index.html" ] && [ -f "$out/classic/index.html" ] && [ -f "$stamp" ] \
    && [ "$(cat "$stamp")" = "$hash" ]; then
    exit 0
fi
(cd web && node build.mjs)
echo "$hash" > "$stamp"
