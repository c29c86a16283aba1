"""Which training questions teach GRPO something: answer-agreement curriculum and zero-variance filtering.

A question whose G completions all get the same reward gives every completion advantage 0 (reward minus the group
mean) and teaches nothing; TRL logs the share of such groups as ``frac_reward_zero_std``. ``grpo-kit curriculum``
samples M answers per training question and stores their final numbers and weighted rewards. From them: the
**answer entropy** of the answers clustered by number ("semantic entropy" in grpo-training-engine; 0 = always the same
number, a missing number is a cluster of its own), the **accuracy** (agreement is not correctness), and whether the
question is **zero-variance**. ``grpo-kit train --curriculum`` trains the lowest-entropy (most consistent) questions
first and keeps or drops the zero-variance ones. docs/SCALING.md has the method and the measured numbers.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from grpo_kit.answers import answers_match, extract_last_number, extract_tagged_answer, normalize_number
from grpo_kit.errors import GrpoKitError

#: ``torch.isclose(std, 0)`` as TRL tests a group's reward std: |std| <= atol (rtol times 0 adds nothing).
ZERO_STD_ATOL = 1e-8


def final_number(text: str) -> str | None:
    """The number a completion ends on: the ``<answer>`` block if it holds a number, else the last one; normalized."""
    tagged = normalize_number(extract_tagged_answer(text) or "")
    return tagged if tagged is not None else normalize_number(extract_last_number(text) or "")


def answer_clusters(answers: Sequence[str | None]) -> list[tuple[str | None, int]]:
    """``(answer, count)`` per distinct answer in first-seen order, then each missing answer (None) as its own
    cluster."""
    counts = Counter(answer for answer in answers if answer is not None)
    return [*counts.items(), *((None, 1) for answer in answers if answer is None)]


def answer_entropy(answers: Sequence[str | None]) -> float:
    """Entropy (nats) of the answer-cluster shares: ``-sum_c p_c ln p_c`` with ``p_c = count_c / M`` (0 for no
    answers)."""
    total = len(answers)
    return -sum(n / total * math.log(n / total) for _, n in answer_clusters(answers)) + 0.0  # + 0.0: no -0.0


def is_zero_variance(rewards: Sequence[float]) -> bool:
    """True when every reward of the group is the same (TRL's ``nanstd``: NaN left out, Bessel-corrected; within
    ``ZERO_STD_ATOL``): no completion gets an advantage. Fewer than two numbers make no std, as in TRL."""
    numbers = [r for r in rewards if not math.isnan(r)]
    return len(numbers) >= 2 and statistics.stdev(numbers) <= ZERO_STD_ATOL


@dataclass(frozen=True)
class PromptScore:
    """What M sampled answers said about one training question: each sample's final number (None = no number) and
    weighted reward total under ``reward_spec``."""

    question: str
    gold: str | None
    answers: tuple[str | None, ...]
    rewards: tuple[float, ...]
    reward_spec: str = ""

    @property
    def entropy(self) -> float:
        return answer_entropy(self.answers)

    @property
    def accuracy(self) -> float | None:
        """Share of the answers equal to ``gold`` as numbers; None without a gold answer or answers."""
        if self.gold is None or not self.answers:
            return None
        return sum(answers_match(answer, self.gold) for answer in self.answers) / len(self.answers)

    @property
    def zero_variance(self) -> bool:
        return is_zero_variance(self.rewards)


def write_scores(path: str | os.PathLike, scores: Sequence[PromptScore]) -> Path:
    """One JSON row per question, written in one piece; derived fields are stored for people reading the file."""
    from grpo_kit.files import atomic_write_text

    rows = [
        {
            **vars(s),
            "entropy": round(s.entropy, 6),
            "accuracy": s.accuracy,
            "zero_variance": s.zero_variance,
            "clusters": answer_clusters(s.answers),
        }
        for s in scores
    ]
    return atomic_write_text(path, "".join(json.dumps(row) + "\n" for row in rows))


def read_scores(path: str | os.PathLike) -> dict[str, PromptScore]:
    """Scores by question text (derived fields are recomputed, not trusted). A missing, unreadable, binary or empty
    file, or a malformed row, is a ``GrpoKitError`` naming the file (and line) and how to write it again."""
    rewrite = f"Write it with: grpo-kit curriculum --data DATA --out {path}"
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:  # missing, a folder, no permission, a binary file
        why = "not found" if isinstance(error, FileNotFoundError) else type(error).__name__
        raise GrpoKitError(f"Cannot read curriculum scores {path} ({why}). {rewrite}") from None
    scores: dict[str, PromptScore] = {}
    for number, line in enumerate(lines, start=1):
        try:
            row = json.loads(line) if line.strip() else None
            if row is not None:
                score = PromptScore(
                    str(row["question"]),
                    row.get("gold"),
                    tuple(row["answers"]),
                    tuple(float(r) for r in row["rewards"]),
                    str(row.get("reward_spec", "")),
                )
                scores[score.question] = score
        except (KeyError, TypeError, ValueError, AttributeError) as error:  # ValueError covers JSONDecodeError
            raise GrpoKitError(
                f"{path}:{number}: not a curriculum row ({type(error).__name__}: {error}). {rewrite}"
            ) from None
    if not scores:
        raise GrpoKitError(f"Curriculum scores {path} hold no rows. {rewrite}")
    return scores


@dataclass(frozen=True)
class Curriculum:
    """How training uses a scores file (``train`` turns TRL's shuffling off unless the recipe set it: order matters)."""

    scores_path: str
    drop_zero_variance: bool = False

    def apply(self, dataset) -> tuple[object, dict]:
        """The training dataset (a ``question`` column), lowest answer entropy (most consistent) first, unscored rows
        last, ties in data order; zero-variance rows dropped if asked. Returns ``(dataset, report)``."""
        scores = read_scores(self.scores_path)
        matched = [scores.get(question) for question in dataset["question"]]
        scored = [s for s in matched if s is not None]
        if not scored:
            raise GrpoKitError(
                f"None of the {len(dataset)} training questions is in {self.scores_path}: the scores "
                "were computed for other data. Run grpo-kit curriculum with the same --data as training."
            )
        order = sorted(range(len(matched)), key=lambda i: math.inf if matched[i] is None else matched[i].entropy)
        # Dropped once, before training: DAPO's dynamic sampling drops such groups online, per batch.
        flat = {i for i, score in enumerate(matched) if score is not None and score.zero_variance}
        indices = [i for i in order if i not in flat] if self.drop_zero_variance else order
        if not indices:
            raise GrpoKitError(
                f"Every training question is zero-variance in {self.scores_path}, so --zero-variance "
                "drop left nothing to train on. Sample more answers (--samples), raise the "
                "temperature, or keep them (--zero-variance keep)."
            )
        report = {
            "scores": str(self.scores_path),
            "zero_variance": "drop" if self.drop_zero_variance else "keep",
            "reward_spec": scored[0].reward_spec,
            "questions": len(dataset),
            "scored": len(scored),
            "zero_variance_questions": len(flat),
            "kept": len(indices),
        }
        return dataset.select(indices), report


# --------------------------------------------------------------------------------------------- grpo-kit curriculum


def score_dataset(dataset, completions: Sequence[Sequence[str]], *, rewards) -> list[PromptScore]:
    """Score each row of a ``format_for_grpo`` dataset from its sampled ``completions``: each one's final number (read
    after the prefill, as the rewards read it) and reward total as TRL sums it, ``sum_k w_k f_k`` over the
    ``rewards`` ((name, weight) pairs, as ``Recipe.rewards``) that returned a number (None = not
    applicable; NaN when none did). The row's other columns go to every function as keyword lists, as in TRL."""
    from grpo_kit.rewards import reward_functions

    funcs = reward_functions([name for name, _ in rewards])
    weights = [weight for _, weight in rewards]
    spec = ",".join(f"{getattr(fn, '__name__', fn)}:{weight:g}" for fn, weight in zip(funcs, weights, strict=True))
    scores = []
    for row, texts in zip(dataset.to_list(), completions, strict=True):
        columns = {key: [value] * len(texts) for key, value in row.items() if key != "prompt"}
        outputs = [fn(list(texts), prompts=[row["prompt"]] * len(texts), **columns) for fn in funcs]
        terms = [
            [w * out[i] for w, out in zip(weights, outputs, strict=True) if out[i] is not None]
            for i in range(len(texts))
        ]
        rewards = tuple(float(sum(t)) if t else math.nan for t in terms)
        answers = tuple(final_number((row.get("prefill") or "") + text) for text in texts)
        scores.append(PromptScore(row["question"], row.get("answer"), answers, rewards, spec))
    return scores


def cli_curriculum(args) -> int:
    """``grpo-kit curriculum``: sample ``--samples`` answers per training question as the recipe would in training
    (model, prompt format, completion length, temperature, rewards; ``--set`` changes them), write the scores."""
    from grpo_kit.config import load_recipe, parse_set
    from grpo_kit.data import format_for_grpo, load_gsm8k, render_prompt
    from grpo_kit.evaluate import generate
    from grpo_kit.models import load_inference_model, set_torch_threads

    if args.samples < 2:
        raise GrpoKitError(f"--samples is {args.samples}: agreement and variance need at least 2 answers per question.")
    recipe = load_recipe(args.preset, **parse_set(args.set))
    kit, config = recipe.kit, recipe.grpo
    out = Path(
        args.out or Path(args.data).with_suffix(".curriculum.jsonl")
    )  # next to a data file; sample.curriculum...
    set_torch_threads()
    dataset = load_gsm8k(args.data, split="train", limit=args.limit, seed=config.seed)
    model, tokenizer = load_inference_model(recipe.model.model_name_or_path, args.adapter)
    formatted, _ = format_for_grpo(
        dataset,
        tokenizer,
        few_shot=kit.few_shot,
        prefill=kit.prefill,
        max_prompt_tokens=kit.max_prompt_length,
        system_prompt=kit.system_prompt,
    )
    # The kit's generate loop, seeded so a rerun draws the same answers; message lists rendered as TRL renders them.
    prompts = [p if isinstance(p, str) else render_prompt(p, tokenizer) for p in formatted["prompt"]]
    groups = generate(
        model,
        tokenizer,
        prompts,
        max_new_tokens=config.max_completion_length,
        batch_size=4,
        num_samples=args.samples,
        temperature=config.temperature,
        seed=config.seed,
        desc="sampling",
    )
    scores = score_dataset(formatted, [[text for text, _ in group] for group in groups], rewards=recipe.rewards)
    write_scores(out, scores)
    accuracies = [s.accuracy for s in scores if s.accuracy is not None]
    print(
        json.dumps(
            {
                "questions": len(scores),
                "mean_entropy": round(statistics.fmean(s.entropy for s in scores), 4),
                "mean_accuracy": round(statistics.fmean(accuracies), 4) if accuracies else None,
                "frac_zero_variance": round(statistics.fmean(s.zero_variance for s in scores), 4),
            }
        )
    )
    print(f"scores: {out}\nuse them: grpo-kit train --data {args.data} --curriculum {out} [--zero-variance drop]")
    return 0
