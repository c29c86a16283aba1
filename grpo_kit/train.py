"""Training: a preset becomes a ``GRPOConfig``, rewards come from the registry by name, TRL's ``GRPOTrainer`` runs.

What this module adds around TRL, and nothing more:

- ``build_grpo_config``: preset + overrides → ``GRPOConfig``. Every key is checked against the installed TRL's
  fields, so a TRL upgrade that renames a field fails loudly instead of being silently ignored.
- ``MetricsLogger``: each logged step appended to ``<run_dir>/metrics.jsonl`` (the plots read it).
- ``latest_checkpoint``: the newest *complete* ``checkpoint-N`` folder (state, readable adapter weights, optimizer and
  scheduler state), so ``resume=True`` never picks a half-written one; metrics logged after that checkpoint are cut
  so the history stays continuous. A run that already reached ``max_steps`` is left as it is.
- ``coerce_overrides``: ``--set`` values converted to their field's type and checked (finite numbers) up front.
- A lock per run folder (``guards.acquire_run_lock``), so two processes never train into the same one.
- ``train``: the whole run, returning a ``TrainResult`` with the reward at the start and at the end.

Run folder layout (see docs/DESIGN.md)::

    run_dir/run.json  metrics.jsonl  checkpoint-N/  adapter/  plots/rewards.png
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grpo_kit.errors import GrpoKitError

#: Preset field → GRPOConfig field, for the fields that are passed through unchanged.
PRESET_TO_CONFIG = {
    "learning_rate": "learning_rate",
    "lr_scheduler_type": "lr_scheduler_type",
    "warmup_steps": "warmup_steps",
    "weight_decay": "weight_decay",
    "max_grad_norm": "max_grad_norm",
    "optim": "optim",
    "num_generations": "num_generations",
    "per_device_train_batch_size": "per_device_train_batch_size",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "max_completion_length": "max_completion_length",
    "temperature": "temperature",
    "beta": "beta",
    "loss_type": "loss_type",
    "scale_rewards": "scale_rewards",
    "mask_truncated_completions": "mask_truncated_completions",
    "use_vllm": "use_vllm",
    "vllm_gpu_memory_utilization": "vllm_gpu_memory_utilization",
    "gradient_checkpointing": "gradient_checkpointing",
    "max_steps": "max_steps",
    "save_steps": "save_steps",
    "logging_steps": "logging_steps",
    "seed": "seed",
}

#: One-line explanations of the GRPO knobs that matter (shown by the CLI help and the notebooks).
KNOBS = {
    "loss_type": "how per-token losses are averaged: grpo (per sequence, length-biased), dr_grpo (constant "
    "normaliser, no length bias), dapo (per token over the whole batch; TRL's default), bnpo (per token, per batch)",
    "beta": "weight of the KL penalty to the reference model; 0 (default) needs no reference model and saves memory",
    "scale_rewards": "divide advantages by the reward std of the group ('group'), the batch ('batch') or not ('none')",
    "num_generations": "group size G: completions sampled per prompt; advantages compare a completion to its group",
    "temperature": "sampling temperature; too low and a group's completions agree, leaving nothing to learn",
    "mask_truncated_completions": "leave completions cut off at max_completion_length out of the loss",
}

#: Metrics copied into metrics.jsonl under the same name (plus every 'rewards/<name>/mean').
TRACKED = (
    "loss",
    "grad_norm",
    "learning_rate",
    "reward",
    "reward_std",
    "frac_reward_zero_std",
    "completions/mean_length",
    "completions/clipped_ratio",
    "kl",
    "entropy",
    "step_time",
    "epoch",
)


@dataclass(frozen=True)
class TrainResult:
    """What a finished run left behind and how it went."""

    run_dir: Path
    adapter_dir: Path
    metrics_path: Path
    steps: int
    seconds: float
    reward_first: float | None  # mean reward over the first few logged steps
    reward_last: float | None  # mean reward over the last few logged steps
    history: list[dict] = field(default_factory=list, repr=False)
    already_finished: bool = False  # ``resume`` found the run at max_steps: nothing was trained or changed

    def summary(self) -> str:
        start = "n/a" if self.reward_first is None else f"{self.reward_first:.3f}"
        end = "n/a" if self.reward_last is None else f"{self.reward_last:.3f}"
        head = ""
        if self.already_finished:
            head = (f"run already finished: step {self.steps} of {self.steps}, nothing was changed (pass a larger "
                    "--max-steps with --resume to train on)\n")
        return (
            head + f"steps: {self.steps}   time: {self.seconds:.0f} s   reward: {start} -> {end}\n"
            f"adapter: {self.adapter_dir}\nmetrics: {self.metrics_path}"
        )


# --------------------------------------------------------------------------------------------- config


def config_fields() -> set[str]:
    """Names of the fields the installed TRL's ``GRPOConfig`` accepts."""
    from trl import GRPOConfig

    return {f.name for f in dataclasses.fields(GRPOConfig)}


