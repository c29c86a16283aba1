"""Which training questions teach GRPO something: answer-agreement curriculum and zero-variance filtering.

GRPO learns only from differences *inside* a group: a completion's advantage is its reward minus the group's mean.
A question whose G completions all get the same reward (all wrong, or all right) gives every completion advantage
0 and teaches nothing; TRL logs the share of such groups per step as ``frac_reward_zero_std``. Both measurements
here come from one offline pass (``grpo-kit curriculum``, sampling in ``grpo_kit.machinery.sampling``): M sampled answers per
training question from the current model, then

- **answer entropy** (called "semantic entropy" in grpo-training-engine): cluster the M answers by their final
  number and take the entropy of the cluster shares, ``H = -sum_c p_c ln p_c`` (nats). 0 = the model always
  gives the same number; ``ln M`` = M different numbers. An answer with no number is a cluster of its own, so a
  model that never answers scores as uncertain, not as confident. Correctness is ignored here (a model can agree
  with itself on a wrong number), so ``accuracy`` (share of the M answers equal to the gold number) is kept too.
- **reward variance**: the M samples scored with the run's reward functions, weighted and summed as TRL does; a
  question whose M rewards are all equal is *zero-variance* (the same test TRL uses: ``isclose(std, 0)``).

Training consumes the scores (``grpo-kit train --curriculum scores.jsonl``) through ``Curriculum``: order the
questions (``ORDERS``) and keep, drop or postpone the zero-variance ones (``ZERO_VARIANCE``). With an order, TRL's
shuffling is turned off so the order is the order trained on.

>>> answers = [final_number(t) for t in ["<answer>18</answer>", "so 18.0", "<answer>20</answer>", "no idea"]]
>>> answers
['18', '18', '20', None]
>>> round(answer_entropy(answers), 4), answer_accuracy(answers, "18")
(1.0397, 0.5)
"""

from __future__ import annotations

import json
import math
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from grpo_kit.answers import answers_match, extract_last_number, extract_tagged_answer, normalize_number
from grpo_kit.errors import GrpoKitError

#: Dataset orders: name → what it does.
ORDERS = {
    "none": "keep the data order (TRL still shuffles it)",
    "entropy": "lowest answer entropy first: questions the model answers consistently come first",
    "accuracy": "most often right first (ties: lowest entropy first); uses the gold answers",
    "staged": "grpo-training-engine's curriculum: the lower-entropy half first, then the rest, each half shuffled",
}
#: What to do with zero-variance questions: name → what it does.
ZERO_VARIANCE = {
    "keep": "train on them as usual",
    "drop": "leave them out (DAPO's dynamic sampling, done once before training)",
    "last": "move them to the end, after every question that had reward variance",
}
#: ``torch.isclose(std, 0)`` as TRL tests a group's reward std: |std| <= atol (rtol times 0 adds nothing).
ZERO_STD_ATOL = 1e-8


# --------------------------------------------------------------------------------------------- pure measurements


def final_number(text: str) -> str | None:
    """The number a completion ends on: the ``<answer>`` block if it holds a number, else the last number; normalized.

    >>> final_number("<think>3+4</think><answer>$7.00</answer>"), final_number("it is 1,080"), final_number("none")
    ('7', '1080', None)
    """
    tagged = normalize_number(extract_tagged_answer(text) or "")
    if tagged is not None:
        return tagged
    last = extract_last_number(text)
    return normalize_number(last) if last is not None else None


def answer_clusters(answers: Sequence[str | None]) -> list[tuple[str | None, int]]:
    """``(answer, count)`` per distinct answer in first-seen order; each missing answer (None) is its own cluster.

    >>> answer_clusters(["18", "20", None, "18", None])
    [('18', 2), ('20', 1), (None, 1), (None, 1)]
    """
    counts: dict[str, int] = {}
    clusters: list[list] = []
    for answer in answers:
        if answer is None:
            clusters.append([None, 1])
        elif answer in counts:
            clusters[counts[answer]][1] += 1
        else:
            counts[answer] = len(clusters)
            clusters.append([answer, 1])
    return [(answer, count) for answer, count in clusters]


