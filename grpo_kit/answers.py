"""Find the final answer in a piece of text and decide whether two answers are the same number.

Two extraction protocols, named everywhere a number is reported (papers differ by many points on this alone):

- **strict**: the text inside the last ``<answer>…</answer>`` block, read as a number.
- **lenient**: the last number anywhere in the text.

>>> extract_tagged_answer("<think>3+4</think><answer> $1,000 </answer>")
'$1,000'
>>> normalize_number("$1,000.00")
'1000'
>>> answers_match("72 clips", "72")
True
>>> answers_match(r"\\boxed{-7}", "-7")
True

Every function here is total: any string in, a value out, no exception. Inputs are cut to ``MAX_SCAN_CHARS``
from the end before any regex runs, so a 100k-character completion costs the same as a short one.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

#: How much of the end of a text is scanned for answers. Final answers live at the end.
MAX_SCAN_CHARS = 4000
#: Numbers with more significant digits than this are treated as absurd (no GSM8K answer comes close).
MAX_DIGITS = 30

_ANSWER_BLOCK = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
# A number: optional minus, digits with optional thousands commas, optional decimals; or a bare decimal like .5
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+")
_BOXED = re.compile(r"\\boxed\s*\{([^{}]*)\}")


def _tail(text: str) -> str:
    return text[-MAX_SCAN_CHARS:] if len(text) > MAX_SCAN_CHARS else text


def extract_tagged_answer(text: str) -> str | None:
    """Strict protocol: the stripped text of the last complete ``<answer>…</answer>`` block, or None.

    >>> extract_tagged_answer("<answer>1</answer> then <answer>\\n 2 \\n</answer>")
    '2'
    >>> extract_tagged_answer("<answer>unfinished") is None
    True
    """
    if not isinstance(text, str):
        return None
    matches = _ANSWER_BLOCK.findall(_tail(text))
    return matches[-1].strip() if matches else None


def extract_last_number(text: str) -> str | None:
    """Lenient protocol: the last number in the text (commas kept, as written), or None.

    >>> extract_last_number("She pays $1,250.50 and then 3 more")
    '3'
    """
    if not isinstance(text, str):
        return None
    numbers = _NUMBER.findall(_tail(text))
    return numbers[-1] if numbers else None


def normalize_number(text: str) -> str | None:
    """Canonical decimal string of the single number in ``text``, or None when there is not exactly one reading.

    Accepts currency signs, thousands commas, units and words around the number ("72 clips", "$18", "18.0",
    "\\boxed{18}", "-7", "1,000"), and a plain fraction "3/4". Returns None for no number, NaN/inf, or absurd
    sizes (more than ``MAX_DIGITS`` digits).

    >>> [normalize_number(s) for s in ["18.0", "$18", "\\\\boxed{18}", "1,080", "-7.50", "3/4", "none"]]
    ['18', '18', '18', '1080', '-7.5', '0.75', None]
    """
    if not isinstance(text, str):
        return None
    text = _tail(text).strip()
    boxed = _BOXED.findall(text)
    if boxed:
        text = boxed[-1]
    fraction = re.fullmatch(r"\s*(-?\d+)\s*/\s*(\d+)\s*", text)
    if fraction:
        numerator, denominator = int(fraction.group(1)), int(fraction.group(2))
        if denominator == 0 or len(fraction.group(1)) > MAX_DIGITS:
            return None
        return _canonical(Decimal(numerator) / Decimal(denominator))
    numbers = _NUMBER.findall(text)
    if not numbers:
        return None
    # "72 clips" has one number; "3 + 4 = 7" has several: take the last, as a human reader would.
    return _to_canonical(numbers[-1])


def _to_canonical(number: str) -> str | None:
    digits = number.replace(",", "")
    if len(digits.lstrip("-").replace(".", "")) > MAX_DIGITS:
        return None
    try:
        value = Decimal(digits)
    except InvalidOperation:
        return None
    return _canonical(value)


def _canonical(value: Decimal) -> str | None:
    if not value.is_finite():
        return None
    value = value.quantize(Decimal(1)) if value == value.to_integral_value() else value.normalize()
    text = format(value, "f")
    return "0" if text in {"-0", "0"} else text


def answers_match(predicted: str | None, gold: str | None) -> bool:
    """True when ``predicted`` reads as the same number as ``gold`` (exact decimal equality, no tolerance).

    >>> answers_match("1,000", "1000"), answers_match("$72.00", "72"), answers_match("71", "72")
    (True, True, False)
    """
    if predicted is None or gold is None:
        return False
    left, right = normalize_number(predicted), normalize_number(gold)
    if left is None or right is None:
        return False
    return Decimal(left) == Decimal(right)
