#!/usr/bin/env bash
# Installs Debian's headless-capable Chromium when it is missing (the status page of
# ems-control is tested in it: tests/control/test_status_page.py). Needs root and apt;
# without them it says so in one line and the page test skips.
set -uo pipefail
if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" != "0" ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "setup-chromium: not root or no apt-get: chromium not installed; the status page test will skip" >&2
  exit 0
fi
echo "setup-chromium: installing chromium (Debian package)" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null 2>&1 || true
if ! apt-get install -y -qq chromium >/dev/null 2>&1; then
  echo "setup-chromium: apt-get install chromium failed; the status page test will skip" >&2
fi
exit 0
