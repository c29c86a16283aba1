"""Sample M completions per training prompt and score them with the run's rewards (for ``grpo_kit.machinery.curriculum``).

A *sampler* is any ``fn(prompts, samples) -> list[list[str]]`` (one list of ``samples`` completion texts per prompt),
so the scoring can be tested with a fake one. ``hf_sampler`` is the real one: the kit's generate loop
(``machinery.generation.generate_hf``) sampling at the training temperature, on whatever device the model sits on (a CPU is
fine for the embedded model and short completions). Heavy imports (torch) stay inside functions.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path

from grpo_kit.errors import GrpoKitError
from grpo_kit.machinery.curriculum import PromptScore, default_scores_path, final_number, score_summary, write_scores

#: ``fn(prompts, samples) -> list[list[str]]``: ``samples`` completions for each prompt, in prompt order.
Sampler = Callable[[Sequence, int], list[list[str]]]


def weighted_rewards(completions: Sequence[str], funcs, weights: Sequence[float], **columns) -> list[float]:
    """Each completion's reward total, as TRL sums it: ``sum_k w_k f_k`` over the functions that returned a number.

    A ``None`` from a function means "not applicable" and is skipped; a completion no function scores gets NaN.
    ``columns`` are passed to every function as keyword lists (``answer=[...]``, ``prefill=[...]``, ...).

    >>> weighted_rewards(["a", "bb"], [lambda c, **k: [len(x) for x in c], lambda c, **k: [1.0, None]], [2.0, 1.0])
    [3.0, 4.0]
    """
    outputs = [fn(list(completions), **columns) for fn in funcs]
    totals = []
    for i in range(len(completions)):
        values = [w * out[i] for w, out in zip(weights, outputs, strict=True) if out[i] is not None]
        totals.append(float(sum(values)) if values else math.nan)
    return totals


def score_dataset(dataset, sampler: Sampler, *, samples: int, reward_spec: str | Sequence[str]) -> list[PromptScore]:
    """Sample ``samples`` completions per row of a ``format_for_grpo`` dataset and score each one.

    Every row yields a ``PromptScore``: the final numbers of its samples (prefill + completion, as the rewards read
    them) and their weighted rewards under ``reward_spec`` (e.g. ``"tag_progress:1,correctness:0.25"``).
    """
    from grpo_kit.machinery.reward_specs import parse_reward_spec

    funcs, weights, names = parse_reward_spec(reward_spec)
    spec = ",".join(f"{name}:{weight:g}" for name, weight in zip(names, weights, strict=True))
    rows = dataset.to_list()
    outputs = sampler([row["prompt"] for row in rows], samples)
    scores = []
    for row, texts in zip(rows, outputs, strict=True):
        prefill = row.get("prefill") or ""
        columns = {key: [value] * len(texts) for key, value in row.items() if key != "prompt"}
        rewards = weighted_rewards(texts, funcs, weights, prompts=[row["prompt"]] * len(texts), **columns)
        scores.append(
            PromptScore(
                question=row["question"],
                gold=row.get("answer"),
                answers=tuple(final_number(prefill + text) for text in texts),
                rewards=tuple(rewards),
                reward_spec=spec,
            )
        )
    return scores


def render_prompt_text(prompt, tokenizer) -> str:
    """The text a model continues, to be tokenized with special tokens as TRL tokenizes string prompts: a string
    prompt as is, a message list through ``data.render_prompt`` (chat template + generation prompt, no double BOS).
    """
    from grpo_kit.data import render_prompt

    return prompt if isinstance(prompt, str) else render_prompt(prompt, tokenizer)


def hf_sampler(
    model, tokenizer, *, max_new_tokens: int, temperature: float = 1.0, batch_size: int = 4, seed: int = 0,
    progress: bool = True,
) -> Sampler:
    """A sampler backed by ``machinery.generation.generate_hf``: ``batch_size`` prompts per call, ``samples`` sequences each,
    drawn at ``temperature`` (the model's own generation defaults play no part). Seeded once per sampler call, so a
    rerun with the same seed draws the same answers.
    """

    def sample(prompts: Sequence, samples: int) -> list[list[str]]:
        import torch

        from grpo_kit.machinery.generation import generate_hf

        torch.manual_seed(seed)
        texts = [render_prompt_text(p, tokenizer) for p in prompts]
        groups = generate_hf(model, tokenizer, texts, max_new_tokens=max_new_tokens, batch_size=batch_size,
                             num_samples=samples, temperature=temperature, progress=progress, desc="sampling")
        return [[text for text, _ in group] for group in groups]

    return sample


def score_with_model(
    preset, *, data: str, model: str | None = None, adapter: str | None = None, rewards: str | None = None,
    samples: int = 4,
    max_new_tokens: int | None = None, temperature: float | None = None, limit: int | None = None,
    batch_size: int = 4, seed: int = 0, progress: bool = True,
) -> list[PromptScore]:
    """Score the training questions of ``data`` with ``model`` (default: the preset's), prompts formatted as training
    formats them (``preset.few_shot``, ``preset.prefill``), completions as long and as hot as training samples them.
    ``adapter`` (a run's ``adapter/`` or ``checkpoint-N/``) re-scores with a partly trained model.
    """
    from grpo_kit.data import format_for_grpo, load_gsm8k
    from grpo_kit.machinery.runtime import set_torch_threads
    from grpo_kit.models import load_inference_model

    set_torch_threads()
    policy, tokenizer = load_inference_model(model or preset.model_id, adapter)  # on the GPU in 16 bits when there is one
    dataset = load_gsm8k(data, split="train", limit=limit, seed=seed)
    formatted, _ = format_for_grpo(
        dataset, tokenizer, few_shot=preset.few_shot, prefill=preset.prefill, max_prompt_tokens=preset.max_prompt_length
    )
    sampler = hf_sampler(
        policy,
        tokenizer,
        max_new_tokens=max_new_tokens or preset.max_completion_length,
        temperature=temperature or preset.temperature,
        batch_size=batch_size,
        seed=seed,
        progress=progress,
    )
    spec = rewards or ",".join(f"{name}:{weight:g}" for name, weight in preset.rewards)
    return score_dataset(formatted, sampler, samples=samples, reward_spec=spec)


def cli_curriculum(args) -> int:
    """``grpo-kit curriculum``: sample ``--samples`` answers per training question, write the scores, print a summary."""
    from grpo_kit.recipes import load_recipe

    preset = load_recipe(args.preset)
    if args.samples < 2:
        raise GrpoKitError(f"--samples is {args.samples}: agreement and variance need at least 2 answers per question.")
    out = Path(args.out) if args.out else default_scores_path(args.data)
    scores = score_with_model(
        preset,
        data=args.data,
        model=args.model,
        adapter=getattr(args, "adapter", None),
        rewards=args.rewards,
        samples=args.samples,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        limit=args.limit,
        batch_size=args.batch_size,
        seed=args.seed,
    )
    write_scores(out, scores)
    summary = score_summary(scores)
    print(json.dumps(summary))
    print(
        f"scores: {out}\nuse them: grpo-kit train --data {args.data} --curriculum {out} "
        "[--curriculum-order entropy|accuracy|staged] [--zero-variance drop|last]"
    )
    return 0
