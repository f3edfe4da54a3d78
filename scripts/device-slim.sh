#!/usr/bin/env bash
# The working tree a device call carries is at most 64 MiB; the bundled weights alone are ~180 MB.
#   bash scripts/device-slim.sh on    untrack the bundled model folders for the calls (git ignores them meanwhile)
#   bash scripts/device-slim.sh off   track them again; `git status` is then as before
# The files never leave the disk. Commit only after `off` (with `on`, git status lists the weights as deleted).
set -euo pipefail
cd "$(dirname "$0")/.."
exclude=.git/info/exclude
mark="# dspark device-slim"
dirs=$(cd src/dspark/assets && for d in */; do [ -f "$d/model.safetensors" ] && echo "src/dspark/assets/${d%/}"; done)
case "${1:-}" in
  on)
    grep -qx "$mark" "$exclude" 2>/dev/null || { echo "$mark"; for d in $dirs; do echo "/$d/"; done; echo "/.devpack/"; echo "/.devpack-build/"; } >> "$exclude"
    git rm -r -q --cached $dirs
    ;;
  off)
    git reset -q -- $dirs
    if grep -qx "$mark" "$exclude" 2>/dev/null; then
      sed -i "/^$mark\$/,/^\/\.devpack-build\/\$/d" "$exclude"
    fi
    ;;
  *) echo "usage: bash scripts/device-slim.sh on|off" >&2; exit 2 ;;
esac
git status --short | head -5
