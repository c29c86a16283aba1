"""Reward functions for GRPO on GSM8K as TRL's ``GRPOTrainer`` calls them, chosen by name from ``REWARDS``.

Every reward is ``fn(completions, **kwargs) -> list[float]``: one finite float per completion, never an exception,
whatever the text. Of the columns TRL passes they read ``answer`` (the gold canonical number, "72") and ``prefill``
(text the kit prefilled for the assistant, prepended so a prefilled ``<think>`` counts as written). Rewards that read
the answer follow ``grpo_kit.answers``; rewards that judge the format check the tags as the system prompt asks them:
lowercase, ``</answer>`` written (vLLM: ``include_stop_str_in_output=True``). math-verify is deliberately not used:
GSM8K gold answers are plain numbers, and its sympy parsing is slow and needs ``signal.alarm`` timeouts that fail
outside the main thread. Every check is linear in the text length (``str.find``/``str.count``, no backtracking).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import itertools
import math
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

from grpo_kit.answers import (
    GROUPED,
    MAX_DIGITS,
    answers_match,
    digit_count,
    extract_tagged_answer,
    normalize_number,
    strip_end_markers,
)
from grpo_kit.errors import GrpoKitError

THINK_OPEN, THINK_CLOSE, ANSWER_OPEN, ANSWER_CLOSE = "<think>", "</think>", "<answer>", "</answer>"
TAGS = (THINK_OPEN, THINK_CLOSE, ANSWER_OPEN, ANSWER_CLOSE)
CORRECT_POINTS, FORMAT_POINTS, INTEGER_POINTS, TAG_POINTS = 2.0, 0.5, 0.5, 0.25
#: tag_count: penalty per character of text after the last </answer>, capped so long junk cannot dominate.
TRAILING_PENALTY_PER_CHAR, TRAILING_PENALTY_CAP = 0.001, 0.25

# Literal start, then one whitespace run: each "</think>" is tried once, so the search is linear in the text length.
_THINK_THEN_ANSWER = re.compile(r"</think>\s*<answer>")
# ASCII digits only; thousands grouped as answers.GROUPED groups them ("1,000", "70 000").
_INTEGER = re.compile(r"[-\u2212]?(?:\d+|" + GROUPED + ")", re.ASCII)


def completion_text(completion: Any) -> str:
    """The text of one completion: a string as is, a message list's last ``content``, anything else ``""``."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, (list, tuple)):
        completion = completion[-1] if completion else None
    content = completion.get("content") if isinstance(completion, dict) else None
    if isinstance(content, (list, tuple)):  # multimodal parts: [{"type": "text", "text": ...}]
        return "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return content if isinstance(content, str) else ""


def column(values: Any, index: int) -> Any:
    """Entry ``index`` of a TRL column (a list), the value itself when a single value was given, else None."""
    if isinstance(values, (list, tuple)):
        return values[index] if index < len(values) else None
    return values


def _texts(completions: Sequence[Any] | None, prefill: Any = None) -> list[str]:
    """Completion texts with each one's prefill prepended (``prefill`` is a list per completion or one string)."""
    return [
        (head if isinstance(head := column(prefill, i), str) else "") + completion_text(c)
        for i, c in enumerate(completions or ())
    ]


def has_soft_format(text: str) -> bool:
    """``<think>…</think>`` then ``<answer>…</answer>`` (anything inside, newlines too), text may follow: the same as
    ``re.match(r"\\s*<think>.*?</think>\\s*<answer>.*?</answer>", text, re.DOTALL)`` in linear time."""
    body = text.lstrip()
    if not body.startswith(THINK_OPEN):
        return False
    # The earliest "</think> <answer>" leaves the most room for "</answer>" after it, so it alone decides.
    handover = _THINK_THEN_ANSWER.search(body, len(THINK_OPEN))
    return handover is not None and body.find(ANSWER_CLOSE, handover.end()) >= 0


def _per_text(score: Callable[[str], float]) -> Callable[..., list[float]]:
    """The reward ``fn(completions, prefill=None, **kwargs)`` that gives each completion ``score(text)``, its prefill
    prepended (``_texts``); named, documented and pickled as ``score``."""

    @functools.wraps(score)
    def reward(completions, prefill=None, **kwargs) -> list[float]:
        return [score(text) for text in _texts(completions, prefill)]

    return reward


