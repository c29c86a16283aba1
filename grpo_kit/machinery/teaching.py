"""Toy GRPO computations for the teaching notebook (``notebooks/02_grpo_explained.ipynb``).

Each function re-derives, on tiny tensors, one step that TRL 1.15's ``GRPOTrainer`` performs inline:

- ``group_advantages``: rewards of ``G`` completions per prompt -> advantages (``_generate_and_score_completions``);
- ``zero_std_fraction``: the share of groups whose rewards are all equal (TRL logs it as ``frac_reward_zero_std``);
- ``k3_kl``: the per-token KL estimator TRL adds to the loss when ``beta > 0``;
- ``clipped_surrogate`` and ``aggregate``: the PPO-style clipped per-token loss and how each ``loss_type``
  (grpo, dr_grpo, dapo, bnpo) turns a ``(B, T)`` matrix of per-token losses into one number;
- ``token_weights``: the gradient weight each ``loss_type`` gives to every completion token;
- ``vllm_is_ratio``: the importance-sampling factor TRL multiplies the loss by when vLLM sampled the completions
  (``vllm_importance_sampling_correction``, on by default), correcting for vLLM's probabilities differing from the
  trainer's.

TRL exposes no standalone function for the advantages or the loss (both are inline code in ``GRPOTrainer``), so
``trl_loss`` runs TRL's own ``GRPOTrainer._compute_loss`` on the toy tensors with a minimal stand-in for the trainer,
and the notebook checks ``grpo_loss`` against it; the advantages are checked against a hand-computed example and
TRL's exported ``nanstd``. Shapes: ``B`` completions (``P`` prompts x ``G`` generations, prompt-major), ``T`` tokens.

Torch is imported inside the functions so importing this module stays cheap.
"""

from __future__ import annotations

from grpo_kit.errors import GrpoKitError

#: TRL adds this to the reward standard deviation before dividing, so equal rewards give 0, not a division by 0.
STD_EPS = 1e-4
#: The loss types this module explains (TRL 1.15 has more: cispo, sapo, vespo, luspo).
LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo")
#: TRL's default clipping range for the probability ratio (``epsilon``).
EPSILON = 0.2
#: TRL 1.15's defaults for the vLLM importance-sampling factor (``vllm_importance_sampling_mode`` / ``_clip_max``).
IS_MODE = "sequence_mask"
IS_CLIP_MAX = 3.0


def _check_groups(rewards, num_generations: int) -> None:
    if num_generations < 2:
        raise GrpoKitError(f"num_generations must be at least 2 (a group needs something to compare), got {num_generations}.")
    if rewards.dim() != 1 or rewards.numel() % num_generations:
        raise GrpoKitError(
            f"rewards must be a 1-D tensor whose length is a multiple of num_generations={num_generations}; "
            f"got shape {tuple(rewards.shape)}."
        )


def group_advantages(rewards, num_generations: int, scale_rewards: str = "group"):
    """Advantages of ``B = P * G`` completions from their rewards, as TRL computes them. Returns shape ``(B,)``.

    Rewards are laid out prompt-major: ``rewards[p * G + g]`` is completion ``g`` of prompt ``p``. Each reward is
    compared to the mean of its own group; ``scale_rewards`` divides by the group's standard deviation
    (``"group"``), the whole batch's (``"batch"``) or nothing (``"none"``). The std is the unbiased one (Bessel's
    correction, like ``torch.std``) plus ``STD_EPS``.

    >>> import torch
    >>> group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0]), num_generations=4)
    tensor([ 0.8659, -0.8659, -0.8659,  0.8659,  0.0000,  0.0000,  0.0000,  0.0000])
    """
    import torch

    _check_groups(rewards, num_generations)
    grouped = rewards.float().view(-1, num_generations)  # (P, G)
    centred = (grouped - grouped.mean(dim=1, keepdim=True)).view(-1)  # (B,)
    if scale_rewards == "none":
        return centred
    if scale_rewards == "group":
        std = grouped.std(dim=1).repeat_interleave(num_generations)  # (B,)
    elif scale_rewards == "batch":
        std = rewards.float().std().expand_as(centred)  # (B,)
    else:
        raise GrpoKitError(f"scale_rewards must be 'group', 'batch' or 'none', got {scale_rewards!r}.")
    return centred / (torch.nan_to_num(std) + STD_EPS)


