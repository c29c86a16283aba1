"""Models: the machine, the loader a recipe uses (Unsloth or transformers + PEFT), the policy, models for evaluation
(the embedded CPU model by its ids: ``grpo_kit.embedded``).

torch, transformers and Unsloth are imported inside functions: ``grpo-kit --help`` stays fast, and Unsloth must be
imported before TRL (``prepare_backend``).
"""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from grpo_kit.embedded import EMBEDDED_4BIT_ID, EMBEDDED_ID, EMBEDDED_NAME, embedded_model_path
from grpo_kit.errors import GrpoKitError, first_line

# --------------------------------------------------------------------------------------------- the machine


@dataclass(frozen=True)
class DeviceInfo:
    kind: str  # "cuda" or "cpu"
    name: str
    vram_gb: float  # total memory of GPU 0 in GiB (0.0 on CPU)
    bf16: bool  # native bf16: Ampere (sm80) and newer; a T4 (sm75) has none


def detect_device() -> DeviceInfo:
    """The machine: GPU 0's name and memory, and whether it computes bfloat16 natively (torch's check without
    emulation: a T4 emulates bf16, slowly, and Unsloth/bitsandbytes kernels expect fp16 there)."""
    import torch

    if not torch.cuda.is_available():
        return DeviceInfo("cpu", "cpu", 0.0, False)
    props = torch.cuda.get_device_properties(0)
    return DeviceInfo(
        "cuda", props.name, props.total_memory / 2**30, torch.cuda.is_bf16_supported(including_emulation=False)
    )


def half_dtype_name() -> str:
    """The 16-bit dtype to load or export in: ``"bfloat16"`` where the GPU has it natively, else ``"float16"``."""
    return "bfloat16" if detect_device().bf16 else "float16"


def in_colab() -> bool:
    return "google.colab" in sys.modules  # importable only inside Colab


def set_torch_threads() -> None:
    """Pin torch's intra-op threads to ``$GRPO_KIT_THREADS`` (CI) when it is set; else torch's default."""
    import torch

    if threads := int(os.environ.get("GRPO_KIT_THREADS") or 0):
        torch.set_num_threads(threads)


# --------------------------------------------------------------------------------------------- which loader


def prepare_backend(backend: str) -> str:
    """The loader for ``backend`` ("auto"|"unsloth"|"transformers"); Unsloth is imported NOW, before TRL.

    ``auto``: Unsloth on a GPU, else transformers. Why now: Unsloth patches at import, rebinding ``trl.GRPOTrainer``
    and ``GRPOConfig`` to its subclasses (its shared vLLM engine, no bf16 cast of 4-bit LoRA weights, which breaks
    fp16 on a T4); a class taken from ``trl`` earlier stays the plain one, so look it up as ``trl.GRPOTrainer``
    afterwards. Without a GPU Unsloth runs only in its CPU-only CI mode (``UNSLOTH_ALLOW_CPU=1``), where ``auto`` and
    ``unsloth`` import it too: its import then leaves TRL alone, so its trainers are patched in here. Its loader
    still needs a GPU (``make test`` stands in for it: tests/test_real_unsloth.py).
    """
    import torch

    gpu = torch.cuda.is_available()
    importable = gpu or os.environ.get("UNSLOTH_ALLOW_CPU") == "1"  # on a CPU only in its CI mode
    if backend == "unsloth" and not importable:
        raise GrpoKitError(
            "backend='unsloth' needs a CUDA GPU (without one Unsloth imports only in its CI mode, which "
            "cannot load a model). On this machine use --set backend=auto or --set backend=transformers "
            "(plain transformers + PEFT)."
        )
    if backend == "auto":
        backend = "unsloth" if importable else "transformers"
    if backend == "unsloth":
        try:
            import unsloth  # noqa: F401  (the import is the patch)
        except ImportError as error:
            raise GrpoKitError(
                f"The Unsloth backend cannot import unsloth ({first_line(error)}). Install the GPU "
                "stack (pip install -r requirements-colab.txt) and restart the runtime, or use plain "
                "transformers + PEFT: --set backend=transformers (slower, more memory)."
            ) from error
        import trl

        if not gpu and not trl.GRPOTrainer.__name__.startswith("Unsloth"):  # its CPU-only CI mode
            from unsloth.models.rl import patch_trl_rl_trainers

            patch_trl_rl_trainers()  # what Unsloth's import does on a GPU
    return backend


# --------------------------------------------------------------------------------------------- the policy