def _check_known(keys, known: set[str], what: str) -> None:
    unknown = sorted(set(keys) - known)
    if unknown:
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(key, known, n=3)
            hints.append(f"{key}" + (f" (did you mean {', '.join(close)}?)" if close else ""))
        raise GrpoKitError(
            f"{what} not accepted by the installed TRL's GRPOConfig: {'; '.join(hints)}.\n"
            "Fix the name, or check the TRL version (grpo-kit is tested with trl==1.15.0)."
        )


def precision_flags(precision: str, on_cpu: bool) -> dict[str, Any]:
    """GRPOConfig flags for a precision name. TRL 1.x turns bf16 on by default, which breaks CPUs and T4s.

    >>> precision_flags("fp16", on_cpu=False)
    {'bf16': False, 'fp16': True}
    """
    if precision not in {"fp32", "fp16", "bf16"}:
        raise GrpoKitError(f"Unknown precision '{precision}': use fp32, fp16 or bf16.")
    if on_cpu and precision != "fp32":
        raise GrpoKitError(f"Precision {precision} needs a GPU; on CPU use the 'cpu' preset (fp32).")
    return {"bf16": precision == "bf16", "fp16": precision == "fp16"}


def build_grpo_config(preset, output_dir: str | os.PathLike, overrides: dict[str, Any] | None = None, *, on_cpu=None):
    """A ``GRPOConfig`` from ``preset`` plus ``overrides`` (GRPOConfig field names), checked against installed TRL.

    ``on_cpu`` defaults to "no CUDA device". Unknown override names raise ``GrpoKitError`` with suggestions.
    """
    import torch
    from trl import GRPOConfig

    from grpo_kit.presets import loss_variant_config

    if on_cpu is None:
        on_cpu = not torch.cuda.is_available()
    known = config_fields()
    overrides = dict(overrides or {})
    _check_known(overrides, known, "Override(s)")
    values: dict[str, Any] = {cfg: getattr(preset, name) for name, cfg in PRESET_TO_CONFIG.items()}
    values.update(precision_flags(preset.precision, on_cpu))
    values.update(loss_variant_config(preset.loss_type))  # e.g. gspo = grpo + sequence-level ratios
    values.update(
        output_dir=str(output_dir),
        use_cpu=on_cpu,
        save_strategy="steps",
        report_to=["tensorboard"] if _has_tensorboard() else "none",
        reward_weights=[float(w) for _, w in preset.rewards] + [0.0],  # + the format_rate metric (weight 0)
        remove_unused_columns=False,
        dataloader_num_workers=0,
        logging_nan_inf_filter=False,  # a NaN/inf loss must reach the logs, where guards.NumericsGuard stops the run
    )
    if preset.use_vllm:
        values["vllm_mode"] = preset.vllm_mode
        if preset.vllm_server:
            from grpo_kit.vllm_server import server_url

            values["vllm_server_base_url"] = server_url(preset)
    if on_cpu:
        values["gradient_checkpointing"] = False
    values.update(overrides)
    _check_known(values, known, "Preset field(s)")
    return GRPOConfig(**values)


