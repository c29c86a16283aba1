"""The kit's training curves (notebook 02 draws its own toys)."""

import os
from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from grpo_kit.doctor import logged
from grpo_kit.errors import GrpoKitError
from grpo_kit.runs import read_metrics


def plot_metrics(metrics: str | os.PathLike, out: str | os.PathLike | None = None, *, show: bool = False) -> Path:
    """Reward, completion-length and zero-variance curves of a run's ``metrics.jsonl``, saved as a PNG (default
    ``<run>/plots/rewards.png``) and shown in a notebook when ``show``."""
    metrics = Path(metrics)
    rows = read_metrics(metrics)
    if not rows:
        raise GrpoKitError(f"No metrics in {metrics}: train first (grpo-kit train), or check the run folder path.")
    fig, out = metrics_figure(rows, show=show), Path(out or metrics.parent / "plots" / "rewards.png")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    if show:
        plt.show()
    return out


def metrics_figure(rows: list[dict], *, show: bool = False):
    """The figure ``plot_metrics`` saves (``frac_reward_zero_std``: groups whose completions all scored the same;
    ``semantic_entropy`` and ``reflection_rate``: ``grpo_kit.rewards``' metrics);
    a pyplot figure to show in a notebook, else a bare ``Figure`` (never displayed, no GUI backend)."""
    fig = (plt.figure if show else Figure)(figsize=(15, 4))
    ax_reward, ax_length, ax_zero = fig.subplots(1, 3)
    _line(ax_reward, rows, "reward", "total reward", linewidth=2.5)
    _line(ax_reward, rows, "seed_grpo/reward", "total reward scaled by SEED-GRPO (trains)", linewidth=2.5)
    for key in sorted({k for row in rows for k in row if k.startswith("reward/")}):
        _line(ax_reward, rows, key, key[7:].replace("seed_grpo/", "scaled: "), linestyle="--")
    _line(ax_reward, rows, "format_rate", "format rate", linestyle=":")
    ax_reward.set(title="Reward per step", xlabel="step", ylabel="mean over completions")
    ax_reward.legend(fontsize=8)
    _line(ax_length, rows, "completions/mean_length", "mean completion length")
    ax_length.set(title="Completion length", xlabel="step", ylabel="tokens")
    _line(ax_zero, rows, "frac_reward_zero_std", "groups with equal rewards")
    _line(ax_zero, rows, "semantic_entropy", "semantic entropy (answers disagree)", linestyle="--")
    _line(ax_zero, rows, "reflection_rate", 'answers that re-check ("wait")', linestyle=":")
    ax_zero.set(title="What the groups say", xlabel="step", ylabel="share, or entropy / log G", ylim=(-0.05, 1.05))
    ax_zero.legend(fontsize=8)
    return fig


def _line(ax, rows: list[dict], key: str, label: str, **style) -> None:
    if shown := logged(rows, key):
        ax.plot(
            [row["step"] for row in shown], [row[key] for row in shown], label=label, marker="o", markersize=3, **style
        )
