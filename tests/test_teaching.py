"""Notebook 02's toy GRPO code, tested as the learner reads it: the notebook's code cells that define functions are
executed, then their functions are checked by hand and against TRL's own ``GRPOTrainer._compute_loss`` and advantage
lines; the notebook is saved with its outputs, which must be those of a fresh run."""

from __future__ import annotations

import ast
import math
import re
import types
from pathlib import Path

import matplotlib
import nbformat
import pytest
import torch

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "02_grpo_explained.ipynb"


def _defines_something(source: str) -> bool:
    return any(isinstance(node, (ast.FunctionDef, ast.ClassDef)) for node in ast.parse(source).body)


def notebook_namespace(every_cell: bool = False) -> types.ModuleType:
    """Notebook 02's code cells, run in order in one namespace: those that define functions, or ``every_cell``."""
    matplotlib.use("Agg")  # the cells draw their pictures; nothing is shown
    namespace = types.ModuleType("notebook_02")
    cells = [c.source for c in nbformat.read(NOTEBOOK, as_version=4).cells if c.cell_type == "code"]
    for source in cells if every_cell else filter(_defines_something, cells):
        exec(compile(source, str(NOTEBOOK), "exec"), namespace.__dict__)
    return namespace


@pytest.fixture(scope="module")
def nb():
    """The functions of notebook 02, from the cells that define them."""
    return notebook_namespace()


def test_group_advantages_by_hand(nb):
    # Group 1: rewards 3, 1 -> mean 2, unbiased std sqrt(2) -> +-1/sqrt(2). Group 2: all equal -> 0.
    adv = nb.group_advantages(torch.tensor([3.0, 1.0, 5.0, 5.0]), num_generations=2)
    assert torch.allclose(adv, torch.tensor([1, -1, 0, 0]) / (2**0.5 + nb.STD_EPS), atol=1e-6)


def test_group_advantages_match_trl_formula(nb):
    from trl.trainer.utils import nanstd

    torch.manual_seed(0)
    rewards, num_generations = torch.rand(12) * 3, 4
    grouped = rewards.view(-1, num_generations)
    # TRL 1.15, GRPOTrainer._generate_and_score_completions:
    mean = grouped.nanmean(dim=1).repeat_interleave(num_generations)
    std = nanstd(grouped, dim=1).repeat_interleave(num_generations)
    assert torch.allclose(nb.group_advantages(rewards, num_generations), (rewards - mean) / (std + 1e-4), atol=1e-6)
    batch = (rewards - mean) / (nanstd(rewards) + 1e-4)
    assert torch.allclose(nb.group_advantages(rewards, num_generations, "batch"), batch, atol=1e-6)
    assert torch.allclose(nb.group_advantages(rewards, num_generations, "none"), rewards - mean, atol=1e-6)


def test_advantages_sum_to_zero_per_group_and_keep_reward_order(nb):
    adv = nb.group_advantages(torch.tensor([0.0, 2.0, 1.0, 0.5, 0.5, 3.0]), num_generations=3).view(2, 3)
    assert torch.allclose(adv.sum(dim=1), torch.zeros(2), atol=1e-5)
    assert adv[0].argsort().tolist() == [0, 2, 1]


def test_bad_groups_and_scale_raise(nb):
    with pytest.raises(ValueError, match="multiple of num_generations"):
        nb.group_advantages(torch.ones(5), num_generations=2)
    with pytest.raises(ValueError, match="at least 2"):
        nb.group_advantages(torch.ones(4), num_generations=1)
    with pytest.raises(ValueError, match="scale_rewards"):
        nb.group_advantages(torch.ones(4), num_generations=2, scale_rewards="global")


def test_zero_std_fraction_counts_equal_groups(nb):
    assert nb.zero_std_fraction(torch.tensor([1.0, 1.0, 0.0, 1.0]), 2) == 0.5
    assert nb.zero_std_fraction(torch.zeros(8), 4) == 1.0
    assert nb.zero_std_fraction(torch.arange(8.0), 4) == 0.0


def test_k3_is_zero_when_equal_and_positive_otherwise(nb):
    logps = torch.log(torch.tensor([0.1, 0.5, 0.9]))
    assert torch.allclose(nb.k3_kl(logps, logps), torch.zeros(3))
    assert (nb.k3_kl(logps, logps - 0.3) > 0).all() and (nb.k3_kl(logps, logps + 0.3) > 0).all()


