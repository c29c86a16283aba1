"""SYNTHETIC, NOT GSM8K: short one- and two-step word problems in GSM8K format, a warm-up set for small models.

``load_gsm8k("arithmetic" | "arithmetic-1step" | "arithmetic-2step", split)`` reads them through
``arithmetic_records``; ``make_arithmetic_dataset`` builds a set of any size directly.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from typing import Any

from grpo_kit.errors import GrpoKitError
from grpo_kit.machinery.data_sources import to_dataset

#: Sizes of the synthetic arithmetic splits that ``load_gsm8k("arithmetic", split)`` generates.
ARITHMETIC_SIZES = {"train": 256, "test": 64}
#: Source names of the synthetic arithmetic sets → ``steps`` of ``make_arithmetic_dataset`` (the difficulty).
ARITHMETIC_SOURCES = {"arithmetic": None, "arithmetic-1step": 1, "arithmetic-2step": 2}
#: Test size of the one-kind sets: enough held-out questions for a 95 % interval of about +-8 points.
ARITHMETIC_KIND_TEST_SIZE = 200


def arithmetic_records(split: str, steps: int | None = None) -> Iterator[tuple[str, Any]]:
    """Train: 256 problems from seed 0. Test: problems from seed 1 that are not in the train split: for the mix, 64
    whose question differs; for one kind (``steps``), ``ARITHMETIC_KIND_TEST_SIZE`` whose calculations differ too."""
    rows = make_arithmetic_dataset(ARITHMETIC_SIZES["train"], seed=0, steps=steps).to_list()
    if split == "test" and steps is not None:
        seen = [row["solution"] for row in rows]
        rows = make_arithmetic_dataset(ARITHMETIC_KIND_TEST_SIZE, seed=1, steps=steps, exclude=seen).to_list()
    elif split == "test":
        seen = {row["question"] for row in rows}
        fresh = make_arithmetic_dataset(ARITHMETIC_SIZES["test"] * 2, seed=1).to_list()
        rows = [row for row in fresh if row["question"] not in seen][: ARITHMETIC_SIZES["test"]]
    for index, row in enumerate(rows, start=1):
        yield f"row {index}", {"question": row["question"], "answer": row["solution"]}


# ---------------------------------------------------------------------------------------------------------- synthetic

_NAMES = ("Ava", "Ben", "Chloe", "Dev", "Eli", "Fatima", "Gus", "Hiro", "Ines", "Jamal", "Kira", "Luis", "Mei", "Nia")
_ITEMS = ("apples", "marbles", "stickers", "pencils", "cookies", "shells", "cards", "stamps", "beads", "books")


def _one_step(rng: random.Random) -> tuple[str, list[str], int]:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    a, b = rng.randint(2, 20), rng.randint(2, 12)
    kind = rng.choice(("add", "sub", "mul", "div"))
    if kind == "add":
        return (
            f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?",
            [f"{name} has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} {item}."],
            a + b,
        )
    if kind == "sub":
        a += b
        return (
            f"{name} has {a} {item} and gives away {b}. How many {item} are left?",
            [f"{a} - {b} = <<{a}-{b}={a - b}>>{a - b} {item} are left."],
            a - b,
        )
    if kind == "mul":
        return (
            f"{name} has {a} bags with {b} {item} in each bag. How many {item} is that?",
            [f"{a} * {b} = <<{a}*{b}={a * b}>>{a * b} {item}."],
            a * b,
        )
    total = a * b
    return (
        f"{name} shares {total} {item} equally among {b} friends. How many {item} does each friend get?",
        [f"Each friend gets {total} / {b} = <<{total}/{b}={a}>>{a} {item}."],
        a,
    )


def _two_step(rng: random.Random) -> tuple[str, list[str], int]:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    a, b, c = rng.randint(2, 9), rng.randint(2, 9), rng.randint(1, 15)
    if rng.random() < 0.5:
        return (
            f"{name} buys {a} boxes of {item} with {b} in each box, and already had {c}. How many {item} does "
            f"{name} have now?",
            [
                f"The boxes hold {a} * {b} = <<{a}*{b}={a * b}>>{a * b} {item}.",
                f"{name} has {a * b} + {c} = <<{a * b}+{c}={a * b + c}>>{a * b + c} {item}.",
            ],
            a * b + c,
        )
    c = min(c, a * b - 1)
    return (
        f"{name} has {a} packs of {item} with {b} in each pack and gives away {c}. How many {item} are left?",
        [
            f"{name} has {a} * {b} = <<{a}*{b}={a * b}>>{a * b} {item}.",
            f"{a * b} - {c} = <<{a * b}-{c}={a * b - c}>>{a * b - c} {item} are left.",
        ],
        a * b - c,
    )


#: ``steps`` values of ``make_arithmetic_dataset``: the difficulty knob. Measured on the embedded SmolLM2-135M with the
#: ``cpu`` prompt (greedy, n=120 of the mix): one-step problems are answered right about a third of the time,
#: two-step ones almost never (it stops after the first operation).
ARITHMETIC_STEPS = {None: "one- and two-step problems, half each", 1: "one-step problems only", 2: "two-step only"}


def make_arithmetic_dataset(n: int = 64, seed: int = 0, *, steps: int | None = None, exclude=()):
    """SYNTHETIC, NOT GSM8K: ``n`` short one- or two-step word problems with small integers, in GSM8K format.

    An easier warm-up set for small models. Deterministic for a ``seed``; questions are distinct. Columns as
    ``load_gsm8k``: ``question``, ``answer`` (canonical), ``solution`` (steps with ``<<a*b=c>>`` and ``#### N``).
    ``steps`` (``ARITHMETIC_STEPS``) sets the difficulty: ``None`` mixes one- and two-step problems, ``1`` or ``2``
    keeps one kind. ``exclude``: solutions (or ``arithmetic_key`` values) whose calculations must not come back, so a
    held-out split never repeats a training calculation under another name.

    >>> ds = make_arithmetic_dataset(3, seed=0)
    >>> len(ds), ds[0]["solution"].endswith("#### " + ds[0]["answer"])
    (3, True)
    >>> all("\\n" not in s.split("####")[0].strip() for s in make_arithmetic_dataset(5, steps=1)["solution"])
    True
    """
    if n < 1:
        raise GrpoKitError(f"make_arithmetic_dataset needs n >= 1, got {n}.")
    if steps not in ARITHMETIC_STEPS:
        raise GrpoKitError(f"steps must be one of {list(ARITHMETIC_STEPS)} ({ARITHMETIC_STEPS}), got {steps!r}.")
    banned = {arithmetic_key(item) for item in exclude}
    rng = random.Random(seed)
    rows: dict[str, dict] = {}
    for _ in range(n * 50):
        if len(rows) == n:
            break
        one_step = rng.random() < 0.5 if steps is None else steps == 1
        question, lines, result = (_one_step if one_step else _two_step)(rng)
        solution = "\n".join([*lines, f"#### {result}"])
        if banned and arithmetic_key(solution) in banned:
            continue
        rows.setdefault(question, {"question": question, "answer": str(result), "solution": solution})
    if len(rows) < n:
        raise GrpoKitError(f"Could only generate {len(rows)} distinct arithmetic problems; ask for n <= {len(rows)}.")
    label = f"synthetic arithmetic (not GSM8K), n={n}, seed={seed}" + (f", {steps}-step" if steps else "")
    return to_dataset(list(rows.values()), label)


def arithmetic_key(solution: str) -> str:
    """The calculations of a synthetic solution (its ``<<...>>`` annotations): equal keys = the same arithmetic.

    >>> arithmetic_key("Ava has 3 + 4 = <<3+4=7>>7 apples.\\n#### 7")
    '3+4=7'
    """
    return ";".join(re.findall(r"<<(.*?)>>", solution)) or solution