# ---------------------------------------------------------------------------------------------------------------
# The rewards. The first docstring line is the row of the README's reward table (the weight-0 metrics share one row).


def correctness_reward(completions, answer=None, prefill=None, **kwargs) -> list[float]:
    """the last ``<answer>`` block reads as the gold number (``$1,000`` = ``1000``)

    Exact after normalizing (``grpo_kit.answers``): "72.0", "$72", "72 clips", "\\boxed{72}" equal "72"."""
    scores = []
    for i, text in enumerate(_texts(completions, prefill)):
        gold = column(answer, i)
        gold = str(gold) if isinstance(gold, (int, float)) else gold  # anything else reads as no number
        scores.append(CORRECT_POINTS if answers_match(extract_tagged_answer(text), gold) else 0.0)
    return scores


@_per_text
def format_reward(text: str) -> float:
    """soft format: ``<think>…</think>`` then ``<answer>…</answer>``, multi-line reasoning allowed

    Unlike the widely copied 2025 regex (no DOTALL), reasoning over several lines counts. Text may follow."""
    return FORMAT_POINTS if has_soft_format(text) else 0.0


@_per_text
def tag_count_reward(text: str) -> float:
    """0.25 per think/answer tag seen exactly once, minus 0.001 per character after ``</answer>`` (at most 0.25)

    Whitespace and end-of-sequence markers after the last ``</answer>`` are not trailing text."""
    _, close, after = text.rpartition(ANSWER_CLOSE)
    trailing = strip_end_markers(after).strip() if close else ""
    penalty = min(TRAILING_PENALTY_PER_CHAR * len(trailing), TRAILING_PENALTY_CAP)
    return round(sum(TAG_POINTS for tag in TAGS if text.count(tag) == 1) - penalty, 6)


@_per_text
def integer_reward(text: str) -> float:
    """the ``<answer>`` text is a bare integer (``-7``, ``1,000`` yes; ``3.5``, ``72 clips`` no)

    Digits, an optional minus, optional thousands separators, at most ``MAX_DIGITS`` digits."""
    answer = extract_tagged_answer(text) or ""  # stripped already
    return INTEGER_POINTS if _INTEGER.fullmatch(answer) and digit_count(answer) <= MAX_DIGITS else 0.0


@_per_text
def tag_progress_reward(text: str) -> float:
    """CPU recipe: 0.25 per ``</think>``, ``<answer>``, ``</answer>`` seen once, +0.25 for an answer block after
    ``</think>``

    With ``<think>\\n`` prefilled each step toward the format earns something, so a 135M model's first attempts
    already differ in reward (GRPO needs that variance to learn)."""
    # str.partition gives "" after a separator it does not find: no </think>, or no <answer> after it, is no block
    answer_after_think = ANSWER_CLOSE in text.partition(THINK_CLOSE)[2].partition(ANSWER_OPEN)[2]
    return sum(TAG_POINTS for tag in TAGS[1:] if text.count(tag) == 1) + TAG_POINTS * answer_after_think


@_per_text
def format_rate(text: str) -> float:
    """metric, weight 0 in training: 1 when ``format`` gives credit (TRL logs the share as
    ``rewards/format_rate/mean``)"""
    return 1.0 if has_soft_format(text) else 0.0


