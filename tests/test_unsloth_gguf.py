"""GGUF through Unsloth, run on CPU with a stand-in ``unsloth`` package (the real one needs a GPU).

The stand-in behaves like Unsloth 2026.10.7's ``save_pretrained_gguf`` where the kit depends on it: it takes a list
of types (one merge for all), writes a merged checkpoint into ``save_directory``, one ``.gguf`` per type (a real one,
made with the kit's CPU writer so the checks have something true to check) plus a Modelfile into the sibling
``<save_directory>_gguf``, and returns ``{"gguf_files": [...]}``. It lives only on the child process's PYTHONPATH, so
an export that imported Unsloth in its own process would fail here.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

import grpo_kit.gguf as gguf_module
from grpo_kit.errors import GrpoKitError
from grpo_kit.export import export

REPO = Path(__file__).resolve().parents[1]

FAKE_UNSLOTH = '''
import json, os
from pathlib import Path


def _log(record):
    with open(os.environ["FAKE_UNSLOTH_LOG"], "a") as handle:
        handle.write(json.dumps(record) + "\\n")


class _Merged:
    def __init__(self, model):
        self.model = model

    def save_pretrained_gguf(self, save_directory, tokenizer, quantization_method="fast_quantized"):
        _log({"save_directory": str(save_directory), "quantization_method": quantization_method})
        if os.environ.get("FAKE_UNSLOTH_CRASH"):
            raise RuntimeError("Unsloth: GGUF conversion failed: llama-quantize is missing")
        save = Path(save_directory)
        save.mkdir(parents=True)
        (save / "model.safetensors").write_bytes(b"stand-in for the merged 16-bit checkpoint")
        gguf_dir = Path(f"{save_directory}_gguf")
        gguf_dir.mkdir()
        (gguf_dir / "Modelfile").write_text("FROM ./model.gguf\\n")
        files = []
        if not os.environ.get("FAKE_UNSLOTH_NO_FILES"):
            from grpo_kit.gguf import write_gguf

            for kind in quantization_method:
                path = gguf_dir / f"{save.name}.{kind.upper()}.gguf"
                files.append(str(write_gguf(self.model, tokenizer, path, kind)))
        return {"save_directory": str(save), "gguf_directory": str(gguf_dir), "gguf_files": files}


def _save_merged(self, save_directory, tokenizer, save_method="merged_16bit"):
    import torch

    _log({"save_directory": str(save_directory), "save_method": save_method})
    self.model.to(torch.bfloat16).save_pretrained(save_directory)
    tokenizer.save_pretrained(save_directory)


_Merged.save_pretrained_merged = _save_merged


class FastLanguageModel:
    @staticmethod
    def from_pretrained(model_name, load_in_4bit=True, dtype=None):
        from peft import PeftModel
        from transformers import AutoModelForCausalLM, AutoTokenizer

        base = json.loads((Path(model_name) / "adapter_config.json").read_text())["base_model_name_or_path"]
        _log({"model_name": model_name, "load_in_4bit": load_in_4bit, "dtype": str(dtype), "base": base})
        model = AutoModelForCausalLM.from_pretrained(base)
        if not os.environ.get("FAKE_UNSLOTH_NO_LORA"):  # the old "merged model ignores the LoRA" bug
            model = PeftModel.from_pretrained(model, model_name).merge_and_unload()
        return _Merged(model), AutoTokenizer.from_pretrained(model_name)
'''


@pytest.fixture(scope="module")
def adapter(tmp_path_factory, tiny_model_dir, make_adapter):
    return make_adapter(tiny_model_dir, tmp_path_factory.mktemp("run") / "adapter")


@pytest.fixture
def fake_unsloth(tmp_path, monkeypatch):
    """Route GGUF to Unsloth and put the stand-in on the child's PYTHONPATH; returns the call log reader."""
    package = tmp_path / "fake" / "unsloth"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(FAKE_UNSLOTH)
    log = tmp_path / "unsloth-calls.jsonl"
    monkeypatch.setenv("FAKE_UNSLOTH_LOG", str(log))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(package.parent), str(REPO), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setattr(gguf_module, "gguf_route", lambda *args: "unsloth")
    return lambda: [json.loads(line) for line in log.read_text().splitlines()]


def test_unsloth_gguf_is_taken_from_the_returned_paths_and_verified(adapter, tiny_model_dir, tmp_path, fake_unsloth):
    out = tmp_path / "exports"
    results = export(adapter, ("gguf",), base_model=str(tiny_model_dir), out_dir=out, name="u", gguf_type="q8_0")

    target = out / "u"
    assert [r.format for r in results] == ["gguf"]
    assert results[0].path == target / "gguf" / "u-q8_0.gguf" and results[0].path.is_file()
    assert results[0].max_abs_diff <= results[0].tolerance and "weights, not logits" in results[0].detail
    # Only the .gguf was taken: not the writer's Modelfile nor its merged checkpoint; no scratch folder is left.
    assert sorted(p.name for p in (target / "gguf").iterdir()) == ["Modelfile", "u-q8_0.gguf"]
    assert (target / "gguf" / "Modelfile").read_text().startswith("FROM ./u-q8_0.gguf")
    assert sorted(p.name for p in out.iterdir()) == ["u"]
    load, save = fake_unsloth()
    assert load["load_in_4bit"] is False and load["base"] == str(tiny_model_dir)
    assert save["quantization_method"] == ["q8_0"]
    assert ".u.partial-" in save["save_directory"] and not Path(save["save_directory"]).exists()
    assert "unsloth" not in sys.modules  # the verification ran on plain transformers


