"""Scaling out, the GPU side that CPU can check: the choice of model loader and vLLM server mode.

No GPU and no vLLM here, so these tests check the kit's part: which loader runs with which arguments (Unsloth replaced
by a recording fake, transformers' loading recorded), and the server check against a real local HTTP server that
answers like ``trl vllm-serve``.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types

import pytest
import torch

from grpo_kit import models
from grpo_kit.config import load_recipe
from grpo_kit.errors import GrpoKitError

MODEL = "unsloth/Meta-Llama-3.1-8B-Instruct"


class _Stop(Exception):
    pass


def _module(name: str) -> types.ModuleType:
    """An importable stand-in for a package this machine lacks (with the spec that availability checks read)."""
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    return module


@pytest.fixture
def fake_gpu(monkeypatch):
    """CUDA reported available, and a fake ``unsloth`` (and ``vllm``) module; records what Unsloth was asked to load."""
    calls: dict = {}

    class FastLanguageModel:
        @staticmethod
        def from_pretrained(**kwargs):
            calls["from_pretrained"] = kwargs
            raise _Stop

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        torch.cuda,
        "get_device_properties",
        lambda index=0: types.SimpleNamespace(name="A100", total_memory=80 * 2**30, major=8),
    )
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    monkeypatch.setattr(torch._C, "_cuda_setDevice", lambda index: None, raising=False)  # GRPOConfig picks cuda:0
    monkeypatch.setitem(sys.modules, "unsloth", types.SimpleNamespace(FastLanguageModel=FastLanguageModel))
    monkeypatch.setitem(sys.modules, "vllm", _module("vllm"))
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    return calls


# ------------------------------------------------------------------------------------------------ backend choice


@pytest.mark.parametrize(
    ("backend", "cuda", "expected"),
    [
        ("auto", True, "unsloth"),
        ("auto", False, "transformers"),
        ("transformers", True, "transformers"),
        ("unsloth", True, "unsloth"),
    ],
)
def test_prepare_backend(fake_gpu, monkeypatch, backend, cuda, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert models.prepare_backend(backend) == expected


def test_unsloth_without_a_gpu_is_refused_before_importing_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "unsloth", None)  # an import attempt would raise ImportError, not this message
    with pytest.raises(GrpoKitError, match="needs a CUDA GPU"):
        models.prepare_backend("unsloth")
    with pytest.raises(GrpoKitError, match="needs a CUDA GPU"):
        load_recipe("cpu", backend="unsloth")


# ------------------------------------------------------------------------------------------------ what the loaders get


def _record_transformers_load(monkeypatch) -> list:
    seen = []

    def record(cls, model_id, **kwargs):
        if cls.__name__ == "AutoTokenizer":
            return types.SimpleNamespace(pad_token="<pad>", eos_token="<eos>", padding_side="right")
        seen.append((model_id, kwargs))
        raise _Stop

    monkeypatch.setattr(models, "_from_pretrained", record)
    return seen


def test_transformers_places_each_process_on_its_gpu(fake_gpu, monkeypatch):
    seen = _record_transformers_load(monkeypatch)
    transformers = load_recipe("a100-80gb", backend="transformers")
    monkeypatch.setenv("LOCAL_RANK", "3")  # set by the launcher (after the recipe: TRL would start torch.distributed)
    with pytest.raises(_Stop):
        models.load_model(transformers)
    assert "from_pretrained" not in fake_gpu
    ((first_id, first),) = seen
    assert first_id == MODEL and first["dtype"] == "bfloat16" and first["device_map"] == {"": 3}


def test_transformers_4bit_is_nf4_computing_in_the_run_dtype(fake_gpu, monkeypatch):
    seen = _record_transformers_load(monkeypatch)
    monkeypatch.setitem(sys.modules, "bitsandbytes", _module("bitsandbytes"))
    with pytest.raises(_Stop):
        models.load_model(load_recipe("t4-16gb", backend="transformers"))
    quant = seen[0][1]["quantization_config"]
    assert quant.load_in_4bit and quant.bnb_4bit_quant_type == "nf4"
    assert quant.bnb_4bit_compute_dtype is torch.float16


def test_vllm_missing_on_the_transformers_backend_loads_without_it_and_says_so(monkeypatch, capsys):
    seen = _record_transformers_load(monkeypatch)
    monkeypatch.setitem(sys.modules, "vllm", None)
    recipe = models.use_vllm_if_importable(load_recipe("cpu", use_vllm=True))
    assert recipe.grpo.use_vllm is False and "vLLM off: it cannot be imported" in capsys.readouterr().out
    with pytest.raises(_Stop):
        models.load_model(recipe)
    assert len(seen) == 1


def test_vllm_on_the_transformers_backend_stays_on_for_trls_own_engine(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))  # importable
    assert models.use_vllm_if_importable(load_recipe("cpu", use_vllm=True)).grpo.use_vllm is True
    assert capsys.readouterr().out == ""


def test_unsloth_starts_its_own_vllm_only_when_colocated(fake_gpu):
    with pytest.raises(_Stop):
        models.load_model(load_recipe("a100-80gb"))
    assert fake_gpu["from_pretrained"]["fast_inference"] is True
    assert fake_gpu["from_pretrained"]["gpu_memory_utilization"] == 0.4
    with pytest.raises(_Stop):
        models.load_model(load_recipe("a100-80gb", vllm_mode="server"))
    assert fake_gpu["from_pretrained"]["fast_inference"] is False  # the server generates: no second copy here


def test_unsloth_loads_onto_the_launchers_local_rank(fake_gpu, monkeypatch):
    recipe = load_recipe("t4-16gb")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(_Stop):
        models.load_model(recipe)
    assert fake_gpu["from_pretrained"]["device_map"] == {"": 1}


# ------------------------------------------------------------------------------------------------ the server check


def test_cli_set_keys_select_server_mode(monkeypatch):
    import grpo_kit.train as train_module
    from grpo_kit.cli import main

    seen = []

    def fake_train(recipe, **kwargs):
        seen.append(recipe)
        raise _Stop

    monkeypatch.setattr(train_module, "train", fake_train)
    with pytest.raises(_Stop):
        main(
            [
                "train",
                "--preset",
                "cpu",
                "--set",
                "use_vllm=true",
                "--set",
                "vllm_mode=server",
                "--set",
                "vllm_server_base_url=http://gpu0:8000",
                "--set",
                "backend=transformers",
            ]
        )
    g = seen[0].grpo
    assert (g.use_vllm, g.vllm_mode, g.vllm_server_base_url) == (True, "server", "http://gpu0:8000")
    assert seen[0].kit.backend == "transformers"
