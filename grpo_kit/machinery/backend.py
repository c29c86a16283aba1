"""Which loader a run uses, and what this machine can run: the backend choice (Unsloth or transformers + PEFT),
importing Unsloth first, the GPU a preset needs, and the vLLM checks (switched off, with one line, when it cannot
be imported or its engine does not start).
"""

from __future__ import annotations

import os

from grpo_kit.errors import GrpoKitError


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


def needs_gpu(preset) -> bool:
    """True for presets that cannot run on a CPU (4-bit weights, vLLM, or 16-bit precision)."""
    return bool(preset.load_in_4bit or preset.use_vllm or preset.precision in {"fp16", "bf16"})


def gpu_required_message(preset) -> str:
    """What to do when a preset that ``needs_gpu`` meets a machine without CUDA."""
    return (
        f"Preset '{preset.name}' needs a CUDA GPU (4-bit weights / vLLM / {preset.precision}) and this machine "
        "has none. Use --preset cpu (or auto), or on Colab: Runtime > Change runtime type > T4 GPU."
    )


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
