"""Reward functions for GRPO on GSM8K, in the form TRL's ``GRPOTrainer`` calls them.

Every reward is ``fn(completions, **kwargs) -> list[float]``: one finite float per completion, never an exception,
whatever the text (empty, 100k characters, unbalanced tags, "nan", 10**400). TRL also passes ``prompts``,
``completion_ids``, ``trainer_state`` and every dataset column as lists; the rewards read two columns:

- ``answer``: the gold canonical number string (e.g. "72"), used by ``correctness``;
- ``prefill``: text the kit prefilled for the assistant (e.g. ``"<think>\\n"``), prepended to each completion before
  scoring, so a prefilled ``<think>`` counts as written.

A completion is a plain string or a conversational list of messages (the text is the last message's ``content``).
The chat format is ``<think> reasoning </think><answer> final number </answer>``.

Rewards that read the answer (``correctness``, ``integer``, ``answer_number``) follow ``grpo_kit.answers``: the last
answer block wherever it is and however much text follows, tags in any case, a final block left open (a stripped
``</answer>`` stop string) read to the end. Rewards that judge the format (``format``, ``strict_format``,
``tag_count``, ``tag_progress``) check the tags exactly as the system prompt asks: lowercase, and ``</answer>``
written, so a run that stops generation at ``</answer>`` gets no format credit for it (vLLM: keep it in the text
with ``include_stop_str_in_output=True``).

>>> good = "<think>\\n48 / 2 = 24, 48 + 24 = 72\\n</think>\\n<answer>\\n72\\n</answer>"
>>> correctness_reward([good, "<answer>71</answer>"], answer=["72", "72"])
[2.0, 0.0]

Choosing rewards by name, with weights, and scoring outside training: ``grpo_kit.machinery.reward_specs``
(``parse_reward_spec("correctness:2,format")``, ``score_completions``).

Correctness compares numbers with ``grpo_kit.answers`` (exact decimal equality after reading "$1,000", "72 clips",
"\\\\boxed{72}", "\\\\frac{3}{4}" ...). math-verify is deliberately not used here: GSM8K gold answers are plain
numbers, and math-verify's sympy parsing is slow and needs ``signal.alarm`` timeouts that fail outside the main
thread. Tag checks use ``str.find``/``str.count`` (linear time, no regex backtracking); answer extraction is linear
in the text length too.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from grpo_kit.answers import (
    MAX_DIGITS,
    THOUSANDS_SEPARATORS,
    answers_match,
    extract_tagged_answer,
    normalize_number,
    strip_end_markers,
)

THINK_OPEN, THINK_CLOSE, ANSWER_OPEN, ANSWER_CLOSE = "<think>", "</think>", "<answer>", "</answer>"
TAGS = (THINK_OPEN, THINK_CLOSE, ANSWER_OPEN, ANSWER_CLOSE)

#: Points per reward (the registry's ranges are built from these).
CORRECT_POINTS = 2.0
FORMAT_POINTS = 0.5
INTEGER_POINTS = 0.5
TAG_POINTS = 0.25
#: tag_count: penalty per character of text after the last </answer>, and its cap.
TRAILING_PENALTY_PER_CHAR = 0.001
TRAILING_PENALTY_CAP = 0.25
#: A reward spec that reproduces the classic five GSM8K rewards, with the bugs fixed.
DEFAULT_REWARD_SPEC = "correctness,integer,strict_format,format,tag_count"

# Literal start, then one whitespace run: each "</think>" is tried once, so the search is linear in the text length.
_THINK_THEN_ANSWER = re.compile(r"</think>\s*<answer>")
_INTEGER = re.compile(
    r"[-\u2212]?(?:[0-9]+|"
    + "|".join(rf"[0-9]{{1,3}}(?:{re.escape(s)}[0-9]{{3}})+" for s in THOUSANDS_SEPARATORS)
    + ")"
)


@dataclass(frozen=True)
class RewardInfo:
    """What a reward scores and the range of values it returns (``low`` ≤ reward ≤ ``high``)."""

    name: str
    low: float
    high: float
    description: str


#: name → reward function (filled by ``_reward`` below, in table order).
REWARDS: dict[str, Callable[..., list[float]]] = {}
#: name → RewardInfo, for the table that ``grpo-kit rewards`` prints and the README embeds.
REWARD_INFO: dict[str, RewardInfo] = {}


def _reward(name: str, low: float, high: float, description: str):
    """Register a reward under ``name``; its ``__name__`` becomes ``name`` so TRL logs ``rewards/<name>/mean``."""

    def register(fn: Callable[..., list[float]]) -> Callable[..., list[float]]:
        fn.__name__ = name
        REWARDS[name] = fn
        REWARD_INFO[name] = RewardInfo(name, low, high, description)
        return fn

    return register


# ---------------------------------------------------------------------------------------------------------------
# Inputs: completion text, prefill, gold answers


def completion_text(completion: Any) -> str:
    """The text of one completion: a string as is, a message list's last ``content``, anything else ``""``.

    >>> completion_text([{"role": "assistant", "content": "<answer>7</answer>"}])
    '<answer>7</answer>'
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, (list, tuple)):
        completion = completion[-1] if completion else None
    if isinstance(completion, dict):
        content = completion.get("content")
        if isinstance(content, str):
            return content
        if isinstance(content, (list, tuple)):  # multimodal parts: [{"type": "text", "text": ...}]
            return "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def column(values: Any, index: int) -> Any:
    """Entry ``index`` of a TRL column (a list), the value itself when a single value was given, else None."""
    if isinstance(values, (list, tuple)):
        return values[index] if index < len(values) else None
    return values


