"""95 % intervals for held-out accuracy, before and after training, on the same questions.

Accuracies on 100-200 questions move by several points by chance alone, so every before/after figure comes with:

- ``wilson``: the Wilson score interval of one accuracy (good coverage at small n and near 0 % or 100 %, where the
  textbook ``p ± 1.96·sqrt(p(1-p)/n)`` fails);
- ``paired_difference``: the change after − before, with Newcombe's interval for paired proportions (method 10,
  Stat. Med. 1998) built from the two Wilson intervals and the correlation of the paired outcomes, and the exact
  McNemar test. Both use the *same* questions: only the discordant ones (right before and wrong after, or the
  reverse) carry information about the change, so a paired interval is narrower than two independent ones.

>>> round(wilson(20, 100)[0], 4), round(wilson(20, 100)[1], 4)
(0.1334, 0.2888)
>>> d = paired_difference([False] * 80 + [True] * 20, [False] * 60 + [True] * 40)
>>> round(d.difference, 2), d.significant
(0.2, True)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from grpo_kit.errors import GrpoKitError

#: Two-sided 95 % normal quantile.
Z95 = 1.959963984540054


def wilson(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval ``(low, high)`` for ``successes`` out of ``n``.

    >>> wilson(0, 10)[0], round(wilson(0, 10)[1], 4)
    (0.0, 0.2775)
    """
    if n < 1 or not 0 <= successes <= n:
        raise GrpoKitError(f"wilson needs 0 <= successes <= n and n >= 1, got {successes} of {n}.")
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value: ``b`` and ``c`` are the discordant counts (binomial test at 1/2).

    >>> mcnemar_exact(0, 0), round(mcnemar_exact(2, 12), 4)
    (1.0, 0.0129)
    """
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(b, c) + 1)) / 2**n
    return min(1.0, 2 * tail)


@dataclass(frozen=True)
class PairedDifference:
    """Accuracy before and after on the same ``n`` questions, with 95 % intervals and the McNemar test.

    ``gained``: wrong before, right after; ``lost``: right before, wrong after.
    """

    n: int
    before: float
    after: float
    before_interval: tuple[float, float]
    after_interval: tuple[float, float]
    difference: float
    interval: tuple[float, float]
    gained: int
    lost: int
    p_value: float

    @property
    def significant(self) -> bool:
        """The whole 95 % interval of the change lies on one side of zero."""
        return self.interval[0] > 0 or self.interval[1] < 0

    def summary(self) -> str:
        """Three lines in percent points, e.g. for a README or a notebook."""
        pct = lambda x: f"{100 * x:.1f} %"  # noqa: E731
        span = lambda i: f"[{100 * i[0]:.1f}, {100 * i[1]:.1f}]"  # noqa: E731
        verdict = "outside" if self.significant else "NOT outside"
        return (
            f"before {pct(self.before)} {span(self.before_interval)}  after {pct(self.after)} "
            f"{span(self.after_interval)}  (n={self.n}, 95 % Wilson)\n"
            f"change {100 * self.difference:+.1f} points, 95 % paired interval {span(self.interval)} (Newcombe); "
            f"zero is {verdict} it\n"
            f"McNemar exact: {self.gained} questions gained, {self.lost} lost, p = {self.p_value:.2g}"
        )


def paired_difference(before: Sequence[bool], after: Sequence[bool], z: float = Z95) -> PairedDifference:
    """Change in accuracy between two scorings of the same questions (``before[i]`` and ``after[i]`` pair up).

    >>> d = paired_difference([True, False, False, True], [True, True, False, True])
    >>> d.gained, d.lost, d.difference
    (1, 0, 0.25)
    """
    if len(before) != len(after) or not before:
        raise GrpoKitError(
            f"paired_difference needs the same questions scored twice: got {len(before)} and {len(after)} results. "
            "Evaluate both models on the same held-out set."
        )
    n = len(before)
    both = sum(1 for x, y in zip(before, after, strict=True) if x and y)
    lost = sum(1 for x, y in zip(before, after, strict=True) if x and not y)
    gained = sum(1 for x, y in zip(before, after, strict=True) if y and not x)
    neither = n - both - lost - gained
    p1, p2 = (both + gained) / n, (both + lost) / n  # after, before
    (l1, u1), (l2, u2) = wilson(both + gained, n, z), wilson(both + lost, n, z)
    phi = _phi(both, lost, gained, neither, n)
    low = math.sqrt(max(0.0, (p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2))
    high = math.sqrt(max(0.0, (u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2))
    difference = p1 - p2
    return PairedDifference(
        n=n, before=p2, after=p1, before_interval=(l2, u2), after_interval=(l1, u1), difference=difference,
        interval=(max(-1.0, difference - low), min(1.0, difference + high)), gained=gained, lost=lost,
        p_value=mcnemar_exact(lost, gained),
    )


def _phi(a: int, b: int, c: int, d: int, n: int) -> float:
    """Newcombe's correlation of the paired outcomes, shrunk towards 0 by n/2 when positive (his method 10)."""
    denominator = math.sqrt((a + b) * (c + d) * (a + c) * (b + d))
    if denominator == 0:
        return 0.0
    numerator = a * d - b * c
    numerator = max(numerator - n / 2, 0.0) if numerator > 0 else numerator
    return numerator / denominator
