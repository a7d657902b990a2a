"""The served checkpoint of a DSpark draft: DFlash's layout, plus the heads' keys and config fields.

SGLang serves DSpark (``--speculative-algorithm DSPARK``) with ``Qwen3DSparkModel``, a
``DFlashDraftModel`` with a Markov head and a confidence head
(``python/sglang/srt/models/dspark.py``; its config is read by
``speculative/dspark_components/dspark_config.py``, on top of DFlash's parser); vLLM's
``Qwen3DSparkModel`` (``vllm/model_executor/models/qwen3_dspark.py``, method ``dspark``) is its
DFlash Qwen3 draft with the same two heads under the same names, reading ``markov_rank``,
``enable_confidence_head`` and ``confidence_head_with_markov`` at the top level. One folder
serves both (formats ``sglang`` and ``vllm``). The directory is DFlash's with four more tensors::

    layers.*  fc.weight  hidden_norm.weight  norm.weight     DFlash's keys, unchanged
    markov_head.markov_w1.weight    [V, r]                   Embedding(V, r)
    markov_head.markov_w2.weight    [V, r]                   Linear(r -> V), no bias
    confidence_head.proj.weight     [1, H (+ r)]             Linear(H (+ r) -> 1)
    confidence_head.proj.bias       [1]

and ``config.json`` is DFlash's (``block_size`` = SGLang's gamma, ``dflash_config`` with the mask
token and target layers) with ``architectures: ["Qwen3DSparkModel"]``, ``dspark_config:
{markov_rank, markov_head_type, mask_token_id}``, the same ``markov_rank`` / ``markov_head_type``
at the top level (where vLLM's DSpark reader looks, and where SGLang builds the heads from),
``enable_confidence_head: true``, ``confidence_head_with_markov`` and ``specforge_strategy:
"dspark"``. Slot k predicts anchor+k+1: the convention both engines take when the folder does
not write ``sample_from_anchor``. No ``speculators_model_type`` is written: vLLM serves this
folder, and its speculators DSpark reader takes slot j to predict anchor+j unless a folder says
``sample_from_anchor: true`` (vllm 0.33.0 passes that field through).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

import torch

from specforge_core.export import CONFIG_FILE, ExportConfig, check_format

from specforge_plugin_dflash.config import DFlashConfig
from specforge_plugin_dflash.export import DFlashExportError, dflash_hf_config, load_backbone, write_export

from .config import DSparkConfigError, DSparkHeadConfig
from .model import DSparkBackbone

STRATEGY = "dspark"
#: The class SGLang (and vLLM) register for DSpark drafts.
ARCHITECTURE = "Qwen3DSparkModel"
#: The formats :func:`export_dspark` writes (one folder). Not vLLM's speculators layout: vLLM serves this one.
FORMATS = ("sglang", "vllm")


class DSparkExportError(DFlashExportError, DSparkConfigError):
    """A DSpark export directory is missing, not a DSpark draft, or does not fit the draft or target.

    A :class:`DFlashExportError` (the layout is DFlash's) and a :class:`DSparkConfigError`
    (the heads' fields are DSpark's), so callers catching either keep working.
    """


def dspark_hf_config(model: DSparkBackbone, *, dtype: str | None = None, options: Any = None) -> dict[str, Any]:
    """``config.json`` of ``model``: DFlash's (vLLM's fields, the dtype, the strategy and its options included),
    with the architecture and the heads' fields SGLang and vLLM read."""
    head = model.head_config
    markov = {"markov_rank": head.markov_rank, "markov_head_type": head.markov_head_type}
    return dflash_hf_config(model, STRATEGY, {
        "architectures": [ARCHITECTURE],
        "dspark_config": {**markov, "mask_token_id": model.config.mask_token_id},
        **markov,
        "enable_confidence_head": True,
        "confidence_head_with_markov": head.confidence_with_markov,
    }, dtype=dtype, options=options)


def export_dspark(model: DSparkBackbone, out_dir: str | os.PathLike[str], *, dtype: str | None = None,
                  options: Any = None, fmt: str = "sglang", target: Any = None) -> Path:
    """The ``dspark`` export of ``model`` (every trainable tensor: the backbone's and the heads'), weights in
    ``dtype`` (None: the draft's own); ``fmt`` sglang or vllm (the same folder)."""
    check_format(fmt, FORMATS, STRATEGY, error=DSparkExportError)
    return write_export(model, out_dir, dspark_hf_config(model, dtype=dtype, options=options), error=DSparkExportError)


def head_from_hf(raw: Mapping[str, Any], source: Path) -> DSparkHeadConfig:
    """The heads' shape from an export's config.json, with errors naming the file and field.

    ``dspark_config`` is read first, then the top level (SGLang's order); a config without
    ``confidence_head_with_markov`` gets SGLang's default (with the Markov embedding).
    """
    config = ExportConfig(raw, source, "a DSpark draft", DSparkExportError)
    section = config.section("dspark_config")
    rank = section.value("markov_rank", int, config.value("markov_rank", int, None))
    if rank is None:
        raise config.fail("has no 'dspark_config.markov_rank' (nor 'markov_rank') field; a DSpark draft needs it as "
                          "an integer")
    kind = section.value("markov_head_type", str, config.value("markov_head_type", str, "vanilla"))
    if config.value("enable_confidence_head", bool, True) is not True:
        raise config.fail("has 'enable_confidence_head' = false; this plugin's DSpark drafts always carry the "
                          "confidence head")
    try:
        return DSparkHeadConfig(markov_rank=rank, markov_head_type=kind,
                                confidence_with_markov=config.value("confidence_head_with_markov", bool, True))
    except DSparkConfigError as exc:
        raise DSparkExportError(f"{source} does not describe a valid DSpark draft: {exc}") from None


def load_dspark(path: str | os.PathLike[str], frozen_parts: Mapping[str, torch.Tensor], *,
                attention: str = "sdpa") -> DSparkBackbone:
    """A ``dspark`` export back as a :class:`DSparkBackbone` over the target's frozen embedding and lm_head.

    The heads' shape comes from the export's config.json, not from options.
    """
    def build(config: DFlashConfig, raw: Mapping[str, Any], dtype: torch.dtype) -> DSparkBackbone:
        return DSparkBackbone(config, frozen_parts["embed_tokens"], frozen_parts["lm_head"],
                              head=head_from_hf(raw, Path(path) / CONFIG_FILE), attention=attention, dtype=dtype)

    return load_backbone(path, STRATEGY, frozen_parts, build, error=DSparkExportError, architecture=ARCHITECTURE)