def load_model(recipe):
    """The recipe's model as a LoRA-wrapped trainable policy: ``(peft_model, tokenizer)``, by the two calls notebook 00
    shows (``load_base_model`` and ``add_lora`` below), in the precision the run trains in (``bf16``/``fp16``, else
    float32) unless the recipe sets ``dtype``. Give it ``use_vllm_if_importable(recipe)``: vLLM that cannot be imported
    is turned off, or refused in server mode."""
    config, lora = recipe.grpo, recipe.model
    # dtype given: left to itself Unsloth picks bf16 wherever the card has it, and its trainer then refuses the model
    # when the run trains in fp16.
    model, tokenizer = load_base_model(
        model_name=lora.model_name_or_path,
        max_seq_length=recipe.kit.max_seq_length,
        dtype=recipe.dtype,
        load_in_4bit=lora.load_in_4bit,
        fast_inference=recipe.vllm_colocated,
        max_lora_rank=lora.lora_r,
        gpu_memory_utilization=config.vllm_gpu_memory_utilization,
        backend=recipe.kit.backend,
    )
    model = add_lora(
        model,
        r=lora.lora_r,
        lora_alpha=lora.lora_alpha,
        lora_dropout=lora.lora_dropout,
        target_modules=lora.lora_target_modules,
        use_rslora=lora.use_rslora,
        modules_to_save=lora.lora_modules_to_save,
        use_gradient_checkpointing="unsloth" if config.gradient_checkpointing else False,
        random_state=config.seed,
        backend=recipe.kit.backend,
    )
    return model, tokenizer


def use_vllm_if_importable(recipe, **changes):
    """``recipe`` with ``changes``, built once, and ``use_vllm`` off with one "vLLM off:" line saying why where it asks
    for Unsloth's colocated vLLM and vLLM cannot be imported (Colab's CUDA 12 torch: the installer leaves it out). The
    run then generates with Unsloth/transformers (slower, same recipe), and a resumed run goes on from its checkpoint
    the same. Decided before the model loads and never marked on the model: Unsloth's trainer turns ``use_vllm`` back
    on for any model that has a ``vllm_engine`` attribute, even ``None``, and TRL then stops with an ImportError.
    In server mode vLLM that cannot be imported is an error: TRL's client needs vLLM's own communicator."""
    if recipe.grpo.use_vllm:
        backend = prepare_backend(recipe.kit.backend)  # vLLM imports transformers, which Unsloth patches first
        try:
            import vllm  # noqa: F401
        except Exception as error:  # ImportError, or a CUDA library of another version failing to load (OSError)
            if not recipe.vllm_colocated:
                raise GrpoKitError(
                    f"vllm_mode='server' needs vLLM here too, and it cannot be imported ({first_line(error)}). "
                    "Install the vllm wheel built for this torch's CUDA, or --set use_vllm=false."
                ) from error
            print(
                f"vLLM off: it cannot be imported ({first_line(error)}). Generation uses {backend}'s generate "
                "(slower, same recipe). To use vLLM, install the vllm wheel built for this torch's CUDA "
                "(requirements-colab.txt) and restart the runtime.",
                flush=True,
            )
            changes["use_vllm"] = False
    return recipe.replace(**changes)


def release_vllm(model) -> bool:
    """Give back the GPU memory of Unsloth's in-process vLLM engine (``model.vllm_engine``) with unsloth_zoo's own
    teardown, ``delete_vllm``: it destroys vLLM's model-parallel groups and distributed environment, which keep the
    engine's memory (about 9 GiB on a T4) after ``del trainer, model``. Call it before an export in the same kernel.
    False when the model has no engine (a CPU, vLLM off or in server mode)."""
    engine = getattr(model, "vllm_engine", None)
    if engine is None:
        return False
    from unsloth_zoo.vllm_utils import delete_vllm  # present wherever Unsloth built an engine

    delete_vllm(engine)
    model.vllm_engine = None
    return True


