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
import math
import os
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grpo_kit.errors import GrpoKitError

#: LoRA on every attention and MLP projection (what Unsloth's GRPO notebooks and the CPU measurement use).
ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: The documented fallback model when the tier's model is too big: 1.5B parameters.
FALLBACK_MODEL = "unsloth/Qwen2.5-1.5B-Instruct"
#: The same model pre-quantised to 4 bits, for recipes with ``load_in_4bit`` (vLLM loads it as it is).
FALLBACK_MODEL_4BIT = "unsloth/Qwen2.5-1.5B-Instruct-bnb-4bit"
PRECISIONS = ("fp16", "bf16", "fp32")
#: Where vLLM generates (``grpo.vllm_mode``): in the training process, or in a ``trl vllm-serve`` server.
VLLM_MODES = ("colocate", "server")
#: How the policy is loaded (``model.backend``); ``models.resolve_backend`` turns ``auto`` into one of the others.
BACKENDS = ("auto", "unsloth", "transformers")
#: A card is given a tier when it reports at least this fraction of the tier's ``vram_gb`` (rounding, ECC).
TIER_TOLERANCE = 0.97

#: Keys of the ``model`` and ``prompt`` sections and their types (the ``grpo`` section is TRL's; see ``GRPO_TYPES``).
MODEL_KEYS = {"id": str, "load_in_4bit": bool, "max_seq_length": int, "precision": str, "lora_rank": int,
              "lora_alpha": int, "lora_targets": list, "backend": str}
PROMPT_KEYS = {"few_shot": int, "prefill": str, "max_prompt_length": int, "system_prompt": str}
TOP_KEYS = {"name": str, "description": str, "vram_gb": float}
#: The GRPOConfig fields the kit itself reads (batch rule, planner, model loading): typed here so ``--set`` values
#: are checked before TRL is imported. Every other grpo key is typed by TRL's own annotations in ``train``.
GRPO_TYPES = {"num_generations": int, "per_device_train_batch_size": int, "gradient_accumulation_steps": int,
              "max_completion_length": int, "max_steps": int, "learning_rate": float, "temperature": float,
              "beta": float, "warmup_steps": float, "use_vllm": bool, "vllm_mode": str,
              "vllm_gpu_memory_utilization": float, "vllm_server_base_url": str, "gradient_checkpointing": bool,
              "optim": str, "seed": int, "save_steps": float, "logging_steps": float, "loss_type": str}
#: Every grpo key the kit reads has a value in every shipped recipe; these are TRL's defaults for a user's own file.
GRPO_DEFAULTS = {"use_vllm": False, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.3, "beta": 0.0,
                 "gradient_checkpointing": False, "optim": "adamw_torch", "seed": 42, "temperature": 1.0}
REQUIRED_GRPO = ("num_generations", "per_device_train_batch_size", "gradient_accumulation_steps",
                 "max_completion_length", "max_steps", "learning_rate")
#: TRL 1.15's ``loss_type`` values.
TRL_LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo")
#: GRPO loss variants, taught by name: the ``--set`` keys each one is, and what it changes (docs/SCALING.md).
LOSS_VARIANTS: dict[str, tuple[dict, str]] = {
    "grpo": ({"loss_type": "grpo"}, "original GRPO: token losses averaged per completion, then over completions "
             "(length-biased: short right answers and long wrong ones are favoured)"),
    "dr_grpo": ({"loss_type": "dr_grpo"}, "Dr. GRPO: token losses summed and divided by a constant "
                "(max_completion_length): no length bias (the paper also drops std scaling: scale_rewards=none)"),
    "dapo": ({"loss_type": "dapo"}, "DAPO, TRL's default: token losses averaged over every token of the batch"),
    "bnpo": ({"loss_type": "bnpo"}, "BNPO: token losses averaged over the tokens of each micro-batch"),
    "gspo": ({"loss_type": "grpo", "importance_sampling_level": "sequence", "epsilon": 3e-4, "epsilon_high": 4e-4},
             "GSPO: one importance ratio per completion clipped at 3e-4/4e-4; differs from grpo only when batches "
             "are reused (num_iterations > 1 or steps_per_generation > accumulation)"),
}
SECTIONS = ("model", "prompt", "grpo")
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
        for problem in _problems(self):
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


