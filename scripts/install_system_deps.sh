#!/usr/bin/env bash
# Install the Debian packages the test suite drives: headless Chromium (browser page test) and
# docker-compose (`docker compose config` validation). Once; skipped when present or not root.
set -euo pipefail
missing=()
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
{ docker compose version >/dev/null 2>&1 || command -v docker-compose >/dev/null 2>&1; } || missing+=(docker-compose)
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ]; then
  echo "install_system_deps: missing ${missing[*]} and not root; the tests needing them will be skipped" >&2
  exit 0
fi
echo "install_system_deps: installing ${missing[*]}" >&2
apt-get update -qq >/dev/null
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
