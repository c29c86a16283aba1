"""Recipes: flat YAML files in ``recipes/`` whose keys are TRL's own fields, parsed by TRL's argument machinery.

A recipe file is what ``trl grpo --config`` reads (open-r1's recipes are the model): every key is a field of
``trl.GRPOConfig`` (learning_rate, num_generations, bf16, reward_weights, ...), of ``trl.ModelConfig``
(model_name_or_path, load_in_4bit, lora_r, lora_target_modules, ...) or of ``KitArgs`` below, the few things TRL has
no field for (prompt format, reward names, the hardware tier). The values go through transformers'
``HfArgumentParser`` exactly as command-line flags would, so types and choices are TRL's, and building the
``GRPOConfig`` runs TRL's own checks (the batch rule among them) — no model is loaded for that.

One override route: ``load_recipe(name, **changes)`` or ``recipe.replace(**changes)`` in code, ``--set KEY=VALUE`` on
the command line. A value the user sets is never changed behind their back: where the kit needs a value (bf16 off on a
CPU, LoRA on) it fills it in only when the recipe left it unset, and refuses a recipe that contradicts it.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib.util
import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grpo_kit.errors import GrpoKitError


@dataclass
class KitArgs:
    """What a recipe says that TRL has no field for."""

    name: str = field(default="custom", metadata={"help": "the recipe's name (runs/<name>-<time>)"})
    description: str = field(default="", metadata={"help": "one paragraph: what the tier is for and why"})
    vram_gb: float = field(default=0.0, metadata={"help": "memory PyTorch reports on the tier's card; 0 = CPU"})
    backend: str = field(
        default="auto",
        metadata={
            "choices": ["auto", "unsloth", "transformers"],
            "help": "Unsloth on a GPU, transformers + PEFT otherwise (auto)",
        },
    )
    max_seq_length: int = field(default=1024, metadata={"help": "prompt + completion tokens (Unsloth, vLLM)"})
    few_shot: int = field(default=0, metadata={"help": "worked examples shown before the question"})
    prefill: str = field(default="", metadata={"help": "text the answer starts with, e.g. '<think>\\n'"})
    system_prompt: str | None = field(default=None, metadata={"help": "replaces the kit's think/answer instruction"})
    max_prompt_length: int = field(default=256, metadata={"help": "longer prompts are left out (and counted)"})
    reward_funcs: list[str] = field(
        default_factory=lambda: ["correctness", "format"],
        metadata={"help": "built-in reward names or package.module:function"},
    )
    seed_grpo_alpha: float = field(
        default=0.0,
        metadata={
            "help": "SEED-GRPO: a group's rewards / (1 + alpha * its semantic entropy); 0: off (rewards.seed_grpo)"
        },
    )


@dataclass(frozen=True)
class Recipe:
    """A parsed recipe: TRL's ``GRPOConfig`` and ``ModelConfig``, the kit's ``KitArgs``, and the values they came
    from."""

    grpo: Any  # trl.GRPOConfig
    model: Any  # trl.ModelConfig
    kit: KitArgs
    values: Mapping[str, Any]  # what the file and the changes set, nothing else (run.json records it)

    @property
    def name(self) -> str:
        return self.kit.name

    @property
    def rewards(self) -> list[tuple[str, float]]:
        """(reward name, weight) pairs; TRL weighs every reward 1.0 when ``reward_weights`` is unset."""
        weights = self.grpo.reward_weights or [1.0] * len(self.kit.reward_funcs)
        return list(zip(self.kit.reward_funcs, weights, strict=True))

    @property
    def reward_funcs(self) -> list:
        """The rewards as given: names (``rewards.reward_functions`` finds them) and Python functions as they are;
        ``kit.reward_funcs`` holds a name for each (what TRL logs and run.json records)."""
        given = self.values.get("reward_funcs")
        return list(given) if isinstance(given, (list, tuple)) else list(self.kit.reward_funcs)

    def parsed(self, key: str) -> Any:
        """The value TRL's parser made of field ``key`` (``"5e-4"`` and ``0.0005`` are one learning rate)."""
        return next(getattr(part, key) for part in (self.grpo, self.model, self.kit) if hasattr(part, key))

    @property
    def vllm_colocated(self) -> bool:
        return self.grpo.use_vllm and self.grpo.vllm_mode == "colocate"

    @property
    def dtype(self) -> str:
        """What the model loads in: the recipe's ``dtype``, else the training precision (float32 without one)."""
        return self.values.get("dtype") or (
            "bfloat16" if self.grpo.bf16 else "float16" if self.grpo.fp16 else "float32"
        )

    @property
    def prompts_per_step(self) -> int:
        """Questions per optimizer step: TRL's generation batch split into groups of ``num_generations``."""
        return self.grpo.generation_batch_size // self.grpo.num_generations

    def replace(self, **changes: Any) -> Recipe:
        """A copy with ``changes`` (field names, as in the YAML file) applied and checked again."""
        return build_recipe({**self.values, **changes}) if changes else self


