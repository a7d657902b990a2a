"""What DSpark's confidence cut does at decode time: tau_real, target forwards and verified tokens per threshold.

Loads one exported DSpark draft and decodes the same held-out prompts once per
``confidence_threshold`` (0 = never cut: the reference run, in the same process). Every decode
is checked token for token against the target's greedy decode. Prints one JSON line per
threshold:

    tau_real           tokens per verification forward (bonus included), as `specforge eval` reports it
    target_forwards    verification forwards for all prompts
    verified_tokens    tokens the target ran in those forwards (the last token plus the drafts it checked)
    wasted_tokens      verified tokens that did not become output (rejected drafts, about verified - tokens)
    ratio_*            each against threshold 0

    python bench/dspark_confidence.py --draft runs/dspark/export
    python bench/dspark_confidence.py --draft out/export --target-model /models/Qwen3-8B --prompts eval.jsonl
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

from specforge_core.protocols import BuildContext
from specforge_core.speculative import PLAIN_DECODE, measure_acceptance, prompts_from_jsonl

from specforge_plugin_dspark import DSparkOptions
from specforge_plugin_dspark.strategy import DSparkStrategy


class CountingEngine:
    """The target engine with each speculative decode's session counting the tokens its forwards run (the prefill
    apart). The reference greedy decodes (opened with ``PLAIN_DECODE``) are not counted."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.per_session: list[int] = []  # tokens verified, per speculative decode, in order

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    @property
    def verified_tokens(self) -> int:
        """Tokens verified by the timed decodes: measure_acceptance's first one is its untimed warm-up."""
        return sum(self.per_session[1:])

    def session(self, prompt_ids: Any, plan: Any) -> Any:
        session = self._engine.session(prompt_ids, plan)
        if plan == PLAIN_DECODE:
            return session
        counts, index = self.per_session, len(self.per_session)
        counts.append(0)

        class Counting:
            prefill = session.prefill

            @property
            def length(self) -> int:
                return session.length

            def extend(self, ids: Any) -> Any:
                counts[index] += len(ids)
                return session.extend(ids)

            def truncate(self, length: int) -> None:
                session.truncate(length)

        return Counting()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draft", required=True, help="A dspark export (OUTPUT/export of a run).")
    parser.add_argument("--target-model", default=None, help="Target model folder (default: the toy target).")
    parser.add_argument("--prompts", default=None, help="JSONL conversations (default: the toy target's eval split).")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--thresholds", default="0,0.3,0.5,0.7,0.9")
    args = parser.parse_args()
    torch.set_num_threads(1)

    from specforge_plugin_hf import HFEngineOptions
    from specforge_plugin_hf.engine import HFTargetEngine

    target = HFTargetEngine(HFEngineOptions(model=args.target_model, dtype="float32", device="cpu"), BuildContext())
    prompts_path = args.prompts or str(target.default_data()[1])
    prompts = prompts_from_jsonl(prompts_path, target.tokenizer, limit=args.num_prompts)
    reference = None
    for threshold in (float(t) for t in args.thresholds.split(",")):
        strategy = DSparkStrategy(DSparkOptions(confidence_threshold=threshold), BuildContext())
        model = strategy.load_export(args.draft, target.info(), target.frozen_parts())
        engine = CountingEngine(target)
        started = time.perf_counter()
        result = measure_acceptance(strategy, model, engine, prompts, max_new_tokens=args.max_new_tokens,
                                    progress=False)
        seconds = time.perf_counter() - started
        verified = engine.verified_tokens
        row = {"bench": "dspark_confidence", "confidence_threshold": threshold, "prompts": result["prompts"],
               "tau_real": round(result["tau_real"], 4), "target_forwards": result["target_forwards"],
               "tokens": result["tokens"], "verified_tokens": verified,
               "wasted_tokens": verified - result["tokens"], "seconds": round(seconds, 2),
               "identical_to_target_greedy": result["identical_to_target_greedy"]}
        reference = reference or row
        for key in ("tau_real", "target_forwards", "verified_tokens", "wasted_tokens"):
            row[f"ratio_{key}"] = round(row[key] / reference[key], 4) if reference[key] else None
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
