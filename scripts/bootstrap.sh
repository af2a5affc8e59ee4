#!/usr/bin/env bash
# Create .venv with everything vitascope needs, once; re-run when pyproject.toml changes.
# torch is pinned to the CPU build first so that pip never pulls a multi-GB CUDA build here.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv="$root/.venv"
stamp="$venv/.vitascope-installed"
want=$(sha256sum "$root/pyproject.toml" | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "bootstrap: installing into $venv (first run takes a few minutes)" >&2
python3 -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip
"$venv/bin/pip" install -q "torch==2.13.0"
"$venv/bin/pip" install -q -e "$root[dev]"
echo "$want" >"$stamp"
