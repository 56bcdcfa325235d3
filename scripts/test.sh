#!/usr/bin/env bash
# Set up and run every test: the Python suite (with ruff and mypy --strict) and the real
# CopilotKit clients from npm. Extra args go to pytest.
set -euo pipefail
source "$(dirname "$0")/_venv.sh" "test"
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
    if command -v apt-get >/dev/null; then
        apt-get install -y -q nodejs npm >/dev/null
    else
        echo "The real-client tests need Node.js 20+ and npm" >&2
        exit 1
    fi
fi
for clients in tests/js tests/gql; do  # the current and the 1.10 generation's packages
    if [ ! -d $clients/node_modules ] || [ $clients/package-lock.json -nt $clients/node_modules ]; then
        (cd $clients && npm ci --no-audit --no-fund --loglevel=error)
    fi
done
# The browser tests drive Debian's chromium (never a downloaded browser build).
if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null; then
    apt-get install -y -q chromium >/dev/null 2>&1 \
        || { apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; }
fi
# (The legacy remote-endpoint tests' environment, mypy and the demo's web build run in the
# background from the start of the session: tests/background.py.)
# The persistence tests use the machine's PostgreSQL and Redis; start them if they are down.
if command -v pg_isready >/dev/null && ! pg_isready -q -h 127.0.0.1 -p 5432; then
    pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -1)" main start || true
fi
if command -v redis-cli >/dev/null && ! redis-cli -h 127.0.0.1 ping >/dev/null 2>&1; then
    redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
        --dir /var/lib/redis --logfile /var/log/redis/ci.log || true
fi
# Three processes, each taking whole test files (module fixtures are set up once): the tests
# mostly wait on sockets and timers, so two processes kept the machine's two cores less than
# half busy (user + system time ~43 % of 2 x wall). `-n 0` (given after) runs in one.
exec .venv/bin/python -m pytest -q -n "${TEST_PROCESSES:-3}" --dist loadfile "$@"