def _has_tensorboard() -> bool:
    import importlib.util

    return importlib.util.find_spec("tensorboard") is not None


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """``["beta=0.04", "loss_type=dr_grpo"]`` → ``{"beta": 0.04, "loss_type": "dr_grpo"}`` (values read as JSON).

    >>> parse_overrides(["beta=0.04", "loss_type=dr_grpo", "use_vllm=true"])
    {'beta': 0.04, 'loss_type': 'dr_grpo', 'use_vllm': True}
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


def _scalar_kinds(hint) -> set:
    """The scalar types (bool, int, float, str) an annotation allows; empty when it allows other things too."""
    import enum
    import types
    import typing

    args = typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union else (hint,)
    kinds = set()
    for arg in args:
        if arg is type(None):
            continue
        if isinstance(arg, type) and issubclass(arg, enum.Enum):
            kinds.add(str)  # TRL's SchedulerType, OptimizerNames: given by name
        elif arg in (bool, int, float, str):
            kinds.add(arg)
        else:
            return set()  # lists, dicts, Any: passed through to GRPOConfig as they are
    return kinds


def _field_hints(preset, *, config: bool = True) -> dict[str, Any]:
    """Field name → annotation, for the preset's fields and (``config=True``) GRPOConfig's (the preset wins:
    split_overrides does too)."""
    import typing

    hints = {}
    if config:
        from trl import GRPOConfig

        hints.update(typing.get_type_hints(GRPOConfig))
    hints.update(typing.get_type_hints(type(preset)))
    return hints


_KIND_NAMES = {bool: "true or false", int: "an integer", float: "a finite number", str: "text"}


def coerce_value(name: str, value: Any, kinds: set) -> Any:
    """``value`` converted to one of ``kinds`` (see ``_scalar_kinds``), or a ``GrpoKitError`` naming field and value.

    >>> coerce_value("max_steps", 3.0, {int}), coerce_value("learning_rate", "1e-4", {float})
    (3, 0.0001)
    """
    if value is None or not kinds or (type(value) in kinds and not isinstance(value, float)):
        return value
    if isinstance(value, float) and float in kinds and math.isfinite(value):
        return value
    if int in kinds and not isinstance(value, bool):
        number = _as_number(value)
        if number is not None and math.isfinite(number) and number == int(number):
            return int(number)
    if float in kinds and not isinstance(value, bool):
        number = _as_number(value)
        if number is not None and math.isfinite(number):
            return float(number)
    if bool in kinds and isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if str in kinds and not isinstance(value, (float, bool)):
        return str(value)
    expected = " or ".join(_KIND_NAMES[k] for k in (bool, int, float, str) if k in kinds)
    raise GrpoKitError(f"--set {name}={value}: {name} expects {expected}, got {value!r}. Fix the value and run again.")


def _as_number(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    try:
        return float(str(value).strip())
    except ValueError:
        return None


def coerce_overrides(preset, overrides: dict[str, Any], *, config: bool = True) -> dict[str, Any]:
    """Each override converted to its field's type (preset or GRPOConfig) and checked, before any weights load.

    ``--set max_steps=1.5``, ``learning_rate=abc`` or ``learning_rate=nan`` are refused naming field, expected type
    and value; unknown names pass through to the name check (which suggests the right one). ``config=False`` converts
    only the preset's fields, without importing TRL (``train`` must import Unsloth first on the GPU path).
    """
    hints = _field_hints(preset, config=config)
    return {key: coerce_value(key, value, _scalar_kinds(hints[key])) if key in hints else value
            for key, value in overrides.items()}


# --------------------------------------------------------------------------------------------- metrics


def format_rate(completions, prefill=None, **kwargs) -> list[float]:
    """Metric-only reward (weight 0): 1.0 when a completion is in the think/answer format, else 0.0.

    TRL logs it as ``rewards/format_rate/mean``: the share of completions in the format.
    """
    from grpo_kit.rewards import REWARDS

    scores = REWARDS["format"](completions, prefill=prefill, **kwargs)
    return [1.0 if score > 0 else 0.0 for score in scores]


def _clean(logs: dict[str, Any]) -> dict[str, Any]:
    row = {}
    for key, value in logs.items():
        if key in TRACKED or (key.startswith("rewards/") and key.endswith("/mean")):
            name = key[len("rewards/") : -len("/mean")] if key.startswith("rewards/") else key
            name = "format_rate" if name == "format_rate" else (f"reward/{name}" if key.startswith("rewards/") else name)
            row[name] = value
    return row


def make_metrics_logger(path: Path):
    """A ``TrainerCallback`` that appends each training log as one JSON line to ``path``."""
    from transformers import TrainerCallback

    from grpo_kit.guards import dumps_finite

    class MetricsLogger(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if not logs or not state.is_world_process_zero or "train_runtime" in logs:
                return
            row = {"step": state.global_step, **_clean(logs)}
            with open(path, "a", encoding="utf-8") as handle:
                handle.write(dumps_finite(row) + "\n")  # NaN/inf become null: metrics.jsonl stays valid JSON

    return MetricsLogger()


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """Rows of a ``metrics.jsonl`` (a torn last line from a killed run is ignored)."""
    rows = []
    path = Path(path)
    if not path.is_file():
        return rows
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def truncate_metrics(path: Path, last_step: int) -> None:
    """Drop rows logged after ``last_step`` (they will be logged again after a resume); atomic rewrite."""
    from grpo_kit.guards import dumps_finite

    rows = [row for row in read_metrics(path) if row.get("step", 0) <= last_step]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(dumps_finite(row) + "\n" for row in rows), encoding="utf-8")
    os.replace(tmp, path)


def reward_first_last(history: list[dict], window: int = 3, key: str = "reward") -> tuple[float | None, float | None]:
    """Mean of ``key`` over the first and the last ``window`` logged steps.

    >>> reward_first_last([{"reward": 0.0}, {"reward": 0.2}, {"reward": 0.8}, {"reward": 1.0}], window=2)
    (0.1, 0.9)
    """
    values = [row[key] for row in history if isinstance(row.get(key), (int, float))]
    if not values:
        return None, None
    window = max(1, min(window, len(values) // 2 or 1))
    return sum(values[:window]) / window, sum(values[-window:]) / window


# --------------------------------------------------------------------------------------------- checkpoints


def checkpoint_problem(folder: Path) -> str | None:
    """Why ``folder`` cannot be resumed from, or None when it is complete.

    Complete: a readable ``trainer_state.json``, adapter weights whose file opens, and the optimizer and scheduler
    state (``optimizer.pt``/``scheduler.pt``, or DeepSpeed's ``global_step*/`` folder). Without those, the Trainer
    would silently start a fresh optimizer and restart the learning-rate schedule.
    """
    from grpo_kit.guards import adapter_weights_problem

    state = folder / "trainer_state.json"
    if not state.is_file():
        return "no trainer_state.json (killed while saving?)"
    try:
        json.loads(state.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return "trainer_state.json is torn (not valid JSON)"
    weights = adapter_weights_problem(folder)
    if weights:
        return weights
    deepspeed = any(path.is_dir() for path in folder.glob("global_step*"))
    for name, what in (("optimizer.pt", "optimizer"), ("scheduler.pt", "learning-rate scheduler")):
        if not deepspeed and not (folder / name).is_file():
            return f"no {name} (the {what} state is missing)"
    return None


def is_complete_checkpoint(folder: Path) -> bool:
    """True when ``folder`` can be resumed from (see ``checkpoint_problem``)."""
    return checkpoint_problem(folder) is None


def _checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """``(step, folder)`` of every ``checkpoint-N`` folder, newest first."""
    found = []
    for folder in run_dir.glob("checkpoint-*"):
        suffix = folder.name.split("-", 1)[1]
        if folder.is_dir() and suffix.isdigit():
            found.append((int(suffix), folder))
    return sorted(found, reverse=True)


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The ``checkpoint-N`` with the highest N that is complete, or None."""
    for _, folder in _checkpoints(Path(run_dir)):
        if is_complete_checkpoint(folder):
            return folder
    return None


def resume_checkpoint(run_dir: Path, *, set_aside: bool) -> Path | None:
    """The checkpoint to resume from; newer, incomplete ones are reported loudly and, with ``set_aside``, renamed
    ``damaged-checkpoint-N`` (never deleted: the Trainer would write into them, and nothing in them is lost)."""
    import warnings

    skipped = []
    for _, folder in _checkpoints(run_dir):
        problem = checkpoint_problem(folder)
        if problem is None:
            if skipped:
                warnings.warn(
                    f"--resume: skipped {'; '.join(skipped)}. Resuming from {folder.name}, the newest complete one, "
                    "with its optimizer and learning-rate state.",
                    stacklevel=3,
                )
            return folder
        aside = _set_aside(folder) if set_aside else None
        skipped.append(f"{folder.name}: {problem}" + (f" (moved to {aside.name})" if aside else ""))
    return None


def _set_aside(folder: Path) -> Path:
    target = folder.with_name(f"damaged-{folder.name}")
    n = 1
    while target.exists():
        n += 1
        target = folder.with_name(f"damaged-{folder.name}.{n}")
    os.rename(folder, target)
    return target


#: Run folders whose lock this process took in ``train``; released when ``train`` returns or raises.
_HELD_LOCKS: list[Path] = []


def _releases_run_locks(function):
    """Decorator: release the run-folder locks ``function`` took, however it ends."""
    import functools

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        finally:
            if _HELD_LOCKS:  # guards imports transformers: never at import time (Unsloth must come first)
                from grpo_kit.guards import release_run_lock

                while _HELD_LOCKS:
                    release_run_lock(_HELD_LOCKS.pop())

    return wrapper


# --------------------------------------------------------------------------------------------- train


def prepare_dataset(preset, tokenizer, data: str = "gsm8k", dataset=None):
    """Load and format the training prompts for ``preset``. Returns ``(dataset, n_filtered)``."""
    from grpo_kit.data import format_for_grpo, load_gsm8k

    if dataset is None:
        dataset = load_gsm8k(data, split="train")
    if len(dataset) == 0:
        raise GrpoKitError(f"The training data '{data}' has no rows. Point --data at a file with question/answer rows.")
    return format_for_grpo(
        dataset,
        tokenizer,
        few_shot=preset.few_shot,
        prefill=preset.prefill,
        max_prompt_tokens=preset.max_prompt_length,
    )


def _is_secret(key: str) -> bool:
    """Keys whose values never go into run.json (``--set hub_token=...`` and the like)."""
    return any(word in key.lower() for word in ("token", "secret", "password", "api_key"))


def _run_info(preset, *, data: str, model: str, overrides: dict, reward_names: list[str]) -> dict:
    import peft
    import transformers
    import trl

    return {
        "preset": dataclasses.asdict(preset),
        "model": model,
        "data": data,
        "rewards": reward_names,
        "overrides": {k: ("***" if _is_secret(k) else v) for k, v in overrides.items()},
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "peft": peft.__version__},
    }


