"""What DSpark adds to a DFlash draft's shape: the Markov head and the confidence head.

Pure Python (no torch). :class:`DSparkHeadConfig` is derived from the options, written into
the export's config.json in the fields SGLang's DSpark draft reads (``dspark_config`` and the
top level, see :mod:`specforge_plugin_dspark.export`) and read back by ``load_export``.
"""

from __future__ import annotations

from typing import Any

import attrs

from specforge_plugin_dflash.config import DFlashConfigError

from . import MARKOV_HEAD_TYPES


class DSparkConfigError(DFlashConfigError):
    """The options or an exported config.json do not describe a valid DSpark head."""


@attrs.frozen(kw_only=True)
class DSparkHeadConfig:
    """The Markov head (rank, variant) and the confidence head's input.

    ``markov_rank`` is r of ``Embedding(V, r) -> Linear(r, V)``; ``confidence_with_markov``
    makes the confidence head read ``[h ; markov_w1(previous token)]`` (``H + r`` inputs)
    instead of ``h`` alone.
    """

    markov_rank: int
    markov_head_type: str = "vanilla"
    confidence_with_markov: bool = True

    def __attrs_post_init__(self) -> None:
        if self.markov_rank < 1:
            raise DSparkConfigError(f"markov_rank must be at least 1 (the Markov head is DSpark's core), got "
                                    f"{self.markov_rank}")
        if self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise DSparkConfigError(f"markov_head_type {self.markov_head_type!r} is not trained by this plugin; "
                                    f"supported: {', '.join(MARKOV_HEAD_TYPES)}")

    @classmethod
    def from_options(cls, options: Any) -> DSparkHeadConfig:
        """The heads under :class:`~specforge_plugin_dspark.DSparkOptions`."""
        return cls(markov_rank=options.markov_rank, markov_head_type=options.markov_head_type,
                   confidence_with_markov=options.confidence_with_markov)

    def confidence_inputs(self, hidden_size: int) -> int:
        """Input width of the confidence head's ``proj``: ``H`` (+ ``r`` with the Markov embedding)."""
        return hidden_size + (self.markov_rank if self.confidence_with_markov else 0)