def recipes_dir() -> Path:
    """The shipped recipes: ``recipes/`` of a checkout, or the copy installed inside the package (see pyproject)."""
    package = Path(__file__).resolve().parent
    checkout = package.parent / "recipes"
    return checkout if checkout.is_dir() else package / "recipes_data"


def _read_yaml(path: Path) -> dict:
    import yaml

    try:
        text = path.read_text(encoding="utf-8")
        data = yaml.safe_load(text)
    except OSError as error:
        raise GrpoKitError(f"Cannot read recipe file {path}: {error.strerror or error}. Check the path.") from error
    except (yaml.YAMLError, UnicodeDecodeError) as error:
        mark = getattr(error, "problem_mark", None)
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        why = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise GrpoKitError(
            f"Recipe file {path}{where}: not valid YAML ({why}). Compare it with recipes/cpu.yaml."
        ) from None
    if not isinstance(data, dict):
        raise GrpoKitError(f"Recipe file {path} must hold a mapping of field names to values, like recipes/cpu.yaml.")
    keys = [key for key, _ in yaml.compose(text).value]  # YAML lets the last of two equal keys win without a word
    for key in keys:
        if len(lines := [other.start_mark.line + 1 for other in keys if other.value == key.value]) > 1:
            raise GrpoKitError(f"Recipe file {path}: {key.value} is set on lines {lines}; keep one of them.")
    return data


def recipe_names() -> list[str]:
    """The shipped recipes, smallest tier first (``planner.auto_recipe`` relies on this order)."""
    tiers = [(float(_read_yaml(p).get("vram_gb") or 0), p.stem) for p in recipes_dir().glob("*.yaml")]
    return [name for _, name in sorted(tiers)]


def load_recipe(name_or_path: str | os.PathLike, **changes: Any) -> Recipe:
    """A shipped recipe by name (``grpo-kit presets`` lists them) or a YAML file of your own, with ``changes``."""
    text = str(name_or_path)
    path = recipes_dir() / f"{text}.yaml"
    if not path.is_file():
        path = Path(text)
        if not (text.endswith((".yaml", ".yml")) or os.sep in text or path.is_file()):
            hint = difflib.get_close_matches(text, recipe_names(), n=1)
            raise GrpoKitError(
                f"Unknown recipe {text!r}."
                + (f" Did you mean {hint[0]!r}?" if hint else "")
                + f" Shipped: {', '.join(recipe_names())}; a file of your own: --recipe my_recipe.yaml."
            )
    return build_recipe({"name": path.stem, **_read_yaml(path), **changes})