def answer_entropy(answers: Sequence[str | None]) -> float:
    """Entropy (nats) of the answer-cluster shares: ``-sum_c p_c ln p_c`` with ``p_c = count_c / M``.

    >>> answer_entropy(["5", "5", "5", "5"]), round(answer_entropy(["5", "5", "6", "6"]), 4)
    (0.0, 0.6931)
    >>> round(answer_entropy([None, None, None, None]), 4)  # four non-answers = four clusters = ln 4
    1.3863
    """
    total = len(answers)
    if total == 0:
        return 0.0
    return -sum(count / total * math.log(count / total) for _, count in answer_clusters(answers)) + 0.0


def answer_accuracy(answers: Sequence[str | None], gold: str | None) -> float | None:
    """Share of ``answers`` equal to ``gold`` as numbers; None without a gold answer or without answers.

    >>> answer_accuracy(["72", "72.0", "71", None], "72")
    0.5
    """
    if gold is None or not answers:
        return None
    return sum(answers_match(answer, gold) for answer in answers) / len(answers)


def reward_std(rewards: Sequence[float]) -> float:
    """Sample standard deviation (Bessel-corrected, as TRL's ``nanstd``); NaN for fewer than 2 rewards.

    >>> reward_std([1.0, 1.0, 1.0]), reward_std([0.0, 2.0])
    (0.0, 1.4142135623730951)
    """
    if len(rewards) < 2:
        return math.nan
    mean = sum(rewards) / len(rewards)
    return math.sqrt(sum((r - mean) ** 2 for r in rewards) / (len(rewards) - 1))


def is_zero_variance(rewards: Sequence[float]) -> bool:
    """True when every reward in the group is the same (TRL: ``isclose(std, 0)``): no completion gets an advantage.

    >>> is_zero_variance([0.5, 0.5, 0.5]), is_zero_variance([0.5, 0.5, 0.75]), is_zero_variance([0.5])
    (True, False, False)
    """
    std = reward_std(rewards)
    return not math.isnan(std) and abs(std) <= ZERO_STD_ATOL


def frac_reward_zero_std(rewards: Sequence[float], num_generations: int) -> float:
    """TRL's ``frac_reward_zero_std`` for one batch: ``rewards`` holds consecutive groups of ``num_generations``.

    TRL flags every completion of a zero-std group and averages the flags over completions, which equals the share
    of zero-variance groups (all groups have the same size).

    >>> frac_reward_zero_std([1, 1, 0, 1, 2, 3, 2, 2], num_generations=2)
    0.5
    """
    if num_generations < 2 or len(rewards) % num_generations:
        raise GrpoKitError(
            f"frac_reward_zero_std needs whole groups of num_generations >= 2; got {len(rewards)} rewards in "
            f"groups of {num_generations}."
        )
    groups = [rewards[i : i + num_generations] for i in range(0, len(rewards), num_generations)]
    return sum(is_zero_variance(group) for group in groups) / len(groups)


@dataclass(frozen=True)
class PromptScore:
    """What M sampled answers said about one training question.

    ``answers``: the final number of each sample (None = no number). ``rewards``: each sample's weighted reward
    total under ``reward_spec``.
    """

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
        return answer_accuracy(self.answers, self.gold)

    @property
    def zero_variance(self) -> bool:
        return is_zero_variance(self.rewards)

    def to_row(self) -> dict:
        """A JSON-ready dict: the stored fields plus the derived ones, for people reading the file."""
        return {
            "question": self.question,
            "gold": self.gold,
            "answers": list(self.answers),
            "rewards": list(self.rewards),
            "reward_spec": self.reward_spec,
            "entropy": round(self.entropy, 6),
            "accuracy": self.accuracy,
            "zero_variance": self.zero_variance,
            "clusters": [[answer, count] for answer, count in answer_clusters(self.answers)],
        }

    @classmethod
    def from_row(cls, row: dict) -> PromptScore:
        """The inverse of ``to_row`` (derived fields are recomputed, not trusted)."""
        return cls(
            question=str(row["question"]),
            gold=row.get("gold"),
            answers=tuple(row["answers"]),
            rewards=tuple(float(r) for r in row["rewards"]),
            reward_spec=str(row.get("reward_spec", "")),
        )


