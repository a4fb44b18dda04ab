#!/usr/bin/env bash
# Chromium and chromedriver from Debian packages, for the browser test of the Prefect UI
# (tests/integration/test_browser_ui.py). Does nothing when both are installed; as root it runs apt-get,
# otherwise it uses `sudo -n` when that works and else says what to run. Never fails the caller.
set -uo pipefail
if command -v chromedriver >/dev/null && { command -v chromium >/dev/null || command -v chromium-browser >/dev/null; }; then
  exit 0
fi
if [ "$(id -u)" = 0 ]; then SUDO=""; elif sudo -n true 2>/dev/null; then SUDO="sudo -n"; else
  echo "browser test: chromium and chromedriver are missing; run as root: apt-get install -y chromium chromium-driver" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 \
  || { $SUDO apt-get update -q >/dev/null 2>&1 && $SUDO apt-get install -y -q chromium chromium-driver >/dev/null 2>&1; } \
  || echo "browser test: could not install chromium chromium-driver with apt-get" >&2
exit 0
