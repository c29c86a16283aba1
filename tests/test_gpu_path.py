"""Regression tests for the GPU path, run on CPU with the GPU libraries faked or their calls recorded."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from grpo_kit import models
from grpo_kit.config import load_recipe
from grpo_kit.errors import GrpoKitError


@pytest.fixture
def fake_t4(monkeypatch):
    """torch.cuda as a T4 shows it: sm75, and ``is_bf16_supported()`` True because it counts emulation (torch's own
    rule: native from major 8, else emulated)."""
    props = SimpleNamespace(name="Tesla T4", total_memory=int(14.7 * 2**30), major=7, minor=5)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=0: props)
    monkeypatch.setattr(
        torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation or props.major >= 8
    )
    monkeypatch.setattr(torch._C, "_cuda_setDevice", lambda index: None, raising=False)  # GRPOConfig picks cuda:0
    return props


def test_t4_is_not_reported_as_bf16(fake_t4):
    device = models.detect_device()
    assert (device.kind, device.bf16) == ("cuda", False)
    assert models.half_dtype_name() == "float16"


def test_ampere_is_bf16(fake_t4, monkeypatch):
    fake_t4.major, fake_t4.minor = 8, 0
    assert models.detect_device().bf16 is True
    assert models.half_dtype_name() == "bfloat16"


# ------------------------------------------------------------------------------------------------ a fake Unsloth

# The tests below run the kit's Unsloth path on a faked GPU: CUDA is reported available, and ``unsloth`` is a stand-in
# whose *import* does what the real one's does to TRL on a GPU (Unsloth 2026.10.7, models/rl.py: ``trl.GRPOTrainer``
# and ``trl.GRPOConfig`` rebound to subclasses; the config keeps TRL's name), and whose ``FastLanguageModel`` records
# what it was asked to load. The real Unsloth runs in tests/test_real_unsloth.py (its CPU-only mode: its import, its
# trainer and config, training, resume, the vLLM-missing fallback, notebook 00). The stand-in stays for what only a
# GPU runs: the loader's arguments on a T4 or an Ampere card (Unsloth's from_pretrained asks the device for its
# properties), the import order on the GPU path (Unsloth's CPU mode leaves TRL alone at import), vLLM's engine (its
# start, its failures, its LoRA requests, its teardown) and server mode.


class _Stop(Exception):
    """Raised by the stand-in trainer once it has recorded how the kit built it (nothing trains)."""


class _ImportHook(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes ``import unsloth`` run ``on_import(module)``, as a real package's ``__init__`` would."""

    def __init__(self, on_import):
        self.on_import = on_import

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name == "unsloth" else None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        self.on_import(module)


@pytest.fixture
def fake_unsloth(monkeypatch, fake_t4):
    """A GPU box (the T4 above, made sm80) with a fake ``unsloth`` and an importable ``vllm``; returns the record.

    ``record.loads``: kwargs of each ``FastLanguageModel.from_pretrained``; ``record.engine_error``: raised by a load
    with ``fast_inference=True`` (vLLM's engine failing to start); ``record.trainer``: ``(class, kwargs)`` of the
    trainer the kit built. TRL's own ``GRPOTrainer`` is a recording stand-in, so an unpatched class shows up as such.
    """
    import trl

    record = types.SimpleNamespace(loads=[], engine_error=None, trainer=None, imported=False)
    fake_t4.major, fake_t4.minor = 8, 0
    monkeypatch.delenv("LOCAL_RANK", raising=False)

    class PlainGRPOTrainer:  # TRL's class, as a module-level `from trl import GRPOTrainer` would have kept it
        def __init__(self, **kwargs):
            record.trainer = (type(self), kwargs)
            raise _Stop

    class FastLanguageModel:
        @staticmethod
        def from_pretrained(**kwargs):
            record.loads.append(kwargs)
            if kwargs["fast_inference"] and record.engine_error is not None:
                raise record.engine_error
            model = types.SimpleNamespace(name="policy")
            if kwargs["fast_inference"]:
                model.vllm_engine = object()  # what Unsloth attaches when its engine started
            name = kwargs["model_name"]
            tokenizer = models.load_tokenizer(name) if Path(name).is_dir() else types.SimpleNamespace(pad_token="<pad>")
            return model, tokenizer

        @staticmethod
        def get_peft_model(model, **kwargs):
            return model

    def patch_trl(module):
        record.imported = True

        class UnslothGRPOTrainer(trl.GRPOTrainer):
            pass

        UnslothGRPOConfig = type("GRPOConfig", (trl.GRPOConfig,), {})  # Unsloth's keeps TRL's name, for pickling

        monkeypatch.setattr(trl, "GRPOTrainer", UnslothGRPOTrainer)
        monkeypatch.setattr(trl, "GRPOConfig", UnslothGRPOConfig)
        module.FastLanguageModel = FastLanguageModel

    monkeypatch.setattr(trl, "GRPOTrainer", PlainGRPOTrainer)
    vllm = types.ModuleType("vllm")
    vllm.__spec__ = importlib.machinery.ModuleSpec("vllm", None)  # what availability checks read
    monkeypatch.setitem(sys.modules, "vllm", vllm)  # tests that need it missing set None
    monkeypatch.setitem(sys.modules, "unsloth", None)  # restored (removed) after the test
    del sys.modules["unsloth"]
    monkeypatch.setattr(sys, "meta_path", [_ImportHook(patch_trl), *sys.meta_path])
    return record