def semantic_entropy(completions, prompts=None, prefill=None, **kwargs) -> list[float]:
    """metric, weight 0: how much a question's G answers disagree, 0 (one number) to 1 (all different)

    Each completion gets its group's discrete semantic entropy (Kuhn et al. 2023; Farquhar et al. 2024): the answers
    are clustered by the number in their last ``<answer>`` (``grpo_kit.answers``: ``$1,000`` = ``1000``), an unreadable
    one is a cluster of its own, and H = -sum p log p with p = |cluster| / G, divided by log G. A group is the
    consecutive completions of one prompt, gathered from every process first (TRL may spread one over several)."""
    from accelerate import PartialState
    from accelerate.utils import gather_object

    texts = _texts(completions, prefill)
    local = [(str(column(prompts, i)), normalize_number(extract_tagged_answer(t))) for i, t in enumerate(texts)]
    entropy = []  # gathered in TRL's order: each process's completions in turn
    for _, group in itertools.groupby(gather_object(local), key=lambda pair: pair[0]):
        answers = [answer or i for i, (_, answer) in enumerate(group)]  # an unreadable answer: a cluster of its own
        shares = [answers.count(a) / len(answers) for a in set(answers)]
        h = -sum(p * math.log(p) for p in shares) / math.log(len(answers)) if len(shares) > 1 else 0.0  # 1 cluster: 0
        entropy += [min(h, 1.0)] * len(answers)  # all different: 1, but for the last bit of float rounding
    offset = PartialState().process_index * len(local)  # every process holds as many completions
    return entropy[offset : offset + len(local)]


#: Words of an answer that re-checks itself, the "aha moment" of DeepSeek-R1's paper (whole words, any case).
REFLECTION_PHRASES = (
    "wait",
    "let me check",
    "let's check",
    "recheck",
    "re-check",
    "double-check",
    "verify",
    "actually",
)
_REFLECTS = re.compile(r"\b(?:" + "|".join(map(re.escape, REFLECTION_PHRASES)) + r")\b", re.IGNORECASE)


@_per_text
def reflection_rate(text: str) -> float:
    """metric, weight 0: 1 when the answer re-checks itself ("wait", "let me check", ``REFLECTION_PHRASES``), else 0

    A cheap proxy for the "aha moment": it counts words, not reasoning."""
    return 1.0 if _REFLECTS.search(text) else 0.0


def seed_grpo(funcs: Sequence[Callable], recipe) -> list[Callable]:
    """``funcs`` as SEED-GRPO (Chen et al. 2025, arXiv 2505.12346) weighs them: with ``seed_grpo_alpha`` > 0, each
    trained reward of a group scaled by 1 / (1 + alpha * H), H the group's ``semantic_entropy``. With
    ``scale_rewards: none`` TRL's advantage is then (r_i - mean r) / (1 + alpha * H): the paper's A_i * f(alpha * SE /
    SE_max) with f(x) = 1 / (1 + x), cluster mass counted (p = |C| / G) where the paper sums the answers'
    probabilities. Metrics (weight 0) are left as they are; 0 (the default) returns ``funcs`` unchanged.

    What each reward gave is logged as without SEED-GRPO (``rewards/<name>/mean``, its column of TRL's completions
    table, and their weighted sum ``reward_unscaled``); what trains is TRL's ``seed_grpo/<name>`` and ``reward``
    (``callbacks.TrainingRun`` writes these two totals as ``reward`` and ``seed_grpo/reward``)."""
    from trl.trainer.utils import get_callable_name  # the name TRL logs a reward under

    alpha, trained = recipe.kit.seed_grpo_alpha, sum(1 for _, weight in recipe.rewards if weight)

    def scaled(fn, weight, name):
        def reward(completions, **kwargs):
            scores, h = fn(completions, **kwargs), semantic_entropy(completions, **kwargs)
            given = [s for s in scores if s is not None]
            if given and "log_metric" in kwargs:  # TRL averages a metric's values: n rewards logging n x a share sum
                kwargs["log_metric"](f"rewards/{name}/mean", sum(given) / len(given))
                kwargs["log_metric"]("reward_unscaled", trained * weight * sum(given) / len(scores))
                kwargs["log_extra"](name, scores)
            return [s if s is None else s / (1 + alpha * e) for s, e in zip(scores, h, strict=True)]

        reward.__name__ = f"seed_grpo/{name}"  # TRL logs the scaled score under its own name
        return reward

    return [
        scaled(fn, weight, get_callable_name(fn)) if alpha and weight else fn
        for fn, (_, weight) in zip(funcs, recipe.rewards, strict=True)
    ]