def _texts(completions: Sequence[Any], prefill: Any = None) -> list[str]:
    """Completion texts with each one's prefill prepended (``prefill`` is a list per completion or one string)."""
    if completions is None:
        return []
    texts = []
    for i, completion in enumerate(completions):
        head = column(prefill, i)
        texts.append((head if isinstance(head, str) else "") + completion_text(completion))
    return texts


def _strip_end(text: str) -> str:
    """``text`` without trailing whitespace and end-of-sequence markers."""
    return strip_end_markers(text)


# ---------------------------------------------------------------------------------------------------------------
# Per-text checks (pure, linear time)


def has_soft_format(text: str) -> bool:
    """``<think>…</think>`` then ``<answer>…</answer>`` (anything inside, newlines too), text may follow.

    Same as ``re.match(r"\\s*<think>.*?</think>\\s*<answer>.*?</answer>", text, re.DOTALL)`` in linear time.

    >>> has_soft_format("<think>\\nline 1\\nline 2\\n</think>\\n<answer>\\n7\\n</answer>")
    True
    """
    body = text.lstrip()
    if not body.startswith(THINK_OPEN):
        return False
    # The earliest "</think> <answer>" leaves the most room for "</answer>" after it, so it alone decides.
    handover = _THINK_THEN_ANSWER.search(body, len(THINK_OPEN))
    return handover is not None and body.find(ANSWER_CLOSE, handover.end()) >= 0


def has_strict_format(text: str) -> bool:
    """Exactly ``<think> reasoning </think> <answer> answer </answer>`` and nothing else but whitespace/EOS.

    Each tag appears once, reasoning and answer are non-empty, only whitespace around and between the blocks.

    >>> has_strict_format("<think>\\n3 + 4 = 7\\n</think>\\n<answer>\\n7\\n</answer>\\n<|im_end|>")
    True
    >>> has_strict_format("<think>x</think><answer>7</answer> more")
    False
    """
    body = _strip_end(text).lstrip()
    if not (body.startswith(THINK_OPEN) and body.endswith(ANSWER_CLOSE)):
        return False
    if any(body.count(tag) != 1 for tag in TAGS):
        return False
    think_close, answer_open = body.find(THINK_CLOSE), body.find(ANSWER_OPEN)
    if answer_open < think_close:
        return False
    reasoning = body[len(THINK_OPEN) : think_close]
    between = body[think_close + len(THINK_CLOSE) : answer_open]
    answer = body[answer_open + len(ANSWER_OPEN) : -len(ANSWER_CLOSE)]
    return not between.strip() and bool(reasoning.strip()) and bool(answer.strip())


def trailing_text(text: str) -> str:
    """What follows the last ``</answer>`` (without surrounding whitespace and EOS markers); "" when no tag.

    >>> trailing_text("<answer>7</answer> and more<|im_end|>")
    'and more'
    """
    end = text.rfind(ANSWER_CLOSE)
    return "" if end < 0 else _strip_end(text[end + len(ANSWER_CLOSE) :]).strip()