def load_base_model(
    model_name,
    *,
    max_seq_length=1024,
    dtype=None,
    load_in_4bit=False,
    fast_inference=False,
    max_lora_rank=16,
    gpu_memory_utilization=0.5,
    backend="auto",
):
    """``(model, tokenizer)``: Unsloth's ``FastLanguageModel.from_pretrained`` with these arguments on the Unsloth
    backend (a GPU), else the same load with transformers (a CPU, ``backend="transformers"``). Notebook 00 and
    ``load_model`` make this call and ``add_lora``. An engine that fails to start is an error naming the fixes, not a
    silent slower run (vLLM that cannot be imported at all: ``use_vllm_if_importable``, before loading)."""
    import torch

    backend, model_id = prepare_backend(backend), resolve_model_id(model_name)
    name = None if dtype is None else str(dtype).removeprefix("torch.")  # transformers takes the name ("auto" too)
    if backend == "transformers":  # TRL starts its own vLLM engine where the recipe asks for one
        model, tokenizer = _transformers_load(model_id, name or "float32", load_in_4bit)
    else:  # Unsloth takes a torch dtype (None or "auto": it picks)
        from unsloth import FastLanguageModel  # lazy: Unsloth cannot import without a GPU

        kwargs = dict(
            model_name=model_id,
            max_seq_length=max_seq_length,
            dtype=getattr(torch, name or "", None),
            load_in_4bit=load_in_4bit,
            max_lora_rank=max_lora_rank,
            gpu_memory_utilization=gpu_memory_utilization if fast_inference else 0.5,
        )
        if "LOCAL_RANK" in os.environ:  # under accelerate/torchrun each process loads onto its own GPU
            kwargs["device_map"] = {"": int(os.environ["LOCAL_RANK"])}
        try:
            model, tokenizer = FastLanguageModel.from_pretrained(**kwargs, fast_inference=fast_inference)
        # What an engine that does not start raises (CUDA errors, out of memory, no room for the KV cache, a
        # missing CUDA library); a TypeError or AttributeError is a bug, and passes through as it is.
        except (RuntimeError, ValueError, ImportError, OSError, AssertionError) as error:
            if not fast_inference:
                raise
            raise GrpoKitError(
                f"The model did not load with vLLM's engine on ({first_line(error)}). If vLLM is "
                "the cause: restart the runtime to free GPU memory, lower --set "
                "vllm_gpu_memory_utilization, or --set use_vllm=false (slower)."
            ) from error
        tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    return model, tokenizer


def add_lora(model, *, use_gradient_checkpointing=False, random_state=3407, backend="auto", **lora):
    """``model`` with LoRA adapters: Unsloth's ``FastLanguageModel.get_peft_model`` on the Unsloth backend, else PEFT's
    ``get_peft_model``. ``lora``: the adapter's settings, under the names Unsloth's call and PEFT's ``LoraConfig``
    share (``r``, ``lora_alpha``, ``target_modules``, ``lora_dropout``, ``use_rslora``, ``modules_to_save``)."""
    if prepare_backend(backend) == "unsloth":  # the loader load_base_model picked for the same backend
        from unsloth import FastLanguageModel

        return FastLanguageModel.get_peft_model(
            model, **lora, use_gradient_checkpointing=use_gradient_checkpointing, random_state=random_state
        )
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import set_seed

    if getattr(model, "is_loaded_in_4bit", False):
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=bool(use_gradient_checkpointing))
    set_seed(random_state)  # as Unsloth's random_state: the LoRA A matrices start from the recipe's seed
    return get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **lora))


def _transformers_load(model_id: str, dtype: str, load_in_4bit: bool):
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    kwargs: dict = {"dtype": dtype}
    if load_in_4bit:  # without bitsandbytes transformers refuses it, naming the install command
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype
        )
    if torch.cuda.is_available():
        kwargs["device_map"] = {"": int(os.environ.get("LOCAL_RANK", 0))}  # each process on its GPU
    tokenizer = load_tokenizer(model_id)
    return match_compute_dtype(_from_pretrained(AutoModelForCausalLM, model_id, **kwargs), dtype), tokenizer


# --------------------------------------------------------------------------------------------- models for evaluation


def resolve_model_id(model: str) -> str:
    """The kit's model names as ``from_pretrained`` takes them: the embedded ids become their folders."""
    if model in {EMBEDDED_ID, "embedded", EMBEDDED_NAME, EMBEDDED_4BIT_ID}:
        return str(embedded_model_path(quantized=model == EMBEDDED_4BIT_ID))
    return model


@functools.lru_cache(maxsize=4)
def load_tokenizer(model_id: str):
    """The model's tokenizer with a pad token and left padding (as batched generation needs), loaded once per process
    (``train`` renders the prompts with it before the weights load, and trains with it)."""
    from transformers import AutoTokenizer

    tokenizer = _from_pretrained(AutoTokenizer, model_id)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def load_inference_model(model: str, adapter: str | os.PathLike | None = None):
    """``model`` (id, folder or ``embedded``) in eval mode, with ``adapter`` kept as a PEFT wrapper (not merged, so it
    can be compared with its merged export). Returns ``(model, tokenizer)``.

    float32 on a CPU; on a GPU 16 bits (bf16, fp16 on a T4) on GPU ``LOCAL_RANK``: float32 would make an 8B model
    need ~32 GB of RAM and evaluate for hours.
    """
    import torch

    if adapter is not None:  # a missing, torn or NaN adapter is reported before the base model loads
        from grpo_kit.adapters import adapter_config, check_adapter

        adapter = Path(adapter)
        check_adapter(adapter, use=f"load the adapter {adapter}")
    model_id = resolve_model_id(model)
    dtype = half_dtype_name() if torch.cuda.is_available() else "float32"
    base, tokenizer = _transformers_load(model_id, dtype, load_in_4bit=False)  # a -bnb-4bit checkpoint stays 4-bit
    if adapter is not None:
        from peft import PeftModel

        try:
            base = PeftModel.from_pretrained(base, str(adapter))
        except RuntimeError as error:  # "size mismatch for ...": the adapter was trained on another base model
            if "size mismatch" not in str(error):
                raise
            trained_on = adapter_config(adapter).base_model_name_or_path or "(not recorded)"
            detail = next(line.strip() for line in str(error).splitlines() if "size mismatch" in line)
            fix = (
                f"it was trained on {trained_on} (adapter_config.json): pass that model as --model"
                if trained_on not in (model, model_id)
                else f"yet adapter_config.json names {trained_on}: that model "
                "changed since the adapter was trained, or the adapter comes from another run"
            )
            raise GrpoKitError(f"The adapter in {adapter} does not fit the model {model}: {fix}. ({detail})") from None
    base.eval()
    return base, tokenizer


