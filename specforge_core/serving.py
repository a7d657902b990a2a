"""What every export must agree on with the serving engines (SGLang, vLLM): layer ids and dtypes.

Torch-free, so hook modules and option checks can import it.

**Layer ids.** Our layer id ``i`` is the output of target decoder layer ``i``, which is the
hidden state *entering* layer ``i + 1`` (transformers' ``hidden_states[i + 1]``). SGLang and
vLLM capture the inputs of decoder layers only, so the largest id a served target can give a
draft is ``L - 2``: the last layer's output (``L - 1``) is never a layer input there, and a
draft trained on it fails to load with a width mismatch. SGLang's EAGLE3 and DFlash configs
take our numbering (SGLang adds 1 itself); vLLM's top-level
``eagle_aux_hidden_state_layer_ids`` counts the captured layer's index, our id + 1
(:func:`engine_layer_ids`).

**Dtype.** An export is written in the dtype it will be served in (bfloat16 by default):
SGLang and vLLM under ``--dtype auto`` serve a float32 checkpoint as float16.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from .errors import OptionError, SpecforgeError

#: The dtypes an export can be written in; the first is the default.
EXPORT_DTYPES = ("bfloat16", "float16", "float32")
DEFAULT_EXPORT_DTYPE = EXPORT_DTYPES[0]

WHY_LAST_LAYER = ("SGLang and vLLM capture the hidden state entering each decoder layer, and layer id i is the "
                  "input of layer i+1, so the last layer's output (id L-1) does not exist in a serving engine")


def max_servable_layer_id(num_layers: int) -> int:
    """The largest layer id a serving engine can capture from a target of ``num_layers`` layers (``L - 2``)."""
    return num_layers - 2


def check_servable_layer_ids(ids: Sequence[int], num_layers: int, name: str, *,
                             error: type[SpecforgeError] = OptionError) -> None:
    """Refuse layer ids outside ``0..L-2``, naming ``name`` (an option or a config field) and saying why."""
    top = max_servable_layer_id(num_layers)
    if top < 0:
        raise error(f"{name}: the target has {num_layers} decoder layer(s), so no layer output can be captured "
                    f"for a served draft ({WHY_LAST_LAYER}); use a target with at least 2 layers")
    negative = [i for i in ids if i < 0]
    if negative:
        raise error(f"{name} {list(ids)} holds negative layer id(s) {negative}; valid ids are 0..{top}")
    last = [i for i in ids if i > top]
    if last:
        raise error(f"{name} {list(ids)} names layer(s) {last}, but a draft for this {num_layers}-layer target can "
                    f"use ids 0..{top} only: {WHY_LAST_LAYER}")


def engine_layer_ids(ids: Iterable[int]) -> list[int]:
    """``ids`` in vLLM's numbering (``eagle_aux_hidden_state_layer_ids``): the captured layer's index, id + 1."""
    return [int(i) + 1 for i in ids]


def check_export_dtype(dtype: str, *, error: type[SpecforgeError] = OptionError) -> str:
    """``dtype`` if an export can be written in it, else an error listing the choices."""
    if dtype not in EXPORT_DTYPES:
        raise error(f"unknown export dtype {dtype!r}; choose one of {', '.join(EXPORT_DTYPES)}")
    return dtype
