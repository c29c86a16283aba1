"""grpo_kit.machinery.harness: lm-evaluation-harness's GSM8K tasks on local data, wired through `grpo-kit eval --harness`.

lm-eval is an optional extra (`pip install grpo-kit[harness]`); the tests that run it are skipped without it.
"""

from __future__ import annotations

import builtins
import json

import pytest

from grpo_kit.cli import main
from grpo_kit.data import load_gsm8k
from grpo_kit.errors import GrpoKitError
from grpo_kit.machinery import harness

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


def test_protocol_sentence_names_task_n_and_budget():
    text = harness.harness_protocol("gsm8k", n=50, max_new_tokens=128, version="9.9")
    assert "lm-evaluation-harness 9.9 task gsm8k" in text and "n=50" in text and "max_gen_toks=128" in text
    assert "'#### N'" in text and "train split" in text


def test_unknown_task_is_refused_with_the_choices():
    with pytest.raises(GrpoKitError, match="gsm8k, gsm8k_cot"):
        harness.check_task("gsm8k_zeroshot")


def test_missing_lm_eval_names_the_extra(monkeypatch):
    real_import = builtins.__import__

    def no_lm_eval(name, *args, **kwargs):
        if name == "lm_eval" or name.startswith("lm_eval."):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_lm_eval)
    with pytest.raises(GrpoKitError, match=r"grpo-kit\[harness\]"):
        harness._import_lm_eval()


def test_questions_are_written_as_gsm8k_json_lines(tmp_path, gsm8k_file):
    dataset = load_gsm8k(str(gsm8k_file), split="test")
    written = harness.write_questions(dataset, tmp_path / "out.jsonl").read_text(encoding="utf-8").splitlines()
    assert [json.loads(line) for line in written] == [
        {"question": row["question"], "answer": row["answer"].split("#### ")[1]} for row in ROWS
    ]


def test_scores_are_read_from_both_filters():
    results = {"results": {"gsm8k": {"exact_match,strict-match": 0.25, "exact_match,flexible-extract": 0.5}}}
    assert harness._scores(results, "gsm8k") == (0.25, 0.5)


# ------------------------------------------------------------------------------------------ with lm-eval installed


@pytest.fixture
def manager():
    pytest.importorskip("lm_eval")
    from pathlib import Path

    import lm_eval
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(Path(lm_eval.__file__).parent / "tasks" / "gsm8k"), include_defaults=False)


def test_task_config_reads_local_files_instead_of_the_hub(manager, gsm8k_file, tmp_path):
    config = harness.task_config("gsm8k_cot", manager, tmp_path / "test.jsonl", None)
    assert config["task"] == "gsm8k_cot" and config["dataset_path"] == "json" and config["dataset_name"] is None
    assert config["dataset_kwargs"] == {"data_files": {"test": str(tmp_path / "test.jsonl")}}
    assert config["num_fewshot"] == 8  # the published protocol is kept


def test_gsm8k_task_needs_the_train_split_for_its_examples(manager, gsm8k_file, tmp_path):
    with pytest.raises(GrpoKitError, match="--fewshot-data"):
        harness.task_config("gsm8k", manager, tmp_path / "test.jsonl", None)
    with pytest.raises(GrpoKitError, match="not found"):
        harness.task_config("gsm8k", manager, tmp_path / "test.jsonl", tmp_path / "missing.jsonl")
    config = harness.task_config("gsm8k", manager, tmp_path / "test.jsonl", gsm8k_file)
    assert config["dataset_kwargs"]["data_files"] == {"test": str(tmp_path / "test.jsonl"), "train": str(gsm8k_file)}


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


def test_cli_refuses_an_unknown_task_before_loading_a_model(gsm8k_file, capsys):
    assert main(["eval", "--harness", "mmlu", "--data", str(gsm8k_file)]) == 2
    assert "Unknown harness task 'mmlu'" in capsys.readouterr().err


def test_cli_refuses_maj_with_the_harness(gsm8k_file, capsys):
    assert main(["eval", "--harness", "gsm8k_cot", "--maj", "4", "--data", str(gsm8k_file)]) == 2
    assert "Leave out --maj" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("adapter", "compare", "expected"),
    [(None, False, {"base": None}), ("a", False, {"tuned": "a"}), ("a", True, {"base": None, "tuned": "a"})],
)
def test_runs_follow_the_kit_eval_naming(adapter, compare, expected, tmp_path):
    args = type("Args", (), {"adapter": adapter, "compare": compare})()
    runs = harness._runs(args)
    assert runs == expected
    names = {name: harness._out_path(tmp_path / "h.json", name, runs).name for name in runs}
    assert names == (
        {"base": "h.json"} if adapter is None else {"tuned": "h.json", **({"base": "h-base.json"} if compare else {})}
    )
