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

Conventions (the same in every reward and in ``grpo-kit eval``; each has a case-table test):

- **Where the answer is.** The last ``</answer>`` and the nearest ``<answer>`` before it, found in the whole text:
  text after the block (however long) and earlier blocks do not count. Tags are read in any case (``<ANSWER>``).
  A last ``<answer>`` with no ``</answer>`` after it is read to the end of the text (end-of-sequence markers
  dropped): vLLM and TRL strip a ``</answer>`` stop string. A completion cut by the token budget inside the block
  is read the same way; the text alone cannot tell the two apart. The *format* rewards (``grpo_kit.rewards``) judge
  the tags as written instead: lowercase, ``</answer>`` present.
- **Which number in the block.** One number, with any words, units, ``$``, markdown bold (``**694**``), ``\\boxed{}``
  around it: that number. A result followed by a remark (``460 (= 459 + 1)``, ``460, because …``, ``72 = 48 + 24``):
  the result. An equation ending in its result (``48 + 24 = 72``): the last number. Two different numbers offered
  as alternatives (``18 or 19``, ``18 (or 19)``): no answer.
- **How a number is written.** Thousands grouped by commas or by spaces, thin spaces or (narrow) no-break spaces
  (``70,000`` = ``70 000`` = ``70\\u202f000``); ``−`` (U+2212) is a minus; fractions ``3/4`` and ``\\frac{3}{4}``
  are their value. A percentage is its number: ``75%`` = 75, not 0.75 (GSM8K states percentages so).
  Not read, so never credited: scientific notation (``1.5e3``, ``10**3``: the last digits are not the value),
  number words (``seventy-two``), NaN/infinity, more than ``MAX_DIGITS`` digits.

