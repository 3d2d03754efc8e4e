#!/usr/bin/env bash
# Format and lint with ruff. --check changes nothing and fails if anything would change.
# Without ruff on PATH or in this Python, a pinned ruff is installed once into .tools/.
set -euo pipefail
cd "$(dirname "$0")"
RUFF_VERSION="0.17.6"
tools=".tools/ruff-$RUFF_VERSION"
if command -v ruff > /dev/null; then
    ruff=(ruff)
elif python3 -m ruff --version > /dev/null 2>&1; then
    ruff=(python3 -m ruff)
else
    if [[ ! -x "$tools/bin/ruff" ]]; then
        echo "format.sh: ruff not found; installing ruff $RUFF_VERSION into $tools" >&2
        python3 -m pip install --quiet --target "$tools" "ruff==$RUFF_VERSION"
    fi
    ruff=("$tools/bin/ruff")
fi
if [[ "${1:-}" == "--check" ]]; then
    "${ruff[@]}" format --check .
    "${ruff[@]}" check .
else
    "${ruff[@]}" format .
    "${ruff[@]}" check --fix .
fi
