"""grpo_kit.answers: extraction protocols, normalization and equivalence, including the edge cases rewards rely on."""

from __future__ import annotations

import doctest
import time

import pytest

from grpo_kit import answers
from grpo_kit.answers import (
    MAX_DIGITS,
    MAX_SCAN_CHARS,
    answers_match,
    extract_last_number,
    extract_tagged_answer,
    normalize_number,
)


def test_doctests_hold():
    assert doctest.testmod(answers).failed == 0


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<answer>72</answer>", "72"),
        ("<think>x</think><answer>\n  72 clips \n</answer>", "72 clips"),
        ("<answer>1</answer> then <answer>2</answer>", "2"),
        ("<ANSWER>5</Answer>", "5"),
        ("<answer>\nmulti\nline\n</answer>", "multi\nline"),
        ("<answer></answer>", ""),
        ("<answer>unfinished", None),
        ("no tags at all", None),
        ("", None),
        ("</answer>7<answer>", None),
        ("<answer>early</answer>" + "x" * (MAX_SCAN_CHARS + 10), None),  # only the tail is scanned
        ("x" * 100_000 + "<answer>9</answer>", "9"),
    ],
)
def test_extract_tagged_answer(text, expected):
    assert extract_tagged_answer(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("She pays $1,250.50 and then 3 more", "3"),
        ("total: 1,000", "1,000"),
        ("it is -7", "-7"),
        ("it is \u22127", "\u22127"),
        ("5-3", "3"),
        ("pages 10-12", "12"),
        ("x = .5", ".5"),
        ("no numbers", None),
        ("", None),
    ],
)
def test_extract_last_number(text, expected):
    assert extract_last_number(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("72", "72"),
        ("72.0", "72"),
        ("72.50", "72.5"),
        ("$72", "72"),
        ("72 clips", "72"),
        ("\\boxed{72}", "72"),
        ("\\boxed{ 72 }", "72"),
        ("$\\boxed{1,000}$", "1000"),
        ("1,000", "1000"),
        ("1,000,000.00", "1000000"),
        ("-7", "-7"),
        ("\u22127", "-7"),
        ("= -7", "-7"),
        ("(-7)", "-7"),
        ("$-7", "-7"),
        ("-0", "0"),
        ("0.0", "0"),
        (".5", "0.5"),
        ("5.", "5"),
        ("3/4", "0.75"),
        (" 3 / 4 ", "0.75"),
        ("-3/4", "-0.75"),
        ("\\frac{3}{4}", "0.75"),
        ("\\dfrac{1}{2}", "0.5"),
        ("-\\frac{3}{4}", "-0.75"),
        ("$\\frac{3}{4}$", "0.75"),
        ("\\boxed{\\frac{3}{4}}", "0.75"),
        ("3 + 4 = 7", "7"),
        ("5-3", "3"),
        ("50%", "50"),
        ("1" * MAX_DIGITS, "1" * MAX_DIGITS),  # the largest size still read (used to raise InvalidOperation)
        ("-" + "9" * MAX_DIGITS, "-" + "9" * MAX_DIGITS),
        ("9" * MAX_DIGITS + "/1", "9" * MAX_DIGITS),
        ("1" * (MAX_DIGITS + 1), None),  # absurd
        ("1/" + "9" * (MAX_DIGITS + 1), None),
        (str(10**400), None),
        ("10**400", None),  # an exponent: the last digits are not the value
        ("2^3", None),
        ("1e5", None),
        ("1.5e3", None),
        ("2^3 = 8", "8"),
        ("3/0", None),
        ("nan", None),
        ("NaN", None),
        ("inf", None),
        ("-inf", None),
        ("Infinity", None),
        ("seventy-two", None),
        ("", None),
        ("   ", None),
        ("\\boxed{}", None),
        ("\u0667\u0662", "72"),  # Arabic-Indic digits are digits
    ],
)
def test_normalize_number(text, expected):
    assert normalize_number(text) == expected


@pytest.mark.parametrize("value", [None, 72, 7.5, b"72", ["72"]])
def test_non_strings_give_none(value):
    assert normalize_number(value) is None
    assert extract_tagged_answer(value) is None
    assert extract_last_number(value) is None
    assert answers_match(value, "72") is False


@pytest.mark.parametrize(
    ("predicted", "gold", "expected"),
    [
        ("72", "72", True),
        ("72.0", "72", True),
        ("$72", "72", True),
        ("72 clips", "72", True),
        ("\\boxed{72}", "72", True),
        ("1,000", "1000", True),
        ("-7", "-7", True),
        ("\u22127", "-7", True),
        ("0.75", "3/4", True),
        ("7", "-7", False),
        ("71", "72", False),
        ("72.01", "72", False),
        ("", "72", False),
        (None, "72", False),
        ("72", None, False),
        ("nan", "nan", False),
        (str(10**400), str(10**400), False),
        ("1" * (MAX_DIGITS + 1), "1" * (MAX_DIGITS + 1), False),
    ],
)
def test_answers_match(predicted, gold, expected):
    assert answers_match(predicted, gold) is expected


@pytest.mark.parametrize(
    "text",
    [
        "<answer>" * 20_000,
        "<answer>" + "1" * 100_000,
        "1," * 50_000,
        "\\boxed{" * 20_000,
        "{" * 100_000,
        "\\frac{" * 20_000,
        "-" * 100_000,
        "1e" * 50_000,
        "9" * 100_000,
    ],
)
def test_long_adversarial_input_is_fast(text):
    start = time.perf_counter()
    extract_tagged_answer(text)
    extract_last_number(text)
    normalize_number(text)
    answers_match(text, text)
    assert time.perf_counter() - start < 0.5
