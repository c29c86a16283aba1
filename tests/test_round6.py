"""Reliability round 6 beyond the fault table (tests/test_faults.py holds its CLI cases): what a SEED-GRPO run logs,
and notebook 00 with a learner's edits on a CPU (its settings cells run as in tests/test_gpu_path.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny_cli import tiny_recipe, varied

from grpo_kit.errors import GrpoKitError

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "00_train_grpo_colab.ipynb"


def test_seed_grpo_logs_what_each_reward_gave_and_what_trained_apart(tiny_model_dir, tmp_path, monkeypatch):
    """A tiny random model writes no number: every answer is a cluster of its own, semantic entropy 1, so at alpha 1
    what trains is exactly half of what the reward gave. metrics.jsonl and TRL's completions table keep the reward's
    own score under its name, the scaled one under seed_grpo/; the summary says which is which."""
    import trl

    from grpo_kit.train import train

    trainers, real_train = [], trl.GRPOTrainer.train
    monkeypatch.setattr(trl.GRPOTrainer, "train", lambda self, **kw: trainers.append(self) or real_train(self, **kw))
    recipe = tiny_recipe(
        tiny_model_dir,
        reward_funcs=[varied, "semantic_entropy"],
        reward_weights=[1.0, 0.0],
        seed_grpo_alpha=1.0,
        scale_rewards="none",
        log_completions=True,
    )
    result = train(recipe, data="sample", output_dir=tmp_path / "run")
    for row in result.history:
        assert row["semantic_entropy"] == 1.0
        assert row["reward"] == pytest.approx(row["reward/varied"], abs=1e-6)  # what the reward gave
        assert row["seed_grpo/reward"] == pytest.approx(row["reward"] / 2, abs=1e-6)  # what trained
        assert row["reward/seed_grpo/varied"] == pytest.approx(row["reward/varied"] / 2, abs=1e-6)
    table = trainers[0]._logs  # TRL's completions table: the reward's own column, and the scaled one
    assert table["extra"]["varied"] == pytest.approx([2 * s for s in table["rewards"]["seed_grpo/varied"]], abs=1e-6)
    assert "what the rewards gave; SEED-GRPO trained on them scaled" in result.summary()


def _cells() -> dict[str, str]:
    return {c["id"]: "".join(c["source"]) for c in json.loads(NOTEBOOK.read_text())["cells"]}


def _settings(monkeypatch, tmp_path, **edits) -> dict:
    """Notebook 00's settings cells on this CPU, with the learner's ``edits`` to the settings cell (c04)."""
    import grpo_kit.colab

    monkeypatch.setattr(grpo_kit.colab, "workspace", lambda: tmp_path)
    monkeypatch.delenv("GRPO_KIT_RECIPE", raising=False)
    cells, namespace = _cells(), {}
    exec(compile(cells["c04"], "c04", "exec"), namespace)
    namespace.update(edits)
    for cell in ("c04b", "c06"):
        exec(compile(cells[cell], cell, "exec"), namespace)
    return namespace


def test_notebook_00_on_a_cpu_says_what_it_replaces_and_keeps_what_it_can(monkeypatch, tmp_path, capsys):
    edited = _settings(
        monkeypatch,
        tmp_path,
        DATA="mine.jsonl",
        EVAL_QUESTIONS=3,
        FORMATS=("lora", "gguf"),
        CHANGES={"output_dir": str(tmp_path / "elsewhere")},
    )
    out = capsys.readouterr().out
    assert "DATA = 'mine.jsonl' is for a GPU run" in out and "gguf left out" in out
    assert (edited["DATA"], edited["EVAL_QUESTIONS"], edited["FORMATS"]) == ("sample", 3, ("lora",))
    assert edited["run_dir"] == tmp_path / "elsewhere" and edited["recipe"].grpo.output_dir == str(edited["run_dir"])
    plain = _settings(monkeypatch, tmp_path)  # nothing edited: the CPU's own choices, said in one line
    assert (plain["DATA"], plain["EVAL_QUESTIONS"], plain["FORMATS"]) == ("sample", 8, ("lora",))
    assert "DATA = 'sample', EVAL_QUESTIONS = 8, FORMATS = ('lora',)" in capsys.readouterr().out
    assert plain["run_dir"] == tmp_path / "runs" / "cpu-colab"


def test_notebook_00_errors_name_the_settings_cells_fix(monkeypatch, tmp_path, capsys):
    with pytest.raises(GrpoKitError, match="--set scale_rewards=none") as raised:
        _settings(monkeypatch, tmp_path, CHANGES={"seed_grpo_alpha": 1.0})
    shell = _settings(monkeypatch, tmp_path)["in_this_notebook"]  # what the kernel shows for a GrpoKitError
    capsys.readouterr()
    assert shell(None, GrpoKitError, raised.value, None) == []
    shown = capsys.readouterr().err
    assert 'CHANGES["scale_rewards"] = "none"' in shown and "--set" not in shown
