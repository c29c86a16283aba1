"""Facts about the machine we run on: GPU or not, how much memory, Colab or not, torch threads.

Nothing here imports Unsloth; torch is imported inside functions so ``grpo-kit --help`` stays fast.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceInfo:
    """What ``detect_device`` found. ``vram_gb`` is total memory of GPU 0 in GiB (0.0 on CPU)."""

    kind: str  # "cuda" or "cpu"
    name: str
    vram_gb: float
    bf16: bool  # True on Ampere (sm80) and newer; a T4 (sm75) has no bf16


def detect_device() -> DeviceInfo:
    """Return the first CUDA device, or the CPU when there is none."""
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return DeviceInfo(
            kind="cuda",
            name=props.name,
            vram_gb=props.total_memory / 2**30,
            bf16=gpu_has_bf16(props.major, props.minor),
        )
    return DeviceInfo(kind="cpu", name="cpu", vram_gb=0.0, bf16=False)


def gpu_has_bf16(major: int | None = None, minor: int = 0) -> bool:
    """True when the GPU computes in bfloat16 natively: compute capability 8.0 (Ampere) or newer.

    Why not ``torch.cuda.is_bf16_supported()``: it counts emulation by default and returns True on a T4 (sm75), where
    bf16 runs slowly in software and Unsloth/bitsandbytes kernels expect fp16. ``major``/``minor`` default to GPU 0's
    capability (False without a GPU).

    >>> gpu_has_bf16(7, 5), gpu_has_bf16(8, 0), gpu_has_bf16(9, 0)
    (False, True, True)
    """
    if major is None:
        import torch

        if not torch.cuda.is_available():
            return False
        major, minor = torch.cuda.get_device_capability(0)
    return (major, minor) >= (8, 0)


def half_dtype_name() -> str:
    """``"bfloat16"`` on a GPU with native bf16, else ``"float16"`` (a T4): the 16-bit dtype to load or export in."""
    return "bfloat16" if gpu_has_bf16() else "float16"


def in_colab() -> bool:
    """True inside Google Colab (its ``google.colab`` module is importable only there)."""
    return "google.colab" in sys.modules


def smoke_mode() -> bool:
    """``GRPO_KIT_SMOKE=1`` asks notebooks and demos for the CPU preset and tiny step counts (CI uses it)."""
    return os.environ.get("GRPO_KIT_SMOKE", "").strip().lower() in {"1", "true", "yes", "on"}


def set_torch_threads(threads: int | None = None) -> int:
    """Pin torch's intra-op threads: ``threads``, else ``$GRPO_KIT_THREADS``, else torch's default. Returns the count."""
    import torch

    if threads is None:
        env = os.environ.get("GRPO_KIT_THREADS")
        threads = int(env) if env else None
    if threads:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def cache_dir() -> str:
    """Where the kit caches converted models: ``$GRPO_KIT_CACHE``, else ``$XDG_CACHE_HOME/grpo-kit``, else ``~/.cache/grpo-kit``."""
    env = os.environ.get("GRPO_KIT_CACHE")
    if env:
        return os.path.abspath(os.path.expanduser(env))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "grpo-kit")
