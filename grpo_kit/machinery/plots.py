"""Training curves from a run's ``metrics.jsonl``: reward (total and per reward function), format rate, length, and
the share of groups whose completions all scored the same (``frac_reward_zero_std``: those teach nothing).

>>> # plot_metrics("runs/demo/metrics.jsonl", "runs/demo/plots/rewards.png")  -> Path of the PNG
"""

from __future__ import annotations

import os
from pathlib import Path

from grpo_kit.errors import GrpoKitError


def plot_metrics(metrics: str | os.PathLike, out: str | os.PathLike | None = None, *, show: bool = False) -> Path:
    """Draw reward, format-rate, completion-length and zero-variance curves; save a PNG (default:
    ``<run>/plots/rewards.png``)."""
    from grpo_kit.machinery.metrics import read_metrics

    metrics = Path(metrics)
    if metrics.is_dir():
        metrics = metrics / "metrics.jsonl"
    rows = read_metrics(metrics)
    if not rows:
        raise GrpoKitError(f"No metrics in {metrics}: train first (grpo-kit train), or check the run folder path.")
    out = Path(out) if out else metrics.parent / "plots" / "rewards.png"
    out.parent.mkdir(parents=True, exist_ok=True)

    fig = metrics_figure(rows, show=show)
    fig.savefig(out, dpi=110)
    if show:
        import matplotlib.pyplot as plt

        plt.show()
    return out


def metrics_figure(rows: list[dict], *, show: bool = False):
    """The figure ``plot_metrics`` saves: reward panel, completion-length panel, zero-variance panel."""
    reward_keys = sorted({k for row in rows for k in row if k.startswith("reward/")})
    fig = _figure(show)
    ax_reward, ax_length, ax_zero = fig.subplots(1, 3)
    _line(ax_reward, rows, "reward", "total reward", linewidth=2.5)
    for key in reward_keys:
        _line(ax_reward, rows, key, key.split("/", 1)[1], linestyle="--")
    _line(ax_reward, rows, "format_rate", "format rate", linestyle=":")
    ax_reward.set(title="Reward per step", xlabel="step", ylabel="mean over completions")
    ax_reward.legend(fontsize=8)
    _line(ax_length, rows, "completions/mean_length", "mean completion length")
    ax_length.set(title="Completion length", xlabel="step", ylabel="tokens")
    _line(ax_zero, rows, "frac_reward_zero_std", "groups with equal rewards")
    ax_zero.set(title="Groups that teach nothing", xlabel="step", ylabel="share of groups", ylim=(-0.05, 1.05))
    fig.tight_layout()
    return fig


def _figure(show: bool):
    """A pyplot figure when it will be shown (notebooks), else a bare ``Figure`` that never touches the backend."""
    if show:
        import matplotlib.pyplot as plt

        return plt.figure(figsize=(15, 4))
    from matplotlib.figure import Figure

    return Figure(figsize=(15, 4))


def _line(ax, rows: list[dict], key: str, label: str, **style) -> None:
    points = [(row["step"], row[key]) for row in rows if isinstance(row.get(key), (int, float))]
    if points:
        steps, values = zip(*points, strict=True)
        ax.plot(steps, values, label=label, marker="o", markersize=3, **style)