def unknown_key_error(keys, valid) -> GrpoKitError:
    hints = [f"{k} → {m[0]}" for k in keys if (m := difflib.get_close_matches(k, list(valid), n=1))]
    return GrpoKitError(
        f"Unknown recipe key(s): {', '.join(keys)}." + (f" Did you mean: {', '.join(hints)}?" if hints else "")
        + f" Valid: {', '.join(valid)}."
    )


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
    from grpo_kit.rewards import REWARDS, parse_reward_spec

    funcs, weights, names = parse_reward_spec(list(value.items()) if isinstance(value, Mapping) else value)
    return [(name if name in REWARDS or ":" in name else fn, w) for fn, w, name in zip(funcs, weights, names, strict=True)]


def _reward_name(item) -> str:
    return item if isinstance(item, str) else getattr(item, "__name__", type(item).__name__)


# --------------------------------------------------------------------------------------------- values


_KIND_NAMES = {bool: "true or false", int: "an integer", float: "a finite number", str: "text", list: "a list"}


def coerce_value(name: str, value: Any, kind: type | set | None) -> Any:
    """``value`` as ``kind`` (a type, a set of types, or None for "leave as is"), or a ``GrpoKitError``.

    ``--set`` hands over JSON-parsed text, so ``"1e-4"``, ``3.0`` and ``"true"`` arrive where a float, an int and a
    bool belong; NaN and infinity are refused by name.

    >>> coerce_value("max_steps", 3.0, int), coerce_value("learning_rate", "1e-4", float)
    (3, 0.0001)
    """
    kinds = kind if isinstance(kind, set) else ({kind} if kind else set())
    if value is None or not kinds:
        return value
    if list in kinds and isinstance(value, (list, tuple)):
        return tuple(value)
    if type(value) in kinds and not isinstance(value, float):
        return value
    number = _as_number(value) if not isinstance(value, bool) else None
    if float in kinds and number is not None and math.isfinite(number):
        return float(number) if not (int in kinds and number == int(number) and not isinstance(value, float)) else int(number)
    if int in kinds and number is not None and math.isfinite(number) and number == int(number):
        return int(number)
    if bool in kinds and isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if str in kinds and not isinstance(value, (float, bool, list, tuple)):
        return str(value)
    expected = " or ".join(_KIND_NAMES[k] for k in (bool, int, float, str, list) if k in kinds)
    raise GrpoKitError(f"--set {name}={value}: {name} expects {expected}, got {value!r}. Fix the value and run again.")


def _as_number(value: Any) -> float | None:
    if isinstance(value, (int, float)):
        return float(value)
    try:
        return float(str(value).strip())
    except ValueError:
        return None


def check_grpo_fields(recipe: Recipe) -> Recipe:
    """The ``grpo`` section checked against the installed TRL: an unknown field is refused with the closest valid
    name, and each value is converted to ``GRPOConfig``'s annotated type (``--set max_steps=1.5`` is refused).

    Imports TRL: on the GPU path call it after ``models.prepare_backend`` (``train`` does).
    """
    import dataclasses as dc
    import typing

    import trl

    known = {f.name for f in dc.fields(trl.GRPOConfig)}
    unknown = [k for k in recipe.grpo if k not in known]
    if unknown:
        named = [k + (f" (did you mean {m[0]}?)" if (m := difflib.get_close_matches(k, [*known, *MODEL_KEYS, *PROMPT_KEYS], n=1)) else "")
                 for k in unknown]
        raise GrpoKitError(
            f"Not a GRPOConfig field of the installed TRL ({trl.__version__}), nor a model/prompt key: "
            f"{'; '.join(named)}."
            + f" Model keys: {', '.join(MODEL_KEYS)}; prompt keys: {', '.join(PROMPT_KEYS)}; the grpo keys are TRL's "
            "GRPOConfig fields (grpo-kit is tested with trl==1.15.0)."
        )
    hints = typing.get_type_hints(trl.GRPOConfig)
    changed = {}
    for key, value in recipe.grpo.items():
        converted = coerce_value(key, value, _scalar_kinds(hints.get(key)))
        if converted != value or type(converted) is not type(value):
            changed[f"grpo.{key}"] = converted
    return recipe.with_overrides(changed) if changed else recipe


