"""Does GRPO on CPU teach *answers*? Held-out strict accuracy before and after the ``cpu-answers`` recipe.

One run: train the ``cpu-answers`` preset on the one-step synthetic arithmetic train split (embedded SmolLM2-135M),
then score the base model and base+adapter greedily on the same held-out problems (``arithmetic`` test split:
no calculation of the train split appears there, even under another name). Prints:

- the correctness reward per step (share of the sampled completions that were right, and TRL's share of groups
  with equal rewards, which teach nothing), and saves that curve as a PNG whose path it prints;
- strict accuracy before and after, each with a 95 % Wilson interval, and the change with a 95 % paired interval
  (Newcombe) and the exact McNemar test (``grpo_kit.evaluate``);
- the verdict against the target: +15 points or more, zero outside the interval, training <= 15 minutes.

    .venv/bin/python benchmarks/bench_cpu_answers.py [--steps N] [--minutes 15] [--questions 200] [--threads 2]

Training stops at the preset's ``max_steps`` or when the next step would end past ``--minutes`` (mean step time so
far), whichever comes first. Wall time is the training's (``TrainResult.seconds``: trainer start to end, model
loading excluded); evaluation time is printed apart. Not a test: it trains.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

TARGET_POINTS = 15.0
TARGET_SECONDS = 15 * 60


def time_budget(seconds: float, clock=time.monotonic):
    """A TrainerCallback that ends training after the step during which ``seconds`` of wall time ran out, so a run
    stays within the target's minutes whatever the machine's speed (the steps done are printed)."""
    from transformers import TrainerCallback

    class TimeBudget(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            self.start = clock()

        def on_step_end(self, args, state, control, **kwargs):
            # Stop when one more step, as long as the mean step so far, would overrun the budget.
            elapsed = clock() - self.start
            if elapsed + elapsed / max(state.global_step, 1) > seconds:
                control.should_training_stop = True

    return TimeBudget()


def correctness_curve(history: list[dict], key: str = "reward/correctness", points: float = 2.0) -> list[tuple]:
    """``(step, share right, share of zero-variance groups)`` per logged step; the reward is 0 or ``points``.

    >>> correctness_curve([{"step": 1, "reward/correctness": 0.5, "frac_reward_zero_std": 0.75}, {"step": 2}])
    [(1, 0.25, 0.75)]
    """
    return [
        (row["step"], row[key] / points, row.get("frac_reward_zero_std"))
        for row in history
        if isinstance(row.get(key), (int, float))
    ]


def curve_table(curve: list[tuple], window: int = 3) -> str:
    """The per-step curve as text, with a moving mean over ``window`` steps (one step holds only a few questions).

    >>> print(curve_table([(1, 0.25, 0.5), (2, 0.5, None)], window=2))
    step  sampled right  mean of last 2  groups teaching nothing
       1          25.0 %          25.0 %                   50.0 %
       2          50.0 %          37.5 %                        -
    """
    lines = [f"step  sampled right  mean of last {window}  groups teaching nothing"]
    for i, (step, right, zero) in enumerate(curve):
        recent = [value for _, value, _ in curve[max(0, i - window + 1) : i + 1]]
        zero_text = "-" if zero is None else f"{100 * zero:.1f} %"
        lines.append(f"{step:>4}{100 * right:>14.1f} %{100 * sum(recent) / len(recent):>14.1f} %{zero_text:>25}")
    return "\n".join(lines)


def plot_curve(curve: list[tuple], path: Path, *, before: float | None = None, after: float | None = None) -> Path:
    """Save the sampled-correctness curve (and the held-out greedy accuracies as lines) to ``path``."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    steps = [step for step, _, _ in curve]
    ax.plot(steps, [100 * right for _, right, _ in curve], marker="o", label="sampled completions right (training)")
    zero = [(step, z) for step, _, z in curve if z is not None]
    if zero:
        ax.plot(*zip(*[(s, 100 * z) for s, z in zero], strict=True), linestyle=":", label="groups with equal rewards")
    for value, name, style in ((before, "held-out greedy, before", "--"), (after, "held-out greedy, after", "-.")):
        if value is not None:
            ax.axhline(100 * value, linestyle=style, color="grey" if name.endswith("before") else "black", label=name)
    ax.set(title="cpu-answers: correctness reward per step", xlabel="step", ylabel="%", ylim=(-2, 102))
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def verdict(change, seconds: float) -> str:
    """One line against the issue's target: >= 15 points, zero outside the 95 % paired interval, <= 15 minutes."""
    points = 100 * change.difference
    met = points >= TARGET_POINTS and change.interval[0] > 0 and seconds <= TARGET_SECONDS
    return (
        f"target (+{TARGET_POINTS:g} points, interval above 0, training <= {TARGET_SECONDS // 60} min): "
        f"{'met' if met else 'NOT met'} ({points:+.1f} points, interval low {100 * change.interval[0]:+.1f}, "
        f"training {seconds:.0f} s)"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, help="GRPO steps at most (default: the cpu-answers preset's)")
    parser.add_argument(
        "--minutes",
        type=float,
        default=TARGET_SECONDS / 60,
        help="training wall-time budget: no step starts that would end past it (default 15)",
    )
    parser.add_argument("--questions", type=int, default=200, help="held-out questions (the split holds 200)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (GRPO_KIT_THREADS)")
    parser.add_argument("--out", default=None, help="run folder (default: runs/bench-cpu-answers-<time>)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="preset override")
    args = parser.parse_args(argv)
    os.environ["GRPO_KIT_THREADS"] = str(args.threads)  # read by every set_torch_threads() call

    from grpo_kit.config import load_recipe, parse_set
    from grpo_kit.data import load_gsm8k
    from grpo_kit.evaluate import evaluate_before_after
    from grpo_kit.stats import paired_difference
    from grpo_kit.train import train

    preset = load_recipe("cpu-answers", **parse_set(args.set), **({"max_steps": args.steps} if args.steps else {}))
    out = Path(args.out or Path("runs") / f"bench-cpu-answers-{time.strftime('%Y%m%d-%H%M%S')}")
    held_out = load_gsm8k("arithmetic", "test", limit=args.questions, seed=0)
    result = train(preset, data="arithmetic", output_dir=out, callbacks=(time_budget(60 * args.minutes),))
    started = time.time()
    base, tuned = evaluate_before_after(
        preset.model.model_name_or_path,
        result.adapter_dir,
        held_out,
        max_new_tokens=preset.grpo.max_completion_length,
        batch_size=16,
        few_shot=preset.kit.few_shot,
        prefill=preset.kit.prefill,
        seed=preset.grpo.seed,
        progress=False,
    )
    eval_seconds = time.time() - started
    change = paired_difference([r["correct_strict"] for r in base.rows], [r["correct_strict"] for r in tuned.rows])
    curve = correctness_curve(result.history)
    png = plot_curve(curve, out / "plots" / "correctness.png", before=change.before, after=change.after)
    for name, scored in (("before", base), ("after", tuned)):
        scored.save(out / f"eval_{name}.json")

    print(
        f"\ncpu-answers: {result.steps} steps x {preset.prompts_per_step} questions x G={preset.grpo.num_generations}, "
        f"lr {preset.grpo.learning_rate:g}, temperature {preset.grpo.temperature:g}, {args.threads} threads"
    )
    print("\ncorrectness reward per step (training samples):\n" + curve_table(curve))
    print(f"curve image: {png}")
    print(f"\nheld-out strict accuracy, arithmetic test, greedy, {preset.grpo.max_completion_length} tokens:")
    print(change.summary())
    print(
        f"lenient {100 * base.accuracy_lenient:.1f} % -> {100 * tuned.accuracy_lenient:.1f} %, "
        f"format {100 * base.format_rate:.1f} % -> {100 * tuned.format_rate:.1f} %"
    )
    print(f"training {result.seconds:.0f} s, evaluation (both models) {eval_seconds:.0f} s")
    print(verdict(change, result.seconds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
