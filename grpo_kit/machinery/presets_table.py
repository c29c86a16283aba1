"""``grpo-kit presets``: the shipped recipes as a table, as JSON, or one tier's VRAM plan."""

from __future__ import annotations

import json

from grpo_kit.errors import GrpoKitError
from grpo_kit.recipes import RECIPES, Recipe, load_recipe


def presets_json(recipes=None) -> list[dict]:
    """Every recipe as a flat JSON-ready dict, plus the batch arithmetic and the planner's estimate (GiB)."""
    rows = []
    for recipe in _as_list(recipes):
        row = recipe.flat()
        row.update(generation_batch_size=recipe.generation_batch_size, prompts_per_step=recipe.prompts_per_step,
                   estimate_gib=_estimate_or_none(recipe), recipe_file=recipe.path)
        rows.append(row)
    return rows


def _as_list(recipes) -> list[Recipe]:
    if recipes is None:
        recipes = RECIPES
    return list(recipes.values()) if isinstance(recipes, dict) else list(recipes)


def _estimate_or_none(recipe: Recipe) -> float | None:
    from grpo_kit.machinery.planner import estimate_vram, shape_for

    if shape_for(recipe.model_id) is None:
        return None
    return round(estimate_vram(recipe).total_gib, 2)


def presets_table(recipes=None) -> str:
    """An aligned text table of the recipes' key numbers (``grpo-kit presets`` prints it)."""
    header = ("preset", "GiB", "model", "4bit", "prec", "G", "batch×accum", "q/step", "compl", "LoRA r", "vLLM", "plan")
    rows = [header]
    for r in _as_list(recipes):
        estimate = _estimate_or_none(r)
        g = r.grpo
        rows.append((
            r.name, f"{r.vram_gb:g}" if r.vram_gb else "cpu", r.model_id.split("/")[-1],
            "yes" if r.model["load_in_4bit"] else "no", r.model["precision"], str(g["num_generations"]),
            f"{g['per_device_train_batch_size']}×{g['gradient_accumulation_steps']}", str(r.prompts_per_step),
            str(g["max_completion_length"]), str(r.model["lora_rank"]),
            f"{g['vllm_gpu_memory_utilization']:g}" if g["use_vllm"] else "-",
            "?" if estimate is None else f"{estimate:.1f}",
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows)


def cli_presets(args) -> int:
    """``grpo-kit presets``: the table; ``--json`` the JSON list; ``--plan NAME [--model ID]`` the VRAM breakdown."""
    from grpo_kit.machinery.planner import estimate_vram, shape_for

    if getattr(args, "model", None) and not getattr(args, "plan", None):
        raise GrpoKitError("--model only applies with --plan NAME, e.g. grpo-kit presets --plan t4-16gb --model ID")
    if getattr(args, "plan", None):
        recipe = load_recipe(args.plan, {"model.id": args.model} if args.model else None)
        shape = shape_for(recipe.model_id) or _shape_from_hub(recipe.model_id)
        print(f"{recipe.name}: {recipe.description}\n")
        print(estimate_vram(recipe, shape).format())
        return 0
    if getattr(args, "json", False):
        print(json.dumps(presets_json(), indent=2))
        return 0
    print(presets_table())
    print(
        "\nGiB: memory PyTorch reports on the tier's card. G: completions per question. q/step: questions per "
        "optimizer step.\nplan: the VRAM planner's estimate in GiB (for cpu: RAM, prompts at full length). "
        "Breakdown: grpo-kit presets --plan NAME; docs/VRAM.md.\nEach preset is a recipe file, recipes/NAME.yaml "
        "(its grpo: keys are TRL GRPOConfig fields). One run's change: --set key=value; your own file: --recipe PATH."
    )
    return 0


def _shape_from_hub(model: str):
    """Read an unknown model's shape from its config on the Hub (only ``config.json`` is downloaded)."""
    from grpo_kit.machinery.planner import ModelShape

    try:
        from transformers import AutoConfig

        return ModelShape.from_config(AutoConfig.from_pretrained(model))
    except GrpoKitError:
        raise
    except Exception as error:  # network, gated repo, not a transformers model
        raise GrpoKitError(
            f"Could not read the config of {model!r} to plan its memory ({type(error).__name__}: {error}). "
            "Check the id (and HF_TOKEN for gated models), or pass a local model folder."
        ) from error
