#!/usr/bin/env bash
# The whole test suite (README "Set-up"): install what is needed (idempotent), lint, then run pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check src tests
.venv/bin/python -m pytest -p no:cacheprovider "$@"
