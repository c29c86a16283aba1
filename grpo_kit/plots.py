"""Training curves from a run's ``metrics.jsonl``: reward (total and per reward function), format rate, length.

>>> # plot_metrics("runs/demo/metrics.jsonl", "runs/demo/plots/rewards.png")  -> Path of the PNG
"""

from __future__ import annotations

import os
from pathlib import Path

from grpo_kit.errors import GrpoKitError


def plot_metrics(metrics: str | os.PathLike, out: str | os.PathLike | None = None, *, show: bool = False) -> Path:
    """Draw reward, format-rate and completion-length curves; save a PNG (default: ``<run>/plots/rewards.png``)."""
    from grpo_kit.train import read_metrics

    metrics = Path(metrics)
    if metrics.is_dir():
        metrics = metrics / "metrics.jsonl"
    rows = read_metrics(metrics)
    if not rows:
        raise GrpoKitError(f"No metrics in {metrics}: train first (grpo-kit train), or check the run folder path.")
    out = Path(out) if out else metrics.parent / "plots" / "rewards.png"
    out.parent.mkdir(parents=True, exist_ok=True)

    reward_keys = sorted({k for row in rows for k in row if k.startswith("reward/")})
    fig = _figure(show)
    ax_reward, ax_length = fig.subplots(1, 2)
    _line(ax_reward, rows, "reward", "total reward", linewidth=2.5)
    for key in reward_keys:
        _line(ax_reward, rows, key, key.split("/", 1)[1], linestyle="--")
    _line(ax_reward, rows, "format_rate", "format rate", linestyle=":")
    ax_reward.set(title="Reward per step", xlabel="step", ylabel="mean over completions")
    ax_reward.legend(fontsize=8)
    _line(ax_length, rows, "completions/mean_length", "mean completion length")
    ax_length.set(title="Completion length", xlabel="step", ylabel="tokens")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    if show:
        import matplotlib.pyplot as plt

        plt.show()
    return out


def _figure(show: bool):
    """A pyplot figure when it will be shown (notebooks), else a bare ``Figure`` that never touches the backend."""
    if show:
        import matplotlib.pyplot as plt

        return plt.figure(figsize=(11, 4))
    from matplotlib.figure import Figure

    return Figure(figsize=(11, 4))


def _line(ax, rows: list[dict], key: str, label: str, **style) -> None:
    points = [(row["step"], row[key]) for row in rows if isinstance(row.get(key), (int, float))]
    if points:
        steps, values = zip(*points, strict=True)
        ax.plot(steps, values, label=label, marker="o", markersize=3, **style)
