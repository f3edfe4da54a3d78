#!/usr/bin/env bash
# README command 1: install (idempotent), then generate with DSpark speculative decoding and compare with no speculation.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/dspark generate "def fibonacci(n):" --max-tokens 128 --compare "$@"