@_releases_run_locks
def train(
    preset,
    *,
    data: str = "gsm8k",
    dataset=None,
    model: str | None = None,
    rewards: str | list[str] | None = None,
    max_steps: int | None = None,
    output_dir: str | os.PathLike | None = None,
    resume: bool = False,
    overrides: dict[str, Any] | None = None,
    callbacks: tuple = (),
    curriculum=None,
    lenient: bool = False,
    show_completions: int = 0,
) -> TrainResult:
    """Train a GRPO LoRA adapter: ``preset`` recipe, ``data`` prompts, ``rewards`` by name. See the module docstring.

    ``rewards`` is a spec such as ``"correctness:2,format"`` (default: the preset's). ``dataset`` (a Dataset with
    question/answer columns) replaces ``data`` when given. ``resume=True`` continues from the latest complete
    checkpoint in ``output_dir``; without it, an existing non-empty run folder is refused rather than overwritten.
    ``curriculum`` (a ``grpo_kit.curriculum.Curriculum``) orders/filters the prompts by their offline scores.
    ``lenient=True`` skips bad data rows (counted, and announced with a warning) instead of stopping at the first.
    ``show_completions=N`` prints a few sampled completions with their reward scores every N steps (``grpo_kit.watch``).
    Under ``accelerate launch`` every process runs this function; only the main process writes the run files.
    """
    from grpo_kit import models
    from grpo_kit.rewards import parse_reward_spec
    from grpo_kit.vllm_server import check_weight_sync

    if rewards is not None:
        funcs, weights, names = parse_reward_spec(rewards)
        preset = dataclasses.replace(preset, rewards=tuple(zip(names, weights, strict=True)))
    else:
        funcs, weights, names = parse_reward_spec([f"{n}:{w}" for n, w in preset.rewards])
    if max_steps is not None:
        preset = dataclasses.replace(preset, max_steps=max_steps)
    preset, overrides = split_overrides(preset, coerce_overrides(preset, overrides or {}, config=False))
    check_weight_sync(preset)  # server mode + 4-bit weights cannot work: refused before anything loads
    # Before anything imports TRL/transformers/PEFT: Unsloth patches them (and rebinds trl.GRPOTrainer) at import.
    backend = models.prepare_backend(preset)
    overrides = coerce_overrides(preset, overrides)  # GRPOConfig fields: their types come from TRL, imported only now
    preset = models.without_missing_vllm(preset)  # no importable vLLM: one line, then plain generate (planned so)

    import trl

    from grpo_kit.compat import ensure_logprob_kernel
    from grpo_kit.data import load_gsm8k
    from grpo_kit.guards import NumericsGuard, check_dataset_size, guard_numerics, guard_rewards
    from grpo_kit.runtime import detect_device, set_torch_threads
    from grpo_kit.watch import CompletionSamples

    set_torch_threads()
    # TRL pings Hugging Face telemetry when a trainer starts, with HF_TOKEN in the request; users can opt back in.
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    ensure_logprob_kernel()  # TRL 1.15 on a machine without Triton (any CPU): see grpo_kit/compat.py
    if curriculum is not None:
        overrides = {**curriculum.config_overrides(), **overrides}  # no shuffling when the order matters
    check_device(preset, detect_device())  # settings are checked before any weights load
    run_dir = Path(output_dir or Path("runs") / f"{preset.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    config = build_grpo_config(preset, run_dir, overrides)
    source = data if dataset is None else "the dataset passed to train()"
    if dataset is None:  # an offline Hub or a bad file is reported before any weights load
        dataset = load_gsm8k(data, split="train", lenient=lenient)  # lenient: bad rows skipped, counted, warned
    check_dataset_size(len(dataset), config, source=source)
    if preset.vllm_server:  # a missing server is reported before any weights load
        from grpo_kit.vllm_server import check_server

        check_server(preset, model=model, wait=config.vllm_server_timeout)
    is_main = config.process_index == 0
    checkpoint = _prepare_run_dir(run_dir, resume, is_main=is_main)
    _wait_for_everyone(config)  # every process has checked the run folder before any process writes in it
    if checkpoint is not None and _checkpoint_step(checkpoint) >= preset.max_steps:
        return _finished_run(run_dir, checkpoint, is_main)  # the Trainer would run one step past max_steps

    policy, tokenizer = models.load_model(preset, model=model)
    if backend == "unsloth" and preset.vllm_colocated and getattr(policy, "vllm_engine", None) is None:
        # Unsloth's engine did not start and the model was loaded without it (load_model said why): generate
        # without vLLM rather than let TRL start an engine of its own.
        preset = dataclasses.replace(preset, use_vllm=False)
        config = build_grpo_config(preset, run_dir, overrides)
    train_set, n_long = prepare_dataset(preset, tokenizer, data, dataset)
    curriculum_report = None
    if curriculum is not None:
        train_set, curriculum_report = curriculum.apply(train_set)
    check_dataset_size(len(train_set), config, source=source, filtered=n_long, max_prompt_tokens=preset.max_prompt_length)
    metrics_path = run_dir / "metrics.jsonl"
    if checkpoint is not None and is_main:
        truncate_metrics(metrics_path, _checkpoint_step(checkpoint))
    info = _run_info(preset, data=data, model=model or preset.model, overrides=overrides, reward_names=names)
    info["curriculum"] = curriculum_report
    if is_main:
        (run_dir / "run.json").write_text(json.dumps(info, indent=2, default=str), encoding="utf-8")

    samples = CompletionSamples(every=show_completions)
    trainer = trl.GRPOTrainer(  # looked up now: on the Unsloth backend this is Unsloth's patched trainer
        model=policy,
        reward_funcs=guard_rewards(samples.wrap([*funcs, format_rate]), run_dir),
        args=config,
        train_dataset=train_set,
        processing_class=tokenizer,
        callbacks=[make_metrics_logger(metrics_path), NumericsGuard(run_dir), samples, *callbacks],
    )
    start = time.time()
    with guard_numerics(trainer, run_dir):  # NaN/inf loss, grad_norm or reward: a clear error naming the step
        trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)
    seconds = time.time() - start
    adapter_dir = _save_adapter(trainer, tokenizer, run_dir)
    if is_main:
        _check_saved_adapter(adapter_dir, run_dir, trainer.state.global_step)
    _write_rank_digest(trainer, run_dir)
    history = read_metrics(metrics_path)
    first, last = reward_first_last(history)
    return TrainResult(
        run_dir=run_dir,
        adapter_dir=adapter_dir,
        metrics_path=metrics_path,
        steps=trainer.state.global_step,
        seconds=seconds,
        reward_first=first,
        reward_last=last,
        history=history,
    )