def parse_set(pairs: list[str]) -> dict[str, Any]:
    """``--set`` arguments as changes; values are read as JSON where they parse, else kept as text."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise GrpoKitError(f"--set expects KEY=VALUE, got '{pair}'.")
        with contextlib.suppress(json.JSONDecodeError):
            raw = json.loads(raw)
        out[key.strip()] = raw
    return out


# --------------------------------------------------------------------------------------------- parsing


def build_recipe(values: Mapping[str, Any]) -> Recipe:
    """Parse ``values`` (field name -> value) with TRL's parser into a checked ``Recipe``."""
    values = dict(values)
    name = str(values.get("name", "custom"))
    # Unsloth patches trl/transformers/peft at import: on its backend it must be imported before TRL (see models)
    from grpo_kit.models import prepare_backend

    try:
        prepare_backend(str(values.get("backend", "auto")))
    except GrpoKitError as error:  # Unsloth not installed: the recipe still parses (presets, the planner) and
        if not isinstance(error.__cause__, ImportError):  # load_model names the fix; a wrong backend is refused now
            raise
    parser = _parser(name)
    known = {action.dest: action for action in parser._actions}
    unknown = sorted(values.keys() - known)
    if unknown:
        hints = [f"{k} -> {m[0]}" for k in unknown if (m := difflib.get_close_matches(k, known, n=1, cutoff=0.6))]
        raise GrpoKitError(
            f"Recipe {name}: unknown field(s) {', '.join(unknown)}."
            + (f" Did you mean {', '.join(hints)}?" if hints else "")
            + " Fields are TRL's GRPOConfig/ModelConfig fields or grpo_kit.config.KitArgs'."
        )
    settable = {**_kit_defaults(values, name), **values}
    for key in BATCH_SIZES:  # TRL's batch arithmetic (and the kit's) divides by them before checking them
        with contextlib.suppress(TypeError, ValueError):  # absent, or no integer: the parser names it
            if int(settable.get(key)) < 1:
                raise GrpoKitError(
                    f"Recipe {name}: {key}={settable[key]} cannot be meant; {', '.join(BATCH_SIZES)} must be "
                    "positive (when set)."
                )
    from trl.trainer.utils import get_callable_name

    if isinstance(settable.get("reward_funcs"), (list, tuple)):  # Python functions stay in values, parsed by the
        # name TRL logs them under (a lambda: "<lambda>", a functools.partial: its function's, an object: its class)
        settable["reward_funcs"] = [f if isinstance(f, str) else get_callable_name(f) for f in settable["reward_funcs"]]
    argv = [token for key, value in settable.items() for token in _flag(known[key], value, name)]
    try:
        grpo, model, kit = parser.parse_args_into_dataclasses(args=argv)
    except ValueError as error:  # TRL's and transformers' own checks in GRPOConfig.__post_init__
        raise GrpoKitError(f"Recipe {name}: {error}") from error
    recipe = Recipe(grpo=grpo, model=model, kit=kit, values=values)
    _check(recipe)
    return recipe


def _parser(name: str):
    import trl
    from transformers import HfArgumentParser

    class Parser(HfArgumentParser):
        def error(self, message):  # argparse would print usage and exit: a recipe error is one clear line
            message = re.sub(r"argument --(\w+)(/--[\w-]+)?", r"\1", message).rstrip(".")
            raise GrpoKitError(f"Recipe {name}: {message}.")

    return Parser((trl.GRPOConfig, trl.ModelConfig, KitArgs))


def _flag(action, value: Any, name: str) -> list[str]:
    """``value`` of ``action``'s field as the command-line tokens HfArgumentParser reads; None leaves TRL's default."""
    key = action.dest
    if value is None:
        return []
    if action.nargs == "+":  # a list field: YAML list, "a,b" from --set, or one value (a list of one)
        items = value.split(",") if isinstance(value, str) else value if isinstance(value, (list, tuple)) else [value]
        return [f"--{key}", *map(_text, items)]
    if isinstance(value, (list, tuple, dict)) and action.type in (int, float, bool):
        raise GrpoKitError(f"Recipe {name}: {key} expects one value, got {value!r}.")
    return [f"--{key}={_text(value)}"]  # one token: argparse would take "-inf" or "-1e-5" for an option


def _text(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (bool, dict, list)) else str(value)  # a bool: "true"/"false"