# --------------------------------------------------------------------------------------------- ordering


def curriculum_order(scores: Sequence[PromptScore | None], order: str = "entropy", seed: int = 0) -> list[int]:
    """Row indices in training order. Rows without a score (None) come last, in their original order.

    >>> s = [PromptScore("a", "1", ("1", "2"), (0.0, 1.0)), None, PromptScore("c", "1", ("1", "1"), (1.0, 1.0))]
    >>> curriculum_order(s, "entropy"), curriculum_order(s, "none")
    ([2, 0, 1], [0, 1, 2])
    """
    if order not in ORDERS:
        raise GrpoKitError(f"Unknown curriculum order {order!r}: choose one of {', '.join(ORDERS)}.")
    scored = [i for i, score in enumerate(scores) if score is not None]
    unscored = [i for i, score in enumerate(scores) if score is None]
    if order == "none":
        return list(range(len(scores)))
    if order == "accuracy":
        scored.sort(key=lambda i: (-_accuracy_or_below(scores[i]), scores[i].entropy))
    else:
        scored.sort(key=lambda i: scores[i].entropy)  # stable: ties keep the data order
    if order == "staged":
        half = (len(scored) + 1) // 2
        first, rest = scored[:half], scored[half:]
        rng = random.Random(seed)
        rng.shuffle(first)
        rng.shuffle(rest)
        scored = first + rest
    return scored + unscored


def _accuracy_or_below(score: PromptScore) -> float:
    accuracy = score.accuracy
    return -1.0 if accuracy is None else accuracy


def zero_variance_filter(
    indices: Sequence[int], scores: Sequence[PromptScore | None], mode: str = "keep"
) -> tuple[list[int], int]:
    """Apply ``mode`` (``ZERO_VARIANCE``) to an ordering; returns ``(indices, number of zero-variance rows)``.

    >>> s = [PromptScore("a", None, ("1", "2"), (1.0, 1.0)), PromptScore("b", None, ("1", "2"), (0.0, 1.0)), None]
    >>> zero_variance_filter([0, 1, 2], s, "drop"), zero_variance_filter([0, 1, 2], s, "last")
    (([1, 2], 1), ([1, 2, 0], 1))
    """
    if mode not in ZERO_VARIANCE:
        raise GrpoKitError(f"Unknown zero-variance mode {mode!r}: choose one of {', '.join(ZERO_VARIANCE)}.")
    flat = [i for i in indices if scores[i] is not None and scores[i].zero_variance]
    rest = [i for i in indices if not (scores[i] is not None and scores[i].zero_variance)]
    if mode == "drop":
        return rest, len(flat)
    if mode == "last":
        return rest + flat, len(flat)
    return list(indices), len(flat)


# --------------------------------------------------------------------------------------------- files


def default_scores_path(data: str) -> Path:
    """Where ``grpo-kit curriculum`` writes scores: next to a data file, else ``<source>.curriculum.jsonl`` here.

    >>> default_scores_path("data/train.jsonl").as_posix(), default_scores_path("sample").as_posix()
    ('data/train.curriculum.jsonl', 'sample.curriculum.jsonl')
    """
    path = Path(data)
    if path.suffix in {".jsonl", ".json", ".parquet"}:
        return path.with_name(f"{path.stem}.curriculum.jsonl")
    return Path(f"{path.name}.curriculum.jsonl")


def write_scores(path: str | os.PathLike, scores: Sequence[PromptScore]) -> Path:
    """One JSON row per question (``PromptScore.to_row``), written in one piece (``folders.atomic_write_text``)."""
    from grpo_kit.machinery.folders import atomic_write_text

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write_text(path, "".join(json.dumps(score.to_row()) + "\n" for score in scores))


