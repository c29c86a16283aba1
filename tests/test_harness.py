"""grpo_kit.evaluate's harness mode: lm-evaluation-harness's gsm8k_cot task on local data, wired through `grpo-kit
eval --harness`.

lm-eval is an optional extra (`pip install grpo-kit[harness]`); the tests that run it are skipped without it.
"""

from __future__ import annotations

import builtins
import json

import pytest

from grpo_kit.cli import main
from grpo_kit.errors import GrpoKitError
from grpo_kit.evaluate import HarnessResult, evaluate_harness, task_config

# GSM8K-format rows written for this test (not GSM8K questions): the answer keeps its "#### N" solution form.
ROWS = [
    {"question": "Tom has 3 apples and buys 4 more. How many apples does he have?", "answer": "3 + 4 = 7\n#### 7"},
    {"question": "A box holds 6 pens. How many pens are in 2 boxes?", "answer": "6 * 2 = 12\n#### 12"},
    {"question": "Mia had 10 stickers and gave away 3. How many are left?", "answer": "10 - 3 = 7\n#### 7"},
]


@pytest.fixture
def gsm8k_file(tmp_path):
    path = tmp_path / "mini.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in ROWS), encoding="utf-8")
    return path


@pytest.fixture
def offline(monkeypatch):
    """No Hub: a task that still pointed at openai/gsm8k would fail to load."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def test_missing_lm_eval_names_the_extra(monkeypatch):
    real_import = builtins.__import__

    def no_lm_eval(name, *args, **kwargs):
        if name == "lm_eval" or name.startswith("lm_eval."):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_lm_eval)
    with pytest.raises(GrpoKitError, match=r"grpo-kit\[harness\]"):
        evaluate_harness("embedded", None)


# ------------------------------------------------------------------------------------------ with lm-eval installed


@pytest.fixture
def manager():
    pytest.importorskip("lm_eval")
    from pathlib import Path

    import lm_eval
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(Path(lm_eval.__file__).parent / "tasks" / "gsm8k"), include_defaults=False)


def test_task_config_reads_local_files_instead_of_the_hub(manager, gsm8k_file, tmp_path):
    config = task_config(manager, tmp_path / "test.jsonl")
    assert config["task"] == "gsm8k_cot" and config["dataset_path"] == "json" and config["dataset_name"] is None
    assert config["dataset_kwargs"] == {"data_files": {"test": str(tmp_path / "test.jsonl")}}
    assert config["num_fewshot"] == 8  # the published protocol is kept


@pytest.mark.slow
def test_cli_runs_gsm8k_cot_on_the_embedded_model_offline(manager, gsm8k_file, offline, tmp_path, capsys):
    out = tmp_path / "harness.json"
    code = main(
        [
            "eval",
            "--harness",
            "gsm8k_cot",
            "--data",
            str(gsm8k_file),
            "--limit",
            "2",
            "--max-new-tokens",
            "4",
            "--batch-size",
            "2",
            "--out",
            str(out),
        ]
    )
    printed = capsys.readouterr().out
    assert code == 0
    saved = json.loads(out.read_text(encoding="utf-8"))
    assert saved["task"] == "gsm8k_cot" and saved["n"] == 2 and saved["label"] == "base"
    assert 0.0 <= saved["strict_match"] <= 1.0 and 0.0 <= saved["flexible_extract"] <= 1.0
    assert "task gsm8k_cot" in saved["protocol"] and "max_gen_toks=4" in saved["protocol"]
    assert "base: gsm8k_cot: strict-match" in printed and "protocol: lm-evaluation-harness" in printed


@pytest.mark.parametrize("task", ["mmlu", "gsm8k", "gsm8k_zeroshot"])  # gsm8k: its examples come from the train split
def test_cli_refuses_an_unknown_task_before_loading_a_model(task, gsm8k_file, capsys):
    assert main(["eval", "--harness", task, "--data", str(gsm8k_file)]) == 2
    assert f"Unknown harness task '{task}'. Choose one of: gsm8k_cot." in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ([], {"h.json": ("base", None)}),
        (["--adapter", "a"], {"h.json": ("tuned", "a")}),
        (["--adapter", "a", "--compare"], {"h.json": ("tuned", "a"), "h-base.json": ("base", None)}),
    ],
)
def test_runs_follow_the_kit_eval_naming(flags, expected, gsm8k_file, tmp_path, monkeypatch):
    """--compare evaluates base and tuned; --out holds the tuned (or only) result, <stem>-base.json the base one."""

    def fake(model, dataset, *, adapter, label, **kwargs):
        return HarnessResult("gsm8k_cot", 0.0, 0.0, len(dataset), f"adapter={adapter}", label)

    monkeypatch.setattr("grpo_kit.evaluate.evaluate_harness", fake)
    monkeypatch.setattr("grpo_kit.evaluate.run_settings", lambda model, adapter: ("embedded", {}))
    out = tmp_path / "out" / "h.json"
    assert main(["eval", "--harness", "gsm8k_cot", "--data", str(gsm8k_file), "--out", str(out), *flags]) == 0
    written = {p.name: json.loads(p.read_text()) for p in out.parent.iterdir()}
    assert {name: (r["label"], r["protocol"]) for name, r in written.items()} == {
        name: (label, f"adapter={adapter}") for name, (label, adapter) in expected.items()
    }


def test_on_a_t4_the_harness_loads_the_model_in_float16_not_the_checkpoints_bf16(
    monkeypatch, make_adapter, tmp_path, tiny_model_dir
):
    """lm-eval's dtype="auto" would load a bf16 checkpoint in bf16, which a T4 only emulates; the harness hands lm-eval
    the model the kit's own protocol loads, in the card's 16-bit dtype. A torn adapter is refused before any load."""
    pytest.importorskip("lm_eval")
    import torch

    from grpo_kit import models

    seen = {}

    class Stop(Exception):
        pass

    def recording_load(model_id, dtype, load_in_4bit):
        seen.update(model_id=model_id, dtype=dtype)
        raise Stop

    monkeypatch.setattr(models, "_transformers_load", recording_load)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=0: (7, 5))
    with pytest.raises(Stop):
        evaluate_harness("embedded", None)
    assert seen["dtype"] == "float16"

    adapter = make_adapter(tiny_model_dir, tmp_path / "adapter")
    weights = adapter / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    seen.clear()
    with pytest.raises(GrpoKitError, match="Cannot load the adapter"):
        evaluate_harness("embedded", None, adapter=adapter)
    assert seen == {}
