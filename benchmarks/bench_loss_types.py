"""Reward after N steps for each GRPO loss variant (``LOSS_VARIANTS`` below) on the CPU demo recipe.

A benchmark, not a test: one short run per variant, same seed, same data (the bundled sample), same everything but
the loss, so every run starts from the same model and samples the same first group. Short runs on a 135M model are
noisy; read the table as "does each variant train", not as a ranking. Measured results and how to read them (why
dr_grpo/dapo/bnpo come out identical with one micro-batch, and why gspo and grpo still differ on-policy) are in
docs/SCALING.md, section 4.

    .venv/bin/python benchmarks/bench_loss_types.py [--steps 4] [--last 2] [--variants grpo,gspo] [--threads 2]
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


def run_variant(name: str, steps: int, workdir: Path) -> list[dict]:
    from grpo_kit.config import load_recipe
    from grpo_kit.train import train

    fields = LOSS_VARIANTS[name][0] if name in LOSS_VARIANTS else {"loss_type": name}  # a variant is --set keys
    preset = load_recipe("cpu", **fields, max_steps=steps, save_steps=steps)
    return train(preset, data="sample", output_dir=workdir / name).history


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="GRPO steps per variant")
    parser.add_argument("--last", type=int, default=2, help="average the reward over the last N steps")
    parser.add_argument("--variants", default=",".join(LOSS_VARIANTS), help="comma-separated variant names")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    args = parser.parse_args()
    os.environ["GRPO_KIT_THREADS"] = str(args.threads)
    names = [n.strip() for n in args.variants.split(",") if n.strip()]

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            start = time.perf_counter()
            history = run_variant(name, args.steps, Path(tmp))
            seconds = time.perf_counter() - start
            rewards = [row["reward"] for row in history if "reward" in row]
            formats = [row.get("format_rate", float("nan")) for row in history if "reward" in row]
            rows.append((name, rewards[0], mean(rewards[-args.last :]), mean(formats[-args.last :]), seconds))
            print(f"{name}: rewards per step {[round(r, 3) for r in rewards]}", flush=True)

    print(f"\ncpu preset, bundled sample, {args.steps} steps per variant, {args.threads} threads")
    print(f"| variant | reward step 1 | reward, last {args.last} steps | format rate, last {args.last} | seconds |")
    print("|---|---|---|---|---|")
    for name, first, last, fmt, seconds in rows:
        print(f"| {name} | {first:.3f} | {last:.3f} | {fmt:.2f} | {seconds:.0f} |")
    print()
    for name in names:
        print(f"{name}: {LOSS_VARIANTS[name][1]}" if name in LOSS_VARIANTS else f"{name}: TRL loss_type")


if __name__ == "__main__":
    main()
