#!/usr/bin/env bash
# Run the whole CPU test suite (the README's test command; .ci/run calls it too).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bash "$root/scripts/bootstrap.sh"
bash "$root/scripts/install_system_deps.sh"
cd "$root"
exec "$root/.venv/bin/python" -m pytest "$@"
