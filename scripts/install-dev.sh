#!/usr/bin/env bash
# Create (or refresh) a virtual environment with torch==2.13.0 and every distribution of
# this repository installed in editable mode. Plugin folders are discovered, never listed:
# any plugins/<name>/pyproject.toml or plugins/backends/<name>/pyproject.toml is picked up.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${SPECFORGE_VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
# torch first, pinned: a requirement that lets pip choose torch freely pulls a CUDA build.
"$PY" -m pip install --quiet -c constraints.txt "torch==2.13.0"
args=(-e ".[dev]")
for project in plugins/*/pyproject.toml plugins/backends/*/pyproject.toml; do
    [ -e "$project" ] && args+=(-e "$(dirname "$project")")
done
"$PY" -m pip install --quiet -c constraints.txt "${args[@]}"
echo "installed into $VENV: ${args[*]}"
