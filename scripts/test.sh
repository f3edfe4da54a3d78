#!/usr/bin/env bash
# README command 2: install what is needed (idempotent), lint, then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check src tests
.venv/bin/python -m pytest -p no:cacheprovider "$@"
