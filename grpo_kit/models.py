"""Models: any preset's model as a LoRA-wrapped policy (Unsloth on a GPU, transformers + PEFT otherwise), and a
model plus adapter for evaluation. The embedded CPU model and the backend/vLLM checks live in the machinery.
"""

from __future__ import annotations

import os
from pathlib import Path

from grpo_kit.errors import GrpoKitError
from grpo_kit.machinery import backend
from grpo_kit.machinery.embedded import EMBEDDED_ID, EMBEDDED_NAME, embedded_model_path

#: A preset's ``precision`` as a torch dtype name: the dtype its weights are loaded in.
PRECISION_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def resolve_model_id(model: str) -> str:
    """Map the kit's model names to something ``from_pretrained`` accepts: the embedded id becomes its folder."""
    if model in {EMBEDDED_ID, "embedded", EMBEDDED_NAME}:
        return str(embedded_model_path())
    return model


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
    if backend.needs_gpu(preset) and not cuda:
        raise GrpoKitError(backend.gpu_required_message(preset))
    check_weight_sync(preset)
    if backend.prepare_backend(preset) == "unsloth":
        return _load_unsloth(preset, model_id)
    return _load_transformers(preset, model_id, cuda=cuda, zero3=backend.zero3_launch(), trust_remote_code=trust_remote_code)


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
    except backend.VLLM_START_ERRORS as error:
        if not kwargs["fast_inference"]:
            raise
        backend.announce_vllm_off(f"its engine did not start ({backend._first_line(error)})", backend.VLLM_ENGINE_HINT)
        backend._free_gpu_memory()
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