def split_overrides(preset, overrides: dict[str, Any]):
    """Apply override keys that are preset fields to the preset (so its checks run and model loading sees them,
    e.g. ``use_vllm=false``); return ``(preset, remaining GRPOConfig overrides)``."""
    preset_fields = {f.name for f in dataclasses.fields(preset)}
    mine = {k: v for k, v in overrides.items() if k in preset_fields}
    rest = {k: v for k, v in overrides.items() if k not in preset_fields}
    return (dataclasses.replace(preset, **mine) if mine else preset), rest


def check_device(preset, device) -> None:
    """Refuse settings the machine cannot run, and warn when the VRAM planner expects the preset not to fit.

    Raises ``GrpoKitError`` for a GPU-only preset without a GPU and for bf16 on a card without bf16 (a T4).
    """
    import warnings

    from grpo_kit.planner import check_fits, needs_gpu

    if device.kind != "cuda" and needs_gpu(preset):
        raise GrpoKitError(check_fits(preset, device))
    if device.kind == "cuda" and preset.precision == "bf16" and not device.bf16:
        raise GrpoKitError(
            f"{device.name} has no bf16 support (a T4 or older card). Use fp16: pass precision='fp16' "
            "(--set precision=fp16) or the t4-16gb preset."
        )
    problem = check_fits(preset, device)
    if problem:
        warnings.warn(f"VRAM planner: {problem}", stacklevel=3)


