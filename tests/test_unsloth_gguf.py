"""Merged and GGUF exports through Unsloth, run on CPU with a stand-in ``unsloth`` package (the real one needs a GPU).

The stand-in behaves like Unsloth 2026.10.7's savers where the kit depends on them: ``save_pretrained_gguf`` takes a
list of types (one merge for all), writes a merged checkpoint into ``save_directory``, one ``.gguf`` per type (a real
one, from tests/gguf_stand_in.py, so the checks have something true to check) plus a Modelfile into the sibling
``<save_directory>_gguf``, and returns ``{"gguf_files": [...]}``; ``save_pretrained_merged`` writes a bf16 folder. It
lives only on the child process's PYTHONPATH, so an export that imported Unsloth in its own process would fail here.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

import grpo_kit.gguf_files as gguf_module
from grpo_kit.errors import GrpoKitError
from grpo_kit.export import export

REPO = Path(__file__).resolve().parents[1]

FAKE_UNSLOTH = """
import json, os
from pathlib import Path


def _log(record):
    with open(os.environ["FAKE_UNSLOTH_LOG"], "a") as handle:
        handle.write(json.dumps(record) + "\\n")


class _Merged:
    def __init__(self, model, loaded_from=None):
        self.model, self.loaded_from = model, loaded_from  # loaded_from: a folder, for a model that is not PEFT

    def save_pretrained_gguf(self, save_directory, tokenizer, quantization_method="fast_quantized"):
        _log({"save_directory": str(save_directory), "quantization_method": quantization_method,
              "converts": self.loaded_from or "a new merge"})
        if os.environ.get("FAKE_UNSLOTH_CRASH"):
            raise RuntimeError("Unsloth: GGUF conversion failed: llama-quantize is missing")
        Path("llama.cpp-f16-intermediate.gguf").write_bytes(b"written to the working directory")
        save = Path(self.loaded_from or save_directory)
        if not self.loaded_from:  # a PEFT model is merged again; a folder's own model is converted as it is
            save.mkdir(parents=True)
            (save / "model.safetensors").write_bytes(b"stand-in for the merged 16-bit checkpoint")
        gguf_dir = Path(f"{save_directory}_gguf")
        gguf_dir.mkdir()
        (gguf_dir / "Modelfile").write_text("FROM ./model.gguf\\n")
        files = []
        if not os.environ.get("FAKE_UNSLOTH_NO_FILES"):
            from gguf_stand_in import write_gguf

            for kind in quantization_method:
                path = gguf_dir / f"{save.name}.{kind.upper()}.gguf"
                files.append(str(write_gguf(self.model, path, kind)))
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

        if not (Path(model_name) / "adapter_config.json").is_file():  # a merged folder: loaded as it is
            _log({"model_name": model_name, "load_in_4bit": load_in_4bit, "plain": True})
            return _Merged(AutoModelForCausalLM.from_pretrained(model_name), loaded_from=model_name), \
                AutoTokenizer.from_pretrained(model_name)
        base = json.loads((Path(model_name) / "adapter_config.json").read_text())["base_model_name_or_path"]
        _log({"model_name": model_name, "load_in_4bit": load_in_4bit, "dtype": str(dtype), "base": base})
        model = AutoModelForCausalLM.from_pretrained(base)
        if not os.environ.get("FAKE_UNSLOTH_NO_LORA"):  # the old "merged model ignores the LoRA" bug
            model = PeftModel.from_pretrained(model, model_name).merge_and_unload()
        return _Merged(model), AutoTokenizer.from_pretrained(model_name)
"""


@pytest.fixture(scope="module")
def adapter(tmp_path_factory, tiny_model_dir, make_adapter):
    return make_adapter(tiny_model_dir, tmp_path_factory.mktemp("run") / "adapter")


@pytest.fixture
def fake_unsloth(tmp_path, monkeypatch):
    """Pretend a GPU with Unsloth, and put the stand-in on the child's PYTHONPATH; returns the call log reader."""
    package = tmp_path / "fake" / "unsloth"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(FAKE_UNSLOTH)
    log = tmp_path / "unsloth-calls.jsonl"
    monkeypatch.setenv("FAKE_UNSLOTH_LOG", str(log))
    paths = [str(package.parent), str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(paths))
    monkeypatch.setattr(gguf_module, "unsloth_on_gpu", lambda: True)
    return lambda: [json.loads(line) for line in log.read_text().splitlines()]