Every function here is total: any string in, a value out, no exception, in time linear in the text length.
"""

from __future__ import annotations

import re
from decimal import Decimal, localcontext

#: The longest answer text read in full; a longer one is read from its last MAX_SCAN_CHARS characters (and the
#: lenient protocol reads the last number of the last MAX_SCAN_CHARS characters). Locating the block is unbounded.
MAX_SCAN_CHARS = 4000
#: Numbers with more significant digits than this are treated as absurd (no GSM8K answer comes close).
MAX_DIGITS = 30
#: Decimal precision for canonical forms: enough for any number within MAX_DIGITS, so rounding never happens.
_PRECISION = 2 * MAX_DIGITS + 4

# One attempt from position 0: ".*" runs to the end and backs off to the last tag, so each search is linear.
_LAST_CLOSE = re.compile(r".*(</answer>)", re.DOTALL | re.IGNORECASE)
_LAST_OPEN = re.compile(r".*(<answer>)", re.DOTALL | re.IGNORECASE)
# End-of-sequence markers a decoded completion may still carry ("<|im_end|>", "<|eot_id|>", "</s>", "<eos>", ...).
_EOS_AT_END = re.compile(r"(?:<\|[^<>|\s]{1,40}\|>|</s>|<eos>|<end_of_turn>|<end_of_text>)\Z")
_MAX_EOS_STRIPS = 8
# Thousands separators: a comma, or one kind of space (plain, no-break U+00A0, thin U+2009, narrow no-break U+202F).
_SPACES = " \u00a0\u2009\u202f"
#: Characters that may group thousands in a number ("70,000", "70 000", "70\u202f000"); one kind per number.
THOUSANDS_SEPARATORS = "," + _SPACES
#: Digits grouped in thousands by one kind of separator ("1,000", "1 000"): the model's answers and gold answers alike.
GROUPED = "|".join([r"\d{1,3}(?:,\d{3})+"] + [r"\d{1,3}(?:" + space + r"\d{3})+(?![\d,])" for space in _SPACES])
# A number: optional minus, digits with optional thousands separators, optional decimals; or a bare decimal like .5.
# A minus sign counts only when no word character precedes it ("5-3" holds the numbers 5 and 3, not 5 and -3);
# U+2212 (the typographic minus) counts as a minus; a dollar sign may sit between minus and digits ("-$5").
_MINUS = r"(?:(?<!\w)[-\u2212]\$?)?"  # "-$5" is minus five dollars
_NUMBER = re.compile(_MINUS + r"(?:(?:" + GROUPED + r"|\d+)(?:\.\d+)?|\.\d+)")
# \boxed{...} with at most one level of nested braces inside, e.g. \boxed{\frac{3}{4}}
_BOXED = re.compile(r"\\boxed\s*\{((?:[^{}]|\{[^{}]*\})*)\}")
_PLAIN_FRACTION = re.compile(r"([-\u2212]?\d+)\s*/\s*(\d+)")
_LATEX_FRACTION = re.compile(r"([-\u2212]?)\s*\\[dt]?frac\s*\{\s*([-\u2212]?\d+)\s*\}\s*\{\s*(\d+)\s*\}")
# "460 (= 459 + 1)", "460, because ...", "$460 dollars; ...": a result first (markdown, "$", "=" may precede it,
# one unit word or "%" may follow it), then a remark that starts with a separator or a word of explanation. A list
# of numbers ("18, 19", "18\n19", "1. 18") or a time ("12:30") is no remark: the last-number rule reads those.
_LEAD = re.compile(
    r"[\s*_$=:]*(?P<number>" + _NUMBER.pattern + r")[\s*_]*(?:%|[^\W\d_]+\b)?[\s*_]*"
    r"(?P<remark>(?:[,;](?!\s*[-\u2212\d$.])|:(?!\d)|[(\[=\u2014]|\.\s(?!\s*[-\u2212\d])|\n(?!\s*[-\u2212\d$])"
    r"|(?:because|since|as|which|from|after|per)\b).*)",
    re.DOTALL | re.IGNORECASE,
)
# A remark that concludes something else ("460, so the total is 920") does not leave 460 as the result.
_CONCLUSION = re.compile(
    r"\b(?:so|therefore|thus|hence|total|answer|final|makes|gives)\b|=>|\)\s*=|\u21d2|\u2192", re.I
)
# Two different numbers offered as alternatives ("18 or 19") are no answer.
_ALTERNATIVE = re.compile(r"\b(?:or|either)\b", re.IGNORECASE)
# A "^" ("2^3", "10 ^ 3") or a "**" right after an operand ("10**3", "10 ** 3") is a power; before a number with a
# space in front "**" is bold.
_POWER = re.compile(r"(?:\^\s*|[\w)\]}]\*\*\s*|[\w)\]}]\s+\*\*\s+)\Z")


def strip_end_markers(text: str) -> str:
    """``text`` without trailing whitespace and end-of-sequence markers.

    >>> strip_end_markers("<answer>7</answer>\\n<|im_end|></s> ")
    '<answer>7</answer>'
    """
    text = text.rstrip()
    for _ in range(_MAX_EOS_STRIPS):
        match = _EOS_AT_END.search(text[-64:])
        if not match:
            break
        text = text[: -len(match[0])].rstrip()  # the marker ends the text (\Z)
    return text


def extract_tagged_answer(text: str) -> str | None:
    """Strict protocol: the stripped text of the last ``<answer>`` block, or None when there is none.

    The block ends at the last ``</answer>``; a last ``<answer>`` left open (a stripped stop string) runs to the end
    of the text. Anything after the block, however long, is ignored.

    >>> extract_tagged_answer("<answer>1</answer> then <answer>\\n 2 \\n</answer>" + " more" * 2000)
    '2'
    >>> extract_tagged_answer("<think>3 + 4</think><answer>7<|im_end|>")
    '7'
    >>> extract_tagged_answer("no tags") is None
    True
    """
    if not isinstance(text, str):
        return None
    close = _LAST_CLOSE.match(text)
    end = close.start(1) if close else len(text)
    opened = _LAST_OPEN.match(text)
    if opened and (close is None or opened.start(1) > end):  # an <answer> after the last </answer>: open to the end
        return strip_end_markers(text[opened.end(1) :]).strip()
    if close is None:
        return None
    opened = _LAST_OPEN.match(text, 0, end)
    return text[opened.end(1) : end].strip() if opened else None


def extract_last_number(text: str) -> str | None:
    """Lenient protocol: the last number in the text (separators kept, as written), or None.

    >>> extract_last_number("She pays $1,250.50 and then 3 more")
    '3'
    """
    if not isinstance(text, str):
        return None
    numbers = _NUMBER.findall(text[-MAX_SCAN_CHARS:])
    return numbers[-1] if numbers else None


def normalize_number(text: str) -> str | None:
    """Canonical decimal string of the number ``text`` states, or None when it states none we can read.

    Follows the conventions of the module docstring: words, units, currency, markdown and ``\\boxed{}`` around the
    number are ignored; a result followed by a remark is the result; otherwise the last number counts; two different
    numbers offered as alternatives are no answer.

    >>> [normalize_number(s) for s in ["18.0", "$18", "\\\\boxed{18}", "1,080", "-7.50", "3/4", "none"]]
    ['18', '18', '18', '1080', '-7.5', '0.75', None]
    >>> [normalize_number(s) for s in ["**694**", "460 (= 459 + 1)", "460, because 3 parts", "70\u2009000"]]
    ['694', '460', '460', '70000']
    >>> [normalize_number(s) for s in ["$\\\\frac{3}{4}$", "\u22127", "5-3", "10**400", "1" * 40, "18 or 19"]]
    ['0.75', '-7', '3', None, None, None]
    """
    if not isinstance(text, str):
        return None
    text = text[-MAX_SCAN_CHARS:].strip()
    if boxed := _BOXED.findall(text):
        text = boxed[-1].strip()
    core = text.strip("$*_ \t\n")
    if fraction := _PLAIN_FRACTION.fullmatch(core):
        return _fraction(*fraction.groups())
    if latex := _LATEX_FRACTION.fullmatch(core):
        return _fraction(latex[1] + latex[2], latex[3])
    numbers = list(_NUMBER.finditer(text))
    # "18 or 19": an "or" and numbers of different values is no answer ("18 or 18.0" is one)
    if not numbers or (_ALTERNATIVE.search(text) and len({_to_canonical(number[0]) for number in numbers}) > 1):
        return None
    lead = _LEAD.match(text)
    if lead and not _CONCLUSION.search(lead["remark"]):
        return _to_canonical(lead["number"])
    if _is_exponent(text, numbers[-1].start()):
        return None
    # "72 clips" has one number; "3 + 4 = 7" has several: take the last, as a human reader would.
    return _to_canonical(numbers[-1][0])


def _is_exponent(text: str, start: int) -> bool:
    """True when the number at ``start`` is an exponent: after "^", an operand's "**", or the "e" of "1e5"."""
    if _POWER.search(text[max(0, start - 8) : start]):
        return True
    return start >= 2 and text[start - 1] in "eE" and text[start - 2].isdigit()


