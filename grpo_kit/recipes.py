"""Recipes: one YAML file per VRAM tier in ``recipes/``, read into a ``Recipe``; ``--set key=value`` changes one run.

A recipe has four sections (open-r1's recipes and GRPO-Zero's ``config_24GB.yaml`` are the model)::

    model:    how the policy loads     id, load_in_4bit, max_seq_length, precision, lora_rank, lora_alpha, lora_targets, backend
    prompt:   how questions become prompts     few_shot, prefill, max_prompt_length, system_prompt (optional)
    rewards:  reward -> weight         a built-in name (``grpo-kit rewards``) or ``package.module:function``
    grpo:     TRL ``GRPOConfig`` fields, passed verbatim: ``GRPOConfig(**recipe.grpo, output_dir=..., ...)``

``recipe.get(key)`` and ``recipe.<key>`` find a plain key in whichever section holds it; ``--set`` uses the same rule
(``--set learning_rate=1e-5``; ``section.key`` names the section: ``--set model.id=ORG/NAME``; ``model=ID`` is
short for ``model.id``). A key that is neither a model nor a prompt key is a GRPOConfig field: ``train`` checks it
against the installed TRL before any weights load.

TRL's batch rule, which every recipe satisfies (checked when a recipe is read or changed)::

    generation batch = per_device_train_batch_size × num_processes × gradient_accumulation_steps
    generation batch % num_generations == 0      (whole groups of G completions per prompt)

>>> r = load_recipe("t4-16gb")
>>> r.model_id, r.prompts_per_step, r.grpo["num_generations"]
('unsloth/Meta-Llama-3.1-8B-Instruct-bnb-4bit', 1, 4)
>>> load_recipe("cpu", {"max_steps": 4, "model.lora_rank": 8}).get("lora_rank")
8
"""

from __future__ import annotations

import difflib
import json
import os
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grpo_kit.errors import GrpoKitError
from grpo_kit.machinery.recipe_checks import (
    GRPO_DEFAULTS,
    GRPO_TYPES,
    MODEL_KEYS,
    PROMPT_KEYS,
    SECTIONS,
    TOP_KEYS,
    coerce_value,
    problems,
    unknown_key_error,
)

#: One-line explanations of the GRPO knobs that matter (the notebooks print them).
KNOBS = {
    "loss_type": "how per-token losses are averaged: grpo (per sequence, length-biased), dr_grpo (constant "
    "normaliser, no length bias), dapo (per token over the whole batch; TRL's default), bnpo (per token, per batch)",
    "beta": "weight of the KL penalty to the reference model; 0 (default) needs no reference model and saves memory",
    "scale_rewards": "divide advantages by the reward std of the group ('group'), the batch ('batch') or not ('none')",
    "num_generations": "group size G: completions sampled per prompt; advantages compare a completion to its group",
    "temperature": "sampling temperature; too low and a group's completions agree, leaving nothing to learn",
    "mask_truncated_completions": "leave completions cut off at max_completion_length out of the loss",
}


def recipes_dir() -> Path:
    """The shipped recipes: ``recipes/`` of a checkout, or the copy installed inside the package (see pyproject)."""
    checkout = Path(__file__).resolve().parent.parent / "recipes"
    return checkout if checkout.is_dir() else Path(__file__).resolve().parent / "recipes_data"


