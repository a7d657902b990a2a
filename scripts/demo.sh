#!/usr/bin/env bash
# Set up a fresh machine and run the main job: train an EAGLE3 draft for the embedded toy
# target on its bundled conversations (online colocated), export it for SGLang and vLLM, and
# measure its real acceptance length and speedup with lossless speculative decoding.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-dev.sh
VENV="${SPECFORGE_VENV:-.venv}"
"$VENV/bin/specforge" plugins
OUT="${1:-runs/demo}"
"$VENV/bin/specforge" run --strategy eagle3 --output "$OUT"
"$VENV/bin/python" - "$OUT/summary.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
print(f"accept_len_sim {s['accept_len_sim']:.3f} (simulated on the eval split; {s['accept_len_convention']})")
real = s["real_eval"]
print(f"accept_len_real {s['accept_len_real']:.3f} (measured by speculative decoding); "
      f"identical to target greedy: {real['identical_to_target_greedy']}")
print(f"speedup {s['speedup']:.2f}x: greedy {real['greedy_tokens_per_s']:.1f} tokens/s, speculative "
      f"{real['speculative_tokens_per_s']:.1f} tokens/s (wall clock on this machine, batch 1)")
print(f"draft exported to {s['export']}")
PY