def zero_std_fraction(rewards, num_generations: int) -> float:
    """Share of groups whose ``G`` rewards are all equal: those completions get advantage 0 and teach nothing.

    >>> import torch
    >>> zero_std_fraction(torch.tensor([1.0, 0.0, 2.0, 2.0, 0.0, 0.0]), num_generations=2)
    0.6666666666666666
    """
    import torch

    _check_groups(rewards, num_generations)
    std = rewards.float().view(-1, num_generations).std(dim=1)  # (P,)
    equal = torch.isclose(std, torch.zeros_like(std))  # (P,) True where the group has one reward value
    return int(equal.sum()) / equal.numel()


def k3_kl(logps, ref_logps):
    """Per-token KL estimate ``exp(r) - r - 1`` with ``r = ref_logps - logps`` (Schulman's "k3"), same shape as inputs.

    ``logps`` are log-probabilities of the *sampled* tokens under the policy, ``ref_logps`` under the reference
    model. Each value is >= 0, is 0 exactly where the two agree, and its mean over tokens sampled from the policy is
    an unbiased estimate of KL(policy || reference).

    >>> import torch
    >>> k3_kl(torch.log(torch.tensor([0.5, 0.5])), torch.log(torch.tensor([0.5, 0.25])))
    tensor([0.0000, 0.1931])
    """
    import torch

    log_ratio = ref_logps - logps
    return torch.exp(log_ratio) - log_ratio - 1


def exact_kl(probs, ref_probs) -> float:
    """KL(probs || ref_probs) of two categorical distributions given as 1-D probability tensors.

    >>> import torch
    >>> round(exact_kl(torch.tensor([0.5, 0.5]), torch.tensor([0.5, 0.5])), 6)
    0.0
    """
    import torch

    mask = probs > 0
    return torch.sum(probs[mask] * (probs[mask].log() - ref_probs[mask].log())).item()


def clipped_surrogate(logps, old_logps, advantages, epsilon: float = EPSILON):
    """PPO-style clipped per-token loss ``-min(ratio * A, clip(ratio, 1-eps, 1+eps) * A)``. Returns ``(B, T)``.

    ``logps``/``old_logps`` are ``(B, T)`` log-probabilities of the completion tokens under the current policy and
    the policy that sampled them; ``advantages`` is ``(B,)`` (one per completion, shared by its tokens). With one
    update per generation batch (TRL's default) ``old_logps == logps``, the ratio is 1 and the loss value is ``-A``
    on every token; only its gradient matters.

    >>> import torch
    >>> clipped_surrogate(torch.zeros(2, 3), torch.zeros(2, 3), torch.tensor([1.0, -0.5]))
    tensor([[-1.0000, -1.0000, -1.0000],
            [ 0.5000,  0.5000,  0.5000]])
    """
    import torch

    ratio = torch.exp(logps - old_logps)  # (B, T)
    adv = advantages.unsqueeze(1)  # (B, 1): every token of a completion shares its advantage
    return -torch.min(ratio * adv, torch.clamp(ratio, 1 - epsilon, 1 + epsilon) * adv)


