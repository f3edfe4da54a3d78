#!/usr/bin/env bash
# Demo: install (idempotent), then answer one instruction with the real bundled pair: the SmolLM2-135M-Instruct
# target and its shipped DSpark drafter, through the model's chat template, greedy. `dspark generate` runs the
# prompt with speculation, then again without it, and prints τ (mean acceptance length) and the speed-up. Every
# step drafts ("speculation_guard": false), so both numbers are DSpark's own; by default the guard may switch
# drafting off where rounds do not pay. The instruction is the second held-out code prompt (the drafter never
# trained on it). Extra arguments go to `dspark generate`, e.g. `bash scripts/demo.sh --threads 2`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
prompt=$(.venv/bin/python -c "import json; f = open('src/dspark/assets/prompts/heldout_code.jsonl'); f.readline(); \
print(json.loads(f.readline())['messages'][0]['content'])")
echo "instruction: $prompt"
echo
.venv/bin/dspark generate --model smollm2-135m-instruct "$prompt" --max-tokens 96 \
  --speculative-config '{"method": "dspark", "speculation_guard": false}' "$@"
echo
echo "(At temperature 0, τ depends on the pair, the prompt and the dtype, not on the machine's speed. The speed-up"
echo "is one short run and moves with whatever else the machine is doing: 'dspark bench' measures it. Where a round"
echo "costs more than its accepted tokens repay, as with this drafter's τ against a target served from its quantized"
echo "GGUF blocks, the speed-up is below 1, and by default the speculation guard switches drafting off. The"
echo "Kimi-K3-shaped pairs (kimi-k3-mini, the default, and k3-mini) are small models trained on a code corpus to"
echo "exercise the architecture: their text is not meant to be read; their τ and speed-ups are in README.md,"
echo "'Results'.)"
