"""Held-out accuracy after N steps for each GRPO loss variant (``LOSS_VARIANTS`` below) on the cpu-answers recipe.

A benchmark, not a test: one short run per variant, the same seed, the same data (one-step synthetic arithmetic),
the same everything but the loss, so every run starts from the same model and samples the same first group. Then
each adapter answers the same held-out problems (``arithmetic`` test split, greedy, the training prompt), and the
table gives its strict accuracy with the 95 % Wilson interval and its change against ``dapo`` (the recipes' loss),
paired on the same questions (Newcombe's interval, exact McNemar; ``grpo_kit.evaluate``). Short runs on a 135M model
are noisy: read the table as "does each variant train", not as a ranking. Measured results, and how to read them,
are in docs/SCALING.md, section 3.

    .venv/bin/python benchmarks/bench_loss_types.py [--steps 4] [--questions 100] [--variants grpo,gspo] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

#: GRPO loss variants, taught by name: the GRPOConfig fields each one is, and what it changes (docs/SCALING.md).
LOSS_VARIANTS: dict[str, tuple[dict, str]] = {
    "grpo": (
        {"loss_type": "grpo"},
        "original GRPO: token losses averaged per completion, then over completions "
        "(length-biased: short right answers and long wrong ones are favoured)",
    ),
    "dr_grpo": (
        {"loss_type": "dr_grpo"},
        "Dr. GRPO: token losses summed and divided by a constant "
        "(max_completion_length): no length bias (the paper also drops std scaling: scale_rewards=none)",
    ),
    "dapo": ({"loss_type": "dapo"}, "DAPO, TRL's default: token losses averaged over every token of the batch"),
    "bnpo": ({"loss_type": "bnpo"}, "BNPO: token losses averaged over the tokens of each micro-batch"),
    "gspo": (
        {"loss_type": "grpo", "importance_sampling_level": "sequence", "epsilon": 3e-4, "epsilon_high": 4e-4},
        "GSPO: one importance ratio per completion clipped at 3e-4/4e-4; differs from grpo only when batches "
        "are reused (num_iterations > 1 or steps_per_generation > accumulation)",
    ),
    "cispo": (
        {"loss_type": "cispo", "epsilon_high": 5.0},
        "CISPO (MiniMax-M1): the ratio, clipped at 5 (ScaleRL's value) and detached, weighs each token's "
        "log-probability gradient: no token loses its gradient to clipping",
    ),
    "sapo": ({"loss_type": "sapo"}, "SAPO: a sigmoid gate instead of the hard clip, steeper for negative advantages"),
    "luspo": (
        {"loss_type": "luspo", "importance_sampling_level": "sequence"},
        "LUSPO: GSPO's sequence ratio with each completion's loss summed over its tokens (length-unbiased)",
    ),
    "vespo": ({"loss_type": "vespo"}, "VESPO: a smooth Gamma weight of the sequence's importance weight, detached"),
}


def run_variant(name: str, steps: int, workdir: Path, questions):
    """Train variant ``name`` for ``steps`` on the cpu-answers recipe; ``(its history, its held-out result)``."""
    from bench_seed_grpo import held_out  # the SEED-GRPO bench's held-out evaluation, beside this file

    from grpo_kit.config import load_recipe
    from grpo_kit.train import train

    fields = LOSS_VARIANTS[name][0] if name in LOSS_VARIANTS else {"loss_type": name}  # a variant is --set keys
    recipe = load_recipe("cpu-answers", **fields, max_steps=steps, save_steps=steps)
    run = train(recipe, data="arithmetic", output_dir=workdir / name)
    return run.history, held_out(recipe, run, questions, name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="GRPO steps per variant (the recipe has 10)")
    parser.add_argument("--questions", type=int, default=100, help="held-out problems (the split holds 200)")
    parser.add_argument("--variants", default=",".join(LOSS_VARIANTS), help="comma-separated variant names")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    args = parser.parse_args()
    os.environ["GRPO_KIT_THREADS"] = str(args.threads)
    from grpo_kit.data import load_gsm8k
    from grpo_kit.stats import paired_difference, wilson

    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    questions = load_gsm8k("arithmetic", split="test", limit=args.questions, seed=0)
    results, rows = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            start = time.perf_counter()
            history, results[name] = run_variant(name, args.steps, Path(tmp), questions)
            rewards = [row["reward"] for row in history if "reward" in row]
            rows.append((name, rewards, time.perf_counter() - start))
            print(f"{name}: rewards per step {[round(r, 3) for r in rewards]}; {results[name].summary()}", flush=True)

    print(
        f"\ncpu-answers recipe, {args.steps} steps per variant, {len(questions)} held-out problems, "
        f"{args.threads} threads"
    )
    print("| variant | reward, first -> last step | held-out strict accuracy [95 %] | against dapo, paired | seconds |")
    print("|---|---|---|---|---|")
    for name, rewards, seconds in rows:
        result = results[name]
        low, high = wilson(round(result.accuracy_strict * result.n), result.n)
        versus = "-"
        if "dapo" in results and name != "dapo":
            change = paired_difference(*([r["correct_strict"] for r in results[k].rows] for k in ("dapo", name)))
            low_d, high_d = change.interval
            versus = (
                f"{100 * change.difference:+.1f} pts [{100 * low_d:+.1f}, {100 * high_d:+.1f}], p={change.p_value:.2f}"
            )
        accuracy = f"{100 * result.accuracy_strict:.1f} % [{100 * low:.1f}, {100 * high:.1f}]"
        print(f"| {name} | {rewards[0]:.3f} -> {rewards[-1]:.3f} | {accuracy} | {versus} | {seconds:.0f} |")
    print()
    for name in names:
        print(f"{name}: {LOSS_VARIANTS[name][1]}" if name in LOSS_VARIANTS else f"{name}: TRL loss_type")


if __name__ == "__main__":
    main()