@dataclass(frozen=True)
class Recipe:
    """One complete recipe (see the module docstring). Read one with ``load_recipe``; change one with
    ``with_overrides``; every change is validated again."""

    name: str
    description: str
    vram_gb: float  # what PyTorch reports on the tier's card (a 16 GB T4 shows 14.7 GiB); 0 = CPU
    model: Mapping[str, Any]
    prompt: Mapping[str, Any]
    rewards: tuple  # (name or function, weight) pairs
    grpo: Mapping[str, Any]
    path: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        # Read-only sections: a recipe is shared (RECIPES), so a change must go through with_overrides.
        grpo = {**{k: v for k, v in GRPO_DEFAULTS.items() if k not in self.grpo}, **self.grpo}
        object.__setattr__(self, "model", types.MappingProxyType({**self.model,
                                                                   "lora_targets": tuple(self.model.get("lora_targets", ()))}))
        object.__setattr__(self, "prompt", types.MappingProxyType({"few_shot": 0, "prefill": "", **self.prompt}))
        object.__setattr__(self, "grpo", types.MappingProxyType(grpo))
        object.__setattr__(self, "rewards", tuple(_reward_pairs(self.rewards)))
        self.validate()

    def __getattr__(self, key: str) -> Any:
        # Only reached for names that are not fields or properties: a plain key of a section.
        if key.startswith("__") or key in {"model", "prompt", "grpo"}:
            raise AttributeError(key)
        section = _section_of(key)
        values = object.__getattribute__(self, section)
        if key in values:
            return values[key]
        raise AttributeError(f"recipe {self.name!r} has no {key!r} (section {section!r})")

    def get(self, key: str, default: Any = None) -> Any:
        """A plain key from its section (``"lora_rank"``, ``"prefill"``, ``"learning_rate"``) or ``"section.key"``."""
        section, name = split_key(key)
        if section is None:
            return getattr(self, name, default)
        return getattr(self, section).get(name, default)

    @property
    def model_id(self) -> str:
        return self.model["id"]

    @property
    def generation_batch_size(self) -> int:
        """Completions generated per optimizer step on one GPU: per-device batch × gradient accumulation."""
        return self.grpo["per_device_train_batch_size"] * self.grpo["gradient_accumulation_steps"]

    @property
    def prompts_per_step(self) -> int:
        """Questions per optimizer step: the generation batch split into groups of ``num_generations``."""
        return self.generation_batch_size // self.grpo["num_generations"]

    @property
    def vllm_colocated(self) -> bool:
        return bool(self.grpo["use_vllm"]) and self.grpo["vllm_mode"] == "colocate"

    @property
    def vllm_server(self) -> bool:
        return bool(self.grpo["use_vllm"]) and self.grpo["vllm_mode"] == "server"

    def with_overrides(self, overrides: Mapping[str, Any] | None = None, **more: Any) -> Recipe:
        """A copy with ``overrides`` applied (``--set`` keys and values; see ``split_key``), validated again."""
        changes = {**(overrides or {}), **more}
        if not changes:
            return self
        parts = {"model": dict(self.model), "prompt": dict(self.prompt), "grpo": dict(self.grpo)}
        top = {"name": self.name, "description": self.description, "vram_gb": self.vram_gb, "rewards": self.rewards}
        for key, value in changes.items():
            section, name = split_key(key)
            if section is None and name in top:
                top[name] = _parse_rewards(value) if name == "rewards" else coerce_value(name, value, TOP_KEYS[name])
                continue
            section = section or _section_of(name)
            if section == "grpo":
                parts["grpo"][name] = coerce_value(name, value, GRPO_TYPES.get(name))
            else:
                schema = MODEL_KEYS if section == "model" else PROMPT_KEYS
                if name not in schema:
                    raise unknown_key_error([key], valid=[f"{section}.{k}" for k in schema])
                parts[section][name] = coerce_value(name, value, schema[name])
        return Recipe(**top, **parts, path=self.path)

    def flat(self) -> dict:
        """Every value in one flat dict (``model`` is the id): ``grpo-kit presets --json`` rows, run comparisons."""
        return flatten(self.to_dict())

    def to_dict(self) -> dict:
        """The recipe as its YAML sections (a user's own recipe file can start from ``yaml.safe_dump`` of this)."""
        return {"name": self.name, "vram_gb": self.vram_gb, "description": self.description,
                "model": {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.model.items()},
                "prompt": dict(self.prompt), "rewards": {_reward_name(i): w for i, w in self.rewards},
                "grpo": dict(self.grpo)}

    def validate(self) -> None:
        """Raise ``GrpoKitError`` naming the fix when the values cannot work together."""
        for problem in problems(self):
            raise GrpoKitError(f"Recipe '{self.name}': {problem}")