def _train_on_fake_gpu(tiny_model_dir, tmp_path, **changes):
    """``train()`` on the fake GPU up to the trainer's construction (fp32 and use_cpu, so TRL builds on a CPU)."""
    from grpo_kit.train import train

    recipe = load_recipe("cpu", backend="unsloth", model_name_or_path=str(tiny_model_dir), use_cpu=True, **changes)
    with pytest.raises(_Stop):
        train(recipe, data="sample", output_dir=tmp_path / "run")


# ------------------------------------------------------------------------------------------------ 1. import order


def test_only_the_unsloth_backend_imports_unsloth(fake_unsloth):
    assert models.prepare_backend("transformers") == "transformers"
    assert fake_unsloth.imported is False
    assert models.prepare_backend("auto") == "unsloth"  # a GPU
    assert fake_unsloth.imported is True


def test_a_gpu_without_unsloth_is_told_how_to_install_it_or_use_transformers(fake_unsloth, monkeypatch):
    monkeypatch.setitem(sys.modules, "unsloth", None)  # `import unsloth` raises ImportError
    with pytest.raises(GrpoKitError, match="--set backend=transformers"):
        models.prepare_backend("auto")


_IMPORT_ORDER_DRIVER = """
import sys, types, torch
torch.cuda.is_available = lambda: True
props = types.SimpleNamespace(name="NVIDIA A100", total_memory=80 * 2**30, major=8, minor=0)
torch.cuda.get_device_properties = lambda index=0: props
torch.cuda.is_bf16_supported = lambda including_emulation=True: True
from grpo_kit.cli import main
sys.exit(main(sys.argv[1:]))
"""

_FAKE_UNSLOTH_INIT = """
import json, os, sys
with open(os.environ["FAKE_UNSLOTH_RECORD"], "w") as handle:
    json.dump(sorted(m for m in ("trl", "transformers", "peft") if m in sys.modules), handle)
raise SystemExit(0)  # recorded what was imported before Unsloth; nothing more to see
"""


