"""``grpo-kit demo``: GRPO that visibly learns, on a plain CPU, in a few minutes.

The story, in four steps, each one call into the kit:

1. **Before**: the embedded SmolLM2-135M answers held-out bundled questions; we measure its format rate and accuracy.
2. **Train**: the ``cpu`` preset's recipe. A 135M model never writes ``<think>``/``<answer>`` tags unprompted, so every
   completion would score 0 and GRPO would have nothing to compare (all advantages zero). The recipe creates reward
   variance: three worked examples as prior chat turns, the assistant turn prefilled with ``<think>\\n``, and the
   partial-credit ``tag_progress`` reward. Some completions in each group then close the tags and score higher, and
   GRPO pushes the policy towards them.
3. **After**: the same held-out questions with the trained adapter, side by side with "before".
4. **Export**: the adapter goes to ``exports/``, verified by reloading it and comparing logits.

The default task (``format``) shows *format learning*: GSM8K accuracy of a 135M model stays near zero; the README says
so. ``--task arithmetic`` shows *answer learning*: the ``cpu-answers`` recipe on one-step synthetic arithmetic, where
the prompt already gives the format and the correctness reward carries the signal; "before"/"after" are then strict
accuracy on held-out arithmetic problems with 95 % intervals (``grpo_kit.evaluate.paired_difference``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

DEMO_EVAL_QUESTIONS = 16
#: One generation batch for all held-out questions: on a CPU a wider batch costs little more than a narrow one.
DEMO_EVAL_BATCH = 16
#: The training completion budget (cpu preset): a tag closed later would not have counted in training either.
DEMO_EVAL_TOKENS = 48


@dataclass(frozen=True)
class DemoTask:
    """What one demo teaches: the preset, the training data, and the held-out questions it is measured on."""

    preset: str
    train_data: str
    held_out: str
    eval_questions: int
    eval_tokens: int
    what: str


#: ``grpo-kit demo --task NAME``. ``format``: the think/answer format on bundled GSM8K-style questions (the default,
#: about 8 minutes on 2 cores). ``arithmetic``: correct answers on one-step synthetic arithmetic (cpu-answers preset).
TASKS = {
    "format": DemoTask("cpu", "sample", "sample", DEMO_EVAL_QUESTIONS, DEMO_EVAL_TOKENS,
                       "the think/answer format"),
    "arithmetic": DemoTask("cpu-answers", "arithmetic-1step", "arithmetic-1step", 100, 40,
                           "right answers to one-step arithmetic"),
}


def run_demo(
    *,
    task: str = "format",
    max_steps: int | None = None,
    output_dir: str | None = None,
    evaluate_model: bool = True,
    export_adapter: bool = True,
    eval_questions: int | None = None,
    print_fn=print,
) -> dict:
    """Run the whole demo for ``task`` (``TASKS``); returns a dict with the train result, eval results (and, for
    arithmetic, ``"change"``: a ``stats.PairedDifference``) and export results."""
    from grpo_kit.config import load_recipe
    from grpo_kit.models import EMBEDDED_ID, load_inference_model, set_torch_threads
    from grpo_kit.plots import plot_metrics
    from grpo_kit.train import train

    spec = demo_task(task)
    started = time.time()
    threads = set_torch_threads()
    preset = load_recipe(spec.preset, **({} if max_steps is None else {"max_steps": max_steps}))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir = Path(output_dir or Path("runs") / f"demo-{stamp}")
    print_fn(f"grpo-kit demo --task {task}: GRPO teaches {spec.what}")
    print_fn(f"preset {preset.name!r} ({EMBEDDED_ID}), {preset.grpo.max_steps} GRPO steps on {threads} CPU threads")
    print_fn(f"run folder: {run_dir}\n")
    outcome: dict = {"run_dir": run_dir}

    held_out = None
    if evaluate_model:
        from grpo_kit.data import load_gsm8k

        held_out = load_gsm8k(spec.held_out, split="test", limit=eval_questions or spec.eval_questions, seed=0)
        print_fn(f"[1/4] before: evaluating the base model on {len(held_out)} held-out {spec.held_out} questions")
        base_model, tokenizer = load_inference_model(EMBEDDED_ID)
        outcome["before"] = _evaluate(base_model, tokenizer, held_out, preset, spec.eval_tokens)
        del base_model

    print_fn(
        f"[2/4] training: {preset.grpo.max_steps} steps x {preset.prompts_per_step} question(s) x "
        f"{preset.grpo.num_generations} completions, on {spec.train_data}"
    )
    result = train(preset, data=spec.train_data, output_dir=run_dir)
    outcome["train"] = result
    outcome["plot"] = plot_metrics(result.metrics_path, run_dir / "plots" / "rewards.png")
    print_fn("\n" + first_vs_last_table(result.history))
    print_fn(f"reward plot: {outcome['plot']}\n")

    if evaluate_model:
        from grpo_kit.evaluate import compare

        print_fn("[3/4] after: the same held-out questions with the trained adapter")
        tuned_model, tokenizer = load_inference_model(EMBEDDED_ID, adapter=result.adapter_dir)
        outcome["after"] = _evaluate(tuned_model, tokenizer, held_out, preset, spec.eval_tokens)
        del tuned_model
        print_fn(compare(outcome["before"], outcome["after"]))
        if task == "arithmetic":
            outcome["change"] = strict_change(outcome["before"], outcome["after"])
            print_fn("\nheld-out strict accuracy, 95 % intervals:\n" + outcome["change"].summary())
        for name in ("before", "after"):
            outcome[name].save(run_dir / f"eval_{name}.json")

    if export_adapter:
        from grpo_kit.export import export

        print_fn("[4/4] export: adapter -> exports/, verified by reloading it")
        eval_results = {k: outcome[k] for k in ("before", "after") if k in outcome}
        outcome["exports"] = export(
            result.adapter_dir, ("lora",), out_dir="exports", name=f"demo-{stamp}", eval_results=eval_results or None
        )
        for item in outcome["exports"]:
            print_fn(f"  {item}")
    print_fn(f"\ndemo finished in {time.time() - started:.0f} s")
    return outcome


def demo_task(name: str) -> DemoTask:
    """The ``TASKS`` entry called ``name``; an unknown name is refused with the valid ones."""
    from grpo_kit.errors import GrpoKitError

    if name not in TASKS:
        raise GrpoKitError(f"Unknown demo task {name!r}. Use one of: {', '.join(TASKS)} (grpo-kit demo --task NAME).")
    return TASKS[name]


def strict_change(before, after):
    """Paired before/after change in strict accuracy of two ``EvalResult`` on the same questions."""
    from grpo_kit.evaluate import paired_difference

    return paired_difference([row["correct_strict"] for row in before.rows], [row["correct_strict"] for row in after.rows])


def _evaluate(model, tokenizer, dataset, preset, max_new_tokens=DEMO_EVAL_TOKENS):
    from grpo_kit.evaluate import evaluate

    return evaluate(
        model,
        tokenizer,
        dataset,
        max_new_tokens=max_new_tokens,
        batch_size=DEMO_EVAL_BATCH,
        few_shot=preset.kit.few_shot,
        prefill=preset.kit.prefill,
        seed=preset.grpo.seed,
    )


def first_vs_last_table(history: list[dict], window: int = 3) -> str:
    """Mean reward and format rate over the first and the last ``window`` logged steps, side by side.

    >>> print(first_vs_last_table([{"step": 1, "reward": 0.1, "format_rate": 0.0},
    ...                            {"step": 2, "reward": 0.9, "format_rate": 1.0}], window=1))
    metric         first 1 steps   last 1 steps
    reward                 0.100          0.900
    format_rate            0.000          1.000
    """
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
    run_demo(
        task=args.task,
        max_steps=args.max_steps,
        output_dir=args.output,
        evaluate_model=not args.no_eval,
        export_adapter=not args.no_export,
    )
    return 0
