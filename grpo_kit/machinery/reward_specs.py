"""Reward specs: ``"correctness:2,format,my_rewards:brevity:0.5"``, functions, or ``(name_or_function, weight)``
pairs into TRL's ``reward_funcs`` and ``reward_weights``; ``package.module:function`` imported as TRL's own script
does; and the ``grpo-kit rewards`` table."""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

from grpo_kit.errors import GrpoKitError
from grpo_kit.rewards import DEFAULT_REWARD_SPEC, REWARD_INFO, REWARDS, column


def parse_reward_spec(spec) -> tuple[list[Callable[..., list[float]]], list[float], list[str]]:
    """Reward functions, weights and names from a spec.

    ``spec`` is a string such as ``"correctness:2,format,my_rewards:brevity:0.5"`` or a list whose items are such
    names, reward functions (any TRL-compatible callable, e.g. one defined in a notebook cell) or
    ``(name_or_function, weight)`` pairs. A name is a built-in reward (``grpo-kit rewards``; case-insensitive, '-'
    for '_') or ``package.module:function``, imported as TRL's own script does. A weight defaults to 1.0.

    >>> parse_reward_spec("tag_progress")[1:]
    ([1.0], ['tag_progress'])
    >>> def brevity(completions, **kwargs):
    ...     return [-len(c) / 100 for c in completions]
    >>> parse_reward_spec(["correctness:2", (brevity, 0.5)])[1:]
    ([2.0, 0.5], ['correctness', 'brevity'])
    """
    funcs, weights, names = [], [], []
    for item in _spec_items(spec):
        fn, name, weight = _resolve_reward(item)
        if name in names:
            raise GrpoKitError(f"Reward {name!r} is named twice; name it once and give it a weight, e.g. {name}:2.")
        funcs.append(fn)
        weights.append(weight)
        names.append(name)
    if not names:
        raise GrpoKitError(f"No reward named in {spec!r}. Give at least one, e.g. 'correctness:2,format'.")
    return funcs, weights, names


def _spec_items(spec) -> list:
    if isinstance(spec, str):
        return [item for item in (part.strip() for part in spec.split(",")) if item]
    if callable(spec):
        return [spec]
    if isinstance(spec, Sequence):
        return [item.strip() if isinstance(item, str) else item for item in spec if not (isinstance(item, str) and not item.strip())]
    raise GrpoKitError(
        f"Reward spec must be a string like 'correctness:2,format', or a list of names and functions, got {spec!r}."
    )


def _resolve_reward(item) -> tuple[Callable[..., list[float]], str, float]:
    """``(function, name, weight)`` for one spec item: ``name[:w]``, ``module:function[:w]``, a callable, or a pair."""
    if isinstance(item, tuple) and len(item) == 2:
        fn, name, _ = _resolve_reward(item[0])
        return fn, name, _parse_weight(str(item[1]), repr(item))
    if callable(item):
        builtin = next((name for name, fn in REWARDS.items() if fn is item), None)
        return item, builtin or getattr(item, "__name__", type(item).__name__), 1.0
    if not isinstance(item, str):
        raise GrpoKitError(f"Reward {item!r} is neither a name nor a function; pass e.g. 'correctness:2' or a function.")
    parts = [part.strip() for part in item.split(":")]
    key = parts[0].lower().replace("-", "_")
    if key in REWARDS:  # a built-in: at most one weight follows
        if len(parts) > 2:
            raise GrpoKitError(f"Bad weight in reward {item!r}: write one finite number after the colon, e.g. correctness:2.")
        return REWARDS[key], key, _parse_weight(parts[1], item) if len(parts) == 2 else 1.0
    weight = _parse_weight(parts.pop(), item) if len(parts) == 3 or (len(parts) == 2 and _looks_numeric(parts[1])) else 1.0
    if len(parts) == 2:
        return _import_reward(parts[0], parts[1], item), f"{parts[0]}:{parts[1]}", weight
    raise GrpoKitError(
        f"Unknown reward {parts[0]!r} in {item!r}. Choose from: {', '.join(REWARDS)} (see `grpo-kit rewards`), or "
        "name your own function as package.module:function (e.g. my_rewards:brevity:0.5)."
    )


def _looks_numeric(text: str) -> bool:
    return bool(re.fullmatch(r"\s*[-+]?(\d+\.?\d*|\.\d+|inf|nan|infinity)([eE][-+]?\d+)?\s*", text, re.IGNORECASE))


def _import_reward(module: str, function: str, item: str) -> Callable[..., list[float]]:
    """Import ``module`` and return its ``function``; the current folder counts, so ``my_rewards.py`` beside you works."""
    import os
    import sys

    if os.getcwd() not in sys.path:  # a console script's sys.path lacks the folder the user runs it from
        sys.path.append(os.getcwd())
    try:
        fn = getattr(importlib.import_module(module), function)
    except ModuleNotFoundError as error:
        raise GrpoKitError(
            f"Reward {item!r}: cannot import module {module!r} ({error}). Put {module.replace('.', '/')}.py in the "
            "folder you run from, or install the package that holds it."
        ) from None
    except AttributeError:
        raise GrpoKitError(f"Reward {item!r}: module {module!r} has no function {function!r}.") from None
    if not callable(fn):
        raise GrpoKitError(f"Reward {item!r}: {module}.{function} is not a function.")
    return fn


def _parse_weight(text: str, item: str) -> float:
    try:
        weight = float(text)
    except ValueError:
        weight = math.nan
    if not math.isfinite(weight):
        raise GrpoKitError(f"Bad weight in reward {item!r}: write a finite number after the colon, e.g. correctness:2.")
    return weight


def _format_number(value: float) -> str:
    return f"{value:g}"


def reward_table_markdown() -> str:
    """The markdown table of rewards (name | range | what it scores) that ``grpo-kit rewards`` prints.

    >>> reward_table_markdown().splitlines()[2].startswith("| `correctness` | 0 to 2 |")
    True
    """
    lines = ["| name | range | what it scores |", "|---|---|---|"]
    for info in REWARD_INFO.values():
        span = f"{_format_number(info.low)} to {_format_number(info.high)}"
        lines.append(f"| `{info.name}` | {span} | {info.description} |")
    return "\n".join(lines)


def cli_rewards(args: Any = None) -> int:
    """``grpo-kit rewards``: print the reward table and how a recipe's rewards (``--set rewards=...``) name them."""
    print(reward_table_markdown())
    print(f"\nUse with: grpo-kit train --set rewards=correctness:2,format   (default set: {DEFAULT_REWARD_SPEC})")
    return 0


def score_completions(
    completions: Sequence[Any],
    answers: Sequence[str] | str | None,
    names: Sequence[str] | str | None = None,
    prefill: Sequence[str] | str = "",
) -> list[dict[str, float]]:
    """Per-completion scores under each reward in ``names`` (default: all), plus their unweighted ``total``.

    ``answers`` is one gold answer per completion, or one for all; ``prefill`` likewise.

    >>> score_completions(["<think>a</think><answer>7</answer>"], "7", names=["correctness", "format"])
    [{'correctness': 2.0, 'format': 0.5, 'total': 2.5}]
    """
    funcs, _, chosen = parse_reward_spec(list(REWARDS) if names is None else names)
    count = len(completions)
    gold = [column(answers, i) for i in range(count)]
    heads = [column(prefill, i) for i in range(count)]
    columns = [fn(completions, answer=gold, prefill=heads) for fn in funcs]
    rows = []
    for i in range(count):
        row = {name: column[i] for name, column in zip(chosen, columns, strict=True)}
        row["total"] = round(sum(row.values()), 6)
        rows.append(row)
    return rows
