"""Does SEED-GRPO help on a CPU? The ``cpu-answers`` recipe trained twice, with and without it, then compared.

Both runs: the ``cpu-answers`` preset (embedded SmolLM2-135M, one-step synthetic arithmetic, correctness alone), the
same seed and steps, and ``scale_rewards: none`` (SEED-GRPO scales r_i - mean r; dividing by the group's std would
undo it, so the plain run leaves the std out too: the only difference is SEED-GRPO's 1 / (1 + alpha * H)). Then
both adapters answer the same held-out problems (``arithmetic`` test split, greedy, the training prompt). Prints:

- each run's semantic entropy and correctness reward per step (``grpo_kit.rewards.semantic_entropy``);
- each run's held-out strict accuracy with its 95 % Wilson interval, and SEED-GRPO minus plain with the 95 % paired
  interval (Newcombe) and the exact McNemar test (``grpo_kit.evaluate``);
- last line: ``seed_grpo_delta_points=X`` (SEED-GRPO's held-out strict accuracy minus the plain run's, in points).

    .venv/bin/python benchmarks/bench_seed_grpo.py [--steps N] [--alpha 1.0] [--questions 100] [--threads 2]

One seed, one pair of runs on a 135M model: the interval is over questions, not over training runs. Not a test: it
trains (about 12 minutes a run on 2 cores).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path


def curve(history: list[dict]) -> list[tuple]:
    """``(step, semantic entropy, share of sampled answers right)`` per logged step (correctness scores 0 or 2; under
    SEED-GRPO too, ``reward/correctness`` is what the reward gave: ``rewards.seed_grpo``).

    >>> curve([{"step": 1, "semantic_entropy": 0.5, "reward/correctness": 1.0}, {"step": 2}])
    [(1, 0.5, 0.5)]
    """
    return [
        (row["step"], row["semantic_entropy"], row["reward/correctness"] / 2)
        for row in history
        if isinstance(row.get("semantic_entropy"), (int, float))
    ]


def held_out(recipe, run, questions, label: str):
    """``run``'s adapter on the held-out ``questions``: greedy, with the prompt and the token budget it trained with."""
    from grpo_kit.evaluate import evaluate
    from grpo_kit.models import load_inference_model

    model, tokenizer = load_inference_model(recipe.model.model_name_or_path, run.adapter_dir)
    return evaluate(
        model,
        tokenizer,
        questions,
        max_new_tokens=recipe.grpo.max_completion_length,
        batch_size=16,
        few_shot=recipe.kit.few_shot,
        prefill=recipe.kit.prefill,
        label=label,
        progress=False,
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, help="GRPO steps (default: the cpu-answers preset's)")
    parser.add_argument("--alpha", type=float, default=1.0, help="SEED-GRPO's alpha (default 1.0)")
    parser.add_argument("--questions", type=int, default=100, help="held-out questions (the split holds 200)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--out", help="folder for the two runs (default: a temporary one)")
    args = parser.parse_args(argv)
    os.environ["GRPO_KIT_THREADS"] = str(args.threads)

    from grpo_kit.config import load_recipe
    from grpo_kit.data import load_gsm8k
    from grpo_kit.stats import paired_difference, wilson
    from grpo_kit.train import train

    out = Path(args.out or tempfile.mkdtemp(prefix="bench-seed-grpo-"))
    base = load_recipe("cpu-answers", scale_rewards="none", **({"max_steps": args.steps} if args.steps else {}))
    recipes = {"plain": base, "seed-grpo": base.replace(seed_grpo_alpha=args.alpha)}
    questions = load_gsm8k("arithmetic", split="test", limit=args.questions, seed=0)
    results = {}
    for name, recipe in recipes.items():
        run = train(recipe, data="arithmetic", output_dir=out / name)
        print(f"\n{name}: {run.steps} steps in {run.seconds:.0f} s\nstep  semantic entropy  sampled right")
        for step, entropy, right in curve(run.history):
            print(f"{step:>4}{entropy:>17.3f}{100 * right:>14.1f} %")
        results[name] = held_out(recipe, run, questions, name)
    print(f"\nheld-out strict accuracy, {args.questions} arithmetic test problems, greedy:")
    for name, result in results.items():
        low, high = wilson(round(result.accuracy_strict * result.n), result.n)
        print(f"  {name:<10} {100 * result.accuracy_strict:5.1f} %  [{100 * low:.1f}, {100 * high:.1f}]")
    change = paired_difference(*([row["correct_strict"] for row in r.rows] for r in results.values()))
    print("SEED-GRPO (after) against plain (before), paired:\n" + change.summary())
    print(f"seed_grpo_delta_points={100 * change.difference:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
