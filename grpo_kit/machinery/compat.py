"""Compatibility with the pinned TRL 1.15.0 on machines without Triton (every CPU-only PyTorch install).

TRL 1.15's ``GRPOTrainer`` scores completion tokens through a fused LM head whose log-probabilities come from a
Triton kernel (``trl.kernels.ChunkedLogProbFunction``). CPU builds of PyTorch ship no Triton, so TRL sets that
function to ``None`` and the first training step fails with ``'NoneType' object has no attribute 'apply'``.
TRL 1.16 added a plain-PyTorch fallback; Unsloth 2026.10.7 pins TRL 1.15.0, so the kit installs the same kind of
fallback itself, **only** when TRL's kernel is missing (on a GPU with Triton nothing changes).

The fallback computes exactly what the kernel returns, with ordinary autograd::

    z        = transform(hidden @ weight.T + bias)          # [N, V]; transform = scale, softcap, / temperature
    log_p    = log_softmax(z)[n, target[n]]                  # [N]
    entropy  = -sum_v p_v log p_v                            # [N]
    log_sum_sq_probs = log sum_v p_v^2, mean_logits = mean_v z_v, is_top1 = target is the unique argmax

in chunks of ``TOKENS_PER_CHUNK`` tokens so the ``[N, V]`` logits never exist all at once.
"""

from __future__ import annotations

TOKENS_PER_CHUNK = 256


class TorchChunkedLogProb:
    """Drop-in for ``trl.kernels.ChunkedLogProbFunction`` (same ``apply`` signature and 5-tuple result)."""

    @staticmethod
    def apply(
        hidden,  # [N, H]
        weight,  # [V, H]
        bias,  # [V] or None
        targets,  # [N] token ids
        temperature: float,
        chunk_size: int,  # vocabulary tile size of the Triton kernel; unused here
        final_logit_softcapping: float | None = None,
        logit_scale: float | None = 1.0,
        outputs: tuple[str, ...] = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1"),
    ):
        import torch

        pieces: dict[str, list] = {k: [] for k in ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")}
        scale = 1.0 if logit_scale is None else logit_scale
        for start in range(0, hidden.shape[0], TOKENS_PER_CHUNK):
            h = hidden[start : start + TOKENS_PER_CHUNK]
            z = h.float() @ weight.float().t()
            if bias is not None:
                z = z + bias.float()
            z = z * scale
            if final_logit_softcapping is not None:
                z = final_logit_softcapping * torch.tanh(z / final_logit_softcapping)
            z = z / temperature
            log_softmax = torch.log_softmax(z, dim=-1)  # [n, V]
            target = targets[start : start + TOKENS_PER_CHUNK]
            pieces["log_probs"].append(log_softmax.gather(-1, target[:, None]).squeeze(-1))
            if "entropy" in outputs:
                pieces["entropy"].append(-(log_softmax.exp() * log_softmax).sum(-1))
            if "log_sum_sq_probs" in outputs:
                pieces["log_sum_sq_probs"].append(torch.logsumexp(2 * log_softmax.detach(), dim=-1))
            if "mean_logits" in outputs:
                pieces["mean_logits"].append(z.detach().mean(-1))
            if "is_top1" in outputs:
                target_logit = z.detach().gather(-1, target[:, None])
                pieces["is_top1"].append((z.detach() >= target_logit).sum(-1) == 1)
        return tuple(torch.cat(parts) if parts else None for parts in pieces.values())


def ensure_logprob_kernel() -> bool:
    """Install ``TorchChunkedLogProb`` into TRL when its Triton kernel is unavailable. Returns True if installed."""
    from trl.trainer import utils

    if getattr(utils, "_ChunkedLogProbFunction", object()) is None:
        utils._ChunkedLogProbFunction = TorchChunkedLogProb
        return True
    return False
