"""Reporting and the ``grpo-kit eval`` command: the before/after table, the bar chart, the eval data and prompt
settings of a run, and ``cli_eval`` (``grpo_kit.evaluate`` does the evaluating)."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from grpo_kit.errors import GrpoKitError
from grpo_kit.evaluate import EvalResult, evaluate, evaluate_before_after, rows_path

_COMPARE_ROWS = (
    ("accuracy (strict)", "accuracy_strict", True),
    ("accuracy (lenient)", "accuracy_lenient", True),
    ("format rate", "format_rate", True),
    ("mean length (tokens)", "mean_completion_tokens", False),
)


def compare(base_result: EvalResult, tuned_result: EvalResult, names: tuple[str, str] = ("base", "tuned")) -> str:
    """Side-by-side table of two results (percent for rates), with the protocol underneath.

    >>> a = EvalResult(0.0, 0.1, 0.0, 50.0, n=10, seed=0, protocol="p")
    >>> b = EvalResult(0.2, 0.3, 0.9, 40.0, n=10, seed=0, protocol="p")
    >>> print(compare(a, b).splitlines()[1])
    accuracy (strict)          0.0 %      20.0 %    +20.0
    """
    lines = [f"{'metric':<22}{names[0]:>10}{names[1]:>12}{'change':>9}"]
    for title, key, percent in _COMPARE_ROWS:
        left, right = getattr(base_result, key), getattr(tuned_result, key)
        if percent:
            lines.append(f"{title:<22}{100 * left:>8.1f} %{100 * right:>10.1f} %{100 * (right - left):>+9.1f}")
        else:
            lines.append(f"{title:<22}{left:>10.1f}{right:>12.1f}{right - left:>+9.1f}")
    if base_result.maj_k and tuned_result.maj_k:
        for kind in ("strict", "lenient"):
            left = getattr(base_result, f"maj_accuracy_{kind}")
            right = getattr(tuned_result, f"maj_accuracy_{kind}")
            title = f"maj@{tuned_result.maj_k} ({kind})"
            lines.append(f"{title:<22}{100 * left:>8.1f} %{100 * right:>10.1f} %{100 * (right - left):>+9.1f}")
    lines.append(f"n = {base_result.n} / {tuned_result.n}")
    if base_result.protocol == tuned_result.protocol:
        lines.append(f"protocol: {base_result.protocol}")
    else:
        lines += [f"protocol ({names[0]}): {base_result.protocol}", f"protocol ({names[1]}): {tuned_result.protocol}"]
    return "\n".join(lines)


def plot_before_after(results: Mapping[str, EvalResult], path: str | os.PathLike) -> Path:
    """Grouped bar chart (strict/lenient accuracy, format rate, in %) of named results, saved as an image."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [("strict acc.", "accuracy_strict"), ("lenient acc.", "accuracy_lenient"), ("format rate", "format_rate")]
    width = 0.8 / max(len(results), 1)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for i, (name, result) in enumerate(results.items()):
        xs = [m + i * width for m in range(len(metrics))]
        bars = ax.bar(xs, [100 * getattr(result, key) for _, key in metrics], width, label=name)
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks([m + width * (len(results) - 1) / 2 for m in range(len(metrics))], [t for t, _ in metrics])
    ax.set_ylabel("%")
    ax.set_ylim(0, 105)
    first = next(iter(results.values()), None)
    ax.set_title(f"held-out evaluation (n={first.n if first else 0})")
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------------------------------- CLI


def load_eval_data(data: str, *, limit: int | None = None, seed: int = 0):
    """The eval split of ``data``: ``gsm8k`` (Hub test split), ``sample`` (bundled held-out test split) or a file."""
    from grpo_kit.data import load_gsm8k

    return load_gsm8k(data, split="test", limit=limit, seed=seed)


def run_prompt_settings(adapter_dir: str | os.PathLike | None) -> dict[str, Any]:
    """``few_shot``/``prefill`` the adapter was trained with (from ``<run>/run.json``), else zero-shot, no prefill."""
    settings: dict[str, Any] = {"few_shot": 0, "prefill": ""}
    if adapter_dir is None:
        return settings
    from grpo_kit.recipes import recorded_settings

    recorded = recorded_settings(Path(adapter_dir).parent)
    return {key: recorded.get(key, default) for key, default in settings.items()}


def cli_eval(args) -> int:
    """``grpo-kit eval``: print metrics (and a before/after table with --compare); save JSON with --out."""
    from grpo_kit.machinery.runtime import set_torch_threads
    from grpo_kit.models import load_inference_model

    set_torch_threads()
    if args.compare and not args.adapter:
        raise GrpoKitError("--compare compares the base model with an adapter; pass --adapter DIR too.")
    dataset = load_eval_data(args.data, limit=args.limit, seed=args.seed)
    if getattr(args, "harness", None):  # lm-evaluation-harness's protocol instead of the kit's
        from grpo_kit.machinery.harness import cli_harness

        return cli_harness(args, dataset)
    settings = run_prompt_settings(args.adapter)
    options = dict(max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, maj_k=args.maj, seed=args.seed, **settings)
    print(f"evaluating {args.model}{' + ' + args.adapter if args.adapter else ''} on {len(dataset)} questions "
          f"(few_shot={settings['few_shot']}, prefill={settings['prefill']!r})")
    started = time.time()
    if args.compare:
        base, tuned = evaluate_before_after(args.model, args.adapter, dataset, **options)
        print(compare(base, tuned))
        results = {"base": base, "tuned": tuned}
    else:
        model, tokenizer = load_inference_model(args.model, args.adapter)
        result = evaluate(model, tokenizer, dataset, label="tuned" if args.adapter else "base", **options)
        print(result.summary())
        print(f"protocol: {result.protocol}")
        results = {"result": result}
    print(f"wall time {time.time() - started:.0f} s")
    if args.out:
        out = Path(args.out)
        for name, result in results.items():
            target = out if name in {"result", "tuned"} else out.with_name(f"{out.stem}-{name}{out.suffix or '.json'}")
            print(f"wrote {result.save(target)} (+ {rows_path(target).name})")
    return 0