def vllm_is_ratio(trainer_logps, sampling_logps, mask, mode: str = IS_MODE, clip_max: float | None = IS_CLIP_MAX,
                  clip_min: float | None = None):
    """The factor TRL multiplies each per-token loss by when vLLM generated the completions.

    vLLM samples with its own kernels, so its token probabilities (``sampling_logps``) differ slightly from the
    trainer's (``trainer_logps``, recomputed before the update). TRL corrects with the importance weight
    ``exp(trainer - sampling)``: per token (``token_*`` modes, ``(B, T)``) or summed over the completion
    (``sequence_*`` modes, ``(B, 1)``). ``*_truncate`` clamps it into ``[clip_min, clip_max]``; ``*_mask`` sets it to 0
    outside that range, dropping completions the two engines disagree on. This is separate from PPO clipping: the
    clipped ratio compares the current policy with the recomputed old one, which is 1 on the first update.

    >>> import torch
    >>> mask = torch.ones(2, 2)
    >>> vllm_is_ratio(torch.zeros(2, 2), torch.tensor([[0.0, 0.0], [-1.0, -1.0]]), mask)  # exp(2) > 3: masked
    tensor([[1.],
            [0.]])
    """
    import math

    import torch

    diff = torch.nan_to_num((trainer_logps - sampling_logps) * mask, nan=0.0)  # (B, T); NaN from vLLM counts as 0
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)  # (B, 1): one weight per completion
    ratio = torch.exp(diff)  # (B, T) or (B, 1)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    if not mode.endswith("mask"):
        raise GrpoKitError(f"Unknown importance-sampling mode '{mode}': use token_/sequence_ + truncate/mask.")
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


def aggregate(per_token_loss, mask, loss_type: str, max_completion_length: int | None = None):
    """One scalar from a ``(B, T)`` per-token loss; ``mask`` ``(B, T)`` is 1 on real completion tokens, 0 on padding.

    - ``grpo``: mean over each completion's tokens, then mean over completions (a token of a long completion
      weighs less than one of a short completion: a length bias);
    - ``bnpo``: mean over all tokens of the (micro-)batch;
    - ``dapo``: sum over tokens divided by the number of tokens in the whole generation batch (equal to ``bnpo`` on
      a single batch; differs under gradient accumulation, see ``accumulate``);
    - ``dr_grpo``: sum over tokens divided by the constant ``B * max_completion_length`` (no length bias at all).

    >>> import torch
    >>> loss, mask = torch.ones(2, 4), torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    >>> [round(aggregate(loss, mask, t, max_completion_length=8).item(), 3) for t in LOSS_TYPES]
    [1.0, 0.375, 1.0, 1.0]
    """
    masked = per_token_loss * mask
    if loss_type == "grpo":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type in ("bnpo", "dapo"):
        return masked.sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        if max_completion_length is None:
            raise GrpoKitError("loss_type 'dr_grpo' divides by max_completion_length: pass max_completion_length=...")
        return masked.sum() / (per_token_loss.size(0) * max_completion_length)
    raise GrpoKitError(f"loss_type must be one of {', '.join(LOSS_TYPES)}; got {loss_type!r}.")


def accumulate(per_token_losses, masks, loss_type: str, max_completion_length: int | None = None):
    """The loss summed over gradient-accumulation micro-batches, normalised the way TRL does for ``loss_type``.

    ``grpo``/``bnpo``/``dr_grpo`` normalise each micro-batch on its own and divide by the number of micro-batches;
    ``dapo`` divides every micro-batch's token sum by the token count of *all* micro-batches together, so the result
    is the token mean over the whole generation batch.

    >>> import torch
    >>> losses = [torch.ones(1, 2), 3 * torch.ones(1, 2)]
    >>> masks = [torch.tensor([[1.0, 0.0]]), torch.tensor([[1.0, 1.0]])]
    >>> round(accumulate(losses, masks, "bnpo").item(), 4), round(accumulate(losses, masks, "dapo").item(), 4)
    (2.0, 2.3333)
    """
    if loss_type == "dapo":
        total_tokens = sum(mask.sum() for mask in masks).clamp(min=1.0)
        return sum((loss * mask).sum() for loss, mask in zip(per_token_losses, masks, strict=True)) / total_tokens
    steps = len(per_token_losses)
    return sum(
        aggregate(loss, mask, loss_type, max_completion_length) / steps
        for loss, mask in zip(per_token_losses, masks, strict=True)
    )


