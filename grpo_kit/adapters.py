"""A LoRA adapter folder: the base model it belongs to (PEFT's own ``adapter_config.json``, read here only) and
whether its weights can be used."""

from __future__ import annotations

import os
from pathlib import Path

from grpo_kit.errors import GrpoKitError

#: No LoRA weight trained with Adam at a learning rate below 1 gets near this (they start at |w| < 0.1 and move by
#: about the learning rate per step); beyond it training diverged, finite or not (lr 1e10: |w| ~ 1e10, only EOS).
MAX_ADAPTER_WEIGHT = 1e3


def is_adapter(folder: str | os.PathLike) -> bool:
    """True for a folder that holds a LoRA adapter's ``adapter_config.json`` (PEFT writes one with every adapter)."""
    return (Path(folder) / "adapter_config.json").is_file()


def adapter_config(adapter_dir: str | os.PathLike):
    """The adapter's ``LoraConfig``, as PEFT reads it from ``adapter_config.json`` (rank, alpha, base model)."""
    from peft import PeftConfig

    return PeftConfig.from_pretrained(str(adapter_dir))


def adapter_problem(adapter_dir: str | os.PathLike) -> str | None:
    """Why the LoRA adapter in ``adapter_dir`` cannot be used, or None when it is sound: no ``adapter_config.json``,
    a weights file that is missing or does not load (safetensors refuses a file whose size does not match its
    header), or NaN/inf weights or weights beyond ``MAX_ADAPTER_WEIGHT``: a NaN adapter would otherwise be exported
    and "verified" (NaN compares false with any limit) or evaluated as a model.
    """
    from safetensors.torch import load_file

    path = Path(adapter_dir) / "adapter_model.safetensors"  # what PEFT writes, in checkpoints and the final adapter
    if not is_adapter(adapter_dir):
        return "no adapter_config.json"
    try:
        tensors = load_file(path)
    except Exception as error:  # SafetensorError, OSError: a missing, torn or foreign file
        return f"{path} cannot be read ({str(error).splitlines()[0][:120]}; truncated by a kill or a full disk?)"
    bad = sorted(
        name
        for name, tensor in tensors.items()
        if not (tensor.float().abs() <= MAX_ADAPTER_WEIGHT).all()  # NaN <= limit is False, as inf <= limit
    )
    if bad:
        return (
            f"the adapter in {adapter_dir} has NaN/inf weights or weights beyond {MAX_ADAPTER_WEIGHT:g} "
            f"({len(bad)} tensor(s), e.g. {bad[0]}); training diverged"
        )
    return None


def check_adapter(adapter_dir: str | os.PathLike, *, use: str) -> None:
    """Refuse an adapter that ``adapter_problem`` finds unusable (``use``: what was asked), naming what to use."""
    if not is_adapter(adapter_dir):
        inside = Path(adapter_dir) / "adapter"  # given the run folder instead of its adapter/
        hint = f"--adapter {inside}" if is_adapter(inside) else "a run's adapter/ or checkpoint-N/"
        raise GrpoKitError(f"{adapter_dir} is not a LoRA adapter folder (no adapter_config.json). Pass {hint}.")
    if problem := adapter_problem(adapter_dir):
        raise GrpoKitError(
            f"Cannot {use}: {problem}. Use another (earlier) checkpoint-N folder of the run, or train "
            "again (if training diverged, with a lower --set learning_rate=...)."
        )
