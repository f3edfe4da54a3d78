#!/usr/bin/env bash
# Drafter training on a lent accelerator, in one call (docs/training.md, "On a lent GPU").
#   bash scripts/device-train.sh --stash .devpack/1                 call 1: leave the first chunk on the machine
#   bash scripts/device-train.sh --stash .devpack/2 -- [RUN OPTIONS]  last call: the rest, then the run
#   bash scripts/device-train.sh -- --tiny                           the dry run (CPU, seconds; the test suite runs it)
# RUN OPTIONS are `python -m dspark.train.device_recipe run`'s (--budget-minutes 8, --dflash, ...). With a pack the
# target, the drafter and the prompts come from it; the results go to $OUT. Nothing is installed but the carried
# wheels (into a scratch folder): the device's own torch runs the code of this tree.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
STASH=${DSPARK_DEVPACK:-/tmp/dspark-devpack}
export DSPARK_DEVPACK=$STASH PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
run=0
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --stash) "$PY" -m dspark.train.device_pack stash "$2"; shift 2 ;;
    --) run=1; shift; args=("$@"); break ;;
    *) echo "device-train.sh: unknown argument $1 (options after --)" >&2; exit 2 ;;
  esac
done
[ "$run" = 1 ] || exit 0
pack=()
if [ -f "$STASH/manifest.json" ]; then
  roles=$("$PY" -m dspark.train.device_pack unpack --src "$STASH")
  echo "device-train.sh: unpacked $roles" >&2
  pick() { "$PY" -c "import json,sys; r=json.loads(sys.argv[1]).get(sys.argv[2], []); print(r[0] if r else '')" "$roles" "$1"; }
  wheels=$(ls "$STASH"/unpacked/wheel/*.whl 2>/dev/null || true)
  if [ -n "$wheels" ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/dspark-site $wheels
    export PYTHONPATH="$PYTHONPATH:/tmp/dspark-site"
  fi
  target=$(pick target); drafter=$(pick drafter); prompts=$(pick data)
  [ -n "$target" ] && pack+=(--target "$target")
  [ -n "$drafter" ] && pack+=(--drafter "$drafter")
  [ -n "$prompts" ] && pack+=(--prompts-file "$prompts")
fi
exec "$PY" -m dspark.train.device_recipe run "${pack[@]}" "${args[@]}"
