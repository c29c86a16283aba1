"""Run guards: stop a training run on NaN/inf numbers, and refuse a dataset too small for one optimizer step.

TRL 1.x is forgiving where a run should stop. It turns a reward of ``None`` *or NaN* into "not applicable"
(``nansum``/``nanmean``, advantages ``nan_to_num``), so a reward function that breaks trains on silently with zero
advantages; transformers' ``logging_nan_inf_filter`` hides a NaN loss in the logs; and a dataset with fewer prompts
than one generation batch makes TRL run **zero** steps and save an untrained adapter. The kit adds three checks:

- ``guard_rewards(funcs)``: each reward's output is checked as it is produced; a NaN/inf raises ``NumericsError``
  naming the reward, the step and the completion (``None`` keeps TRL's meaning: "not applicable").
- ``NumericsGuard``: a ``TrainerCallback`` that checks every log (``loss``, ``grad_norm``, ``reward``,
  ``rewards/<name>/mean``). The error is raised from ``on_log``, i.e. *before* that step's checkpoint is written,
  so the last checkpoint on disk is the last good one; the message names it.
- ``guard_numerics(trainer, run_dir)``: a context manager that turns the errors broken weights cause inside
  generation ("probability tensor contains either inf, nan or element < 0") into the same ``NumericsError``.

>>> non_finite({"loss": float("nan"), "grad_norm": 1.0, "rewards/format/mean": float("inf"), "epoch": 0.1})
[('loss', nan), ('reward/format', inf)]

fp16 (a T4) is a special case for ``grad_norm``: its loss scaler *expects* the occasional inf gradient and skips that
step, so ``grad_norm`` must be non-finite on ``grad_norm_patience`` consecutive logs (default 3) before the run stops.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from grpo_kit.errors import GrpoKitError
from grpo_kit.machinery.runs import ADAPTER_WEIGHTS, adapter_weights_problem, latest_checkpoint

#: Logged metrics that must stay finite (plus every ``rewards/<name>/mean``).
CHECKED = ("loss", "grad_norm", "reward")
#: Consecutive non-finite ``grad_norm`` logs tolerated under fp16 loss scaling before the run stops.
FP16_GRAD_NORM_PATIENCE = 3
#: Text of the errors sampling raises when the model's logits are NaN/inf (torch.multinomial and friends).
_SAMPLING_NAN = ("probability tensor contains either", "contains nan", "contains inf")


class NumericsError(GrpoKitError):
    """A NaN/inf showed up during training. ``step`` is the optimizer step (1-based), ``metric`` what was bad."""

    def __init__(self, message: str, *, step: int | None, metric: str, value: Any = None):
        super().__init__(message)
        self.step = step
        self.metric = metric
        self.value = value


# --------------------------------------------------------------------------------------------- pure checks


def is_finite_number(value: Any) -> bool:
    """True for a real number that is not NaN or ±inf (ints, floats, numpy/torch scalars); None and text are False.

    >>> [is_finite_number(v) for v in (1, 0.5, float("nan"), float("-inf"), None, "1", True)]
    [True, True, False, False, False, False, False]
    """
    if isinstance(value, (bool, str, bytes)) or value is None:
        return False
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError, OverflowError):
        return False


def non_finite(logs: dict[str, Any]) -> list[tuple[str, Any]]:
    """``(name, value)`` for each checked metric in a Trainer log that is NaN/inf; rewards are named ``reward/<name>``.

    Metrics that are absent or not numbers (e.g. text) are ignored; only the checked names are looked at.
    """
    bad = []
    for key, value in logs.items():
        if key in CHECKED:
            name = key
        elif key.startswith("rewards/") and key.endswith("/mean"):
            name = "reward/" + key[len("rewards/") : -len("/mean")]
        else:
            continue
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isfinite(value):
            bad.append((name, value))
    return bad


def _checkpoint_hint(run_dir: str | os.PathLike | None, checkpoint_is_clean: bool) -> str:
    if run_dir is None:
        return ""
    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is None:
        return f" No complete checkpoint was written in {run_dir} yet, so the run has to start again."
    resume = f"`grpo-kit train ... --output {run_dir} --resume` (or train(..., resume=True))"
    if checkpoint_is_clean:
        return f" The last complete checkpoint, {checkpoint}, was written before the problem: after the fix, continue with {resume}."
    return (
        f" The last complete checkpoint is {checkpoint}, but the weights may have broken in the update it holds: after "
        f"the fix, continue with {resume}; if that fails the same way, move that checkpoint folder out of {run_dir} "
        "and resume from the one before."
    )


def numerics_message(
    step: int | None, metric: str, value: Any, run_dir: str | os.PathLike | None, *, checkpoint_is_clean: bool = True
) -> str:
    """The ``NumericsError`` text: what was bad at which step, what to change, and where to resume from.

    ``checkpoint_is_clean``: False when the bad value may come from weights that the last checkpoint already holds.
    """
    where = f"at step {step}" if step is not None else "during training"
    if metric.startswith("reward/"):
        fix = (
            f"The reward function '{metric.split('/', 1)[1]}' returned {value}; rewards must be finite floats "
            "(return None for 'not applicable'). Fix the reward, or leave it out of the recipe's rewards (--set rewards=...)."
        )
    else:
        fix = (
            "The weights or the loss overflowed. Lower the learning rate (--set learning_rate=..., e.g. by 10x), keep "
            "gradient clipping on (max_grad_norm, e.g. --set max_grad_norm=0.1), and on a T4 (fp16) shorten "
            "completions or use a bf16 card; on CPU the 'cpu' preset trains in fp32."
        )
    return (
        f"Training stopped: {metric} is {value} {where}. GRPO cannot learn from NaN/inf, so the run was stopped "
        f"instead of training on silently (nothing from this step was saved). {fix}"
        + _checkpoint_hint(run_dir, checkpoint_is_clean)
    )


# --------------------------------------------------------------------------------------------- rewards


class CheckedReward:
    """A reward function whose every score is checked: NaN/inf raises ``NumericsError`` (None passes through).

    Keeps the wrapped function's ``__name__`` (TRL logs ``rewards/<__name__>/mean``) and is picklable when the
    wrapped function is.

    >>> def half(completions, **kwargs):
    ...     return [0.5 for _ in completions]
    >>> CheckedReward(half)(["a", "b"]), CheckedReward(half).__name__
    ([0.5, 0.5], 'half')
    """

    def __init__(self, fn, run_dir: str | os.PathLike | None = None):
        self.fn = fn
        self.run_dir = run_dir
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)
        self.__doc__ = getattr(fn, "__doc__", None)

    def __call__(self, *args, **kwargs):
        scores = self.fn(*args, **kwargs)
        for index, score in enumerate(scores):
            if score is not None and not is_finite_number(score):
                state = kwargs.get("trainer_state")
                step = state.global_step + 1 if state is not None else None
                completions = kwargs.get("completions", args[0] if args else None)
                raise NumericsError(
                    numerics_message(step, f"reward/{self.__name__}", score, self.run_dir)
                    + f" (completion {index}: {_preview(completions, index)})",
                    step=step,
                    metric=f"reward/{self.__name__}",
                    value=score,
                )
        return scores


def _preview(completions, index: int, limit: int = 80) -> str:
    try:
        item = completions[index]
        text = item[-1]["content"] if isinstance(item, list) else str(item)
    except (TypeError, IndexError, KeyError):
        return "n/a"
    return repr(text[:limit] + ("..." if len(text) > limit else ""))


def guard_rewards(funcs, run_dir: str | os.PathLike | None = None) -> list:
    """Wrap each plain (synchronous) reward function in ``CheckedReward``; other reward kinds pass unchanged.

    Async functions and reward *models* (``nn.Module``) are left as they are: TRL treats them differently.
    """
    import torch
    from trl.trainer.utils import is_async_callable

    out = []
    for fn in funcs:
        plain = callable(fn) and not isinstance(fn, (torch.nn.Module, CheckedReward)) and not is_async_callable(fn)
        out.append(CheckedReward(fn, run_dir) if plain else fn)
    return out


# --------------------------------------------------------------------------------------------- trainer


class NumericsGuard(TrainerCallback):
    """Stop training with a ``NumericsError`` when a log has a NaN/inf loss, grad_norm or reward.

    ``grad_norm_patience``: consecutive non-finite ``grad_norm`` logs allowed; None means
    ``FP16_GRAD_NORM_PATIENCE`` under fp16 (the loss scaler skips such steps on purpose) and 1 otherwise.
    """

    def __init__(self, run_dir: str | os.PathLike | None = None, grad_norm_patience: int | None = None):
        self.run_dir = run_dir
        self.grad_norm_patience = grad_norm_patience
        self.bad_grad_norms = 0

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs:
            return
        bad = non_finite(logs)
        grad = [item for item in bad if item[0] == "grad_norm"]
        self.bad_grad_norms = self.bad_grad_norms + 1 if grad else 0
        patience = self.grad_norm_patience or (FP16_GRAD_NORM_PATIENCE if getattr(args, "fp16", False) else 1)
        fatal = [item for item in bad if item[0] != "grad_norm"] + (grad if self.bad_grad_norms >= patience else [])
        if fatal:
            metric, value = fatal[0]
            raise NumericsError(
                numerics_message(state.global_step, metric, value, self.run_dir),
                step=state.global_step,
                metric=metric,
                value=value,
            )


def is_sampling_nan_error(error: BaseException) -> bool:
    """True for the errors sampling raises on NaN/inf probabilities (the model's weights went non-finite).

    >>> is_sampling_nan_error(RuntimeError("probability tensor contains either `inf`, `nan` or element < 0"))
    True
    """
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(marker in text for marker in _SAMPLING_NAN)


@contextlib.contextmanager
def guard_numerics(trainer, run_dir: str | os.PathLike | None = None):
    """Around ``trainer.train()``: the two mid-run failures a user can act on get a message instead of a traceback.

    A sampling error caused by NaN/inf weights becomes a ``NumericsError``; CUDA running out of memory becomes a
    ``GrpoKitError`` listing the settings that lower memory and the checkpoint to resume from.
    """
    import torch

    try:
        yield
    except torch.OutOfMemoryError as error:
        raise GrpoKitError(oom_message(trainer.state.global_step + 1, error, run_dir)) from error
    except RuntimeError as error:
        if not is_sampling_nan_error(error):
            raise
        step = trainer.state.global_step + 1  # the step whose generation failed
        raise NumericsError(
            numerics_message(step, "the model's output (sampling probabilities)", "NaN/inf", run_dir,
                             checkpoint_is_clean=False),
            step=step,
            metric="sampling",
            value=str(error).splitlines()[0],
        ) from error


def oom_message(step: int, error: BaseException, run_dir: str | os.PathLike | None) -> str:
    """What to change when the GPU ran out of memory mid-run (the VRAM planner's estimate was too optimistic)."""
    return (
        f"The GPU ran out of memory at step {step} ({str(error).splitlines()[0][:160]}). Lower the memory a step "
        "needs: shorter completions (--set max_completion_length=N), fewer completions per forward pass "
        "(--set per_device_train_batch_size=1 with a larger gradient_accumulation_steps), a smaller group "
        "(--set num_generations=N), a smaller vLLM share (--set vllm_gpu_memory_utilization=0.4), or a smaller preset/model; "
        "`grpo-kit presets --plan NAME` shows the estimate (docs/VRAM.md)." + _checkpoint_hint(run_dir, True)
    )


# --------------------------------------------------------------------------------------------- data size


def check_dataset_size(
    n_prompts: int,
    config,
    *,
    source: str,
    filtered: int = 0,
    max_prompt_tokens: int | None = None,
) -> None:
    """Refuse a dataset that cannot fill one optimizer step (TRL would run 0 steps); warn about dropped prompts.

    ``config`` is the run's ``GRPOConfig``. The prompts one step needs are counted from it rather than from the
    recipe's ``prompts_per_step``: TRL's generation batch also spans every process (and may be set directly), and
    its ``RepeatSampler`` drops an incomplete batch, so fewer prompts than this yield no step at all.
    """
    needed = config.generation_batch_size // config.num_generations
    dropped = ""
    if filtered:
        dropped = f" after dropping {filtered} prompt(s) longer than max_prompt_length={max_prompt_tokens} tokens"
    if n_prompts < needed:
        raise GrpoKitError(
            f"The training data '{source}' has {n_prompts} usable prompt(s){dropped}, but one optimizer step needs "
            f"{needed} distinct prompts (generation batch {config.generation_batch_size} = "
            f"per_device_train_batch_size {config.per_device_train_batch_size} x gradient_accumulation_steps "
            f"{config.gradient_accumulation_steps}, in groups of num_generations={config.num_generations}); TRL would "
            "train 0 steps. Use more data (--data sample has 50 questions, --data arithmetic 256), or lower "
            "--set per_device_train_batch_size / gradient_accumulation_steps"
            + (", or raise --set max_prompt_length" if filtered else "")
            + "."
        )
    if filtered:
        warnings.warn(
            f"{source}: {filtered} prompt(s) longer than max_prompt_length={max_prompt_tokens} tokens were left out "
            f"of training ({n_prompts} kept). Raise max_prompt_length (--set max_prompt_length=N) to keep them.",
            stacklevel=2,
        )



# --------------------------------------------------------------------------------------------- JSON and adapters


def json_safe(value: Any) -> Any:
    """``value`` with every NaN/±inf float replaced by None, so ``json.dumps(..., allow_nan=False)`` writes valid JSON.

    Python's ``json`` writes ``NaN``/``Infinity`` by default, which no other JSON reader accepts.

    >>> json_safe({"loss": float("nan"), "rows": [1.5, float("inf")], "name": "x"})
    {'loss': None, 'rows': [1.5, None], 'name': 'x'}
    """
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    return value


def dumps_finite(value: Any, **kwargs) -> str:
    """``json.dumps`` that never writes ``NaN``/``Infinity`` (they become ``null``)."""
    import json

    return json.dumps(json_safe(value), allow_nan=False, **kwargs)


#: The weights file PEFT writes into an adapter folder (and the Trainer into each checkpoint).


def non_finite_tensors(adapter_dir: str | os.PathLike) -> list[str]:
    """Names of the adapter's tensors that hold a NaN or ±inf value (the file must be readable)."""
    import torch
    from safetensors.torch import load_file

    tensors = load_file(str(Path(adapter_dir) / ADAPTER_WEIGHTS))
    return sorted(name for name, tensor in tensors.items() if not bool(torch.isfinite(tensor.float()).all()))


def check_adapter(adapter_dir: str | os.PathLike, *, use: str) -> None:
    """Refuse an adapter whose weights file is unreadable or holds NaN/inf values; ``use`` says what was asked.

    A NaN adapter would otherwise be exported and "verified" (NaN compares false with any limit) or evaluated
    as if it were a model.
    """
    problem = adapter_weights_problem(adapter_dir)
    if problem:
        raise GrpoKitError(
            f"Cannot {use}: {problem}. Use another checkpoint-N folder of the run, or train again."
        )
    bad = non_finite_tensors(adapter_dir)
    if bad:
        raise GrpoKitError(
            f"Cannot {use}: the adapter in {adapter_dir} has NaN/inf weights ({len(bad)} tensor(s), e.g. {bad[0]}); "
            "training diverged. Use an earlier checkpoint-N folder of the run, or train again with a lower "
            "--set learning_rate=..."
        )


def adapter_base_message(adapter_dir: str | os.PathLike, base: str, error: BaseException) -> str:
    """The message for an adapter that does not fit ``base`` (PEFT's size-mismatch RuntimeError)."""
    import json

    try:
        config = json.loads((Path(adapter_dir) / "adapter_config.json").read_text(encoding="utf-8"))
        expected = config.get("base_model_name_or_path") or "(not recorded)"
    except (OSError, ValueError):
        expected = "(adapter_config.json unreadable)"
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    detail = next((line for line in lines if "size mismatch" in line), lines[0] if lines else "")
    return (
        f"The adapter in {adapter_dir} does not fit the model {base}: it was trained on {expected} "
        f"(adapter_config.json, base_model_name_or_path). Pass that model as --model. ({detail[:200]})"
    )


# --------------------------------------------------------------------------------------------- run folder lock


def check_saved_adapter(adapter_dir: Path, run_dir: Path, step: int) -> None:
    """A run is done only when its adapter is finite: NaN/inf weights are moved to ``adapter.nonfinite`` and reported.

    The logged loss of the last step is computed before that step's update, so the NumericsGuard cannot see an
    update that broke the weights (an inf learning rate does exactly that).
    """
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