def _scalar_kinds(hint) -> set:
    """The scalar types (bool, int, float, str) an annotation allows; empty when it allows other things too."""
    import enum
    import typing

    union = isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
    kinds = set()
    for arg in typing.get_args(hint) if union else (hint,):
        if arg is type(None):
            continue
        if isinstance(arg, type) and issubclass(arg, enum.Enum):
            kinds.add(str)  # TRL's SchedulerType, OptimizerNames: given by name
        elif arg in (bool, int, float, str):
            kinds.add(arg)
        else:
            return set()  # lists, dicts, Any: passed through to GRPOConfig as they are
    return kinds


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


# --------------------------------------------------------------------------------------------- checks


def launched_processes() -> int:
    """Training processes of this launch: ``$WORLD_SIZE`` (set by accelerate launch / torchrun), else 1."""
    value = os.environ.get("WORLD_SIZE", "1")
    return int(value) if value.isdigit() and int(value) > 0 else 1


def batch_rule_problem(per_device: int, accumulation: int, num_generations: int, processes: int = 1) -> str | None:
    """What breaks TRL's batch rule, with the fix, or None when the generation batch holds whole groups.

    >>> batch_rule_problem(1, 4, 4) is None
    True
    >>> print(batch_rule_problem(1, 3, 4).split("Fix: ")[1])
    make the product a multiple of 4 (e.g. gradient_accumulation_steps=4), or choose num_generations among the divisors of 3: [3].
    """
    batch = per_device * processes * accumulation
    if batch % num_generations == 0:
        return None
    step = per_device * processes
    suggested = -(-batch // num_generations) * num_generations  # the next multiple of G
    while suggested % step:
        suggested += num_generations
    divisors = [d for d in range(2, batch + 1) if batch % d == 0]
    return (
        f"TRL generates per_device_train_batch_size ({per_device}) × processes ({processes}) × "
        f"gradient_accumulation_steps ({accumulation}) = {batch} completions per step and must split them into whole "
        f"groups of num_generations ({num_generations}). Fix: make the product a multiple of {num_generations} "
        f"(e.g. gradient_accumulation_steps={suggested // step}), or choose num_generations among the divisors of "
        f"{batch}: {divisors}."
    )


def _problems(r: Recipe):
    """Each problem of ``r`` as a message naming the fix (the first one is raised)."""
    missing = [f"model.{k}" for k in ("id", "load_in_4bit", "max_seq_length", "precision", "lora_rank", "lora_alpha",
                                      "lora_targets") if k not in r.model]
    missing += ["prompt.max_prompt_length"] * ("max_prompt_length" not in r.prompt)
    missing += [f"grpo.{k}" for k in REQUIRED_GRPO if k not in r.grpo]
    if missing:
        yield f"missing {', '.join(missing)}; every recipe names them (see recipes/cpu.yaml)."
        return
    unknown = [f"{s}.{k}" for s, schema in (("model", MODEL_KEYS), ("prompt", PROMPT_KEYS))
               for k in getattr(r, s) if k not in schema]
    if unknown:
        yield str(unknown_key_error(unknown, [f"model.{k}" for k in MODEL_KEYS] + [f"prompt.{k}" for k in PROMPT_KEYS]))
    for section, schema in (("model", MODEL_KEYS), ("prompt", PROMPT_KEYS), ("grpo", GRPO_TYPES)):
        for key, kind in schema.items():
            value = getattr(r, section).get(key)
            if value is not None and not _is_kind(value, kind):
                yield f"{section}.{key} expects {_KIND_NAMES[kind]}, got {value!r}."
    numbers = [(k, v) for k, v in [*r.grpo.items(), ("vram_gb", r.vram_gb)] if isinstance(v, float)]
    bad = [(k, v) for k, v in numbers if not math.isfinite(v)]
    if bad:  # ``> 0`` accepts inf, and NaN fails every comparison silently: refuse both by name
        yield f"{bad[0][0]} is {bad[0][1]}; every number in a recipe must be finite (--set {bad[0][0]}=N)."
    g, m, p = r.grpo, r.model, r.prompt
    if g["num_generations"] < 2:
        yield (f"num_generations is {g['num_generations']}; GRPO compares completions within a group, so it needs at "
               "least 2 (4-16 is usual).")
    if g["per_device_train_batch_size"] < 1 or g["gradient_accumulation_steps"] < 1:
        yield "per_device_train_batch_size and gradient_accumulation_steps must be >= 1."
    problem = batch_rule_problem(g["per_device_train_batch_size"], g["gradient_accumulation_steps"],
                                 g["num_generations"], processes=launched_processes())
    if problem:
        yield problem
    if p["max_prompt_length"] + g["max_completion_length"] > m["max_seq_length"]:
        yield (f"max_prompt_length ({p['max_prompt_length']}) + max_completion_length ({g['max_completion_length']}) "
               f"exceeds max_seq_length ({m['max_seq_length']}). Raise model.max_seq_length to "
               f"{p['max_prompt_length'] + g['max_completion_length']} or shorten the prompt/completion budget.")
    if min(p["max_prompt_length"], g["max_completion_length"], m["lora_rank"], g["max_steps"]) < 1:
        yield (f"lengths, lora_rank and max_steps must be positive, got max_prompt_length={p['max_prompt_length']}, "
               f"max_completion_length={g['max_completion_length']}, lora_rank={m['lora_rank']}, "
               f"max_steps={g['max_steps']}.")
    if m["precision"] not in PRECISIONS:
        yield f"precision {m['precision']!r} is not one of {', '.join(PRECISIONS)}."
    if m.get("backend", "auto") not in BACKENDS:
        yield f"backend {m['backend']!r} is not one of {', '.join(BACKENDS)}."
    if not 0.0 < g["vllm_gpu_memory_utilization"] < 1.0:
        yield f"vllm_gpu_memory_utilization is a fraction of the card (0-1), got {g['vllm_gpu_memory_utilization']}."
    if g["vllm_mode"] not in VLLM_MODES:
        yield f"vllm_mode {g['vllm_mode']!r} is not one of {', '.join(VLLM_MODES)}."
    if g["vllm_mode"] == "server" and not g["use_vllm"]:
        yield ("vllm_mode='server' generates with a vLLM server, but use_vllm is off. Pass --set use_vllm=true too, "
               "or drop vllm_mode.")
    url = g.get("vllm_server_base_url")
    if url and not str(url).startswith(("http://", "https://")):
        yield f"vllm_server_base_url {url!r} is not a URL; write it as http://HOST:PORT (e.g. http://localhost:8000)."
    if not (g["learning_rate"] > 0 and g["temperature"] > 0 and g.get("warmup_steps", 0) >= 0 and g["beta"] >= 0):
        yield (f"learning_rate and temperature must be > 0, warmup_steps and beta >= 0, got learning_rate="
               f"{g['learning_rate']}, temperature={g['temperature']}, warmup_steps={g.get('warmup_steps')}, "
               f"beta={g['beta']}.")
    if g.get("loss_type", "dapo") not in TRL_LOSS_TYPES:
        variant = LOSS_VARIANTS.get(g["loss_type"])
        yield (f"loss_type {g['loss_type']!r} is not one of TRL's: {', '.join(TRL_LOSS_TYPES)}."
               + (f" {g['loss_type']} is these GRPOConfig fields: "
                  + " ".join(f"--set {k}={v}" for k, v in variant[0].items()) if variant else ""))
    if not m["lora_targets"]:
        yield f"lora_targets is empty; name modules such as {', '.join(ALL_PROJECTIONS)}."
    if not r.rewards or not all(item and isinstance(w, (int, float)) and math.isfinite(w) for item, w in r.rewards):
        yield "rewards must be name: finite weight pairs, e.g. {correctness: 1.0, format: 1.0}."
    from grpo_kit.rewards import REWARDS

    unknown = [i for i, _ in r.rewards if isinstance(i, str) and ":" not in i and i.lower().replace("-", "_") not in REWARDS]
    if unknown:  # package.module:function names are imported (and checked) when training starts
        yield (f"unknown reward {unknown[0]!r}; choose from {', '.join(REWARDS)} (`grpo-kit rewards`) or write "
               "package.module:function.")


def _is_kind(value, kind: type) -> bool:
    """``value`` fits ``kind``; an int is a fine float, a bool is not a number."""
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is list:
        return isinstance(value, (list, tuple))
    return isinstance(value, kind) and (kind is bool or not isinstance(value, bool))


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


def auto_recipe(device=None) -> tuple[Recipe, str]:
    """Pick the tier for ``device`` (a ``runtime.DeviceInfo``; detected when None) and say why in one line.

    The largest GPU tier whose ``vram_gb`` the card reaches (within ``TIER_TOLERANCE``) wins; a card without bf16
    gets fp16; a GPU smaller than a T4 gets the T4 recipe with the fallback 1.5B model.

    >>> from grpo_kit.machinery.runtime import DeviceInfo
    >>> auto_recipe(DeviceInfo("cuda", "Tesla T4", 14.74, False))[0].name
    't4-16gb'
    """
    from grpo_kit.machinery.planner import check_fits, estimate_vram

    if device is None:
        from grpo_kit.machinery.runtime import detect_device

        device = detect_device()
    if device.kind != "cuda":
        return RECIPES["cpu"], (
            "No CUDA GPU → cpu: the embedded SmolLM2-135M trains on the CPU in minutes (it learns the answer format; "
            "the cpu-answers recipe teaches one-step arithmetic)."
        )
    gpu_tiers = [r for r in RECIPES.values() if r.vram_gb > 0]
    fitting = [r for r in gpu_tiers if device.vram_gb >= r.vram_gb * TIER_TOLERANCE]
    changes: dict = {}
    if fitting:
        recipe = fitting[-1]
        why = f"the largest tier for {recipe.vram_gb:g}+ GiB cards"
    else:
        recipe = gpu_tiers[0]
        changes["model.id"] = FALLBACK_MODEL_4BIT if recipe.model["load_in_4bit"] else FALLBACK_MODEL
        why = f"smaller than a T4's {recipe.vram_gb:g} GiB, so the T4 recipe with the 1.5B fallback model"
    if recipe.model["precision"] == "bf16" and not device.bf16:
        changes["model.precision"] = "fp16"
        why += "; fp16 since this GPU has no bf16"
    recipe = recipe.with_overrides(changes)
    estimate = estimate_vram(recipe, card_gb=device.vram_gb)
    reason = (f"{device.name} with {device.vram_gb:.1f} GiB → {recipe.name} because it is {why} "
              f"(planner: ~{estimate.total_gib:.1f} GiB).")
    warning = check_fits(recipe, device)
    return recipe, reason + (" Warning: " + warning if warning else "")


# --------------------------------------------------------------------------------------------- CLI


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
