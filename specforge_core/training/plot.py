"""The loss / accuracy / acceptance curves of a run, as one PNG."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any


def _is_acc(name: str) -> bool:
    return "acc" in name and "accept" not in name


def _is_accept(name: str) -> bool:
    return "accept" in name or "tau" in name


def smoothed(values: list[float], weight: float) -> list[float]:
    """An exponential moving average with TensorBoard's debiasing (the first points are not pulled to 0)."""
    out, average = [], 0.0
    for index, value in enumerate(values, 1):
        average = weight * average + (1.0 - weight) * value
        out.append(average / (1.0 - weight ** index))
    return out


def plot_curves(records: list[dict[str, Any]], path: str | Path) -> Path:
    """Draw loss, accuracy and acceptance-length metrics against the optimizer step.

    Training metrics are drawn faintly as logged, with a smoothed line over them (an
    exponential moving average sized to the run's length); eval metrics (``eval/...``) are
    points with a line between them.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("loss", lambda n: n.endswith("loss")), ("accuracy", _is_acc), ("acceptance length", _is_accept)]
    fig, axes = plt.subplots(1, len(panels), figsize=(15, 4))
    for ax, (title, wanted) in zip(axes, panels):
        names = sorted({k for r in records for k in r if wanted(k) and isinstance(r[k], (int, float))})
        for name in names:
            points = [(r["step"], r[name]) for r in records if name in r and r[name] is not None
                      and not (isinstance(r[name], float) and math.isnan(r[name]))]
            if not points:
                continue
            xs, ys = zip(*points)
            if name.startswith("eval/"):
                ax.plot(xs, ys, label=name, marker="o", markersize=4)
            elif len(points) < 10:
                ax.plot(xs, ys, label=name, marker=".")
            else:
                line, = ax.plot(xs, ys, alpha=0.25, linewidth=0.8)
                weight = min(0.98, 1.0 - 5.0 / len(points))  # about a twentieth of the run per time constant
                ax.plot(xs, smoothed(list(ys), weight), color=line.get_color(), label=f"{name} (smoothed)")
        ax.set_title(title)
        ax.set_xlabel("optimizer step")
        if names:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