def grpo_loss(
    logps,
    old_logps,
    advantages,
    mask,
    loss_type: str = "dapo",
    *,
    epsilon: float = EPSILON,
    beta: float = 0.0,
    ref_logps=None,
    max_completion_length: int | None = None,
    is_ratio=None,
):
    """The whole GRPO loss on one batch: clipped surrogate (times the vLLM importance weight ``is_ratio`` when
    given), plus ``beta *`` k3 KL, aggregated by ``loss_type``.

    Shapes: ``logps``, ``old_logps``, ``ref_logps``, ``mask``: ``(B, T)``; ``advantages``: ``(B,)``; ``is_ratio``:
    ``(B, T)`` or ``(B, 1)`` from ``vllm_is_ratio``. Returns a 0-d tensor, differentiable with respect to ``logps``.

    >>> import torch
    >>> round(grpo_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.tensor([1.0, -1.0]), torch.ones(2, 3)).item(), 6)
    0.0
    """
    per_token = clipped_surrogate(logps, old_logps, advantages, epsilon)  # (B, T)
    if is_ratio is not None:
        per_token = per_token * is_ratio  # TRL weights the policy term only, before adding the KL term
    if beta:
        if ref_logps is None:
            raise GrpoKitError("beta > 0 adds a KL penalty to a reference model: pass ref_logps=...")
        per_token = per_token + beta * k3_kl(logps, ref_logps)
    return aggregate(per_token, mask, loss_type, max_completion_length)


def token_weights(mask, loss_type: str, max_completion_length: int | None = None):
    """How strongly each completion token's log-probability is pushed, per unit advantage, under ``loss_type``.

    It is the gradient of ``aggregate(per_token_loss, mask, loss_type)`` with respect to each per-token loss: a
    ``(B, T)`` tensor (0 on padding). Under ``grpo`` a token of a 2-token completion gets twice the weight of a token
    of a 4-token completion; ``dr_grpo``, ``bnpo`` and ``dapo`` give every token the same weight.

    >>> import torch
    >>> token_weights(torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]]), "grpo")
    tensor([[0.2500, 0.2500, 0.0000, 0.0000],
            [0.1250, 0.1250, 0.1250, 0.1250]])
    """
    import torch

    per_token = torch.zeros_like(mask, dtype=torch.float32, requires_grad=True)
    aggregate(per_token, mask, loss_type, max_completion_length).backward()
    return per_token.grad


def trl_loss(
    logps,
    old_logps,
    advantages,
    mask,
    loss_type: str = "dapo",
    *,
    epsilon: float = EPSILON,
    beta: float = 0.0,
    ref_logps=None,
    max_completion_length: int | None = None,
    is_ratio=None,
) -> float:
    """The same loss computed by TRL's own ``GRPOTrainer._compute_loss`` on the toy tensors (one batch, one process).

    With ``is_ratio`` the stand-in trainer says it generated with vLLM (``use_vllm`` and
    ``vllm_importance_sampling_correction``, as TRL does by default then) and TRL applies the factor itself.

    TRL has no standalone loss function, so this calls the trainer's private method on a minimal stand-in object
    that supplies only what the method reads, with the model's log-probabilities replaced by ``logps``. It targets
    the pinned TRL (1.15); if TRL's internals change, it raises ``GrpoKitError`` instead of returning a wrong number.
    """
    import torch

    try:
        from trl import GRPOTrainer

        trainer = _TrlLossStandIn(
            loss_type=loss_type,
            epsilon=epsilon,
            beta=beta,
            max_completion_length=max_completion_length or logps.size(1),
            logps=logps,
            vllm=is_ratio is not None,
        )
        inputs = {
            "prompt_ids": torch.zeros(logps.size(0), 1, dtype=torch.long),
            "prompt_mask": torch.ones(logps.size(0), 1, dtype=torch.long),
            "completion_ids": torch.zeros_like(mask, dtype=torch.long),
            "completion_mask": mask,
            "advantages": advantages,
            "old_per_token_logps": old_logps,
            "num_items_in_batch": mask.sum(),
        }
        if beta:
            inputs["ref_per_token_logps"] = ref_logps
        if is_ratio is not None:
            inputs["importance_sampling_ratio"] = is_ratio
        return GRPOTrainer._compute_loss(trainer, None, inputs).item()
    except (AttributeError, KeyError, TypeError) as error:
        raise GrpoKitError(
            f"Could not run TRL's GRPOTrainer._compute_loss on toy tensors ({type(error).__name__}: {error}). "
            "Its internals changed since TRL 1.15; compare with grpo_loss by hand, or install trl==1.15.0."
        ) from error