def flatten(sections: Mapping[str, Any]) -> dict:
    """A recipe's sections (``Recipe.to_dict()``, ``run.json``'s ``recipe``) as one flat dict; ``model`` is the id.

    >>> flatten({"name": "x", "model": {"id": "m", "lora_rank": 8}, "prompt": {"few_shot": 1}, "grpo": {"beta": 0.0},
    ...          "rewards": {"correctness": 2.0}})
    {'name': 'x', 'model': 'm', 'lora_rank': 8, 'few_shot': 1, 'beta': 0.0, 'rewards': [['correctness', 2.0]]}
    """
    row = {k: sections[k] for k in TOP_KEYS if k in sections}
    model = dict(sections.get("model") or {})
    row["model"] = model.pop("id", None)
    for part in (model, sections.get("prompt") or {}, sections.get("grpo") or {}):
        row.update({k: (list(v) if isinstance(v, tuple) else v) for k, v in part.items()})
    row["rewards"] = [[name, weight] for name, weight in (sections.get("rewards") or {}).items()]
    return row


def recorded_settings(run_dir: str | os.PathLike) -> dict:
    """The recipe a run was trained with (``run_dir/run.json``), flat (see ``flatten``); ``{}`` when unreadable."""
    try:
        recorded = json.loads((Path(run_dir) / "run.json").read_text(encoding="utf-8"))["recipe"]
        return flatten(recorded)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def split_key(key: str) -> tuple[str | None, str]:
    """``"model.id"`` → ``("model", "id")``; ``"learning_rate"`` → ``(None, "learning_rate")``; ``"model"`` →
    ``("model", "id")`` (the short form of ``model.id``).

    >>> split_key("model.lora_rank"), split_key("beta"), split_key("model")
    (('model', 'lora_rank'), (None, 'beta'), ('model', 'id'))
    """
    section, dot, name = key.strip().partition(".")
    if not dot:
        return ("model", "id") if section == "model" else (None, section)
    if section not in SECTIONS or not name:
        raise unknown_key_error([key], valid=[f"{s}.KEY" for s in SECTIONS])
    return section, name


def _section_of(key: str) -> str:
    """Which section a plain key belongs to: model and prompt keys are known; anything else is a GRPOConfig field."""
    if key in MODEL_KEYS:
        return "model"
    if key in PROMPT_KEYS:
        return "prompt"
    return "grpo"


def all_keys() -> list[str]:
    """Every key the kit knows by name (for "did you mean" hints): sections' keys and the typed grpo keys."""
    return [*TOP_KEYS, "rewards", *MODEL_KEYS, *PROMPT_KEYS, *GRPO_TYPES]


def _reward_pairs(rewards) -> list[tuple[Any, float]]:
    """``{"correctness": 2}``, ``[("format", 1)]``, ``[fn]`` or ``"correctness:2,format"`` → ``[(item, weight)]``."""
    if isinstance(rewards, Mapping):
        rewards = list(rewards.items())
    if isinstance(rewards, str):
        return _parse_rewards(rewards)
    pairs = []
    for item in rewards:
        name, weight = item if isinstance(item, (tuple, list)) and len(item) == 2 else (item, 1.0)
        pairs.append((name, weight))
    return pairs


def _parse_rewards(value) -> list[tuple[Any, float]]:
    """A ``--set rewards=...`` value (``"correctness:2,format"``, pairs or functions) → ``[(item, weight)]``: names
    that can be written down (built-ins, ``package.module:function``) stay names, other functions stay functions."""
    from grpo_kit.machinery.reward_specs import parse_reward_spec
    from grpo_kit.rewards import REWARDS

    funcs, weights, names = parse_reward_spec(list(value.items()) if isinstance(value, Mapping) else value)
    return [(name if name in REWARDS or ":" in name else fn, w) for fn, w, name in zip(funcs, weights, names, strict=True)]


