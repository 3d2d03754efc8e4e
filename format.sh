#!/usr/bin/env bash
# Format and lint with ruff. --check changes nothing and fails if anything would change.
set -euo pipefail
cd "$(dirname "$0")"
if command -v ruff > /dev/null; then
    ruff=(ruff)
elif python3 -m ruff --version > /dev/null 2>&1; then
    ruff=(python3 -m ruff)
else
    echo "format.sh: ruff not found; install it with: pip install -e '.[dev]'" >&2
    exit 1
fi
if [[ "${1:-}" == "--check" ]]; then
    "${ruff[@]}" format --check .
    "${ruff[@]}" check .
else
    "${ruff[@]}" format .
    "${ruff[@]}" check --fix .
fi
