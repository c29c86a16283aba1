"""Is a change in accuracy real? Paired statistics of two scorings of the same questions (``evaluate.compare``
prints them).

Accuracies on 100-200 questions move by several points by chance alone. On the same questions only the discordant ones
(right before and wrong after, or the reverse) carry information about the change: the exact McNemar test, and
Newcombe's paired interval (method 10, Stat. Med. 1998) built from two Wilson intervals.
"""

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from grpo_kit.errors import GrpoKitError


def wilson(successes: int, n: int, z: float = 1.959963984540054) -> tuple[float, float]:
    """95 % Wilson score interval (right at small n and near 0 or 1, where p ± z·se fails)."""
    p, z2 = successes / n, z * z
    denominator = 1 + z2 / n
    centre, half = (p + z2 / (2 * n)) / denominator, z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / denominator
    return max(0.0, centre - half), min(1.0, centre + half)


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value of the discordant counts (binomial test at 1/2)."""
    return min(1.0, 2 * sum(math.comb(b + c, k) for k in range(min(b, c) + 1)) / 2 ** (b + c))


@dataclass(frozen=True)
class PairedDifference:
    """Strict accuracy before and after on the same ``n`` questions; ``gained``: wrong before, right after."""

    n: int
    before: float
    after: float
    difference: float
    interval: tuple[float, float]  # 95 % paired (Newcombe) interval of the difference
    gained: int
    lost: int
    p_value: float  # exact McNemar

    @property
    def significant(self) -> bool:
        return self.interval[0] > 0 or self.interval[1] < 0

    def summary(self) -> str:
        span = lambda i: f"[{100 * i[0]:.1f}, {100 * i[1]:.1f}]"  # noqa: E731
        return (
            f"before {100 * self.before:.1f} % {span(wilson(round(self.before * self.n), self.n))}  after "
            f"{100 * self.after:.1f} % {span(wilson(round(self.after * self.n), self.n))}  (n={self.n}, 95 % Wilson)\n"
            f"change {100 * self.difference:+.1f} points, 95 % paired interval {span(self.interval)} (Newcombe); zero "
            f"is {'outside' if self.significant else 'NOT outside'} it\nMcNemar exact: {self.gained} questions "
            f"gained, {self.lost} lost, p = {self.p_value:.2g}"
        )


def paired_difference(before: Sequence[bool], after: Sequence[bool]) -> PairedDifference:
    """Change in accuracy between two scorings of the same questions (``before[i]`` and ``after[i]`` pair up)."""
    if len(before) != len(after) or not before:
        raise GrpoKitError(
            f"paired_difference needs the same questions scored twice: got {len(before)} and "
            f"{len(after)} results. Evaluate both models on the same held-out set."
        )
    n, pairs = len(before), Counter(zip(map(bool, before), map(bool, after), strict=True))  # {(before, after): count}
    both, lost, gained, neither = pairs[True, True], pairs[True, False], pairs[False, True], pairs[False, False]
    right_after, right_before = both + gained, both + lost
    p1, p2 = right_after / n, right_before / n  # after, before
    (l1, u1), (l2, u2) = wilson(right_after, n), wilson(right_before, n)
    # Newcombe's phi: correlation of the paired outcomes, shrunk towards 0 by n/2 when positive.
    denominator = math.sqrt(right_before * (gained + neither) * right_after * (lost + neither))
    numerator = both * neither - lost * gained
    phi = (max(numerator - n / 2, 0.0) if numerator > 0 else numerator) / denominator if denominator else 0.0
    low = math.sqrt(max(0.0, (p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2))
    high = math.sqrt(max(0.0, (u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2))
    return PairedDifference(
        n,
        p2,
        p1,
        p1 - p2,
        (max(-1.0, p1 - p2 - low), min(1.0, p1 - p2 + high)),
        gained,
        lost,
        mcnemar_exact(lost, gained),
    )
