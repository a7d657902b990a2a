#!/usr/bin/env bash
# Set up the environment and run the whole test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-dev.sh
export HF_HUB_OFFLINE=1 SPECFORGE_STRICT_PLUGINS=1
exec "${SPECFORGE_VENV:-.venv}/bin/python" -m pytest -q "$@"
