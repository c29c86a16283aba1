"""The rules a recipe must satisfy, and the types of its keys: the schema of each section, ``--set`` value
conversion, TRL's batch rule, and the check of the ``grpo`` section against the installed TRL. ``grpo_kit.recipes``
calls these on every recipe it reads or changes."""

from __future__ import annotations

import difflib
import math
import os
import types
from typing import Any

from grpo_kit.errors import GrpoKitError

#: LoRA on every attention and MLP projection (what Unsloth's GRPO notebooks and the CPU measurement use).
ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PRECISIONS = ("fp16", "bf16", "fp32")
#: Where vLLM generates (``grpo.vllm_mode``): in the training process, or in a ``trl vllm-serve`` server.
VLLM_MODES = ("colocate", "server")
#: How the policy is loaded (``model.backend``); ``backend.resolve_backend`` turns ``auto`` into one of the others.
BACKENDS = ("auto", "unsloth", "transformers")
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


def unknown_key_error(keys, valid) -> GrpoKitError:
    hints = [f"{k} → {m[0]}" for k in keys if (m := difflib.get_close_matches(k, list(valid), n=1))]
    return GrpoKitError(
        f"Unknown recipe key(s): {', '.join(keys)}." + (f" Did you mean: {', '.join(hints)}?" if hints else "")
        + f" Valid: {', '.join(valid)}."
    )


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


def check_grpo_fields(recipe):
    """The ``grpo`` section checked against the installed TRL: an unknown field is refused with the closest valid
    name, and each value is converted to ``GRPOConfig``'s annotated type (``--set max_steps=1.5`` is refused).

    Imports TRL: on the GPU path call it after ``backend.prepare_backend`` (``train`` does).
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


def problems(r):
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