def has_answer_after_think(text: str) -> bool:
    """A complete ``<answer>…</answer>`` block somewhere after the first ``</think>``.

    >>> has_answer_after_think("</think> so <answer>7</answer>"), has_answer_after_think("<answer>7</answer></think>")
    (True, False)
    """
    think_close = text.find(THINK_CLOSE)
    if think_close < 0:
        return False
    opened = text.find(ANSWER_OPEN, think_close + len(THINK_CLOSE))
    return opened >= 0 and text.find(ANSWER_CLOSE, opened + len(ANSWER_OPEN)) >= 0


def is_integer_answer(answer: str | None) -> bool:
    """The answer text is a bare integer: digits, optional minus, optional thousands separators, at most MAX_DIGITS.

    >>> [is_integer_answer(s) for s in ["72", "-7", "1,000", "70 000", "3.5", "72 clips", "1,000 000", "", None]]
    [True, True, True, True, False, False, False, False, False]
    """
    if not answer:
        return False
    answer = answer.strip()
    return bool(_INTEGER.fullmatch(answer)) and sum(c.isdigit() for c in answer) <= MAX_DIGITS


def _finite(value: float) -> float:
    value = float(value)
    return value if math.isfinite(value) else 0.0


# ---------------------------------------------------------------------------------------------------------------
# The rewards


@_reward("correctness", 0.0, CORRECT_POINTS, "the last `<answer>` block reads as the gold number (`$1,000` = `1000`)")
def correctness_reward(completions, answer=None, prefill=None, **kwargs) -> list[float]:
    """2.0 when the last ``<answer>`` block holds the gold number, else 0.0 (wrong, empty, missing, absurd, no gold).

    Range 0.0 to 2.0. Numbers are compared exactly after normalizing: "72", "72.0", "$72", "72 clips",
    "\\\\boxed{72}" all equal "72"; "1,000" equals "1000".

    >>> correctness_reward(["<think>..</think><answer>$1,000</answer>", "<answer>999</answer>", "1000"], answer=["1000"] * 3)
    [2.0, 0.0, 0.0]
    """
    texts = _texts(completions, prefill)
    scores = []
    for i, text in enumerate(texts):
        gold = column(answer, i)
        gold = gold if isinstance(gold, str) else (str(gold) if isinstance(gold, (int, float)) else None)
        scores.append(CORRECT_POINTS if answers_match(extract_tagged_answer(text), gold) else 0.0)
    return scores


@_reward(
    "format",
    0.0,
    FORMAT_POINTS,
    "soft format: `<think>…</think>` then `<answer>…</answer>`, multi-line reasoning allowed",
)
def format_reward(completions, prefill=None, **kwargs) -> list[float]:
    """0.5 when the text starts with a think block followed by an answer block (multi-line, text may follow), else 0.

    Range 0.0 to 0.5. Unlike the widely copied 2025 regex (no DOTALL), reasoning over several lines counts.

    >>> format_reward(["<think>\\na\\nb\\n</think>\\n<answer>7</answer> bye", "<answer>7</answer>"])
    [0.5, 0.0]
    """
    return [FORMAT_POINTS if has_soft_format(text) else 0.0 for text in _texts(completions, prefill)]


@_reward(
    "strict_format",
    0.0,
    FORMAT_POINTS,
    "the whole text is exactly `<think>…</think><answer>…</answer>`, each tag once, nothing after",
)
def strict_format_reward(completions, prefill=None, **kwargs) -> list[float]:
    """0.5 when the whole completion is one think block and one answer block, whitespace/EOS only around them.

    Range 0.0 to 0.5. Whitespace between tags is free; each tag exactly once; reasoning and answer non-empty.

    >>> strict_format_reward(["<think>\\n7\\n</think>\\n<answer>\\n7\\n</answer>\\n", "<think>7</think><answer>7</answer>!"])
    [0.5, 0.0]
    """
    return [FORMAT_POINTS if has_strict_format(text) else 0.0 for text in _texts(completions, prefill)]