def _kit_defaults(values: Mapping[str, Any], name: str) -> dict[str, Any]:
    """What the kit needs where the recipe is silent; a recipe that contradicts it is refused."""
    import torch
    import trl

    def refuse_unless(key: str, wanted: Any, why: str) -> None:
        if values.get(key) not in (None, wanted):
            raise GrpoKitError(
                f"Recipe {name}: {key}={values[key]!r} cannot work here: {why}. Remove it or set {key}: "
                f"{_text(wanted)}."
            )

    refuse_unless("use_peft", True, "grpo-kit trains LoRA adapters")
    refuse_unless("remove_unused_columns", False, "the rewards read the answer column")
    defaults: dict[str, Any] = {"use_peft": True, "logging_nan_inf_filter": False}  # a NaN loss must reach the guard
    if "trackio" in str(values.get("report_to")) and "log_completions" not in values:
        defaults["log_completions"] = True  # TRL's completions table in the Trackio dashboard
    # TRL's default upper clip (epsilon_high = epsilon), written out: Unsloth's GRPOConfig sets 0.28 where it is unset
    # and loss_type is dapo, so a recipe silent on it would clip differently on a GPU than on a CPU.
    with contextlib.suppress(TypeError, ValueError):  # an epsilon that is no number is refused by TRL's parser
        defaults["epsilon_high"] = float(values.get("epsilon", trl.GRPOConfig.epsilon))  # the class holds its default
    if torch.cuda.is_available():
        from grpo_kit.models import detect_device

        if "bf16" not in values and "fp16" not in values:  # TRL turns bf16 on, which a T4 cannot run
            bf16 = detect_device().bf16
            defaults.update(bf16=bf16, fp16=not bf16)
    else:  # a GPU tier's recipe still parses here (presets, planner); planner.check_device refuses to train it
        defaults.update(bf16=False, use_cpu=True, gradient_checkpointing=False)  # checkpointing only slows a CPU
    return defaults


#: Values TRL accepts without complaint that cannot be meant: field -> (test, what the value must be).
MEANT_VALUES = {
    "learning_rate": (
        lambda v: 0 < v < 1,
        "above 0 and below 1 (LoRA GRPO: 5e-6 on the GPU tiers, 5e-4 on the tiny "
        "CPU model); a rate of 1 or more destroys the weights in a step",
    ),
    "temperature": (lambda v: v > 0, "above 0 (1.0 is TRL's default; GRPO needs varied samples)"),
    "beta": (lambda v: v >= 0, "0 (no KL penalty, TRL's default) or a small positive number such as 0.04"),
    "vllm_gpu_memory_utilization": (lambda v: 0 < v <= 1, "a share of the GPU above 0 and at most 1"),
    "save_steps": (lambda v: v > 0, "a positive number of steps"),
    "max_steps": (lambda v: v <= 10_000_000, "at most 10,000,000 (250 steps is a long Colab run): a typo?"),
    "seed_grpo_alpha": (lambda v: v >= 0, "0 (off) or positive (1.0: a group whose answers all differ learns half)"),
}


#: GRPOConfig's batch sizes and counts: each must be at least 1.
BATCH_SIZES = (
    "num_generations",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "steps_per_generation",
    "generation_batch_size",
)


#: The ModelConfig fields the kit's loader passes on (``models.load_model``: Unsloth's ``FastLanguageModel`` arguments).
LOADER_FIELDS = (
    "model_name_or_path",
    "dtype",
    "use_peft",
    "load_in_4bit",
    "lora_r",
    "lora_alpha",
    "lora_dropout",
    "lora_target_modules",
    "use_rslora",
    "lora_modules_to_save",
)


