#!/usr/bin/env bash
# README command 1: install (idempotent), then generate with DSpark speculative decoding on the bundled pair and
# compare with no speculation (τ and speed-up). The prompt is the first held-out prompt (code neither model saw).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
prompt=$(.venv/bin/python -c "import json; print(json.loads(open('src/dspark/assets/prompts/heldout.jsonl').readline())['prompt'])")
.venv/bin/dspark generate "$prompt" --max-tokens 128 "$@"