def test_several_gguf_types_take_one_unsloth_child_and_one_merge(adapter, tiny_model_dir, tmp_path, fake_unsloth):
    """Colab's disk: one merge of an 8B model is 16 GB, so every type asked for comes from one save_pretrained_gguf."""
    results = export(adapter, ("gguf",), base_model=str(tiny_model_dir), out_dir=tmp_path / "exports", name="u",
                     gguf_type="q8_0,f16")
    assert [r.path.name for r in results] == ["u-q8_0.gguf", "u-f16.gguf"]
    calls = fake_unsloth()
    assert len([c for c in calls if "model_name" in c]) == 1  # one child process loaded the model once
    assert [c["quantization_method"] for c in calls if "quantization_method" in c] == [["q8_0", "f16"]]


def test_unsloth_writing_no_file_fails_clearly_and_leaves_nothing(adapter, tiny_model_dir, tmp_path, fake_unsloth,
                                                                  monkeypatch):
    monkeypatch.setenv("FAKE_UNSLOTH_NO_FILES", "1")
    out = tmp_path / "exports"
    with pytest.raises(GrpoKitError, match="returned no .gguf file.*llama.cpp.*--format merged16"):
        export(adapter, ("lora", "gguf"), base_model=str(tiny_model_dir), out_dir=out, name="u", gguf_type="f16")
    assert list(out.iterdir()) == []


def test_unsloth_crash_reports_its_last_output(adapter, tiny_model_dir, tmp_path, fake_unsloth, monkeypatch):
    monkeypatch.setenv("FAKE_UNSLOTH_CRASH", "1")
    out = tmp_path / "exports"
    with pytest.raises(GrpoKitError, match=r"(?s)exit code 1.*llama-quantize is missing.*build"):
        export(adapter, ("gguf",), base_model=str(tiny_model_dir), out_dir=out, name="u", gguf_type="q4_k_m")
    assert list(out.iterdir()) == []


def test_k_quants_are_accepted_and_routed_to_unsloth_only(adapter, tiny_model_dir, tmp_path, monkeypatch):
    assert gguf_module.parse_names("F16, q4_k_m", gguf_module.GGUF_TYPES, "GGUF type(s)") == ["f16", "q4_k_m"]
    from grpo_kit.models import load_tokenizer

    tokenizer = load_tokenizer(str(tiny_model_dir))
    assert gguf_module.gguf_route(str(tiny_model_dir), tokenizer, ["q8_0"]) == "cpu"
    with pytest.raises(GrpoKitError, match="k-quants.*Unsloth"):  # no GPU here: the message names the way out
        gguf_module.gguf_route(str(tiny_model_dir), tokenizer, ["q4_k_m"])
    import importlib.util

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: object() if name == "unsloth" else None)
    assert gguf_module.gguf_route(str(tiny_model_dir), tokenizer, ["q4_k_m"]) == "unsloth"


@pytest.fixture
def small_gpu(monkeypatch):
    """Pretend the 16-bit base does not fit in GPU memory (a 7-8B model on a T4/L4)."""
    monkeypatch.setattr(gguf_module, "base_too_big_for_gpu", gguf_module.local_base)


def test_a_base_too_big_for_the_gpu_is_merged_by_unsloth_and_checked_weight_by_weight(
        adapter, tiny_model_dir, tmp_path, fake_unsloth, small_gpu):
    out = tmp_path / "exports"
    results = export(adapter, ("lora", "merged16", "gguf"), base_model=str(tiny_model_dir), out_dir=out, name="t4",
                     gguf_type="q8_0,f16")

    assert [r.format for r in results] == ["lora", "gguf", "gguf", "merged16"]
    assert all("weights, not logits" in r.detail and r.mean_abs_diff < r.mean_abs_diff_base for r in results[1:])
    target = out / "t4"
    assert (target / "merged16" / "model.safetensors").is_file() and (target / "merged16" / "tokenizer.json").is_file()
    assert sorted(p.name for p in (target / "gguf").iterdir()) == ["Modelfile", "t4-f16.gguf", "t4-q8_0.gguf"]
    assert sorted(p.name for p in out.iterdir()) == ["t4"]  # no scratch folder left
    calls = fake_unsloth()
    loads = [c for c in calls if "base" in c]
    assert len(loads) == 1 and loads[0]["load_in_4bit"]  # one child, one load, one merge for every GGUF type
    assert [c.get("save_method") or c.get("quantization_method") for c in calls if "base" not in c] == [
        "merged_16bit", ["q8_0", "f16"]]


def test_unsloth_dropping_the_lora_is_caught_by_the_weight_check(adapter, tiny_model_dir, tmp_path, fake_unsloth,
                                                                 small_gpu, monkeypatch):
    monkeypatch.setenv("FAKE_UNSLOTH_NO_LORA", "1")
    out = tmp_path / "exports"
    with pytest.raises(GrpoKitError, match="merged16.*(LoRA weights are missing|limit)"):
        export(adapter, ("merged16",), base_model=str(tiny_model_dir), out_dir=out, name="t4")
    assert list(out.iterdir()) == []


@pytest.mark.parametrize("fraction, expected", [(1.0, False), (0.1, True)])
def test_a_per_process_memory_cap_counts_as_a_smaller_gpu(tiny_model_dir, monkeypatch, fraction, expected):
    """An 80 GiB card capped to a T4's share (a shared card, or the GPU proof's emulated T4) takes the T4 route:
    mem_get_info reports the card, not the cap."""
    import importlib.util

    import torch

    gib, size = 2**30, sum(p.stat().st_size for p in tiny_model_dir.glob("*.safetensors"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (79 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda *a: fraction)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: int(8 * gib - size))  # 1.0x the model left
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: object() if name == "unsloth" else None)
    assert (gguf_module.base_too_big_for_gpu(str(tiny_model_dir)) == tiny_model_dir) is expected
