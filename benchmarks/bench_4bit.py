"""4-bit (QLoRA) on a CPU, measured: what it costs, and the gap between what was trained and what is shipped.

``speed``: seconds per GRPO step and peak RSS of the ``cpu`` recipe (fp32 base) and the ``cpu-4bit`` recipe (the
same recipe on the embedded model's NF4 copy), each run in its own process so its peak memory is its own; the rounds
alternate the two sides and the first step of each run (warm-up) is not counted. Prints the medians and their ratio.

``gap``: trains ``cpu-answers`` on the NF4 copy (one-step arithmetic), exports merged16 (the LoRA merged into the
16-bit original, as a user ships it), then compares the two models a user meets: "4-bit base + LoRA" (what GRPO
trained and what the training metrics describe) and "16-bit merged" (what the export holds). Prints max and mean
|Δlogit| on three probe prompts and greedy held-out accuracy of both (paired, same questions).

    .venv/bin/python benchmarks/bench_4bit.py speed [--rounds 2] [--steps 3]
    .venv/bin/python benchmarks/bench_4bit.py gap [--steps 10] [--questions 100]

Not a test: it trains. Figures from one machine go into docs/RESULTS.md with the command.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: Two questions chat-formatted (one with the ``<think>`` prefill the recipes use) and one raw text.
PROBES = (
    "A baker makes 12 loaves in the morning and 15 in the afternoon. She sells 20. How many loaves are left?",
    "Tom reads 23 pages a day for 6 days. How many pages does he read?",
    "The sum of 17 and 25 is",
)


def one_run(recipe: str, steps: int, out: str) -> None:
    """Child process: ``steps`` GRPO steps of ``recipe`` on the sample data; prints step times and peak RSS as JSON."""
    from grpo_kit.config import load_recipe
    from grpo_kit.train import train

    result = train(load_recipe(recipe, max_steps=steps, save_steps=steps), data="sample", output_dir=out)
    times = [row["step_time"] for row in result.history if isinstance(row.get("step_time"), (int, float))]
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    print("RESULT " + json.dumps({"step_times": times, "peak_gib": peak_gib}), flush=True)


def speed(rounds: int, steps: int) -> None:
    sides = {"cpu": {"times": [], "peaks": []}, "cpu-4bit": {"times": [], "peaks": []}}
    for round_ in range(rounds):
        for recipe, seen in sides.items():
            with tempfile.TemporaryDirectory() as out:
                done = subprocess.run(
                    [sys.executable, __file__, "one-run", recipe, str(steps), f"{out}/run"],
                    capture_output=True,
                    text=True,
                    check=True,
                )
            row = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])
            seen["times"] += row["step_times"][1:]  # the first step warms up (allocations, kernel choice)
            seen["peaks"].append(row["peak_gib"])
            print(
                f"round {round_ + 1} {recipe:<9} steps {[round(t, 1) for t in row['step_times']]} s, "
                f"peak RSS {row['peak_gib']:.2f} GiB",
                flush=True,
            )
    median = {name: statistics.median(seen["times"]) for name, seen in sides.items()}
    for name, seen in sides.items():
        print(
            f"{name:<9} median {median[name]:.1f} s/step (min {min(seen['times']):.1f}, "
            f"{len(seen['times'])} timed steps), peak RSS median {statistics.median(seen['peaks']):.2f} GiB"
        )
    print(f"4-bit / fp32 step time (ratio of medians): {median['cpu-4bit'] / median['cpu']:.2f}")


def gap(steps: int, questions: int) -> None:
    import torch

    from grpo_kit.config import load_recipe
    from grpo_kit.data import load_gsm8k
    from grpo_kit.embedded import EMBEDDED_4BIT_ID
    from grpo_kit.evaluate import build_prompts, evaluate
    from grpo_kit.export import export
    from grpo_kit.models import load_inference_model
    from grpo_kit.stats import paired_difference
    from grpo_kit.train import train

    recipe = load_recipe("cpu-answers", model_name_or_path=EMBEDDED_4BIT_ID, load_in_4bit=True, max_steps=steps)
    out = Path("runs") / f"bench-4bit-gap-{time.strftime('%Y%m%d-%H%M%S')}"
    result = train(recipe, data="arithmetic", output_dir=out)
    merged = export(result.adapter_dir, ("merged16",), out_dir=out / "exports", name="merged")[0].path
    trained, tokenizer = load_inference_model(EMBEDDED_4BIT_ID, result.adapter_dir)  # 4-bit base + LoRA
    shipped, _ = load_inference_model(str(merged))
    texts = [
        build_prompts([PROBES[0]], tokenizer)[0],
        build_prompts([PROBES[1]], tokenizer, prefill="<think>\n")[0],
        PROBES[2],
    ]

    def logits(model):
        with torch.no_grad():
            return [model(**tokenizer(text, return_tensors="pt")).logits[0].float() for text in texts]

    deltas = [(a - b).abs() for a, b in zip(logits(trained), logits(shipped), strict=True)]
    print(f"\n{recipe.name} on {EMBEDDED_4BIT_ID}: {result.steps} steps in {result.seconds:.0f} s")
    stored = json.loads((merged / "config.json").read_text()).get("dtype")
    print(
        f"|Δlogit| 4-bit+LoRA vs merged16 (stored in {stored}), {len(deltas)} probe prompts: "
        f"max {max(d.max().item() for d in deltas):.3f}, "
        f"mean {torch.cat([d.flatten() for d in deltas]).mean().item():.4f}"
    )
    held_out = load_gsm8k("arithmetic", "test", limit=questions, seed=0)
    settings = dict(
        max_new_tokens=recipe.grpo.max_completion_length,
        batch_size=16,
        few_shot=recipe.kit.few_shot,
        prefill=recipe.kit.prefill,
        seed=recipe.grpo.seed,
        progress=False,
    )
    scored = [evaluate(trained, tokenizer, held_out, **settings), evaluate(shipped, tokenizer, held_out, **settings)]
    change = paired_difference(*([row["correct_strict"] for row in s.rows] for s in scored))
    print(
        f"held-out strict accuracy ({len(held_out)} arithmetic test questions, greedy): "
        f"4-bit+LoRA {100 * scored[0].accuracy_strict:.1f} %, merged16 {100 * scored[1].accuracy_strict:.1f} %"
    )
    print("merged16 vs 4-bit+LoRA, paired: " + change.summary())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="part", required=True)
    p = sub.add_parser("speed")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="steps per run; the first is not timed")
    p = sub.add_parser("gap")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--questions", type=int, default=100)
    p = sub.add_parser("one-run")
    p.add_argument("recipe")
    p.add_argument("steps", type=int)
    p.add_argument("out")
    args = parser.parse_args(argv)
    os.environ.setdefault("GRPO_KIT_THREADS", "2")
    if args.part == "speed":
        speed(args.rounds, args.steps)
    elif args.part == "gap":
        gap(args.steps, args.questions)
    else:
        one_run(args.recipe, args.steps, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