def _reward_name(item) -> str:
    return item if isinstance(item, str) else getattr(item, "__name__", type(item).__name__)


def parse_set(pairs: list[str]) -> dict[str, Any]:
    """``["beta=0.04", "loss_type=dr_grpo"]`` → ``{"beta": 0.04, "loss_type": "dr_grpo"}`` (values read as JSON).

    >>> parse_set(["beta=0.04", "model.id=org/name", "use_vllm=true"])
    {'beta': 0.04, 'model.id': 'org/name', 'use_vllm': True}
    """
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise GrpoKitError(f"--set expects KEY=VALUE, got '{pair}'.")
        try:
            out[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            out[key.strip()] = raw
    return out


# --------------------------------------------------------------------------------------------- loading


def read_recipe_file(path: str | os.PathLike) -> Recipe:
    """A ``Recipe`` from a YAML file; a missing file, bad YAML or a missing section is a clear error."""
    import yaml

    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise GrpoKitError(f"Cannot read recipe file {path}: {error.strerror or error}. Check the path.") from error
    except yaml.YAMLError as error:
        raise GrpoKitError(f"Recipe file {path} is not valid YAML ({error}). Compare it with recipes/cpu.yaml.") from error
    if not isinstance(data, dict):
        raise GrpoKitError(f"Recipe file {path} must hold a mapping with model:, prompt:, rewards: and grpo: sections.")
    extra = sorted(set(data) - {*TOP_KEYS, "model", "prompt", "rewards", "grpo"})
    if extra:
        raise unknown_key_error(extra, valid=[*TOP_KEYS, "model", "prompt", "rewards", "grpo"])
    sections = {s: data.get(s) or {} for s in ("model", "prompt", "grpo")}
    for name, value in sections.items():
        if not isinstance(value, dict):
            raise GrpoKitError(f"Recipe file {path}: {name}: must be a mapping of keys to values.")
    return Recipe(
        name=str(data.get("name") or path.stem), description=str(data.get("description") or ""),
        vram_gb=float(data.get("vram_gb") or 0.0), rewards=data.get("rewards") or {}, path=str(path), **sections,
    )


def _shipped() -> dict[str, Recipe]:
    recipes = [read_recipe_file(p) for p in sorted(recipes_dir().glob("*.yaml"))]
    return {r.name: r for r in sorted(recipes, key=lambda r: (r.vram_gb, r.name))}


#: name → shipped recipe, smallest tier first (``auto_recipe`` relies on this order).
RECIPES: dict[str, Recipe] = _shipped()


def load_recipe(name_or_path: str | os.PathLike, overrides: Mapping[str, Any] | None = None, **more: Any) -> Recipe:
    """A shipped recipe by name (``grpo-kit presets`` lists them) or a user's YAML file, with ``overrides``.

    >>> load_recipe("cpu", max_steps=2).grpo["max_steps"]
    2
    """
    text = str(name_or_path)
    if text in RECIPES:
        recipe = RECIPES[text]
    elif text.endswith((".yaml", ".yml")) or os.sep in text or Path(text).is_file():
        recipe = read_recipe_file(text)
    else:
        hint = difflib.get_close_matches(text, RECIPES, n=1)
        raise GrpoKitError(
            f"Unknown recipe {text!r}." + (f" Did you mean {hint[0]!r}?" if hint else "")
            + f" Shipped: {', '.join(RECIPES)} (or 'auto'); `grpo-kit presets` describes them. A file of your own: "
            "--recipe my_recipe.yaml."
        )
    return recipe.with_overrides(overrides, **more)