@_reward(
    "tag_count",
    -TRAILING_PENALTY_CAP,
    4 * TAG_POINTS,
    "0.25 per think/answer tag seen exactly once, minus 0.001 per character after `</answer>` (at most 0.25)",
)
def tag_count_reward(completions, prefill=None, **kwargs) -> list[float]:
    """Partial credit: 0.25 for each of the four tags appearing exactly once, minus a bounded trailing-text penalty.

    Range -0.25 to 1.0. The penalty is 0.001 per character after the last ``</answer>`` (whitespace and EOS
    markers ignored), capped at 0.25 so long junk cannot dominate the other rewards.

    >>> tag_count_reward(["<think>a</think><answer>7</answer>", "<think>a</think><answer>7</answer>" + "x" * 100])
    [1.0, 0.9]
    """
    scores = []
    for text in _texts(completions, prefill):
        seen_once = sum(TAG_POINTS for tag in TAGS if text.count(tag) == 1)
        penalty = min(TRAILING_PENALTY_PER_CHAR * len(trailing_text(text)), TRAILING_PENALTY_CAP)
        scores.append(_finite(round(seen_once - penalty, 6)))
    return scores


@_reward(
    "integer", 0.0, INTEGER_POINTS, "the `<answer>` text is a bare integer (`-7`, `1,000` yes; `3.5`, `72 clips` no)"
)
def integer_reward(completions, prefill=None, **kwargs) -> list[float]:
    """0.5 when the last ``<answer>`` block holds a bare integer (negatives and thousands commas allowed), else 0.

    Range 0.0 to 0.5.

    >>> integer_reward(["<answer>-7</answer>", "<answer>1,000</answer>", "<answer>3.5</answer>", "7"])
    [0.5, 0.5, 0.0, 0.0]
    """
    return [
        INTEGER_POINTS if is_integer_answer(extract_tagged_answer(t)) else 0.0 for t in _texts(completions, prefill)
    ]


@_reward(
    "tag_progress",
    0.0,
    4 * TAG_POINTS,
    "CPU recipe: 0.25 per `</think>`, `<answer>`, `</answer>` seen once, +0.25 for an answer block after `</think>`",
)
def tag_progress_reward(completions, prefill=None, **kwargs) -> list[float]:
    """The reward a 135M model learns the format from on CPU (with ``<think>\\n`` prefilled).

    Range 0.0 to 1.0: 0.25 for each of ``</think>``, ``<answer>``, ``</answer>`` appearing exactly once, plus 0.25
    when a complete ``<answer>…</answer>`` block follows the first ``</think>``. Each step toward the format earns
    something, so a small model's first attempts already differ in reward (GRPO needs that variance to learn).

    >>> tag_progress_reward(["a</think><answer>7</answer>", "a</think>", "nothing"], prefill=["<think>\\n"] * 3)
    [1.0, 0.25, 0.0]
    """
    scores = []
    for text in _texts(completions, prefill):
        seen_once = sum(TAG_POINTS for tag in (THINK_CLOSE, ANSWER_OPEN, ANSWER_CLOSE) if text.count(tag) == 1)
        scores.append(seen_once + (TAG_POINTS if has_answer_after_think(text) else 0.0))
    return scores


@_reward(
    "answer_number", 0.0, INTEGER_POINTS, "a number can be read from the last `<answer>` block (`72 clips`, `$3.50`)"
)
def answer_number_reward(completions, prefill=None, **kwargs) -> list[float]:
    """0.5 when a number can be read from the last ``<answer>`` block ("72 clips", "$3.50", "\\\\frac{1}{2}"), else 0.

    Range 0.0 to 0.5.

    >>> answer_number_reward(["<answer>72 clips</answer>", "<answer>seventy</answer>"])
    [0.5, 0.0]
    """
    return [
        INTEGER_POINTS if normalize_number(extract_tagged_answer(t) or "") is not None else 0.0
        for t in _texts(completions, prefill)
    ]


# ---------------------------------------------------------------------------------------------------------------
# Scoring completions outside training, and the format metric


def format_rate(completions, prefill=None, **kwargs) -> list[float]:
    """Metric-only reward (weight 0 in training): 1.0 when a completion is in the think/answer format, else 0.0.

    TRL logs it as ``rewards/format_rate/mean``: the share of completions in the format.
    """
    return [1.0 if score > 0 else 0.0 for score in REWARDS["format"](completions, prefill=prefill, **kwargs)]
