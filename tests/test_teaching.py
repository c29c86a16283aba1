"""grpo_kit.machinery.teaching: the toy GRPO computations of notebook 02, checked by hand and against TRL's own code."""

from __future__ import annotations

import pytest
import torch

from grpo_kit.errors import GrpoKitError
from grpo_kit.machinery import teaching
from grpo_kit.machinery.teaching import (
    LOSS_TYPES,
    accumulate,
    aggregate,
    clipped_surrogate,
    exact_kl,
    group_advantages,
    grpo_loss,
    k3_kl,
    token_weights,
    trl_loss,
    vllm_is_ratio,
    zero_std_fraction,
)


def test_group_advantages_by_hand():
    # Group 1: rewards 3, 1 -> mean 2, unbiased std sqrt(2) -> +-1/sqrt(2). Group 2: all equal -> 0.
    adv = group_advantages(torch.tensor([3.0, 1.0, 5.0, 5.0]), num_generations=2)
    expected = torch.tensor([1, -1, 0, 0]) / (2**0.5 + teaching.STD_EPS)
    assert torch.allclose(adv, expected, atol=1e-6)


def test_group_advantages_match_trl_formula():
    from trl.trainer.utils import nanstd

    torch.manual_seed(0)
    rewards = torch.rand(12) * 3
    num_generations = 4
    grouped = rewards.view(-1, num_generations)
    # TRL 1.15, GRPOTrainer._generate_and_score_completions, scale_rewards="group":
    mean = grouped.nanmean(dim=1).repeat_interleave(num_generations)
    std = nanstd(grouped, dim=1).repeat_interleave(num_generations)
    trl_adv = (rewards - mean) / (std + 1e-4)
    assert torch.allclose(group_advantages(rewards, num_generations), trl_adv, atol=1e-6)
    batch_adv = (rewards - mean) / (nanstd(rewards) + 1e-4)
    assert torch.allclose(group_advantages(rewards, num_generations, "batch"), batch_adv, atol=1e-6)
    assert torch.allclose(group_advantages(rewards, num_generations, "none"), rewards - mean, atol=1e-6)


def test_advantages_sum_to_zero_per_group_and_keep_reward_order():
    rewards = torch.tensor([0.0, 2.0, 1.0, 0.5, 0.5, 3.0])
    adv = group_advantages(rewards, num_generations=3).view(2, 3)
    assert torch.allclose(adv.sum(dim=1), torch.zeros(2), atol=1e-5)
    assert adv[0].argsort().tolist() == [0, 2, 1]


def test_bad_groups_and_scale_raise():
    with pytest.raises(GrpoKitError, match="multiple of num_generations"):
        group_advantages(torch.ones(5), num_generations=2)
    with pytest.raises(GrpoKitError, match="at least 2"):
        group_advantages(torch.ones(4), num_generations=1)
    with pytest.raises(GrpoKitError, match="scale_rewards"):
        group_advantages(torch.ones(4), num_generations=2, scale_rewards="global")


def test_zero_std_fraction_counts_equal_groups():
    assert zero_std_fraction(torch.tensor([1.0, 1.0, 0.0, 1.0]), 2) == 0.5
    assert zero_std_fraction(torch.zeros(8), 4) == 1.0
    assert zero_std_fraction(torch.arange(8.0), 4) == 0.0


def test_k3_is_zero_when_equal_and_positive_otherwise():
    logps = torch.log(torch.tensor([0.1, 0.5, 0.9]))
    assert torch.allclose(k3_kl(logps, logps), torch.zeros(3))
    assert (k3_kl(logps, logps - 0.3) > 0).all()
    assert (k3_kl(logps, logps + 0.3) > 0).all()


def test_k3_mean_estimates_exact_kl():
    policy = torch.tensor([0.6, 0.3, 0.1])
    reference = torch.tensor([0.3, 0.3, 0.4])
    generator = torch.Generator().manual_seed(0)
    tokens = torch.multinomial(policy, 200_000, replacement=True, generator=generator)
    estimate = k3_kl(policy.log()[tokens], reference.log()[tokens]).mean().item()
    assert exact_kl(policy, reference) == pytest.approx(0.2773, abs=1e-3)
    assert estimate == pytest.approx(exact_kl(policy, reference), rel=0.02)


def test_clipping_stops_the_gradient_outside_the_trust_region():
    old = torch.zeros(1, 2)
    logps = torch.tensor([[0.5, 0.05]], requires_grad=True)  # ratio e^0.5 = 1.65 is clipped, e^0.05 = 1.05 is not
    clipped_surrogate(logps, old, torch.tensor([1.0])).sum().backward()
    assert logps.grad[0, 0] == 0
    assert logps.grad[0, 1] < 0  # minimising the loss raises the log-probability of a positive-advantage token


