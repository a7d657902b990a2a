#!/usr/bin/env bash
# Set up and run the main job on a fresh machine. Until the first-party strategies land,
# the main job is: list the plugins, then resolve and validate a full run plan with the
# out-of-tree example strategy (installed into a scratch directory, not into the venv).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-dev.sh
VENV="${SPECFORGE_VENV:-.venv}"
"$VENV/bin/specforge" plugins
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
"$VENV/bin/python" -m pip install --quiet --no-deps --no-build-isolation --target "$scratch" ./examples/specforge-plugin-example
PYTHONPATH="$scratch" "$VENV/bin/specforge" run --strategy example --set train.max_steps=100 --dry-run
