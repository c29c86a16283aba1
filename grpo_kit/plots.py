"""Every chart the kit draws: training curves, before/after accuracy, VRAM plans (notebook 02 draws its own toys)."""

import os
from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from grpo_kit.errors import GrpoKitError


def _figure(show: bool, figsize: tuple[float, float]):
    """A pyplot figure to show in a notebook, else a bare ``Figure`` (saved, never displayed, no GUI backend)."""
    return plt.figure(figsize=figsize) if show else Figure(figsize=figsize)


def _finish(fig, out: str | os.PathLike | None, show: bool):
    """Lay out, save to ``out`` (folders made) when given, show when asked; returns the PNG path, else the figure."""
    fig.tight_layout()
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=110)
    if show:
        plt.show()
    return fig if out is None else Path(out)


def plot_metrics(metrics: str | os.PathLike, out: str | os.PathLike | None = None, *, show: bool = False) -> Path:
    """Reward, completion-length and zero-variance curves of a run's ``metrics.jsonl`` (or its run folder), saved
    as a PNG (default ``<run>/plots/rewards.png``)."""
    from grpo_kit.callbacks import read_metrics

    metrics = Path(metrics)
    if metrics.is_dir():
        metrics = metrics / "metrics.jsonl"
    rows = read_metrics(metrics)
    if not rows:
        raise GrpoKitError(f"No metrics in {metrics}: train first (grpo-kit train), or check the run folder path.")
    return _finish(metrics_figure(rows, show=show), out or metrics.parent / "plots" / "rewards.png", show)


def metrics_figure(rows: list[dict], *, show: bool = False):
    """The figure ``plot_metrics`` saves (``frac_reward_zero_std``: groups whose completions all scored the same)."""
    ax_reward, ax_length, ax_zero = _figure(show, (15, 4)).subplots(1, 3)
    _line(ax_reward, rows, "reward", "total reward", linewidth=2.5)
    for key in sorted({k for row in rows for k in row if k.startswith("reward/")}):
        _line(ax_reward, rows, key, key.split("/", 1)[1], linestyle="--")
    _line(ax_reward, rows, "format_rate", "format rate", linestyle=":")
    ax_reward.set(title="Reward per step", xlabel="step", ylabel="mean over completions")
    ax_reward.legend(fontsize=8)
    _line(ax_length, rows, "completions/mean_length", "mean completion length")
    ax_length.set(title="Completion length", xlabel="step", ylabel="tokens")
    _line(ax_zero, rows, "frac_reward_zero_std", "groups with equal rewards")
    ax_zero.set(title="Groups that teach nothing", xlabel="step", ylabel="share of groups", ylim=(-0.05, 1.05))
    return ax_zero.figure


def _line(ax, rows: list[dict], key: str, label: str, **style) -> None:
    points = [(row["step"], row[key]) for row in rows if isinstance(row.get(key), (int, float))]
    if points:
        ax.plot(*zip(*points, strict=True), label=label, marker="o", markersize=3, **style)


def plot_before_after(results, path: str | os.PathLike) -> Path:
    """Grouped bars (strict/lenient accuracy, format rate, in %) of named ``EvalResult``s, saved as a PNG."""
    metrics = [("strict acc.", "accuracy_strict"), ("lenient acc.", "accuracy_lenient"), ("format rate", "format_rate")]
    width = 0.8 / len(results)
    ax = _figure(False, (6, 3.5)).subplots()
    for i, (name, result) in enumerate(results.items()):
        bars = ax.bar([m + i * width for m in range(len(metrics))], [100 * getattr(result, k) for _, k in metrics],
                      width, label=name)
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks([m + width * (len(results) - 1) / 2 for m in range(len(metrics))], [t for t, _ in metrics])
    n = max(result.n for result in results.values())
    ax.set(ylabel="%", ylim=(0, 105), title=f"held-out evaluation (n={n})")
    ax.legend()
    return _finish(ax.figure, path, False)


def plot_vram_plans(estimates, *, highlight: str | None = None, out=None, show: bool = True):
    """Stacked bars of ``{name: planner.VramEstimate}``, one per recipe; a black tick marks each card's memory (a bar
    ending left of its tick fits). ``highlight`` stars the chosen recipe."""
    names = list(estimates)
    ax = _figure(show, (9, 0.6 * len(names) + 1.8)).subplots()
    left = [0.0] * len(names)
    for label, attr in (("weights", "weights_gib"), ("LoRA + grads + Adam", "lora_gib"),
                        ("activations", "activations_gib"), ("logits", "logits_gib"), ("vLLM KV cache", "vllm_gib"),
                        ("CUDA overhead", "overhead_gib")):  # the parts of a planner.VramEstimate, bottom to top
        values = [getattr(estimates[name], attr) for name in names]
        ax.barh(names, values, left=left, label=label)
        left = [a + b for a, b in zip(left, values, strict=True)]
    ax.bar_label(ax.containers[-1], labels=[f" {total:.1f}" for total in left], fontsize=8)
    for y, card in enumerate(estimate.card_gib for estimate in estimates.values()):
        if card:
            ax.plot([card, card], [y - 0.42, y + 0.42], color="black", linewidth=2.5)
    ax.plot([], [], color="black", linewidth=2.5, label="card memory")
    ax.set_yticks(range(len(names)), [f"{n} *" if n == highlight else n for n in names])
    ax.invert_yaxis()
    ax.set(title="VRAM plan per recipe (GiB; * = chosen)", xlabel="GiB")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    return _finish(ax.figure, out, show)
