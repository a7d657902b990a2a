"""Pooling of ratio metrics and the metrics JSONL log."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

from .distributed import DistInfo, all_reduce_sums


class RatioPool:
    """Sums ``(numerator, denominator)`` pairs in float64 and reduces them across ranks.

    The pooled value is ``Σnum / Σden`` over every micro-batch and rank, so it does not
    depend on how samples were split into batches or ranks.
    """

    def __init__(self) -> None:
        self.sums: dict[str, list[float]] = {}

    def add(self, ratios: Mapping[str, tuple[float, float]]) -> None:
        for name, (num, den) in ratios.items():
            acc = self.sums.setdefault(name, [0.0, 0.0])
            acc[0] += float(num)
            acc[1] += float(den)

    def reduce(self, info: DistInfo, names: list[str] | None = None) -> dict[str, float]:
        """Values pooled across ranks. Collective: every rank must call it with the same names."""
        names = sorted(self.sums) if names is None else names
        flat = [v for name in names for v in self.sums.get(name, [0.0, 0.0])]
        total = all_reduce_sums(flat, info)
        out = {}
        for i, name in enumerate(names):
            num, den = total[2 * i], total[2 * i + 1]
            out[name] = num / den if den else float("nan")
        return out

    def clear(self) -> None:
        self.sums.clear()


class MetricsLog:
    """Append-only ``metrics.jsonl``, one JSON object per logged step (rank 0 only)."""

    def __init__(self, output_dir: str | os.PathLike[str], info: DistInfo) -> None:
        self.path = Path(output_dir) / "metrics.jsonl"
        self.enabled = info.is_main

    def truncate_after(self, global_step: int) -> None:
        """On resume: drop records a crashed run wrote after the checkpoint it resumes from."""
        if not self.enabled or not self.path.exists():
            return
        lines = self.path.read_text().splitlines()
        kept = [line for line in lines if line.strip() and json.loads(line).get("step", 0) <= global_step]
        if len(kept) < len(lines):  # rewritten only when a crash left records to drop
            self.path.write_text("".join(line + "\n" for line in kept))

    def write(self, record: Mapping[str, Any]) -> None:
        if not self.enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record, sort_keys=True) + "\n")

    def records(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
