"""Seconds per GRPO step: the kit's ``train()`` vs a plain TRL ``GRPOTrainer`` script, same CPU config, one run.

Both sides use the embedded SmolLM2-135M, the ``cpu`` preset's numbers, the same formatted prompts and the same
reward functions; the only difference is the kit's wiring (config building, metrics logger, adapter saving).
Runs are interleaved (kit, plain, plain, kit, kit, plain, ...) so slow drift of the machine cancels out. The verdict
is the ratio of the two sides' **median** step times, so one slow step (a background job, a page-cache miss) cannot
move it; the minimum is printed beside it. Target: ratio kit / plain <= 1.02.

    .venv/bin/python benchmarks/bench_step_time.py [--steps 3] [--rounds 4] [--warmup-runs 1] [--threads 2]

Step time is measured by a callback (wall time between on_step_begin and on_step_end), the first step of every
run is dropped as warm-up, and one untimed run of each side comes first (``--warmup-runs``: the first run in a
process pays one-time costs, which would land on whichever side goes first): ``rounds * (steps - 1)`` timed steps
per side (8 by default).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def step_timer():
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times: list[float] = []
            self._start = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            self._start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self._start)

    return StepTimer()


def run_kit(preset, workdir: Path) -> list[float]:
    from grpo_kit.train import train

    timer = step_timer()
    train(preset, data="sample", output_dir=workdir / f"kit-{time.time_ns()}", callbacks=(timer,))
    return timer.times[1:]


def run_plain_trl(preset, workdir: Path) -> list[float]:
    """What a user would write by hand with TRL + PEFT for the same recipe."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer, get_peft_config

    from grpo_kit.data import format_for_grpo, load_gsm8k
    from grpo_kit.embedded import embedded_model_path
    from grpo_kit.models import ensure_logprob_kernel
    from grpo_kit.rewards import reward_functions

    ensure_logprob_kernel()  # a plain TRL 1.15 script fails on any CPU without it (grpo_kit/models.py)
    path = embedded_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    dataset, _ = format_for_grpo(
        load_gsm8k("sample", split="train"),
        tokenizer,
        few_shot=preset.kit.few_shot,
        prefill=preset.kit.prefill,
        max_prompt_tokens=preset.kit.max_prompt_length,
    )
    funcs = reward_functions(preset.kit.reward_funcs)
    # The recipe is TRL's own GRPOConfig and ModelConfig: the plain script uses them as they are.
    config = copy.copy(preset.grpo)
    config.output_dir, config.report_to = str(workdir / f"plain-{time.time_ns()}"), "none"
    lora = get_peft_config(preset.model)
    timer = step_timer()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=funcs,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=lora,
        callbacks=[timer],
    )
    trainer.train()
    return timer.times[1:]


def run_order(rounds: int) -> list[str]:
    """Interleaved run order, each round mirrored so neither side always runs first.

    >>> run_order(3)
    ['kit', 'plain', 'plain', 'kit', 'kit', 'plain']
    """
    return [name for i in range(rounds) for name in (("kit", "plain") if i % 2 == 0 else ("plain", "kit"))]


def verdict(times: dict[str, list[float]], target: float = 1.02) -> str:
    """Median and minimum per side and the verdict on the ratio of medians.

    >>> print(verdict({"kit": [10.0, 10.0, 10.0], "plain": [10.0, 10.0, 99.0]}))
    kit    median 10.00  min 10.00 s/step  (3 timed steps)
    plain  median 10.00  min 10.00 s/step  (3 timed steps)
    ratio of medians kit/plain = 1.000 (target <= 1.02): met
    """
    lines = [
        f"{name:<6} median {statistics.median(ts):.2f}  min {min(ts):.2f} s/step  ({len(ts)} timed steps)"
        for name, ts in times.items()
    ]
    ratio = statistics.median(times["kit"]) / statistics.median(times["plain"])
    lines.append(
        f"ratio of medians kit/plain = {ratio:.3f} (target <= {target}): {'met' if ratio <= target else 'NOT met'}"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per run (first one is warm-up)")
    parser.add_argument("--rounds", type=int, default=4, help="kit/plain run pairs, interleaved")
    parser.add_argument(
        "--warmup-runs",
        type=int,
        default=1,
        help="untimed kit + plain runs first: the first run in a process pays one-time costs",
    )
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    args = parser.parse_args()

    import torch

    from grpo_kit.config import load_recipe

    torch.set_num_threads(args.threads)
    preset = load_recipe("cpu", max_steps=args.steps, save_steps=10_000)
    times: dict[str, list[float]] = {"kit": [], "plain": []}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        for name in ["kit", "plain"] * args.warmup_runs:
            (run_kit if name == "kit" else run_plain_trl)(preset, workdir)
            print(f"{name:>5}: warm-up run, not timed")
        for name in run_order(args.rounds):
            runner = run_kit if name == "kit" else run_plain_trl
            run_times = runner(preset, workdir)
            times[name].extend(run_times)
            print(f"{name:>5}: {', '.join(f'{t:.2f}' for t in run_times)} s/step")
    print("\n" + verdict(times))


if __name__ == "__main__":
    main()