def match_compute_dtype(model, dtype):
    """``model`` with its bitsandbytes 4-bit layers computing in ``dtype`` (the run's precision).

    A pre-quantized checkpoint (Unsloth's ``*-bnb-4bit`` ids, the embedded ``-bnb-4bit`` copy) keeps the quantization
    config stored with it: transformers ignores the ``BitsAndBytesConfig`` passed in, so its ``bnb_4bit_compute_dtype``
    (bfloat16 in Unsloth's repositories) would win over the run's fp16 (a T4 has no bf16) or float32 (a CPU).
    """
    import torch

    dtype = getattr(torch, dtype)
    for module in model.modules():
        if getattr(module, "compute_dtype", None) not in (None, dtype) and hasattr(module, "quant_state"):
            module.compute_dtype = dtype  # Linear4bit casts its input and dequantized weight to this per call
    return model


def _from_pretrained(cls, model_id: str, **kwargs):
    """``cls.from_pretrained`` with a clear message when the model cannot be found (offline, typo, no access)."""
    try:
        return cls.from_pretrained(model_id, **kwargs)
    except (OSError, ValueError) as error:
        head = f"Could not load model '{model_id}'"
        if Path(model_id).exists():
            head = f"'{model_id}' is not a complete model"
        elif model_id.startswith((".", "/", "~")) or model_id.count("/") > 1:  # a path, not "org/name"
            head = f"No model folder at '{model_id}'"
        raise GrpoKitError(
            f"{head} ({first_line(error)}). Pass a Hub id such as Qwen/Qwen2.5-1.5B-Instruct (check "
            "it, your network and HF_TOKEN), a folder save_pretrained wrote (config.json, weights, "
            "tokenizer files; a merged16 export is one), or offline: --model embedded."
        ) from None


# --------------------------------------------------------------------------------------------- TRL without Triton


def ensure_logprob_kernel() -> None:
    """Install ``TorchChunkedLogProb`` where TRL's Triton kernel cannot run: without Triton (every CPU build of
    PyTorch), or without a GPU (Triton installed for Unsloth's CPU mode, as ``make test`` does).

    Without it TRL 1.15's first step fails with ``'NoneType' object has no attribute 'apply'``, or with Triton's "0
    active drivers". TRL 1.16 has its own fallback, but Unsloth 2026.10.7 pins TRL 1.15.0.
    """
    import torch
    from trl.trainer import utils

    if utils._ChunkedLogProbFunction is None or not torch.cuda.is_available():  # TRL 1.15 sets it None without Triton
        utils._ChunkedLogProbFunction = TorchChunkedLogProb


class TorchChunkedLogProb:
    """TRL's ``ChunkedLogProbFunction`` in plain autograd, 256 tokens at a time (the ``[N, V]`` logits never exist at
    once): z = (hidden @ weight.T + bias) * logit_scale, softcapped, / temperature; returns the target's log p and the
    entropy, the two outputs GRPOTrainer asks for (the kernel's other three are None).
    """

    @staticmethod
    def apply(hidden, weight, bias, targets, temperature, chunk_size, softcap=None, logit_scale=1.0, outputs=()):
        import torch

        log_probs, entropy = [], []
        # torch.split yields one (empty) chunk for no tokens: empty tensors come back
        for rows, ids in zip(hidden.split(256), targets.split(256), strict=True):
            z = rows.float() @ weight.float().t()
            z = (z if bias is None else z + bias.float()) * logit_scale
            z = (z if softcap is None else softcap * torch.tanh(z / softcap)) / temperature
            log_p = torch.log_softmax(z, dim=-1)
            log_probs.append(log_p.gather(-1, ids[:, None]).squeeze(-1))
            entropy.append(-(log_p.exp() * log_p).sum(-1))
        return torch.cat(log_probs), torch.cat(entropy) if "entropy" in outputs else None, None, None, None
