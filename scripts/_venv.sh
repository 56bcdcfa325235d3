# Sourced by the other scripts: make .venv with the project installed (extras in $1), once
# per change of pyproject.toml.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
EXTRAS="${1:-}"
PYTHON="${PYTHON:-python3}"
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    echo "copilot-runtime needs Python 3.11 or newer (found: $("$PYTHON" --version 2>&1))" >&2
    exit 1
fi
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
STAMP=".venv/.installed-$(sha256sum pyproject.toml | cut -c1-16)${EXTRAS:+-$EXTRAS}"
if [ ! -f "$STAMP" ]; then
    .venv/bin/python -m pip install --quiet --upgrade pip
    .venv/bin/python -m pip install --quiet -e ".${EXTRAS:+[$EXTRAS]}"
    touch "$STAMP"
fi
