"""Notebook 06's GRPO, written from scratch in its cells, against TRL's own trainer.

The notebook's cells run in one namespace, as the learner runs them, except the three listed in ``SKIPPED``, with the
recipe CI gives the notebook (tests/smoke.yaml); then its ``same_batch_check`` (one sampled batch, one update taken
on it, then the next update's loss and LoRA gradients by the notebook's code and by
``trl.GRPOTrainer.compute_loss``) runs for the notebook's other loss types at the T4 recipe's loss settings on the
smallest batch that accumulates (a group of 2 in 2 micro-batches of 1: ``ACCUMULATING``); a loss with a known mistake
must fail it. The check at the recipe's own values and at the T4 settings (loss type dapo, 4 micro-batches of 1), with
its count of micro-batches and of clipped tokens, is asserted by the notebook's last cell, which nbmake runs in
``make test`` with the same recipe, after training through the notebook top to bottom.
"""

from __future__ import annotations

import math
import os
import types
from pathlib import Path

import nbformat
import pytest

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "06_grpo_from_scratch.ipynb"
SMOKE = Path(__file__).resolve().with_name("smoke.yaml")
#: Cells not run here, by id: what they do is covered elsewhere.
SKIPPED = {
    "06-02": "the Colab install cell (tests/test_notebooks.py)",
    "06-17": "the training run (nbmake runs the whole notebook)",
    "06-21": "the check at the recipe's values and the T4 settings (nbmake runs and asserts it)",
}
#: The T4 recipe's accumulation of micro-batches of 1 (4 there), on a group of 2: what TRL's accumulation does to a
#: loss shows with two micro-batches, and each sampled completion costs a CPU several forward and backward passes.
ACCUMULATING = {"num_generations": 2, "per_device_train_batch_size": 1, "gradient_accumulation_steps": 2}


@pytest.fixture(scope="module")
def nb():
    """The notebook's model, data, rewards and functions, after its cells ran (LoRA as initialised, not trained)."""
    namespace = types.ModuleType("notebook_06")
    cells = nbformat.read(NOTEBOOK, as_version=4).cells
    assert SKIPPED.keys() <= {cell.id for cell in cells}, "a skipped cell's id is gone: update SKIPPED"
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(os.environ, "GRPO_KIT_RECIPE", str(SMOKE))  # what nbmake runs it with: 32 new tokens
        for cell in cells:
            if cell.cell_type == "code" and cell.id not in SKIPPED:
                exec(compile(cell.source, str(NOTEBOOK), "exec"), namespace.__dict__)
    assert namespace.recipe.name == "smoke"
    return namespace


@pytest.fixture(scope="module")
def rows(nb):
    """The notebook's questions with their prompts written without worked examples, as its own check asks them: the
    check is about the loss, and a prompt of ~60 tokens instead of ~340 (the cpu recipe's three worked examples) makes
    each forward pass several times shorter on a CPU."""
    kit = nb.recipe.kit
    return nb.format_for_grpo(nb.questions, nb.tokenizer, few_shot=0, prefill=kit.prefill)[0]


def check(nb, rows, settings, question: int = 0):
    return nb.same_batch_check(nb.model, settings, rows[question])


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo"])
def test_the_other_loss_types_are_trls_with_accumulation(nb, rows, loss_type, tmp_path, monkeypatch):
    """At the T4 loss settings, accumulated (``ACCUMULATING``): TRL divides these by the accumulation steps, as the
    notebook does. The trainers it builds write nothing where it runs (their ``output_dir`` is the recipe's temporary
    one)."""
    monkeypatch.chdir(tmp_path)
    settings = nb.recipe.replace(**{**nb.T4_LOSS, **ACCUMULATING, "loss_type": loss_type}).grpo
    ours, theirs, error, _ = check(nb, rows, settings, question=1)
    assert nb.agrees(ours, theirs, error), (ours, theirs, error)
    assert list(tmp_path.iterdir()) == []


def ignores_old_logps(loss):
    return lambda logps, old_logps, *args: loss(logps, logps.detach(), *args)


def divides_by_its_own_tokens(loss):
    """DAPO's sum divided by the micro-batch's tokens, not the generation batch's: the error TRL's
    ``num_items_in_batch`` exists to avoid."""
    return lambda logps, old_logps, advantages, mask, cfg, num_items: loss(
        logps, old_logps, advantages, mask, cfg, mask.sum()
    )


@pytest.mark.parametrize("mistake", [ignores_old_logps, divides_by_its_own_tokens])
def test_a_wrong_loss_fails_the_check(nb, rows, monkeypatch, mistake):
    monkeypatch.setattr(nb, "grpo_loss", mistake(nb.grpo_loss))
    settings = nb.recipe.replace(**{**nb.T4_LOSS, **ACCUMULATING}).grpo
    ours, theirs, error, _ = check(nb, rows, settings, question=2)
    assert math.isfinite(error) and any(ours), "the batch has gradients to compare"
    assert not nb.agrees(ours, theirs, error), (ours, theirs, error)