def _check(recipe: Recipe) -> None:
    """The kit's own rules: its fields, and values that parse but cannot be meant."""
    from grpo_kit.rewards import REWARDS

    config, kit, name = recipe.grpo, recipe.kit, recipe.name
    if unused := [key for key in recipe.values if hasattr(recipe.model, key) and key not in LOADER_FIELDS]:
        raise GrpoKitError(
            f"Recipe {name}: {', '.join(unused)} would be ignored: models load through "
            f"FastLanguageModel, which takes {', '.join(LOADER_FIELDS)}. Remove it."
        )
    parsed = {key: recipe.parsed(key) for key in recipe.values}
    bad = [
        (key, item)
        for key, v in parsed.items()
        for item in (v if isinstance(v, list) else [v])
        if isinstance(item, float) and not math.isfinite(item)
    ]
    if bad:  # argparse reads "inf" and "nan" as floats; TRL would train with them
        raise GrpoKitError(f"Recipe {name}: {bad[0][0]} is {bad[0][1]}; every number must be finite.")
    for key, (ok, wanted) in MEANT_VALUES.items():  # values TRL accepts that no run can mean
        if key in parsed and not ok(parsed[key]):
            raise GrpoKitError(f"Recipe {name}: {key}={parsed[key]!r} cannot be meant; it must be {wanted}.")
    if config.reward_weights is not None and len(config.reward_weights) != len(kit.reward_funcs):
        raise GrpoKitError(
            f"Recipe {name}: {len(kit.reward_funcs)} reward_funcs ({', '.join(kit.reward_funcs)}) but "
            f"{len(config.reward_weights)} reward_weights; give one weight per reward."
        )
    if not any(weight for _, weight in recipe.rewards):
        raise GrpoKitError(
            f"Recipe {name}: every reward weight is 0, so every completion scores 0 and GRPO learns "
            "nothing (all advantages are zero). Give at least one reward a weight, e.g. reward_weights: "
            "[1.0, ...]."
        )
    unknown = [f for f in recipe.reward_funcs if isinstance(f, str) and ":" not in f and f not in REWARDS]
    if unknown:  # package.module:function names are imported (and checked) by train before any weights load
        raise GrpoKitError(
            f"Recipe {name}: unknown reward {unknown[0]!r}; choose from {', '.join(REWARDS)} or write "
            "package.module:function (a function passed in Python, as a run's run.json names it, is passed again "
            "itself: train(load_recipe(..., reward_funcs=[...]), resume=True))."
        )
    if kit.seed_grpo_alpha and config.scale_rewards != "none":  # the std division would cancel the group's scale
        raise GrpoKitError(
            f"Recipe {name}: seed_grpo_alpha needs scale_rewards: none (SEED-GRPO scales r_i - mean r; dividing by the "
            "group's std would undo it). Set --set scale_rewards=none."
        )
    if kit.max_prompt_length + config.max_completion_length > kit.max_seq_length:
        raise GrpoKitError(
            f"Recipe {name}: max_prompt_length ({kit.max_prompt_length}) + max_completion_length "
            f"({config.max_completion_length}) exceeds max_seq_length ({kit.max_seq_length}). Raise "
            "max_seq_length or shorten the prompt/completion budget."
        )
    if min(kit.max_prompt_length, config.max_completion_length, recipe.model.lora_r, config.max_steps) < 1:
        raise GrpoKitError(
            f"Recipe {name}: max_prompt_length, max_completion_length, lora_r and max_steps must be "
            "positive (max_steps -1 means epochs in TRL; the kit counts steps)."
        )
    if config.use_vllm and config.vllm_mode == "server" and recipe.model.load_in_4bit:  # TRL would send the server each
        # param.data with LoRA merged in: for a bitsandbytes 4-bit layer, packed bytes without their quantization state
        raise GrpoKitError(
            f"Recipe {name}: vllm_mode='server' cannot train 4-bit weights (load_in_4bit): the server "
            "would silently generate from packed 4-bit bytes. Use colocated vLLM (--set vllm_mode=colocate) "
            "or 16-bit weights (--set load_in_4bit=false, or the a100-40gb recipe: more memory)."
        )
    if not recipe.model.model_name_or_path:
        raise GrpoKitError(f"Recipe {name}: model_name_or_path is missing; name a Hub id or a local folder.")
    if "trackio" in config.report_to and importlib.util.find_spec("trackio") is None:
        raise GrpoKitError(
            f"Recipe {name}: report_to: trackio needs Trackio, which is not installed: pip install trackio==0.43.0 "
            '(or pip install -e ".[track]"), or drop report_to.'
        )
