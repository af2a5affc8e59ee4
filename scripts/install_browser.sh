#!/usr/bin/env bash
# Install Debian's headless Chromium for the browser-page test, once.
set -euo pipefail
if command -v chromium >/dev/null 2>&1; then exit 0; fi
if [ "$(id -u)" != 0 ]; then
  echo "install_browser: chromium missing and not root; the browser test will be skipped" >&2
  exit 0
fi
echo "install_browser: installing Debian chromium" >&2
apt-get update -qq >/dev/null
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
