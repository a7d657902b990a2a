#!/usr/bin/env bash
# Set up the environment and run the whole test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-dev.sh
export HF_HUB_OFFLINE=1 SPECFORGE_STRICT_PLUGINS=1
# Two pytest workers (SPECFORGE_TEST_WORKERS; 0 runs the tests in this process, one at a
# time), each torch on one thread: two workers of two threads each on a 2-core machine
# would spin-wait on each other. Tests that start processes cap theirs the same way.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "${SPECFORGE_VENV:-.venv}/bin/python" -m pytest -q -n "${SPECFORGE_TEST_WORKERS:-2}" "$@"