def _fraction(numerator: str, denominator: str) -> str | None:
    numerator = numerator.replace("\u2212", "-").replace("--", "")
    if digit_count(numerator) > MAX_DIGITS or len(denominator) > MAX_DIGITS or int(denominator) == 0:
        return None
    with localcontext(prec=_PRECISION):
        value = Decimal(numerator) / Decimal(denominator)
        # Round so the canonical form keeps at most MAX_DIGITS digits: 1/3 -> 0.333... (29 threes), not absurd.
        places = MAX_DIGITS - max(value.adjusted() + 1, 1)
        return _canonical(value.quantize(Decimal(1).scaleb(-places)) if places > 0 else value)


def _to_canonical(number: str) -> str | None:
    digits = number.translate(str.maketrans("\u2212", "-", "$" + THOUSANDS_SEPARATORS))  # U+2212 minus: "-"
    if digit_count(digits) > MAX_DIGITS:
        return None
    return _canonical(Decimal(digits))


def _canonical(value: Decimal) -> str | None:
    # room for MAX_DIGITS digits on both sides of the point: quantize never overflows
    with localcontext(prec=_PRECISION):
        value = value.quantize(Decimal(1)) if value == value.to_integral_value() else value.normalize()
    text = format(value, "f")
    if digit_count(text) > MAX_DIGITS:
        return None
    return "0" if text == "-0" else text


def digit_count(number: str) -> int:
    """How many digits ``number`` has (what ``MAX_DIGITS`` limits)."""
    return sum(char.isdigit() for char in number)


def answers_match(predicted: str | None, gold: str | None) -> bool:
    """True when ``predicted`` reads as the same number as ``gold`` (exact decimal equality, no tolerance).

    >>> answers_match("1,000", "1000"), answers_match("$72.00", "72"), answers_match("71", "72")
    (True, True, False)
    """
    left = normalize_number(predicted)  # canonical: one string per value (1000, 0.75, -7; "-0" is "0")
    return left is not None and left == normalize_number(gold)
