"""``metrics.jsonl``: one JSON line per logged training step (the plots, the demo and resume read it)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

#: Metrics copied into metrics.jsonl under the same name (plus every 'rewards/<name>/mean').
TRACKED = (
    "loss",
    "grad_norm",
    "learning_rate",
    "reward",
    "reward_std",
    "frac_reward_zero_std",
    "completions/mean_length",
    "completions/clipped_ratio",
    "kl",
    "entropy",
    "step_time",
    "epoch",
)


def _clean(logs: dict[str, Any]) -> dict[str, Any]:
    row = {}
    for key, value in logs.items():
        if key in TRACKED or (key.startswith("rewards/") and key.endswith("/mean")):
            name = key[len("rewards/") : -len("/mean")] if key.startswith("rewards/") else key
            name = "format_rate" if name == "format_rate" else (f"reward/{name}" if key.startswith("rewards/") else name)
            row[name] = value
    return row


def make_metrics_logger(path: Path):
    """A ``TrainerCallback`` that appends each training log as one JSON line to ``path``."""
    from transformers import TrainerCallback

    from grpo_kit.machinery.guards import dumps_finite

    class MetricsLogger(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if not logs or not state.is_world_process_zero or "train_runtime" in logs:
                return
            row = {"step": state.global_step, **_clean(logs)}
            with open(path, "a", encoding="utf-8") as handle:
                handle.write(dumps_finite(row) + "\n")  # NaN/inf become null: metrics.jsonl stays valid JSON

    return MetricsLogger()


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """Rows of a ``metrics.jsonl`` (a torn last line from a killed run is ignored)."""
    rows = []
    path = Path(path)
    if not path.is_file():
        return rows
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def truncate_metrics(path: Path, last_step: int) -> None:
    """Drop rows logged after ``last_step`` (they will be logged again after a resume); atomic rewrite."""
    from grpo_kit.machinery.guards import dumps_finite

    rows = [row for row in read_metrics(path) if row.get("step", 0) <= last_step]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(dumps_finite(row) + "\n" for row in rows), encoding="utf-8")
    os.replace(tmp, path)


def reward_first_last(history: list[dict], window: int = 3, key: str = "reward") -> tuple[float | None, float | None]:
    """Mean of ``key`` over the first and the last ``window`` logged steps.

    >>> reward_first_last([{"reward": 0.0}, {"reward": 0.2}, {"reward": 0.8}, {"reward": 1.0}], window=2)
    (0.1, 0.9)
    """
    values = [row[key] for row in history if isinstance(row.get(key), (int, float))]
    if not values:
        return None, None
    window = max(1, min(window, len(values) // 2 or 1))
    return sum(values[:window]) / window, sum(values[-window:]) / window
