"""``grpo-kit train``: the recipe from ``--preset``/``--recipe`` and ``--set``, then ``grpo_kit.train.train``, the
summary and the curves."""

from __future__ import annotations

from pathlib import Path

from grpo_kit.errors import GrpoKitError


def cli_train(args) -> int:
    """``grpo-kit train``: the recipe (``--preset``/``--recipe``, ``--set``), train, print the summary, draw curves."""
    from grpo_kit.machinery.planner import auto_recipe
    from grpo_kit.machinery.plots import plot_metrics
    from grpo_kit.recipes import load_recipe, parse_set, recorded_settings
    from grpo_kit.train import train  # looked up now: tests replace it

    if getattr(args, "recipe", None):
        recipe = load_recipe(args.recipe)
    elif args.preset == "auto":
        recipe, reason = auto_recipe()
        print(f"recipe: {recipe.name} ({reason})")
    else:
        recipe = load_recipe(args.preset)
    overrides = parse_set(args.set)
    if args.resume and args.output and "max_steps" not in overrides:  # finish the run as started, not the recipe's
        recorded = recorded_settings(Path(args.output)).get("max_steps")
        if isinstance(recorded, int) and recorded > 0:
            overrides["max_steps"] = recorded
    result = train(
        recipe,
        data=args.data,
        output_dir=args.output,
        resume=args.resume,
        overrides=overrides,
        curriculum=_curriculum_from_args(args),
        lenient=getattr(args, "lenient", False),
        show_completions=getattr(args, "show_completions", 0) or 0,
    )
    if not _is_main_process():  # under accelerate launch: one summary and one plot, from the main process
        return 0
    if result.already_finished:  # nothing changed, not even the plot
        print(result.summary())
        return 0
    plot = plot_metrics(result.metrics_path, result.run_dir / "plots" / "rewards.png")
    print("\n" + result.summary() + f"\nplot: {plot}")
    return 0


def _curriculum_from_args(args):
    """A ``Curriculum`` from ``--curriculum``/``--curriculum-order``/``--zero-variance``, or None without a file."""
    order, zero_variance = getattr(args, "curriculum_order", None), getattr(args, "zero_variance", None)
    if not getattr(args, "curriculum", None):
        if order or zero_variance:
            raise GrpoKitError(
                "--curriculum-order and --zero-variance need the scores file: --curriculum scores.jsonl "
                "(write it with grpo-kit curriculum --data DATA)."
            )
        return None
    from grpo_kit.machinery.curriculum import Curriculum

    return Curriculum(args.curriculum, order=order or "entropy", zero_variance=zero_variance or "keep")


def _is_main_process() -> bool:
    from accelerate import PartialState

    return PartialState().is_main_process
