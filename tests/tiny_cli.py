"""Command-line arguments for a tiny CPU run, shared by the tests that drive ``grpo-kit train`` as a user would."""

from __future__ import annotations

import zlib

#: 2 completions of 8 tokens per step, one question per step, no worked examples.
TINY_SETTINGS = {"num_generations": 2, "per_device_train_batch_size": 2, "max_completion_length": 8, "few_shot": 0}


def tiny_train_args(data: str | None = None, **settings) -> list[str]:
    """``--preset cpu [--data DATA] --set KEY=VALUE ...`` with ``TINY_SETTINGS`` and then ``settings``."""
    sets = [token for key, value in {**TINY_SETTINGS, **settings}.items() for token in ("--set", f"{key}={value}")]
    return ["--preset", "cpu", *(("--data", data) if data else ()), *sets]


def recorded_values(**settings) -> dict:
    """The recipe values ``tiny_train_args(**settings)`` trains with, as run.json records them (for a made-up run)."""
    from grpo_kit.config import load_recipe, parse_set

    return dict(load_recipe("cpu", **parse_set([f"{k}={v}" for k, v in {**TINY_SETTINGS, **settings}.items()])).values)


def varied(completions, **kwargs) -> list[float]:
    """A reward that scores any two different completions differently (from a hash of the text), so a tiny run's
    groups always differ and its LoRA moves: a run with no reward signal fails (``runs.learned_nothing``)."""
    from grpo_kit.rewards import completion_text

    return [zlib.crc32(completion_text(c).encode()) / 2**32 for c in completions]


#: Settings that give a tiny run a reward signal: ``tiny_train_args(..., **SIGNAL)``.
SIGNAL = {"reward_funcs": "tiny_cli:varied", "reward_weights": "[1]"}
