#!/usr/bin/env bash
# Format and lint with ruff. --check changes nothing and fails if anything would change.
set -euo pipefail
cd "$(dirname "$0")"
if command -v ruff > /dev/null; then ruff=(ruff); else ruff=(python3 -m ruff); fi
if [[ "${1:-}" == "--check" ]]; then
    "${ruff[@]}" format --check .
    "${ruff[@]}" check .
else
    "${ruff[@]}" format .
    "${ruff[@]}" check --fix .
fi
