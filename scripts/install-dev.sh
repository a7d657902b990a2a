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
# The Mooncake transfer engine's CPU build needs Debian's libibverbs1 at run time (its
# tests start a real mooncake_master on loopback); install it only when that plugin exists.
if [ -e plugins/backends/mooncake/pyproject.toml ] && ! ldconfig -p | grep -q 'libibverbs\.so\.1'; then
    if [ "$(id -u)" = 0 ]; then
        apt-get update -qq && apt-get install -y -qq libibverbs1
    else
        echo "warning: libibverbs1 is missing; install it (apt-get install libibverbs1) for the Mooncake plugin" >&2
    fi
fi
# The postgres plugin's tests start real PostgreSQL servers: install Debian's when missing.
if [ -e plugins/backends/postgres/pyproject.toml ] && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 \
        && ! command -v initdb >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ]; then
        apt-get update -qq && apt-get install -y -qq postgresql
    else
        echo "warning: PostgreSQL server binaries are missing; install them (apt-get install postgresql) for the postgres plugin's tests" >&2
    fi
fi
# The across-hosts tests make two network namespaces with iproute2's `ip netns` (as root).
if [ -e plugins/backends/postgres/pyproject.toml ] && ! command -v ip >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ]; then
        apt-get update -qq && apt-get install -y -qq iproute2
    else
        echo "warning: iproute2 (ip) is missing; the across-hosts tests will be skipped" >&2
    fi
fi
# strategy.compile's tests run torch.compile, whose CPU backend builds C++ kernels with g++.
if ! command -v g++ >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ]; then
        apt-get update -qq && apt-get install -y -qq g++
    else
        echo "warning: g++ is missing; install it (apt-get install g++) for strategy.compile and its tests" >&2
    fi
fi
echo "installed into $VENV: ${args[*]}"