def read_scores(path: str | os.PathLike) -> dict[str, PromptScore]:
    """Scores by question text. A missing file or a malformed row raises ``GrpoKitError`` naming the line."""
    path = Path(path)
    if not path.is_file():
        raise GrpoKitError(
            f"Curriculum scores not found: {path}. Write them first: grpo-kit curriculum --data DATA --out {path}"
        )
    scores: dict[str, PromptScore] = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            score = PromptScore.from_row(json.loads(line))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
            raise GrpoKitError(
                f"{path}:{number}: not a curriculum row ({type(error).__name__}: {error}). Re-run grpo-kit curriculum."
            ) from None
        scores[score.question] = score
    return scores


# --------------------------------------------------------------------------------------------- training hook


@dataclass(frozen=True)
class Curriculum:
    """How training uses a scores file: ``order`` (``ORDERS``), ``zero_variance`` (``ZERO_VARIANCE``), ``seed``."""

    scores_path: str
    order: str = "entropy"
    zero_variance: str = "keep"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.order not in ORDERS:
            raise GrpoKitError(f"Unknown curriculum order {self.order!r}: choose one of {', '.join(ORDERS)}.")
        if self.zero_variance not in ZERO_VARIANCE:
            raise GrpoKitError(
                f"Unknown zero-variance mode {self.zero_variance!r}: choose one of {', '.join(ZERO_VARIANCE)}."
            )

    def config_overrides(self) -> dict:
        """GRPOConfig fields the curriculum needs: no shuffling when the order matters."""
        keeps_order = self.order != "none" or self.zero_variance == "last"
        return {"shuffle_dataset": False} if keeps_order else {}

    def apply(self, dataset) -> tuple[object, dict]:
        """The training dataset (a ``question`` column) reordered/filtered; returns ``(dataset, report)``."""
        scores = read_scores(self.scores_path)
        matched = [scores.get(question) for question in dataset["question"]]
        n_scored = sum(score is not None for score in matched)
        if n_scored == 0:
            raise GrpoKitError(
                f"None of the {len(dataset)} training questions is in {self.scores_path}: the scores were computed "
                "for other data. Run grpo-kit curriculum with the same --data as training."
            )
        indices = curriculum_order(matched, self.order, self.seed)
        indices, n_flat = zero_variance_filter(indices, matched, self.zero_variance)
        if not indices:
            raise GrpoKitError(
                f"Every training question is zero-variance in {self.scores_path}, so --zero-variance drop left "
                "nothing to train on. Sample more answers (--samples), raise the temperature, or use 'last'."
            )
        report = {
            "scores": str(self.scores_path),
            "order": self.order,
            "zero_variance": self.zero_variance,
            "reward_spec": next(s.reward_spec for s in matched if s is not None),
            "questions": len(dataset),
            "scored": n_scored,
            "zero_variance_questions": n_flat,
            "kept": len(indices),
        }
        return dataset.select(indices), report


# --------------------------------------------------------------------------------------------- CLI


def score_summary(scores: Sequence[PromptScore]) -> dict:
    """Mean entropy, mean accuracy (where gold exists) and the zero-variance share of a scored set.

    >>> score_summary([PromptScore("a", "1", ("1", "1"), (1.0, 1.0)), PromptScore("b", "1", ("1", "2"), (1.0, 0.0))])
    {'questions': 2, 'mean_entropy': 0.3466, 'mean_accuracy': 0.75, 'frac_zero_variance': 0.5}
    """
    accuracies = [s.accuracy for s in scores if s.accuracy is not None]
    n = max(len(scores), 1)
    return {
        "questions": len(scores),
        "mean_entropy": round(sum(s.entropy for s in scores) / n, 4),
        "mean_accuracy": round(sum(accuracies) / len(accuracies), 4) if accuracies else None,
        "frac_zero_variance": round(sum(s.zero_variance for s in scores) / n, 4),
    }