#: The built-in rewards that are metrics: logged under their own name (weight 0 in the recipes: they never train).
#: Weight-0 rewards, not ``log_metric``/``log_extra`` calls from another reward: TRL logs each one's mean, std and
#: per-completion column itself, and a recipe adds or drops one by name like any reward.
METRICS = ("format_rate", "semantic_entropy", "reflection_rate")
#: name -> reward function, in the order of the README's reward table.
REWARDS: dict[str, Callable[..., list[float]]] = {
    "correctness": correctness_reward,
    "format": format_reward,
    "tag_count": tag_count_reward,
    "integer": integer_reward,
    "tag_progress": tag_progress_reward,
    "format_rate": format_rate,
    "semantic_entropy": semantic_entropy,
    "reflection_rate": reflection_rate,
}
for _name, _fn in REWARDS.items():
    _fn.__name__ = _name  # TRL logs rewards/<__name__>/mean
#: built-in reward -> (lowest, highest) score it gives.
RANGES = {
    "correctness": (0.0, CORRECT_POINTS),
    "format": (0.0, FORMAT_POINTS),
    "tag_count": (-TRAILING_PENALTY_CAP, 4 * TAG_POINTS),
    "integer": (0.0, INTEGER_POINTS),
    "tag_progress": (0.0, 4 * TAG_POINTS),
    "format_rate": (0.0, 1.0),
    "semantic_entropy": (0.0, 1.0),
    "reflection_rate": (0.0, 1.0),
}


# ---------------------------------------------------------------------------------------------------------------
# Rewards by name (a recipe's reward_funcs; TRL's reward_weights weigh them)


def reward_functions(names: Sequence[str | Callable]) -> list[Callable[..., list[float]]]:
    """The reward functions ``names`` name: a built-in (``REWARDS``) or ``package.module:function``, imported as TRL's
    ``scripts/grpo.py`` imports its rewards (the working folder counts, so ``my_rewards.py`` beside you works); a
    Python function given itself (a lambda, a ``functools.partial``, a callable object) is used as it is.

    A recipe runs the code it names, like a script: run recipes you trust. Builtins and C functions (``os:system``)
    are refused: a reward is a Python function that takes the completions and returns one score each.
    """
    if isinstance(names, str) or not names:
        raise GrpoKitError(f"Rewards are a list of names, e.g. [correctness, format]; got {names!r}.")
    from trl.trainer.utils import get_callable_name  # a Python function's name in TRL's logs

    named = [item if isinstance(item, str) else get_callable_name(item) for item in names]
    if duplicates := sorted({name for name in named if named.count(name) > 1}):
        raise GrpoKitError(
            f"Reward {duplicates[0]!r} is named twice; name it once and give it a larger weight (two different "
            "Python functions with one name, such as two lambdas: give each a name of its own, e.g. with def)."
        )
    return list(map(_reward_function, names))


def _reward_function(name: str | Callable) -> Callable[..., list[float]]:
    if not isinstance(name, str):
        return name  # a function passed in Python: used as it is
    name = name.strip()
    if name in REWARDS:
        return REWARDS[name]
    module, _, function = name.partition(":")  # config._check refused unknown bare names (no ":")
    if os.getcwd() not in sys.path:  # a console script's sys.path lacks the folder the user runs it from
        sys.path.append(os.getcwd())
    try:
        fn = getattr(importlib.import_module(module), function)
    except ModuleNotFoundError as error:
        raise GrpoKitError(
            f"Reward {name!r}: cannot import module {module!r} ({error}). Put "
            f"{module.replace('.', '/')}.py in the folder you run from, or install the package that "
            "holds it."
        ) from None
    except AttributeError:
        raise GrpoKitError(
            f"Reward {name!r}: module {module!r} has no function {function!r}"
            + (
                " (a lambda or a function defined inside another cannot be imported by name: pass the function "
                "itself, load_recipe(..., reward_funcs=[...]), and train from Python)"
                if "<" in function
                else ""
            )
            + "."
        ) from None
    if not callable(fn) or inspect.isbuiltin(fn) or inspect.ismethoddescriptor(fn) or isinstance(fn, type):
        raise GrpoKitError(
            f"Reward {module}.{function} is not a Python reward function (f(completions, **kwargs) -> list of "
            "floats); builtins and classes cannot be rewards."
        )
    return fn
