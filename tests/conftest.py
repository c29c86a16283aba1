"""Shared fixtures. Nothing here touches the network: models are the embedded SmolLM2 or tiny random ones."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

# Deterministic, CI-sized threading before torch is imported anywhere.
os.environ.setdefault("GRPO_KIT_THREADS", "2")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


#: The marker of the tests that run the real Unsloth (tests/test_real_unsloth.py), and the real vLLM's CPU build
#: (tests/test_real_vllm.py): each only in a pytest process of its own, ``pytest -m <marker>``.
REAL_UNSLOTH, REAL_VLLM = "real_unsloth", "real_vllm"


def pytest_configure(config):
    """``pytest -m real_unsloth``: the real Unsloth, in its CPU-only CI mode, imported first, as on a GPU.

    Unsloth patches transformers, TRL and PEFT for the whole process when it is imported, so its tests run in a
    pytest process of their own (``make test`` runs two) and the other tests never see it. ``make test`` installs it
    and its CPU dependencies in ``.venv/unsloth-cpu``, which only this process puts on ``sys.path``. Its compiled files
    go to a temporary folder, not the checkout; its torch.compile pass is off (on 2 CPU cores it spends about a minute
    tracing the first step: benchmarks/bench_real_unsloth.py).
    """
    if config.option.markexpr.strip() == REAL_VLLM:
        from vllm_cpu import use_the_cpu_build

        return use_the_cpu_build()
    if config.option.markexpr.strip() != REAL_UNSLOTH:
        return
    packages = Path(sys.prefix) / "unsloth-cpu"  # where `make test` installs Unsloth and its CPU dependencies
    if packages.is_dir():
        sys.path.insert(0, str(packages))
    os.environ["UNSLOTH_ALLOW_CPU"] = "1"
    os.environ.setdefault("UNSLOTH_COMPILE_LOCATION", tempfile.mkdtemp(prefix="unsloth-compiled-"))
    os.environ.setdefault("UNSLOTH_COMPILE_DISABLE", "1")
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    try:
        import unsloth  # noqa: F401  before transformers, TRL and PEFT, as the kit imports it on a GPU
    except ImportError as error:
        raise pytest.UsageError(
            f"-m real_unsloth needs the real Unsloth ({error}): `make test` installs it in {packages}."
        ) from error


#: Notebooks that a test module runs top to bottom, cell by cell in its own namespace, before checking more on the same
#: objects (nbmake would run them a second time): notebook -> module.
RUN_BY_A_MODULE = {"06_grpo_from_scratch.ipynb": "test_from_scratch.py"}
#: Notebooks that read what an earlier one wrote: 04 evaluates and 05 exports the run 03 trains.
CHAINED_NOTEBOOKS = ("03_train.ipynb", "04_evaluate.ipynb", "05_export.ipynb")


@pytest.hookimpl(optionalhook=True)  # a plain `pytest` without pytest-xdist
def pytest_xdist_make_scheduler(config, log):
    """``make test``'s two workers (pytest-xdist) get whole modules, in the collection's order: a module's fixtures
    are built once, and notebooks 03-05 run in order on one worker. (xdist's own ``--dist loadgroup`` marks a test by
    renaming its node id, which pytest 9.2's node ids no longer take.)"""
    from xdist.scheduler import LoadScopeScheduling

    class WholeModules(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            module = nodeid.split("::", 1)[0]
            return CHAINED_NOTEBOOKS[0] if Path(module).name in CHAINED_NOTEBOOKS else module

    return WholeModules(config, log)


def pytest_collection_modifyitems(config, items):
    """Without ``-m real_unsloth`` (``-m real_vllm``) those tests are left out (deselected, not skipped): see above.

    A notebook that a test module runs top to bottom itself (``RUN_BY_A_MODULE``) is left to that module when both are
    collected: it runs once. Modules that wait on the network come first (under ``make test``'s two workers their pip
    resolutions use the core the other worker leaves), then the notebooks and the modules that train, so that the
    quick tests fill in beside them.
    """
    tier = config.option.markexpr.strip()
    if tier in (REAL_UNSLOTH, REAL_VLLM):
        return
    collected = {item.path.name for item in items}
    keep = [
        item
        for item in items
        if not (item.get_closest_marker(REAL_UNSLOTH) or item.get_closest_marker(REAL_VLLM))
        and RUN_BY_A_MODULE.get(item.path.name) not in collected
    ]
    if len(keep) != len(items):
        config.hook.pytest_deselected(items=[item for item in items if item not in keep])
        items[:] = keep
    waits = {item.path for item in items if item.get_closest_marker("network")}
    heavy = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: (item.path not in waits, item.path.suffix != ".ipynb", item.path not in heavy))


@pytest.fixture(scope="session", autouse=True)
def _pin_threads():
    from grpo_kit.models import set_torch_threads

    set_torch_threads()
    # bitsandbytes picks its backend when first imported: import it while torch.cuda is real, before a test fakes a
    # GPU (with a faked GPU it would load its CUDA ops, which a CPU torch lacks).
    import bitsandbytes  # noqa: F401


@pytest.fixture(scope="session")
def embedded_dir():
    """Plain HF folder of the embedded SmolLM2-135M-Instruct (converted once per cache dir, ~1 min the first time)."""
    from grpo_kit.models import embedded_model_path

    return embedded_model_path()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, embedded_dir):
    """A tiny random Llama (2 layers, hidden 32) that uses the embedded model's tokenizer and chat template.

    Trains and generates in milliseconds; its outputs are noise, which is what mechanics tests want.
    """
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = AutoTokenizer.from_pretrained(embedded_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


#: LoRA on every projection of the tiny Llama.
ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _make_adapter(base_dir, out_dir, *, std: float = 0.05, seed: int = 0, targets=ALL_TARGETS):
    """Save a LoRA adapter for ``base_dir`` whose B weights are N(0, std), plus the tokenizer; returns ``out_dir``.

    A fresh LoRA has B = 0 and changes nothing, so it could not catch an evaluation or export that drops it.
    """
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), lora_dropout=0.0))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, std)
    peft_model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(base_dir).save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def make_adapter():
    """``make_adapter(base_dir, out_dir, *, std=0.05, seed=0, targets=ALL_TARGETS)``: a LoRA adapter that changes
    logits."""
    return _make_adapter


def _fake_checkpoint(run_dir, step: int, *, skip=(), state: bool = True):
    """A ``checkpoint-<step>`` folder as the Trainer writes it (tiny adapter weights, optimizer and scheduler state),
    minus the files named in ``skip``; ``state=False`` leaves out ``trainer_state.json`` (killed while saving)."""
    import json

    import torch
    from safetensors.torch import save_file

    folder = run_dir / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    save_file(
        {"base_model.model.lora_B.weight": torch.full((2, 2), float(step))}, str(folder / "adapter_model.safetensors")
    )
    (folder / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "tiny"}))
    if state:
        (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    for name in ("optimizer.pt", "scheduler.pt"):
        (folder / name).write_bytes(b"state")
    for name in skip:
        (folder / name).unlink()
    return folder


@pytest.fixture(scope="session")
def fake_checkpoint():
    """``fake_checkpoint(run_dir, step, *, skip=(), state=True)``: a complete checkpoint folder without training."""
    return _fake_checkpoint


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if any weights are loaded: these problems must be caught before."""
    import grpo_kit.models as models

    def refuse(*args, **kwargs):
        pytest.fail("a model was loaded before the problem was reported")

    monkeypatch.setattr(models, "load_model", refuse)
    monkeypatch.setattr(models, "load_inference_model", refuse)