def test_unsloth_gguf_is_taken_from_the_returned_paths_and_verified(adapter, tiny_model_dir, tmp_path, fake_unsloth):
    out = tmp_path / "exports"
    results = export(adapter, ("gguf",), base_model=str(tiny_model_dir), out_dir=out, name="u", gguf_type="q8_0")

    target = out / "u"
    assert [r.format for r in results] == ["gguf"]
    assert results[0].path == target / "gguf" / "u-q8_0.gguf" and results[0].path.is_file()
    assert results[0].max_abs_diff <= results[0].tolerance and "compared with base + LoRA" in results[0].detail
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
    results = export(
        adapter, ("gguf",), base_model=str(tiny_model_dir), out_dir=tmp_path / "exports", name="u", gguf_type="q8_0,f16"
    )
    assert [r.path.name for r in results] == ["u-q8_0.gguf", "u-f16.gguf"]
    calls = fake_unsloth()
    assert len([c for c in calls if "model_name" in c]) == 1  # one child process loaded the model once
    assert [c["quantization_method"] for c in calls if "quantization_method" in c] == [["q8_0", "f16"]]


def test_unsloth_writing_no_file_fails_clearly_and_leaves_nothing(
    adapter, tiny_model_dir, tmp_path, fake_unsloth, monkeypatch
):
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


def test_gguf_without_a_gpu_is_refused_before_anything_loads_naming_the_way_out(
    adapter, tiny_model_dir, tmp_path, monkeypatch
):
    assert gguf_module.parse_names("F16, q4_k_m", gguf_module.GGUF_TYPES, "GGUF type(s)") == ["f16", "q4_k_m"]
    import grpo_kit.models as models

    monkeypatch.setattr(models, "load_tokenizer", lambda *a: pytest.fail("something was loaded"))
    with pytest.raises(GrpoKitError, match="llama.cpp.*no CUDA GPU.*--format merged16.*convert_hf_to_gguf"):
        export(
            adapter, ("lora", "gguf"), base_model=str(tiny_model_dir), out_dir=tmp_path / "exports", gguf_type="q8_0"
        )
    assert not (tmp_path / "exports").exists()


def test_on_a_gpu_every_merged_format_comes_from_one_unsloth_child_loaded_as_the_run_trained(
    adapter, tiny_model_dir, tmp_path, fake_unsloth
):
    import shutil

    run = tmp_path / "run"  # the run trained in 4 bit (run.json): Unsloth loads it so, as a T4 holds an 8B model
    shutil.copytree(adapter, run / "adapter")
    (run / "run.json").write_text(
        json.dumps({"recipe": {"model_name_or_path": str(tiny_model_dir), "load_in_4bit": True}})
    )
    out = tmp_path / "exports"
    results = export(run / "adapter", ("lora", "merged16", "gguf"), out_dir=out, name="t4", gguf_type="q8_0,f16")

    assert [r.format for r in results] == ["lora", "gguf", "gguf", "merged16"]
    assert all(r.mean_abs_diff < r.mean_abs_diff_base for r in results[1:])
    target = out / "t4"
    assert (target / "merged16" / "model.safetensors").is_file() and (target / "merged16" / "tokenizer.json").is_file()
    assert sorted(p.name for p in (target / "gguf").iterdir()) == ["Modelfile", "t4-f16.gguf", "t4-q8_0.gguf"]
    assert sorted(p.name for p in out.iterdir()) == ["t4"]  # no scratch folder left
    calls = fake_unsloth()
    adapter_loads = [c for c in calls if "base" in c]
    assert len(adapter_loads) == 1 and adapter_loads[0]["load_in_4bit"]  # the adapter, loaded as the run trained
    merges = [c for c in calls if c.get("save_method") == "merged_16bit"]
    (gguf_call,) = [c for c in calls if "quantization_method" in c]
    # One merge: the GGUF types are converted from the merged folder, loaded again as a plain model (in 4 bit)
    assert len(merges) == 1 and gguf_call["converts"] == merges[0]["save_directory"]
    assert gguf_call["quantization_method"] == ["q8_0", "f16"]
    assert [c["load_in_4bit"] for c in calls if c.get("plain")] == [True]


def test_unsloth_dropping_the_lora_is_caught_by_the_weight_check(
    adapter, tiny_model_dir, tmp_path, fake_unsloth, monkeypatch
):
    monkeypatch.setenv("FAKE_UNSLOTH_NO_LORA", "1")
    out = tmp_path / "exports"
    with pytest.raises(GrpoKitError, match="merged16.*(LoRA weights are missing|limit)"):
        export(adapter, ("merged16",), base_model=str(tiny_model_dir), out_dir=out, name="t4")
    assert list(out.iterdir()) == []
