"""``grpo-kit demo``: GRPO that visibly learns, on a plain CPU, in a few minutes.

The story, in four steps, each one call into the kit:

1. **Before**: the embedded SmolLM2-135M answers held-out questions; we measure its format rate and accuracy.
2. **Train**: the task's recipe. A 135M model never writes ``<think>``/``<answer>`` tags unprompted, so every
   completion would score 0 and GRPO would have nothing to compare (all advantages zero). The ``cpu`` recipe creates
   reward variance: three worked examples as prior chat turns, the assistant turn prefilled with ``<think>\\n``, and
   the partial-credit ``tag_progress`` reward. Some completions in each group then close the tags and score higher,
   and GRPO pushes the policy towards them.
3. **After**: the same held-out questions with the trained adapter, side by side with "before".
4. **Export**: the adapter goes to ``exports/``, verified tensor by tensor.

``--task format`` (the default) shows *format learning*: GSM8K accuracy of a 135M model stays near zero; the README
says so. ``--task arithmetic`` shows *answer learning*: the ``cpu-answers`` recipe on one-step synthetic arithmetic,
where the prompt already gives the format and the correctness reward carries the signal; "before"/"after" are then
strict accuracy on held-out problems with 95 % intervals (``grpo_kit.evaluate.paired_difference``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import NamedTuple

from grpo_kit.errors import GrpoKitError


class DemoTask(NamedTuple):
    """What one demo teaches: the recipe, the data, and the held-out questions it is measured on."""

    recipe: str
    data: str  # training data and held-out test split
    eval_questions: int
    eval_tokens: int  # the training completion budget: a tag closed later would not have counted in training either
    what: str


#: ``grpo-kit demo --task NAME``; format takes about 4 minutes on 2 cores (README, demo section).
TASKS = {
    "format": DemoTask("cpu", "sample", 16, 48, "the think/answer format"),
    "arithmetic": DemoTask("cpu-answers", "arithmetic-1step", 100, 40, "right answers to one-step arithmetic"),
}


def run_demo(*, task: str = "format", max_steps: int | None = None, output_dir: str | None = None,
             evaluate_model: bool = True, export_adapter: bool = True) -> dict:
    """Run the whole demo for ``task`` (``TASKS``); returns the train result, the eval results and the export results."""
    from grpo_kit.config import load_recipe
    from grpo_kit.data import load_gsm8k
    from grpo_kit.evaluate import compare, evaluate
    from grpo_kit.export import export
    from grpo_kit.models import EMBEDDED_ID, load_inference_model, set_torch_threads
    from grpo_kit.plots import plot_metrics
    from grpo_kit.train import train

    if task not in TASKS:
        raise GrpoKitError(f"Unknown demo task {task!r}. Use one of: {', '.join(TASKS)} (grpo-kit demo --task NAME).")
    spec, started, threads = TASKS[task], time.time(), set_torch_threads()
    recipe = load_recipe(spec.recipe, **({} if max_steps is None else {"max_steps": max_steps}))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir = Path(output_dir or Path("runs") / f"demo-{stamp}")
    print(f"grpo-kit demo --task {task}: GRPO teaches {spec.what}")
    print(f"recipe {recipe.name!r} ({EMBEDDED_ID}), {recipe.grpo.max_steps} GRPO steps on {threads} CPU threads")
    print(f"run folder: {run_dir}\n")
    outcome: dict = {"run_dir": run_dir}
    held_out = load_gsm8k(spec.data, split="test", limit=spec.eval_questions, seed=0) if evaluate_model else None
    settings = dict(max_new_tokens=spec.eval_tokens, batch_size=16, few_shot=recipe.kit.few_shot,
                    prefill=recipe.kit.prefill, seed=recipe.grpo.seed)  # one batch: on a CPU a wider one costs little

    if evaluate_model:
        print(f"[1/4] before: evaluating the base model on {len(held_out)} held-out {spec.data} questions")
        outcome["before"] = evaluate(*load_inference_model(EMBEDDED_ID), held_out, **settings)

    print(f"[2/4] training: {recipe.grpo.max_steps} steps x {recipe.prompts_per_step} question(s) x "
          f"{recipe.grpo.num_generations} completions, on {spec.data}")
    result = outcome["train"] = train(recipe, data=spec.data, output_dir=run_dir)
    outcome["plot"] = plot_metrics(result.metrics_path)  # <run>/plots/rewards.png
    print("\n" + first_vs_last_table(result.history) + f"\nreward plot: {outcome['plot']}\n")

    if evaluate_model:
        print("[3/4] after: the same held-out questions with the trained adapter")
        outcome["after"] = evaluate(*load_inference_model(EMBEDDED_ID, result.adapter_dir), held_out, **settings)
        print(compare(outcome["before"], outcome["after"]))  # with the paired 95 % intervals: same questions
        for name in ("before", "after"):
            outcome[name].save(run_dir / "eval" / f"{name}.json")  # the export's model card reports them

    if export_adapter:
        print("[4/4] export: adapter -> exports/, verified tensor by tensor")
        outcome["exports"] = export(result.adapter_dir, ("lora",), out_dir="exports", name=f"demo-{stamp}")
        for item in outcome["exports"]:
            print(f"  {item}")
    print(f"\ndemo finished in {time.time() - started:.0f} s")
    return outcome


def first_vs_last_table(history: list[dict], window: int = 3) -> str:
    """Mean reward and format rate over the first and the last ``window`` logged steps, side by side."""
    from grpo_kit.callbacks import reward_first_last

    logged = sum(1 for row in history if isinstance(row.get("reward"), (int, float)))
    window = max(1, min(window, logged // 2 or 1))  # the same window reward_first_last uses
    lines = [f"{'metric':<12}{f'first {window} steps':>16}{f'last {window} steps':>15}"]
    for key in ("reward", "format_rate"):
        first, last = reward_first_last(history, window=window, key=key)
        if first is not None:
            lines.append(f"{key:<12}{first:>16.3f}{last:>15.3f}")
    return "\n".join(lines)


def cli_demo(args) -> int:
    run_demo(task=args.task, max_steps=args.max_steps, output_dir=args.output, evaluate_model=not args.no_eval,
             export_adapter=not args.no_export)
    return 0
