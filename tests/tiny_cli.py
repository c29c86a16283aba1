"""A tiny CPU run, shared by tests: command-line arguments for those that drive ``grpo-kit train`` as a user would,
a recipe for those that call ``train()``."""

from __future__ import annotations

import zlib

#: 2 completions of 8 tokens per step, one question per step, no worked examples.
TINY_SETTINGS = {"num_generations": 2, "per_device_train_batch_size": 2, "max_completion_length": 8, "few_shot": 0}


def tiny_train_args(data: str | None = None, **settings) -> list[str]:
    """``--preset cpu [--data DATA] --set KEY=VALUE ...`` with ``TINY_SETTINGS`` and then ``settings``."""
    sets = [token for key, value in {**TINY_SETTINGS, **settings}.items() for token in ("--set", f"{key}={value}")]
    return ["--preset", "cpu", *(("--data", data) if data else ()), *sets]


def tiny_recipe(model_dir, **changes):
    """The ``cpu`` recipe on the tiny random model (conftest's ``tiny_model_dir``) with ``TINY_SETTINGS``: 2 steps,
    a checkpoint and a metrics row at each, then ``changes``."""
    from grpo_kit.config import load_recipe

    settings = {**TINY_SETTINGS, "gradient_accumulation_steps": 1, "max_steps": 2, "save_steps": 1, "logging_steps": 1}
    # 0.05, not the recipe's 5e-4: one step of a 2-layer random model then visibly changes what it samples
    return load_recipe("cpu", model_name_or_path=str(model_dir), **{**settings, "learning_rate": 0.05, **changes})


def recorded_values(**settings) -> dict:
    """The recipe values ``tiny_train_args(**settings)`` trains with, as run.json records them (for a made-up run)."""
    from grpo_kit.config import load_recipe, parse_set

    return dict(load_recipe("cpu", **parse_set([f"{k}={v}" for k, v in {**TINY_SETTINGS, **settings}.items()])).values)


def varied(completions, **kwargs) -> list[float]:
    """A reward that scores any two different completions differently (from a hash of the text), so a tiny run's
    groups always differ and its LoRA moves: a run with no reward signal fails (``doctor.learned_nothing``)."""
    from grpo_kit.rewards import completion_text

    return [zlib.crc32(completion_text(c).encode()) / 2**32 for c in completions]


#: Settings that give a tiny run a reward signal: ``tiny_train_args(..., **SIGNAL)``.
SIGNAL = {"reward_funcs": "tiny_cli:varied", "reward_weights": "[1]"}
