"""Property tests: no reward raises, each returns one finite float per completion within its documented range,
whatever the text; long adversarial inputs stay fast; the linear-time format check agrees with the DOTALL regex.

Budget: every registered reward scores at least ``FUZZ_EXAMPLES * MIN_BATCH`` (>= 10,000) generated completions.
"""

from __future__ import annotations

import math
import re
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grpo_kit.answers import answers_match, extract_last_number, extract_tagged_answer, normalize_number
from grpo_kit.rewards import RANGES, REWARDS, has_soft_format

FUZZ_EXAMPLES = 1_250
MIN_BATCH = 8  # FUZZ_EXAMPLES * MIN_BATCH = 10,000 completions per reward

FUZZ = settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)

TAG_PIECES = [
    "<think>",
    "</think>",
    "<answer>",
    "</answer>",
    "<think>\n",
    "\n</think>\n",
    "<answer>\n",
    "\n</answer>",
    "<ANSWER>",
    "</Answer>",
    "<answer",
    "</",
    "<|im_end|>",
    "</s>",
    "<eos>",
]
NUMBER_PIECES = [
    "nan",
    "NaN",
    "inf",
    "-inf",
    "Infinity",
    "1e400",
    "10**400",
    "2^3",
    str(10**400),
    "1,000",
    "1,00",
    "$",
    "-",
    "\u2212",
    ".",
    ",",
    "/",
    "0/0",
    "\\boxed{",
    "\\frac{",
    "{",
    "}",
    "%",
    "\u0667\u0662",
    "\uff17\uff12",
]