def test_aggregate_normalisations():
    loss = torch.tensor([[2.0, 2.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    assert aggregate(loss, mask, "grpo").item() == pytest.approx((2 + 1) / 2)
    assert aggregate(loss, mask, "bnpo").item() == pytest.approx(8 / 6)
    assert aggregate(loss, mask, "dapo").item() == pytest.approx(8 / 6)
    assert aggregate(loss, mask, "dr_grpo", max_completion_length=10).item() == pytest.approx(8 / 20)
    with pytest.raises(GrpoKitError, match="max_completion_length"):
        aggregate(loss, mask, "dr_grpo")
    with pytest.raises(GrpoKitError, match="loss_type"):
        aggregate(loss, mask, "ppo")


def test_accumulate_dapo_is_the_global_token_mean():
    losses = [torch.tensor([[1.0, 1.0, 1.0]]), torch.tensor([[4.0, 0.0, 0.0]])]
    masks = [torch.tensor([[1.0, 1.0, 1.0]]), torch.tensor([[1.0, 0.0, 0.0]])]
    assert accumulate(losses, masks, "dapo").item() == pytest.approx(7 / 4)
    assert accumulate(losses, masks, "bnpo").item() == pytest.approx((1 + 4) / 2)
    assert accumulate(losses, masks, "grpo").item() == pytest.approx((1 + 4) / 2)


def test_token_weights_show_the_grpo_length_bias():
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    grpo = token_weights(mask, "grpo")
    assert grpo[0, 0] == pytest.approx(2 * grpo[1, 0].item())
    assert grpo[0, 2] == 0
    for loss_type in ("bnpo", "dapo", "dr_grpo"):
        weights = token_weights(mask, loss_type, max_completion_length=4)
        real = weights[mask.bool()]
        assert torch.allclose(real, real[0].expand_as(real)), loss_type


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_grpo_loss_matches_trl_compute_loss(loss_type, beta):
    torch.manual_seed(1)
    batch, tokens = 4, 6
    logps = torch.randn(batch, tokens) * 0.3 - 1.0
    old = logps + 0.3 * torch.randn(batch, tokens)  # off-policy enough that some ratios are clipped
    ref = logps + 0.3 * torch.randn(batch, tokens)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    mask = (torch.arange(tokens) < torch.tensor([[6], [2], [4], [1]])).float()
    kwargs = {"beta": beta, "ref_logps": ref, "max_completion_length": 8}
    ours = grpo_loss(logps, old, advantages, mask, loss_type, **kwargs).item()
    assert ours == pytest.approx(trl_loss(logps, old, advantages, mask, loss_type, **kwargs), abs=1e-6)


@pytest.mark.parametrize("mode", ["sequence_mask", "sequence_truncate", "token_mask", "token_truncate"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_vllm_importance_weight_matches_trl(loss_type, mode):
    torch.manual_seed(2)
    batch, tokens = 4, 6
    logps = torch.randn(batch, tokens) * 0.3 - 1.0
    sampling = logps + 0.6 * torch.randn(batch, tokens)  # vLLM's probabilities differ from the trainer's
    mask = (torch.arange(tokens) < torch.tensor([[6], [2], [4], [1]])).float()
    ratio = vllm_is_ratio(logps, sampling, mask, mode=mode, clip_max=1.5, clip_min=0.7)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    args = {"beta": 0.04, "ref_logps": logps + 0.1, "max_completion_length": 8, "is_ratio": ratio}
    ours = grpo_loss(logps, logps, advantages, mask, loss_type, **args).item()
    assert ours == pytest.approx(trl_loss(logps, logps, advantages, mask, loss_type, **args), abs=1e-6)
    assert ours != pytest.approx(grpo_loss(logps, logps, advantages, mask, loss_type, beta=0.04,
                                           ref_logps=logps + 0.1, max_completion_length=8).item(), abs=1e-4)


def test_vllm_importance_weight_modes():
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    trainer = torch.tensor([[0.0, 0.0, 9.0]])  # the padded token's difference must not count
    sampling = torch.tensor([[-0.5, -1.0, 0.0]])  # per-token log-weights 0.5 and 1.0; 1.5 per sequence
    assert vllm_is_ratio(trainer, sampling, mask, "sequence_truncate").item() == pytest.approx(3.0)  # e^1.5 > 3
    assert vllm_is_ratio(trainer, sampling, mask, "sequence_mask", clip_max=5.0).item() == pytest.approx(4.4817, abs=1e-3)
    assert vllm_is_ratio(trainer, sampling, mask, "token_mask", clip_max=2.0).tolist()[0][:2] == pytest.approx([1.6487, 0.0], abs=1e-3)
    with pytest.raises(GrpoKitError, match="importance-sampling mode"):
        vllm_is_ratio(trainer, sampling, mask, "token_clip")


def test_trl_loss_fails_loudly_when_inputs_are_missing():
    with pytest.raises(GrpoKitError, match="_compute_loss"):
        trl_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1), torch.ones(1, 2), beta=0.1, ref_logps=None)


def test_pictures_draw_without_a_display():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from grpo_kit.machinery.teaching import plot_advantages, plot_token_weights

    ax = plot_advantages(torch.tensor([1.0, 0.0, 0.5, 0.5]), num_generations=2, show=False)
    assert [len(bars) for bars in ax.containers] == [4, 4]  # a reward bar and an advantage bar per completion
    fig = plot_token_weights(torch.tensor([[1.0, 0.0], [1.0, 1.0]]), max_completion_length=2, show=False)
    assert [ax.get_title() for ax in fig.axes[: len(LOSS_TYPES)]] == list(LOSS_TYPES)
    plt.close("all")