def _checkpoint_step(checkpoint: Path) -> int:
    return int(checkpoint.name.split("-", 1)[1])


def _prepare_run_dir(run_dir: Path, resume: bool, *, is_main: bool = True) -> Path | None:
    """Lock and create the run folder; on resume return the checkpoint to continue from. Never deletes user data.

    Only the main process locks and sets damaged checkpoints aside (the others run on the same folder).
    """
    from grpo_kit.guards import LOCK_NAME, acquire_run_lock

    no_checkpoint = GrpoKitError(
        f"--resume: no complete checkpoint-N folder in {run_dir}. Check --output points at the run folder, "
        "or drop --resume to start a new run."
    )
    if resume and not run_dir.is_dir():
        raise no_checkpoint
    if is_main:
        acquire_run_lock(run_dir)  # a second process on this folder stops here, naming the first one's PID
        _HELD_LOCKS.append(run_dir)
    if resume:
        checkpoint = resume_checkpoint(run_dir, set_aside=is_main)
        if checkpoint is None:
            raise no_checkpoint
        return checkpoint
    if run_dir.exists() and any(item.name != LOCK_NAME for item in run_dir.iterdir()):
        raise GrpoKitError(
            f"Run folder {run_dir} already has files. Use --resume to continue it, or choose another --output."
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    return None


def _recorded_max_steps(run_dir: Path) -> int | None:
    """``max_steps`` of the run as first started (``run.json``): ``--resume`` without ``--max-steps`` finishes that
    run rather than running on to the preset's default length."""
    try:
        value = json.loads((run_dir / "run.json").read_text(encoding="utf-8"))["preset"]["max_steps"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return value if isinstance(value, int) and value > 0 else None


def _finished_run(run_dir: Path, checkpoint: Path, is_main: bool) -> TrainResult:
    """The result of a run that already reached ``max_steps``: nothing trains, nothing is rewritten.

    Only when the final adapter is missing (killed between the last checkpoint and the adapter write) is it
    written, from that checkpoint's adapter files.
    """
    adapter = run_dir / "adapter"
    if is_main and not (adapter / "adapter_config.json").is_file():
        staging = run_dir / ".adapter.tmp"
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(checkpoint, staging, ignore=shutil.ignore_patterns(
            "optimizer.pt", "scheduler.pt", "rng_state*", "trainer_state.json", "training_args.bin", "global_step*"))
        os.rename(staging, adapter)
    metrics_path = run_dir / "metrics.jsonl"
    history = read_metrics(metrics_path)
    first, last = reward_first_last(history)
    return TrainResult(run_dir=run_dir, adapter_dir=adapter, metrics_path=metrics_path, steps=_checkpoint_step(checkpoint),
                       seconds=0.0, reward_first=first, reward_last=last, history=history, already_finished=True)


def _check_saved_adapter(adapter_dir: Path, run_dir: Path, step: int) -> None:
    """A run is done only when its adapter is finite: NaN/inf weights are moved to ``adapter.nonfinite`` and reported.

    The logged loss of the last step is computed before that step's update, so the NumericsGuard cannot see an
    update that broke the weights (an inf learning rate does exactly that).
    """
    from grpo_kit.guards import NumericsError, non_finite_tensors, numerics_message

    bad = non_finite_tensors(adapter_dir)
    if not bad:
        return
    aside = run_dir / "adapter.nonfinite"
    shutil.rmtree(aside, ignore_errors=True)
    os.rename(adapter_dir, aside)
    raise NumericsError(
        numerics_message(step, "the final adapter", f"NaN/inf in {len(bad)} tensor(s)", run_dir, checkpoint_is_clean=False)
        + f" The broken adapter was moved to {aside}.",
        step=step,
        metric="adapter",
        value=bad[0],
    )


def _save_adapter(trainer, tokenizer, run_dir: Path) -> Path:
    """Write the final adapter to ``run_dir/adapter`` via a temporary folder, so it is never half-written.

    Every process calls ``save_model`` (DeepSpeed ZeRO-3 gathers the weights collectively); only the main one writes.
    """
    final = run_dir / "adapter"
    staging = run_dir / ".adapter.tmp"
    is_main = trainer.is_world_process_zero()
    if is_main:
        shutil.rmtree(staging, ignore_errors=True)
    trainer.accelerator.wait_for_everyone()
    trainer.save_model(str(staging))
    if is_main:
        tokenizer.save_pretrained(str(staging))
        if final.exists():
            old = run_dir / ".adapter.old"
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
            os.rename(staging, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(staging, final)
    trainer.accelerator.wait_for_everyone()
    return final


def _wait_for_everyone(config) -> None:
    """A barrier across the processes of ``accelerate launch``/``torchrun``; nothing in a single process."""
    state = getattr(config, "distributed_state", None)
    if state is not None:
        state.wait_for_everyone()


#: Set to "1" to make every process write ``rank-<i>.digest`` (SHA-256 of its LoRA weights) into the run folder
#: after training: equal files prove the data-parallel copies stayed identical (tests/test_scaling.py checks it).
RANK_DIGEST_ENV = "GRPO_KIT_RANK_DIGEST"


def weights_digest(tensors: dict) -> str:
    """SHA-256 over each tensor's name and float32 bytes, in name order: equal digests mean equal weights."""
    import hashlib

    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode("utf-8"))
        digest.update(tensors[name].detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _write_rank_digest(trainer, run_dir: Path) -> None:
    if os.environ.get(RANK_DIGEST_ENV) != "1":
        return
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(trainer.accelerator.unwrap_model(trainer.model))  # the adapter file's keys
    (run_dir / f"rank-{trainer.args.process_index}.digest").write_text(weights_digest(state), encoding="utf-8")


# --------------------------------------------------------------------------------------------- CLI


def cli_train(args) -> int:
    """``grpo-kit train``: resolve the preset, train, print the summary and draw the curves."""
    from grpo_kit.plots import plot_metrics
    from grpo_kit.presets import auto_preset, get_preset

    if args.preset == "auto":
        preset, reason = auto_preset()
        print(f"preset: {preset.name} ({reason})")
    else:
        preset = get_preset(args.preset)
    if args.model:
        preset = dataclasses.replace(preset, model=args.model)
    knobs = {
        "loss_type": args.loss_type,
        "beta": args.beta,
        "num_generations": args.num_generations,
        "temperature": args.temperature,
        "learning_rate": args.learning_rate,
        "seed": args.seed,
    }
    preset = dataclasses.replace(preset, **{k: v for k, v in knobs.items() if v is not None})
    if getattr(args, "backend", None):
        preset = dataclasses.replace(preset, backend=args.backend)
    if getattr(args, "vllm_server", None) and getattr(args, "no_vllm", False):
        raise GrpoKitError("--vllm-server generates with vLLM and --no-vllm turns vLLM off: pass one of them.")
    if getattr(args, "vllm_server", None):
        preset = dataclasses.replace(preset, use_vllm=True, vllm_mode="server", vllm_server_base_url=args.vllm_server)
    if getattr(args, "no_vllm", False):
        preset = dataclasses.replace(preset, use_vllm=False)
    max_steps = args.max_steps
    if max_steps is None and args.resume and args.output:  # the run as started, not the preset's default length
        max_steps = _recorded_max_steps(Path(args.output))
    result = train(
        preset,
        data=args.data,
        rewards=args.rewards,
        max_steps=max_steps,
        output_dir=args.output,
        resume=args.resume,
        overrides=parse_overrides(args.set),
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
    from grpo_kit.curriculum import Curriculum

    return Curriculum(args.curriculum, order=order or "entropy", zero_variance=zero_variance or "keep")


def _is_main_process() -> bool:
    from accelerate import PartialState

    return PartialState().is_main_process