def test_k3_mean_estimates_exact_kl(nb):
    policy, reference = torch.tensor([0.6, 0.3, 0.1]), torch.tensor([0.3, 0.3, 0.4])
    tokens = torch.multinomial(policy, 200_000, replacement=True, generator=torch.Generator().manual_seed(0))
    estimate = nb.k3_kl(policy.log()[tokens], reference.log()[tokens]).mean().item()
    assert nb.exact_kl(policy, reference) == pytest.approx(0.2773, abs=1e-3)
    assert estimate == pytest.approx(nb.exact_kl(policy, reference), rel=0.02)


def test_clipping_stops_the_gradient_outside_the_trust_region(nb):
    logps = torch.tensor([[0.5, 0.05]], requires_grad=True)  # ratio e^0.5 = 1.65 is clipped, e^0.05 = 1.05 is not
    nb.clipped_surrogate(logps, torch.zeros(1, 2), torch.tensor([1.0])).sum().backward()
    assert logps.grad[0, 0] == 0
    assert logps.grad[0, 1] < 0  # minimising the loss raises the log-probability of a positive-advantage token


def test_aggregate_normalisations(nb):
    loss = torch.tensor([[2.0, 2.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    assert nb.aggregate(loss, mask, "grpo").item() == pytest.approx((2 + 1) / 2)
    assert nb.aggregate(loss, mask, "bnpo").item() == pytest.approx(8 / 6)
    assert nb.aggregate(loss, mask, "dapo").item() == pytest.approx(8 / 6)
    assert nb.aggregate(loss, mask, "dr_grpo", max_completion_length=10).item() == pytest.approx(8 / 20)
    with pytest.raises(ValueError, match="max_completion_length"):
        nb.aggregate(loss, mask, "dr_grpo")
    with pytest.raises(ValueError, match="loss_type"):
        nb.aggregate(loss, mask, "ppo")


def test_accumulate_dapo_is_the_global_token_mean(nb):
    losses = [torch.tensor([[1.0, 1.0, 1.0]]), torch.tensor([[4.0, 0.0, 0.0]])]
    masks = [torch.tensor([[1.0, 1.0, 1.0]]), torch.tensor([[1.0, 0.0, 0.0]])]
    assert nb.accumulate(losses, masks, "dapo").item() == pytest.approx(7 / 4)
    assert nb.accumulate(losses, masks, "bnpo").item() == pytest.approx((1 + 4) / 2)
    assert nb.accumulate(losses, masks, "grpo").item() == pytest.approx((1 + 4) / 2)


def test_token_weights_show_the_grpo_length_bias(nb):
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    grpo = nb.token_weights(mask, "grpo")
    assert grpo[0, 0] == pytest.approx(2 * grpo[1, 0].item()) and grpo[0, 2] == 0
    for loss_type in ("bnpo", "dapo", "dr_grpo"):
        real = nb.token_weights(mask, loss_type, max_completion_length=4)[mask.bool()]
        assert torch.allclose(real, real[0].expand_as(real)), loss_type


def _batch(seed: int):
    torch.manual_seed(seed)
    batch, tokens = 4, 6
    logps = torch.randn(batch, tokens) * 0.3 - 1.0
    mask = (torch.arange(tokens) < torch.tensor([[6], [2], [4], [1]])).float()
    return logps, mask, torch.tensor([1.0, -1.0, 0.5, -0.5])


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "bnpo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_grpo_loss_matches_trl_compute_loss_with_trls_defaults(nb, loss_type, beta):
    logps, mask, advantages = _batch(1)
    old = logps + 0.3 * torch.randn_like(logps)  # off-policy enough that some ratios are clipped
    kwargs = {"beta": beta, "ref_logps": logps + 0.3 * torch.randn_like(logps), "max_completion_length": 8}
    ours = nb.grpo_loss(logps, old, advantages, mask, loss_type, **kwargs).item()
    assert ours == pytest.approx(nb.trl_loss(logps, old, advantages, mask, loss_type, **kwargs), abs=1e-6)


def test_the_check_sees_trls_kl_bias_correction(nb):
    """With beta > 0 off-policy, leaving out TRL's default use_bias_correction_kl changes the loss: the check would
    fail; TRL with the correction switched off agrees with ours without it."""
    logps, mask, advantages = _batch(3)
    old, ref = logps + 0.3 * torch.randn_like(logps), logps + 0.3 * torch.randn_like(logps)
    kwargs = {"beta": 0.04, "ref_logps": ref, "max_completion_length": 8}
    trl_default = nb.trl_loss(logps, old, advantages, mask, "dapo", **kwargs)
    without = nb.grpo_loss(logps, old, advantages, mask, "dapo", bias_correction_kl=False, **kwargs).item()
    assert abs(without - trl_default) > 1e-5
    trl_without = nb.trl_loss(logps, old, advantages, mask, "dapo", use_bias_correction_kl=False, **kwargs)
    assert without == pytest.approx(trl_without, abs=1e-6)


@pytest.mark.parametrize("mode", ["sequence_mask", "sequence_truncate", "token_mask", "token_truncate"])
@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "bnpo"])
def test_vllm_importance_weight_matches_trl(nb, loss_type, mode):
    logps, mask, advantages = _batch(2)
    sampling = logps + 0.6 * torch.randn_like(logps)  # vLLM's probabilities differ from the trainer's
    ratio = nb.vllm_is_ratio(logps, sampling, mask, mode=mode, clip_max=1.5, clip_min=0.7)
    args = {"beta": 0.04, "ref_logps": logps + 0.1, "max_completion_length": 8}
    ours = nb.grpo_loss(logps, logps, advantages, mask, loss_type, is_ratio=ratio, **args).item()
    assert ours == pytest.approx(
        nb.trl_loss(logps, logps, advantages, mask, loss_type, is_ratio=ratio, **args), abs=1e-6
    )
    assert ours != pytest.approx(nb.grpo_loss(logps, logps, advantages, mask, loss_type, **args).item(), abs=1e-4)


def test_vllm_importance_weight_modes(nb):
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    trainer = torch.tensor([[0.0, 0.0, 9.0]])  # the padded token's difference must not count
    sampling = torch.tensor([[-0.5, -1.0, 0.0]])  # per-token log-weights 0.5 and 1.0; 1.5 per sequence
    assert nb.vllm_is_ratio(trainer, sampling, mask, "sequence_truncate").item() == pytest.approx(3.0)  # e^1.5 > 3
    assert nb.vllm_is_ratio(trainer, sampling, mask, "sequence_mask", clip_max=5.0).item() == pytest.approx(
        4.4817, abs=1e-3
    )
    token = nb.vllm_is_ratio(trainer, sampling, mask, "token_mask", clip_max=2.0).tolist()[0][:2]
    assert token == pytest.approx([1.6487, 0.0], abs=1e-3)
    with pytest.raises(ValueError, match="importance-sampling mode"):
        nb.vllm_is_ratio(trainer, sampling, mask, "token_clip")


def test_grpo_loss_with_a_kl_needs_the_reference(nb):
    logps, mask, advantages = _batch(4)
    with pytest.raises(ValueError, match="ref_logps"):
        nb.grpo_loss(logps, logps, advantages, mask, beta=0.1)


def test_pictures_are_saved(nb, tmp_path):
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5])
    nb.plot_advantages(rewards, nb.group_advantages(rewards, 2), 2).savefig(tmp_path / "adv.png")
    mask = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    weights = {name: nb.token_weights(mask, name, max_completion_length=2) for name in nb.LOSS_TYPES}
    nb.plot_token_weights(weights, mask).savefig(tmp_path / "weights.png")
    for png in (tmp_path / "adv.png", tmp_path / "weights.png"):
        assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 5_000