class _TrlLossStandIn:
    """Just the attributes ``GRPOTrainer._compute_loss`` (TRL 1.15) reads, for a single CPU process, no extras."""

    def __init__(self, *, loss_type, epsilon, beta, max_completion_length, logps, vllm=False):
        from collections import defaultdict
        from types import SimpleNamespace

        self.loss_type = loss_type
        self.epsilon_low = self.epsilon_high = epsilon
        self.beta = beta
        self.max_completion_length = max_completion_length
        self.importance_sampling_level = "token"
        self.top_entropy_quantile = 1.0
        self.off_policy_mask_threshold = None
        self.use_vllm = vllm
        self.vllm_importance_sampling_correction = vllm
        self.aux_loss_enabled = False
        self._entropy_bonus_enabled = False
        self.current_gradient_accumulation_steps = 1
        self.args = SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1)
        self.model = SimpleNamespace(training=True)
        self.accelerator = _SingleProcess()
        self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
        self._logps = logps

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, **kwargs):
        import torch

        return self._logps, torch.zeros_like(self._logps), None


class _SingleProcess:
    """The ``accelerator`` methods ``_compute_loss`` calls, for one process: gathering and reducing change nothing."""

    num_processes = 1
    sync_gradients = True

    @staticmethod
    def gather(tensor):
        return tensor

    gather_for_metrics = gather

    @staticmethod
    def reduce(tensor, reduction="sum"):
        return tensor


# ------------------------------------------------------------------------------------------------ pictures


def plot_advantages(rewards, num_generations: int, *, ax=None, show: bool = True):
    """Bars of each completion's reward and advantage, grouped by prompt (groups shaded). Returns the Axes."""
    import matplotlib.pyplot as plt

    advantages = group_advantages(rewards, num_generations)
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 3))
    xs = list(range(rewards.numel()))
    ax.bar([x - 0.2 for x in xs], rewards.tolist(), width=0.4, label="reward")
    ax.bar([x + 0.2 for x in xs], advantages.tolist(), width=0.4, label="advantage")
    for group in range(0, rewards.numel(), 2 * num_generations):
        ax.axvspan(group - 0.5, group + num_generations - 0.5, color="grey", alpha=0.12)
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xticks(xs, [f"p{x // num_generations}g{x % num_generations}" for x in xs], fontsize=8)
    ax.set(title=f"Rewards and group-relative advantages (G={num_generations})", xlabel="prompt p, completion g")
    ax.legend(fontsize=8)
    if show:
        plt.tight_layout()
        plt.show()
    return ax


def plot_token_weights(mask, max_completion_length: int, *, loss_types=LOSS_TYPES, show: bool = True):
    """One heat map per loss type of ``token_weights``: how hard each token is pushed. Returns the Figure."""
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(
        1, len(loss_types), figsize=(3.0 * len(loss_types), 0.5 * mask.size(0) + 1.8), squeeze=False,
        constrained_layout=True,
    )
    weights = {name: token_weights(mask, name, max_completion_length) for name in loss_types}
    top = max(float(w.max()) for w in weights.values())
    for index, (ax, name) in enumerate(zip(axes[0], loss_types, strict=True)):
        image = ax.imshow(weights[name].numpy(), vmin=0, vmax=top, cmap="Blues", aspect="auto")
        for (row, col), value in np.ndenumerate(weights[name].numpy()):
            text = f"{value:.3g}" if mask[row, col] else "pad"
            ax.text(col, row, text, ha="center", va="center", fontsize=8, color="black" if value < top / 2 else "white")
        ax.set_xticks(range(mask.size(1)))
        ax.set_yticks(range(mask.size(0)))
        ax.set(title=name, xlabel="token")
        if index == 0:
            ax.set_ylabel("completion")
    fig.colorbar(image, ax=axes[0].tolist(), shrink=0.9, label="gradient weight per token")
    if show:
        plt.show()
    return fig
