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
from decimal import Decimal, InvalidOperation, localcontext

#: How much of the end of a text is scanned for answers. Final answers live at the end.
MAX_SCAN_CHARS = 4000
#: Numbers with more significant digits than this are treated as absurd (no GSM8K answer comes close).
MAX_DIGITS = 30
#: Decimal precision for canonical forms: enough for any number within MAX_DIGITS, so rounding never happens.
_PRECISION = 2 * MAX_DIGITS + 4

_ANSWER_BLOCK = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
# A number: optional minus, digits with optional thousands commas, optional decimals; or a bare decimal like .5.
# A minus sign counts only when no word character precedes it ("5-3" holds the numbers 5 and 3, not 5 and -3);
# U+2212 (the typographic minus) counts as a minus; a dollar sign may sit between minus and digits ("-$5").
_MINUS = r"(?:(?<!\w)[-\u2212]\$?)?"  # "-$5" is minus five dollars
_NUMBER = re.compile(_MINUS + r"(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)")
# \boxed{...} with at most one level of nested braces inside, e.g. \boxed{\frac{3}{4}}
_BOXED = re.compile(r"\\boxed\s*\{((?:[^{}]|\{[^{}]*\})*)\}")
_PLAIN_FRACTION = re.compile(r"([-\u2212]?\d+)\s*/\s*(\d+)")
_LATEX_FRACTION = re.compile(r"([-\u2212]?)\s*\\[dt]?frac\s*\{\s*([-\u2212]?\d+)\s*\}\s*\{\s*(\d+)\s*\}")


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
    """Canonical decimal string of the number ``text`` states, or None when it states none we can read.

    Accepts currency signs, thousands commas, units and words around the number ("72 clips", "$18", "18.0",
    "\\boxed{18}", "-7", "1,000"), a plain fraction "3/4" and a LaTeX one "\\frac{3}{4}". With several numbers
    ("3 + 4 = 7") the last one is the answer. Returns None for no number, NaN/inf, an exponent ("10**400", "2^3",
    "1e5": the last digits are not the value), or absurd sizes (more than ``MAX_DIGITS`` digits).

    >>> [normalize_number(s) for s in ["18.0", "$18", "\\\\boxed{18}", "1,080", "-7.50", "3/4", "none"]]
    ['18', '18', '18', '1080', '-7.5', '0.75', None]
    >>> [normalize_number(s) for s in ["$\\\\frac{3}{4}$", "\u22127", "5-3", "10**400", "1" * 40]]
    ['0.75', '-7', '3', None, None]
    """
    if not isinstance(text, str):
        return None
    text = _tail(text).strip()
    boxed = _BOXED.findall(text)
    if boxed:
        text = boxed[-1].strip()
    core = text.strip("$ \t\n")
    fraction = _PLAIN_FRACTION.fullmatch(core)
    if fraction:
        return _fraction(fraction.group(1), fraction.group(2))
    latex = _LATEX_FRACTION.fullmatch(core)
    if latex:
        return _fraction(latex.group(1) + latex.group(2), latex.group(3))
    numbers = list(_NUMBER.finditer(text))
    if not numbers or _is_exponent(text, numbers[-1].start()):
        return None
    last = numbers[-1]
    # "72 clips" has one number; "3 + 4 = 7" has several: take the last, as a human reader would.
    return _to_canonical(last.group())


def _is_exponent(text: str, start: int) -> bool:
    """True when the number starting at ``start`` is an exponent: after "^", "**", or the "e" of "1e5"."""
    before = text[max(0, start - 2) : start].rstrip()
    if before.endswith(("^", "**")):
        return True
    return start >= 2 and text[start - 1] in "eE" and text[start - 2].isdigit()


def _fraction(numerator: str, denominator: str) -> str | None:
    numerator = numerator.replace("\u2212", "-").replace("--", "")
    if len(numerator.lstrip("-")) > MAX_DIGITS or len(denominator) > MAX_DIGITS:
        return None
    top, bottom = int(numerator), int(denominator)
    if bottom == 0:
        return None
    with localcontext() as context:
        context.prec = _PRECISION
        value = Decimal(top) / Decimal(bottom)
        # Round so the canonical form keeps at most MAX_DIGITS digits: 1/3 -> 0.333... (29 threes), not absurd.
        places = MAX_DIGITS - max(value.adjusted() + 1, 1)
        return _canonical(value.quantize(Decimal(1).scaleb(-places)) if places > 0 else value)


def _to_canonical(number: str) -> str | None:
    digits = number.replace(",", "").replace("$", "").replace("\u2212", "-")
    if _digit_count(digits) > MAX_DIGITS:
        return None
    try:
        value = Decimal(digits)
    except InvalidOperation:
        return None
    return _canonical(value)


def _canonical(value: Decimal) -> str | None:
    if not value.is_finite():
        return None
    with localcontext() as context:
        context.prec = _PRECISION  # room for MAX_DIGITS digits on both sides of the point: quantize never overflows
        value = value.quantize(Decimal(1)) if value == value.to_integral_value() else value.normalize()
    text = format(value, "f")
    if _digit_count(text) > MAX_DIGITS:
        return None
    return "0" if text in {"-0", "0"} else text


def _digit_count(number: str) -> int:
    return sum(char.isdigit() for char in number)


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