# Hypothesis draws bytes cheaply (one choice per chunk) and shrinks them well; each byte picks a piece of text from
# VOCAB, so a chunk of 40 bytes is a completion of 40 tags, numbers, words and odd characters.
ODD_PIECES = ["\x00", "\ud800", "\u200b", "\u202e", "e\u0301", "\U0001f600", "\u00a0", "\ufeff", "\\", '"', "'", "`"]
WORD_PIECES = [
    "the answer is",
    " so ",
    "clips",
    "=",
    "+",
    "*",
    "x",
    "Sure!",
    "3/4",
    "\\frac{3}{4}",
    "72",
    "-7",
    "0",
    ".",
]
_BASE = TAG_PIECES + NUMBER_PIECES + ODD_PIECES + WORD_PIECES + list("0123456789") + [" ", "\n", "\t", "\r\n", "  \n\n"]
VOCAB = (_BASE * (256 // len(_BASE) + 1))[:256]
TRAILERS = ["", "\n", "<|im_end|>", " junk", "</answer>", "\n\n<|eot_id|>", "<think>"]


def decode(chunk: bytes):
    """A completion from bytes: byte 0 picks the shape (free text or think/answer template, plain or chat)."""
    if not chunk:
        return ""
    shape, pieces = chunk[0], [VOCAB[b] for b in chunk[1:]]
    half = len(pieces) // 2
    if shape % 3 == 0:
        text = "".join(pieces)
    else:
        middle = ["", "\n", " so "][(shape // 3) % 3]
        text = f"<think>{''.join(pieces[:half])}</think>{middle}<answer>{''.join(pieces[half:])}</answer>"
        text += TRAILERS[(shape // 9) % len(TRAILERS)]
    return [{"role": "assistant", "content": text}] if shape >= 192 else text


chunks = st.binary(max_size=48)
texts = st.one_of(st.text(max_size=40), chunks.map(decode).map(lambda c: c if isinstance(c, str) else c[0]["content"]))
numbers = st.one_of(
    st.integers(min_value=-(10**40), max_value=10**40).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(str),
    st.decimals(allow_nan=True, allow_infinity=True).map(str),
    st.fractions().map(str),
)
golds = st.one_of(numbers, st.text(max_size=8), st.none(), st.integers())
prefills = st.sampled_from(["", "<think>\n", "<think>", "</think>", "<answer>"])


def _check(name, scores, count):
    low, high = RANGES[name]
    assert isinstance(scores, list) and len(scores) == count, name
    for score in scores:
        assert isinstance(score, float) and math.isfinite(score), (name, score)
        assert low <= score <= high, (name, score)


@FUZZ
@given(
    batch=st.lists(chunks.map(decode), min_size=MIN_BATCH, max_size=MIN_BATCH + 4),
    noise=st.text(max_size=40),
    gold=golds,
    prefill=prefills,
)
def test_every_reward_is_total_on_generated_completions(batch, noise, gold, prefill):
    batch = [*batch, noise]
    count = len(batch)
    kwargs = {
        "prompts": ["q"] * count,
        "completion_ids": [[0]] * count,
        "trainer_state": None,
        "answer": [gold] * count,
        "prefill": [prefill] * count,
    }
    for name in RANGES:  # every built-in (other tests register extra rewards in REWARDS)
        _check(name, REWARDS[name](batch, **kwargs), count)


@settings(max_examples=300, deadline=None, database=None)
@given(
    value=st.integers(min_value=-(10**9), max_value=10**9),
    style=st.sampled_from(
        [
            "{n}",
            "{n}.0",
            "${c}",
            "{c}",
            "{n} clips",
            "\\boxed{{{n}}}",
            "{u}",
            "**{n}**",
            "{s}",
            "{t}",
            "{n} (= {n} + 0)",
            "{n}, because the parts add up",
        ]
    ),
    prefill=prefills,
)
def test_correct_answers_score_above_wrong_ones(value, style, prefill):
    grouped = f"{value:,}"
    written = style.format(
        n=value,
        c=grouped,
        u=str(value).replace("-", "\u2212"),
        s=grouped.replace(",", " "),
        t=grouped.replace(",", "\u202f"),
    )
    if style.startswith("$") and value < 0:
        written = "-$" + f"{-value:,}"
    text = f"<think>\nwork\n</think>\n<answer>\n{written}\n</answer>" + "\nChecked: 1 + 2 = 3." * (value % 500)
    right = REWARDS["correctness"]([text], answer=[str(value)])
    wrong = REWARDS["correctness"]([text], answer=[str(value + 1)])
    assert right == [2.0] and wrong == [0.0]


FORMAT_PIECES = [*TAG_PIECES[:8], "a", " ", "\n", "x y"]
FORMAT_REGEX = re.compile(r"\s*<think>.*?</think>\s*<answer>.*?</answer>", re.DOTALL)


@settings(max_examples=1_000, deadline=None, database=None)
@given(text=st.binary(max_size=12).map(lambda raw: "".join(FORMAT_PIECES[b % len(FORMAT_PIECES)] for b in raw)))
def test_soft_format_agrees_with_the_dotall_regex(text):
    assert has_soft_format(text) == bool(FORMAT_REGEX.match(text))


@settings(max_examples=1_000, deadline=None, database=None)
@given(text=texts, other=st.one_of(numbers, st.text(max_size=10)))
def test_answer_helpers_are_total(text, other):
    extract_tagged_answer(text)
    extract_last_number(text)
    normal = normalize_number(text)
    assert normal is None or answers_match(normal, normal)
    assert answers_match(text, other) == answers_match(other, text)


# Adversarial inputs of about 100,000 characters: (head, repeated unit, repeats, tail). The rewards must take linear
# time on them (DESIGN.md, reward contract): a regex that backtracks takes quadratic time, 64x for 8x the input.
LONG_INPUTS = {
    "open think x20000": ("", "<think>", 20_000, ""),
    "open answer x20000": ("", "<answer>", 20_000, ""),
    "close then open": ("", "</think><answer>", 7_000, ""),
    "think close + whitespace": ("<think></think>", " ", 100_000, ""),
    "handover never closed": ("<think>", "</think> <answer>", 6_000, ""),
    "every tag": ("", "<think></think><answer></answer>", 3_000, ""),
    "answer of digits": ("<answer>", "9", 100_000, "</answer>"),
    "answer of commas": ("<answer>", "1,", 50_000, "</answer>"),
    "nested boxed": ("<answer>", "\\boxed{", 14_000, "</answer>"),
    "trailing junk": ("<think>a</think><answer>7</answer>", "x", 100_000, ""),
    "eos markers": ("<think>a</think><answer>7</answer>", "<|im_end|>", 10_000, ""),
    "whitespace": ("", " \n", 50_000, ""),
    "unicode": ("", "\u2212\u0667\uff17\U0001f600", 25_000, ""),
    "closing tags": ("", "</answer>", 11_000, ""),
    "answer left open": ("<think>a</think><answer>", "7, because ", 9_000, ""),
    "alternatives": ("<answer>", "18 or ", 16_000, "</answer>"),
    "spaced digits": ("<answer>", "1 000 ", 16_000, "</answer>"),
    "bold": ("<answer>", "**7** ", 16_000, "</answer>"),
}


def long_input(label: str, fraction: int = 1) -> str:
    head, unit, repeats, tail = LONG_INPUTS[label]
    return head + unit * (repeats // fraction) + tail


def fastest_seconds(name: str, text: str) -> float:
    """The fastest of three calls in this process's CPU time: the reward's own work, without the time other processes
    hold the CPU, which a wall clock counts."""
    times = []
    for _ in range(3):
        start = time.process_time()
        REWARDS[name]([text, [{"role": "assistant", "content": text}]], answer=["7", "7"], prefill="<think>\n")
        times.append(time.process_time() - start)
    return min(times)


@pytest.mark.parametrize("name", sorted(RANGES))
@pytest.mark.parametrize("label", sorted(LONG_INPUTS))
def test_long_adversarial_input_takes_linear_time(name, label):
    text = long_input(label)
    assert len(text) >= 90_000
    _check(name, REWARDS[name]([text, [{"role": "assistant", "content": text}]], answer=["7", "7"]), 2)
    # 8x the input: about 8x the time when linear, 64x when quadratic; a ratio holds on a busy machine as well
    ratio = fastest_seconds(name, text) / max(fastest_seconds(name, long_input(label, 8)), 1e-4)
    assert ratio < 24, f"{name}: 8x the input {label!r} took {ratio:.0f}x the time (not linear)"
