"""Command-line arguments for a tiny CPU run, shared by the tests that drive ``grpo-kit train`` as a user would."""

from __future__ import annotations

#: 2 completions of 8 tokens per step, one question per step, no worked examples.
TINY_SETTINGS = {"num_generations": 2, "per_device_train_batch_size": 2, "max_completion_length": 8, "few_shot": 0}


def tiny_train_args(data: str | None = None, **settings) -> list[str]:
    """``--preset cpu [--data DATA] --set KEY=VALUE ...`` with ``TINY_SETTINGS`` and then ``settings``."""
    sets = [token for key, value in {**TINY_SETTINGS, **settings}.items() for token in ("--set", f"{key}={value}")]
    return ["--preset", "cpu", *(("--data", data) if data else ()), *sets]