def test_grpo_kit_train_imports_unsloth_before_trl_transformers_and_peft(tiny_model_dir, tmp_path):
    """Unsloth patches TRL, transformers and PEFT at import and warns when they came first: the CLI must import it
    first."""
    import json
    import os
    import subprocess

    package = tmp_path / "fake" / "unsloth"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(_FAKE_UNSLOTH_INIT, encoding="utf-8")
    record = tmp_path / "imported-before-unsloth.json"
    root = Path(__file__).resolve().parents[1]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path / "fake"), str(root)]),
        "FAKE_UNSLOTH_RECORD": str(record),
    }
    command = [
        sys.executable,
        "-c",
        _IMPORT_ORDER_DRIVER,
        "train",
        "--preset",
        "cpu",
        "--set",
        "backend=unsloth",
        "--set",
        f"model_name_or_path={tiny_model_dir}",
        "--data",
        "sample",
        "--set",
        "max_steps=1",
        "--output",
        str(tmp_path / "run"),
        "--set",
        "use_cpu=true",
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert record.is_file(), f"unsloth was never imported:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    assert json.loads(record.read_text()) == []


# ------------------------------------------------------------------------------------------------ 3. dtype to Unsloth


def test_fast_language_model_without_a_dtype_lets_unsloth_pick_as_unsloths_own_does(fake_unsloth):
    models.load_base_model("some/model")
    models.load_base_model("some/model", dtype="auto")
    assert [load["dtype"] for load in fake_unsloth.loads] == [None, None]


@pytest.mark.parametrize(("recipe", "dtype"), [("t4-16gb", torch.float16), ("a100-80gb", torch.bfloat16)])
def test_unsloth_loads_in_the_recipes_precision(fake_unsloth, recipe, dtype):
    models.load_model(load_recipe(recipe))  # the fake card is sm80: the t4 recipe's fp16 must still win
    assert fake_unsloth.loads[-1]["dtype"] is dtype


def test_notebook_00_on_a_t4_loads_its_written_out_values_through_unsloth(
    fake_unsloth, fake_t4, monkeypatch, tmp_path, capsys
):
    """Notebook 00's settings, CPU/CI, values and model cells on a (fake) T4: the CPU/CI cell changes nothing, auto
    picks the t4 tier, and Unsloth gets the T4 run's values, vLLM colocated, in fp16."""
    import json

    import grpo_kit.colab

    monkeypatch.setattr(grpo_kit.colab, "workspace", lambda: tmp_path)
    fake_t4.major = 7  # a T4 (sm75) for auto_recipe: a bf16 card of 14.7 GiB gets the bf16 rtx-12gb tier
    notebook = Path(__file__).resolve().parents[1] / "notebooks" / "00_train_grpo_colab.ipynb"
    cells = {c["id"]: "".join(c["source"]) for c in json.loads(notebook.read_text())["cells"]}
    namespace: dict = {}
    for cell in ("c04", "c04b", "c06"):
        exec(compile(cells[cell], cell, "exec"), namespace)
    assert namespace["TIER"] == "t4-16gb" and namespace["recipe"].name == "t4-16gb"  # the CPU/CI cell left it
    peft = []
    unsloth = sys.modules["unsloth"].FastLanguageModel  # imported by the values cell, before TRL's classes are used
    monkeypatch.setattr(
        unsloth,
        "get_peft_model",
        lambda model, **kw: (
            peft.append(kw) or SimpleNamespace(vllm_engine=model.vllm_engine, print_trainable_parameters=lambda: None)
        ),
    )
    exec(compile(cells["c08"], "c08", "exec"), namespace)
    (load,) = fake_unsloth.loads
    assert load["model_name"] == "unsloth/Meta-Llama-3.1-8B-Instruct-bnb-4bit" and load["load_in_4bit"] is True
    assert (load["dtype"], load["fast_inference"], load["gpu_memory_utilization"]) == (torch.float16, True, 0.6)
    assert (load["max_seq_length"], load["max_lora_rank"]) == (512, 32)
    assert peft[0]["r"] == 32 and peft[0]["use_gradient_checkpointing"] == "unsloth"
    import trl

    assert (
        namespace["recipe"].grpo.use_vllm is True and type(namespace["recipe"].grpo) is trl.GRPOConfig
    )  # Unsloth's, patched in


# -------------------------------------------------------------------------------------------- 5. tuned model on vLLM


@pytest.fixture
def tuned_with_engine(tiny_model_dir, monkeypatch):
    """The tiny Llama with a LoRA adapter, carrying what Unsloth's fast_inference adds: a vLLM engine, whose
    ``fast_generate`` records the ``lora_request`` it gets, and ``load_lora`` returning a request per call."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir),
        LoraConfig(r=4, target_modules=["q_proj"], lora_dropout=0.0),
    )
    seen = types.SimpleNamespace(requests=[], load_lora=[])

    def load_lora(folder, load_tensors=False):
        seen.load_lora.append((folder, load_tensors))
        return f"lora-request-{len(seen.load_lora)}"

    def fast_generate(prompts, sampling_params=None, lora_request=None, use_tqdm=True):
        seen.requests.append(lora_request)
        output = types.SimpleNamespace(text="<answer>1</answer>", token_ids=[1, 2, 3])
        return [types.SimpleNamespace(outputs=[output] * sampling_params.n) for _ in prompts]

    model.vllm_engine, model.fast_generate, model.load_lora = object(), fast_generate, load_lora
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(SamplingParams=types.SimpleNamespace))
    return model, seen


def test_evaluating_a_tuned_model_on_vllm_generates_with_its_adapter(tuned_with_engine, tiny_model_dir):
    from grpo_kit.data import load_gsm8k
    from grpo_kit.evaluate import evaluate

    model, seen = tuned_with_engine
    questions = load_gsm8k("sample", "test", limit=2, seed=0)
    tokenizer = models.load_tokenizer(str(tiny_model_dir))
    evaluate(model, tokenizer, questions, progress=False)
    assert seen.requests == ["lora-request-1"]  # the adapter's request
    assert seen.load_lora[0][1] is True  # the live adapter tensors, not a stale file
    with model.disable_adapter():  # "base" in evaluate_before_after: no adapter, as asked
        evaluate(model, tokenizer, questions, progress=False)
    assert seen.requests[-1] is None


def test_chatting_with_a_tuned_model_on_vllm_uses_its_adapter(tuned_with_engine, tiny_model_dir):
    from grpo_kit.evaluate import ask

    model, seen = tuned_with_engine
    ask(model, models.load_tokenizer(str(tiny_model_dir)), "What is 1 + 0?", stream=False)
    assert seen.requests == ["lora-request-1"]


def test_an_engine_that_cannot_load_the_adapter_is_refused(tuned_with_engine, tiny_model_dir):
    from grpo_kit.data import load_gsm8k
    from grpo_kit.evaluate import evaluate

    model, seen = tuned_with_engine
    del model.load_lora
    with pytest.raises(GrpoKitError, match="would score the base model"):
        evaluate(
            model, models.load_tokenizer(str(tiny_model_dir)), load_gsm8k("sample", "test", limit=1), progress=False
        )
    assert seen.requests == []


# ------------------------------------------------------------------------------------------------ 6. evaluation dtype


def _record_inference_load(monkeypatch) -> list:
    seen = []

    def record(cls, model_id, **kwargs):
        if cls.__name__ == "AutoTokenizer":
            return types.SimpleNamespace(pad_token="<pad>", eos_token="<eos>", padding_side="right")
        seen.append(kwargs)
        return types.SimpleNamespace(eval=lambda: None, modules=lambda: [])

    monkeypatch.setattr(models, "_from_pretrained", record)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    return seen


def test_inference_model_on_a_gpu_loads_in_16_bits_onto_the_gpu(fake_t4, monkeypatch):
    seen = _record_inference_load(monkeypatch)
    models.load_inference_model("some/model")
    assert getattr(torch, seen[-1]["dtype"]) is torch.float16 and seen[-1]["device_map"] == {"": 0}  # a T4: fp16


def test_inference_model_on_a_cpu_stays_float32(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    seen = _record_inference_load(monkeypatch)
    models.load_inference_model("some/model")
    assert getattr(torch, seen[-1]["dtype"]) is torch.float32 and "device_map" not in seen[-1]


# ------------------------------------------------------------------------------------------------ 7. server + 4-bit


def test_server_mode_with_4bit_weights_is_refused_before_any_weights_load(fake_unsloth, tmp_path):
    from grpo_kit.train import train

    with pytest.raises(GrpoKitError, match="4-bit") as error:  # a contradiction in the recipe itself
        train(load_recipe("t4-16gb", vllm_mode="server"), data="sample", output_dir=tmp_path / "run")
    assert "load_in_4bit=false" in str(error.value) and "colocated" in str(error.value)
    assert fake_unsloth.loads == [] and not (tmp_path / "run").exists()


def test_server_mode_with_16bit_weights_loads(fake_unsloth):
    models.load_model(load_recipe("t4-16gb", vllm_mode="server", load_in_4bit=False))
    assert fake_unsloth.loads[-1]["fast_inference"] is False  # the server generates


# ------------------------------------------------------------------------------------------------ vLLM import or start


def _vllm_off_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().out.splitlines() if line.startswith("vLLM off:")]


def test_an_engine_that_fails_to_start_is_an_error_naming_the_fixes(fake_unsloth, monkeypatch, capsys):
    """No silent fallback to slower generation: the cause's first line, and the three ways out."""
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    fake_unsloth.engine_error = RuntimeError("Engine core initialization failed. See root cause above.\nmore")
    with pytest.raises(GrpoKitError, match="RuntimeError: Engine core initialization failed") as error:
        models.load_model(load_recipe("a100-80gb"))
    for fix in ("restart the runtime", "--set vllm_gpu_memory_utilization", "--set use_vllm=false"):
        assert fix in str(error.value)
    assert [load["fast_inference"] for load in fake_unsloth.loads] == [True]  # not loaded again without vLLM
    assert _vllm_off_lines(capsys) == []


def test_a_programming_error_is_not_taken_for_an_engine_failure(fake_unsloth):
    fake_unsloth.engine_error = TypeError("from_pretrained() got an unexpected keyword argument")
    with pytest.raises(TypeError):
        models.load_model(load_recipe("a100-80gb"))
    assert len(fake_unsloth.loads) == 1


def test_train_stops_with_the_fixes_when_the_engine_fails(fake_unsloth, tiny_model_dir, tmp_path, monkeypatch):
    from grpo_kit.train import train

    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    fake_unsloth.engine_error = ValueError("No available memory for the cache blocks.")
    recipe = load_recipe("cpu", backend="unsloth", model_name_or_path=str(tiny_model_dir), use_cpu=True, use_vllm=True)
    with pytest.raises(GrpoKitError, match="ValueError: No available memory.*--set use_vllm=false"):
        train(recipe, data="sample", output_dir=tmp_path / "run")
    assert fake_unsloth.trainer is None  # no trainer was built: the run did not go on without vLLM


def test_vllm_that_cannot_be_imported_in_server_mode_is_refused(fake_unsloth, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(GrpoKitError, match="needs vLLM here too.*use_vllm=false"):
        models.use_vllm_if_importable(load_recipe("a100-80gb", vllm_mode="server"))
    assert fake_unsloth.loads == []


def test_use_vllm_false_reaches_train(fake_unsloth, monkeypatch):
    import grpo_kit.train as train_module
    from grpo_kit.cli import main

    seen = []

    def fake_train(recipe, **kwargs):
        seen.append(recipe)
        raise _Stop

    monkeypatch.setattr(train_module, "train", fake_train)
    with pytest.raises(_Stop):
        main(["train", "--preset", "a100-80gb", "--set", "use_vllm=false"])
    assert seen[0].grpo.use_vllm is False and seen[0].name == "a100-80gb"


def test_the_colocated_vllm_engine_is_released_by_unsloths_own_teardown(monkeypatch):
    """``del trainer, model`` leaves Unsloth's engine holding its memory (vLLM's distributed groups keep it alive);
    ``release_vllm`` hands the engine to unsloth_zoo's ``delete_vllm`` once, and is a no-op without an engine."""
    torn_down = []
    zoo = types.ModuleType("unsloth_zoo")
    zoo.vllm_utils = types.ModuleType("unsloth_zoo.vllm_utils")
    zoo.vllm_utils.delete_vllm = torn_down.append
    monkeypatch.setitem(sys.modules, "unsloth_zoo", zoo)
    monkeypatch.setitem(sys.modules, "unsloth_zoo.vllm_utils", zoo.vllm_utils)
    engine = object()
    model = SimpleNamespace(vllm_engine=engine)
    assert models.release_vllm(model) and torn_down == [engine] and model.vllm_engine is None
    assert not models.release_vllm(model) and torn_down == [engine]  # a second call finds nothing to release
    assert not models.release_vllm(SimpleNamespace())  # the CPU path: no engine, nothing imported