def trl_advantage_lines():
    """TRL's own code, taken from the source of ``GRPOTrainer._generate_and_score_completions``: the lines that turn
    the rewards into advantages and ``is_std_zero`` (for ``frac_reward_zero_std``), for the default aggregation."""
    import inspect
    import textwrap

    from trl import GRPOTrainer

    source = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    start = source.index('if self.multi_objective_aggregation == "sum_then_normalize":')
    end = source.index('elif self.multi_objective_aggregation == "normalize_then_sum":')
    block = textwrap.dedent(source[start:end].split("\n", 1)[1])  # the body of that `if`
    return compile(block, "trl/trainer/grpo_trainer.py", "exec")


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_group_advantages_and_zero_std_share_are_trls_own(nb, scale_rewards):
    """TRL's lines run on the notebook's rewards (section 1's, plus a flat group) give group_advantages's values."""
    from trl.trainer.utils import nanstd

    rewards = torch.tensor([2.0, 0.0, 1.0, 1.0, 0.5, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    trainer = types.SimpleNamespace(scale_rewards=scale_rewards, reward_weights=torch.tensor([1.0]))
    scope = {
        "self": trainer,
        "torch": torch,
        "nanstd": nanstd,
        "num_generations": 4,
        "device": "cpu",
        "rewards_per_func": rewards.unsqueeze(1),
        "unscorable_mask": torch.zeros(12, dtype=torch.bool),
    }
    exec(trl_advantage_lines(), scope)
    assert torch.allclose(nb.group_advantages(rewards, 4, scale_rewards), scope["advantages"], atol=1e-6)
    assert scope["is_std_zero"].float().mean().item() == pytest.approx(
        nb.zero_std_fraction(rewards, 4) if scale_rewards != "batch" else 0.0
    )


def test_epsilon_high_lets_a_good_token_rise_further(nb):
    logps = torch.tensor([[0.22, 0.3]], requires_grad=True)  # ratios 1.25 and 1.35: above 1.2, one below 1.28
    nb.clipped_surrogate(logps, torch.zeros(1, 2), torch.tensor([1.0]), epsilon_high=0.28).sum().backward()
    assert logps.grad[0, 0] < 0 and logps.grad[0, 1] == 0
    low = torch.tensor([[-0.25]], requires_grad=True)  # ratio 0.78, a bad token: the lower bound is still 0.2
    nb.clipped_surrogate(low, torch.zeros(1, 1), torch.tensor([-1.0]), epsilon_high=0.28).sum().backward()
    assert low.grad[0, 0] == 0


#: Section 8's losses: (loss_type, the notebook's options, TRL's GRPOConfig fields for the same loss).
FAMILY = [
    ("cispo", {"epsilon_high": 5.0}, {"epsilon_high": 5.0}),
    ("sapo", {}, {}),
    ("grpo", {"level": "sequence"}, {"importance_sampling_level": "sequence"}),  # GSPO
    ("luspo", {"level": "sequence"}, {"importance_sampling_level": "sequence"}),
    ("vespo", {}, {}),
    ("dapo", {"delta": 1.2}, {"delta": 1.2}),
]


def _trls_loss_and_gradient(nb, logps, old, advantages, mask, loss_type, entropies=None, **config):
    """TRL's _compute_loss on one micro-batch, and its gradient with respect to the log-probabilities."""
    import tempfile

    from trl import GRPOConfig, GRPOTrainer

    logps = logps.clone().requires_grad_()
    with tempfile.TemporaryDirectory() as folder:
        args = GRPOConfig(output_dir=folder, bf16=False, loss_type=loss_type, max_completion_length=8, **config)
    inputs = {
        "prompt_ids": torch.zeros(len(mask), 1, dtype=torch.long),
        "prompt_mask": torch.ones(len(mask), 1, dtype=torch.long),
        "completion_ids": torch.zeros_like(mask, dtype=torch.long),
        "completion_mask": mask,
        "advantages": advantages,
        "old_per_token_logps": old,
        "num_items_in_batch": mask.sum(),
    }
    loss = GRPOTrainer._compute_loss(nb.TrlLossStandIn(args, logps, entropies), None, inputs)
    loss.backward()
    return loss.item(), logps.grad


@pytest.mark.parametrize(("loss_type", "ours", "trls"), FAMILY)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_rest_of_trls_loss_family_matches_trl_in_value_and_gradient(nb, loss_type, ours, trls, seed):
    logps, mask, advantages = _batch(seed)
    old = logps + 0.3 * torch.randn_like(logps)  # off-policy enough that clipping and gating act
    theirs, their_grad = _trls_loss_and_gradient(nb, logps, old, advantages, mask, loss_type, **trls)
    logps = logps.clone().requires_grad_()
    loss = nb.family_loss(nb.family_per_token(logps, old, advantages, mask, loss_type, **ours), mask, loss_type)
    loss.backward()
    assert loss.item() == pytest.approx(theirs, abs=1e-6)
    assert torch.allclose(logps.grad, their_grad, atol=1e-6)  # what a step moves, not only the number logged


@pytest.mark.parametrize("rho", [0.2, 0.5, 1.0])
def test_top_entropy_quantile_keeps_trls_tokens(nb, rho):
    logps, mask, advantages = _batch(4)
    old, entropies = logps + 0.3 * torch.randn_like(logps), torch.rand_like(logps) * 2
    keep = nb.high_entropy_mask(entropies, mask, rho)
    theirs, their_grad = _trls_loss_and_gradient(
        nb, logps, old, advantages, mask, "dapo", entropies=entropies, top_entropy_quantile=rho
    )
    logps = logps.clone().requires_grad_()
    loss = nb.family_loss(nb.family_per_token(logps, old, advantages, mask, "dapo"), mask, "dapo", keep=keep)
    loss.backward()
    assert loss.item() == pytest.approx(theirs, abs=1e-6) and torch.allclose(logps.grad, their_grad, atol=1e-6)
    assert int(keep.sum()) == (int(mask.sum()) if rho == 1.0 else pytest.approx(rho * mask.sum(), abs=1.5))


def test_the_family_differs_where_its_papers_say(nb):
    """CISPO keeps a gradient on tokens PPO's clip zeroes; GSPO gives a completion one ratio; delta caps a negative
    advantage's unclipped ratio."""
    logps = torch.tensor([[0.5, 0.0]], requires_grad=True)  # token 0's ratio e^0.5 = 1.65: clipped for A > 0
    old, adv, mask = torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2)
    nb.family_loss(nb.family_per_token(logps, old, adv, mask, "dapo"), mask, "dapo").backward()
    assert logps.grad[0, 0] == 0
    logps.grad = None
    nb.family_loss(nb.family_per_token(logps, old, adv, mask, "cispo", epsilon_high=5.0), mask, "cispo").backward()
    assert logps.grad[0, 0] < 0
    assert nb.sequence_ratio(logps, old, mask).item() == pytest.approx(math.exp(0.25))
    negative = nb.family_per_token(
        torch.tensor([[1.0]]), torch.zeros(1, 1), torch.tensor([-1.0]), torch.ones(1, 1), "dapo", delta=1.5
    )
    assert negative.item() == pytest.approx(1.5)  # -min(e * -1, 1.2 * -1) = e, capped at delta


def _t4_batch(seed: int):
    """One question's G=4 answers as the T4 recipe trains them: uneven lengths, moved since sampling, vLLM-sampled."""
    from grpo_kit.config import load_recipe

    t4 = load_recipe("t4-16gb").grpo
    logps, mask, _ = _batch(seed)
    old = logps + 0.3 * torch.randn_like(logps)
    sampled = old + 0.3 * torch.randn_like(logps)
    return t4, logps, old, mask, sampled


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo", "bnpo"])
@pytest.mark.parametrize("seed", [5, 6])
def test_grpo_loss_matches_trl_at_the_t4_recipes_settings(nb, loss_type, seed):
    """epsilon_high 0.28, beta 0, the vLLM factor on and 4 accumulation steps, read from recipes/t4-16gb.yaml."""
    t4, logps, old, mask, sampled = _t4_batch(seed)
    assert (t4.epsilon_high, t4.beta, t4.gradient_accumulation_steps) == (0.28, 0.0, 4)
    assert t4.use_vllm and t4.vllm_importance_sampling_correction
    ratio = nb.vllm_is_ratio(
        old,
        sampled,
        mask,
        t4.vllm_importance_sampling_mode,
        t4.vllm_importance_sampling_clip_max,
        t4.vllm_importance_sampling_clip_min,
    )
    advantages = nb.group_advantages(torch.tensor([1.0, 0.0, 0.25, 0.5]), t4.num_generations)
    args = {
        "beta": t4.beta,
        "epsilon": t4.epsilon,
        "epsilon_high": t4.epsilon_high,
        "max_completion_length": 8,
        "is_ratio": ratio,
    }
    steps = t4.gradient_accumulation_steps
    ours = nb.grpo_loss(logps, old, advantages, mask, loss_type, accumulation_steps=steps, **args).item()
    theirs = nb.trl_loss(logps, old, advantages, mask, loss_type, gradient_accumulation_steps=steps, **args)
    assert ours == pytest.approx(theirs, abs=1e-6)


def test_the_t4_check_sees_epsilon_high_and_the_accumulation(nb):
    """Symmetric clipping, or TRL's loss without accumulation, gives another value: the check would fail."""
    t4, logps, old, mask, _ = _t4_batch(5)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    args = {"epsilon": 0.2, "epsilon_high": 0.28}
    ours = nb.grpo_loss(logps, old, advantages, mask, "bnpo", accumulation_steps=4, **args).item()
    assert ours == pytest.approx(
        nb.trl_loss(logps, old, advantages, mask, "bnpo", gradient_accumulation_steps=4, **args), abs=1e-6
    )
    assert abs(ours - nb.trl_loss(logps, old, advantages, mask, "bnpo", **args)) > 1e-4
    assert abs(ours - nb.grpo_loss(logps, old, advantages, mask, "bnpo", accumulation_steps=4).item()) > 1e-4


def test_the_semantic_entropy_worked_out_by_hand_is_the_kits_metric(nb):
    import random

    from grpo_kit.rewards import REWARDS

    rng = random.Random(0)
    for _ in range(300):
        numbers = [rng.choice(["1", "2", "3", "40", None]) for _ in range(rng.randint(1, 8))]  # None: no number
        texts = [f"<think>x</think><answer>{n}</answer>" if n else "I am not sure." for n in numbers]
        assert nb.group_entropy(numbers) == pytest.approx(REWARDS["semantic_entropy"](texts)[0], abs=1e-12)


def fresh_run(path: Path = NOTEBOOK):
    """The notebook run top to bottom in a new kernel. Its stderr (library warnings, which differ between machines)
    is left out, and no timings are recorded, so what a run prints is the same on every machine."""
    from nbclient import NotebookClient

    notebook = nbformat.read(path, as_version=4)
    NotebookClient(
        notebook,
        timeout=600,
        kernel_name="python3",
        record_timing=False,
        resources={"metadata": {"path": str(path.parent)}},
    ).execute()
    for cell in (cell for cell in notebook.cells if cell.cell_type == "code"):
        outputs = []
        for output in cell.outputs:
            if output.get("name") == "stderr":
                continue
            if output.get("name") == "stdout" and outputs and outputs[-1].get("name") == "stdout":
                outputs[-1]["text"] += output["text"]  # the kernel cuts a cell's prints into chunks as timing falls
            else:
                outputs.append(output)
        cell.outputs = outputs
    return notebook


def text_outputs(notebook) -> list[list[str]]:
    """What each code cell printed, and the text form of what it displayed (pictures: their size and axes)."""
    return [
        [output.get("text") or output.get("data", {}).get("text/plain") for output in cell.outputs]
        for cell in notebook.cells
        if cell.cell_type == "code"
    ]


#: How far a number in a saved output may be from a fresh run's: float32's last bits differ between CPUs (vector
#: width, fused multiply-add, summation order), so a number printed in full differs in its 7th significant digit, and
#: one printed to k decimals may flip its last digit. Text is compared exactly.
REL_TOLERANCE, ABS_TOLERANCE = 1e-5, 1e-6
_NUMBER = re.compile(r"-?\d+(?:\.(\d+))?(?:e[-+]?\d+)?")


def same_output(saved: str | None, fresh: str | None) -> bool:
    """``saved`` and ``fresh`` are the same text with the same numbers, each number within ``REL_TOLERANCE`` of
    the other (``ABS_TOLERANCE`` near zero) plus one unit of its last printed decimal.

    >>> same_output("ratio [2.886979341506958]", "ratio [2.886979103088379]"), same_output("-0.890484", "-0.890485")
    (True, True)
    >>> same_output("loss 0.25", "loss 0.28"), same_output("900x300", "901x300"), same_output("grpo 1", "dapo 1")
    (False, False, False)
    """
    if saved is None or fresh is None:
        return saved == fresh
    a, b = list(_NUMBER.finditer(saved)), list(_NUMBER.finditer(fresh))
    if len(a) != len(b) or _NUMBER.sub("#", saved) != _NUMBER.sub("#", fresh):
        return False
    for x, y in zip(a, b, strict=True):
        digit = max(10.0 ** -len(m[1]) if m[1] else 0.0 for m in (x, y))  # the last printed decimal may round
        u, v = float(x[0]), float(y[0])
        if abs(u - v) > max(REL_TOLERANCE * max(abs(u), abs(v)), ABS_TOLERANCE) + digit:
            return False
    return True


@pytest.mark.saved_outputs
def test_the_saved_outputs_are_those_of_a_fresh_run():
    """Notebook 02 is committed with its outputs, for readers on GitHub; a change to its code or to TRL that changes a
    number fails here, a CPU that rounds float32 differently does not (``same_output``; `make test` runs this test
    under a second ``ATEN_CPU_CAPABILITY`` too). To save a fresh run: ``.venv/bin/python tests/test_teaching.py``."""
    committed = text_outputs(nbformat.read(NOTEBOOK, as_version=4))
    assert any(committed), "notebook 02 is saved without its outputs: python tests/test_teaching.py saves them"
    fresh = text_outputs(fresh_run())
    assert [len(cell) for cell in committed] == [len(cell) for cell in fresh]
    different = [
        (saved, now)
        for cell, new in zip(committed, fresh, strict=True)
        for saved, now in zip(cell, new, strict=True)
        if not same_output(saved, now)
    ]
    assert not different, different[0]


if __name__ == "__main__":
    nbformat.write(fresh_run(), NOTEBOOK)
