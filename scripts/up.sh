#!/usr/bin/env bash
# Bring the whole system up on the tiny preset on the CPU and print the URL (the README's first command).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bash "$root/scripts/bootstrap.sh"
cd "$root"
exec "$root/.venv/bin/python" -m services.up --profile "${VITASCOPE_PROFILE:-configs/tiny_cpu.yaml}" "$@"
