"""Notebook 06's GRPO, written from scratch in its cells, against TRL's own trainer.

The notebook runs here top to bottom, every cell in one namespace as the learner runs them, with the recipe CI gives
the notebooks (tests/smoke.yaml): its training loop, then its last cell's check at the recipe's values and at the T4
settings (loss type dapo, 4 micro-batches of 1), which asserts the agreement, the count of micro-batches and of clipped
tokens. nbmake leaves this notebook to this module (tests/conftest.py), so it runs once per ``make test``. Then, on the
same model, its ``same_batch_check`` (one sampled batch, one update taken on it, then the next update's loss and LoRA
gradients by the notebook's code and by ``trl.GRPOTrainer.compute_loss``) runs for the notebook's other loss types at
the T4 recipe's loss settings on the smallest batch that accumulates (a group of 2 in 2 micro-batches of 1:
``ACCUMULATING``); a loss with a known mistake must fail it.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import re
import types
from pathlib import Path

import nbformat
import pytest

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "06_grpo_from_scratch.ipynb"
SMOKE = Path(__file__).resolve().with_name("smoke.yaml")
#: The T4 recipe's accumulation of micro-batches of 1 (4 there), on a group of 2: what TRL's accumulation does to a
#: loss shows with two micro-batches, and each sampled completion costs a CPU several forward and backward passes.
ACCUMULATING = {"num_generations": 2, "per_device_train_batch_size": 1, "gradient_accumulation_steps": 2}
pytestmark = pytest.mark.slow  # the notebook trains


@pytest.fixture(scope="module")
def nb():
    """The notebook's model (trained by its loop), data, rewards and functions, after every cell ran; a cell that
    raises or whose assertion fails fails every test here."""
    namespace = types.ModuleType("notebook_06")
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(io.StringIO()) as printed:
        patch.setitem(os.environ, "GRPO_KIT_RECIPE", str(SMOKE))  # what the other notebooks run with: 32 new tokens
        for cell in nbformat.read(NOTEBOOK, as_version=4).cells:
            if cell.cell_type == "code":
                exec(compile(cell.source, str(NOTEBOOK), "exec"), namespace.__dict__)
    assert namespace.recipe.name == "smoke"
    namespace.printed = printed.getvalue()  # what the learner reads under the cells
    return namespace


def test_the_notebook_trains_and_checks_its_loss_against_trls_for_both_settings(nb):
    """What its cells printed: a row of the training table per step, the held-out format rate before and after, and
    the last cell's check for each setting (its assertions ran as the fixture ran the cell)."""
    steps = [
        line.split()[0] for line in nb.printed.splitlines() if re.fullmatch(r" *\d+ +-?[\d.]+ +\d+% +[-+][\d.]+", line)
    ]
    assert steps == [str(step) for step in range(1, nb.cfg.max_steps + 1)]
    assert f"format rate on {len(nb.held_out)} held-out questions (greedy): {nb.before:.1%} before" in nb.printed
    for label in ("cpu recipe", "T4 loss settings"):
        assert f"{label}: loss_type=" in nb.printed and label in nb.settings


@pytest.fixture(scope="module")
def rows(nb):
    """The notebook's questions with their prompts written without worked examples, as its own check asks them: the
    check is about the loss, and a prompt of ~60 tokens instead of ~340 (the cpu recipe's three worked examples) makes
    each forward pass several times shorter on a CPU."""
    kit = nb.recipe.kit
    return nb.format_for_grpo(nb.questions, nb.tokenizer, few_shot=0, prefill=kit.prefill)[0]


def check(nb, rows, question: int, **loss):
    """The notebook's check on ``rows[question]`` at the T4 loss settings, accumulated (``ACCUMULATING``), with
    ``loss`` changed."""
    settings = nb.recipe.replace(**{**nb.T4_LOSS, **ACCUMULATING, **loss}).grpo
    return nb.same_batch_check(nb.model, settings, rows[question])


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo"])
def test_the_other_loss_types_are_trls_with_accumulation(nb, rows, loss_type, tmp_path, monkeypatch):
    """At the T4 loss settings, accumulated (``ACCUMULATING``): TRL divides these by the accumulation steps, as the
    notebook does. The trainers it builds write nothing where it runs (their ``output_dir`` is the recipe's temporary
    one)."""
    monkeypatch.chdir(tmp_path)
    ours, theirs, error, _ = check(nb, rows, 1, loss_type=loss_type)
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
    ours, theirs, error, _ = check(nb, rows, 2)
    assert math.isfinite(error) and any(ours), "the batch has gradients to compare"
    assert not nb.agrees(ours, theirs, error), (ours, theirs, error)
