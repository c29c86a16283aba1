"""What keeps a run safe and visible, as trainer callbacks and reward wrappers that ``train`` and notebook 00 plug in.

TRL 1.x is forgiving where a run should stop: it reads a NaN reward as "not applicable" (``nansum``, advantages
``nan_to_num``), transformers' ``logging_nan_inf_filter`` hides a NaN loss, and a dataset smaller than one generation
batch trains **zero** steps. So each reward's scores are checked as they are produced (``guard_rewards``), a log
with a NaN/inf stops the run from ``on_log``, i.e. before that step's checkpoint is written, so the last checkpoint on
disk is the last good one (``NumericsGuard``), and a run is done only when its adapter is finite.

>>> non_finite({"loss": float("nan"), "grad_norm": 1.0, "rewards/format/mean": float("inf"), "epoch": 0.1})
[('loss', nan), ('reward/format', inf)]
"""

from __future__ import annotations

import math
import os
import traceback
from pathlib import Path
from typing import Any

from transformers import TrainerCallback, TrainerState

from grpo_kit.doctor import Doctor
from grpo_kit.errors import GrpoKitError
from grpo_kit.rewards import completion_text
from grpo_kit.runs import Run, disk_full, history_rows, numerics_error, resume_hint


def is_finite_number(value: Any) -> bool:
    """True for a real number that is not NaN or ±inf; None, bools and text are False."""
    try:
        return not isinstance(value, (bool, str, bytes)) and math.isfinite(float(value))
    except (TypeError, ValueError, OverflowError):  # None, an int too large for a float, a list
        return False


def non_finite(logs: dict[str, Any]) -> list[tuple[str, Any]]:
    """``(name, value)`` of each NaN/inf ``loss``, ``grad_norm``, ``reward`` or ``rewards/<name>/mean`` in a log."""
    bad = []
    for key, value in logs.items():
        name = "reward/" + key[8:-5] if key.startswith("rewards/") and key.endswith("/mean") else key
        # a value that is not a float (text) is not looked at
        if (name in ("loss", "grad_norm", "reward") or name.startswith("reward/")) and isinstance(value, float):
            if not math.isfinite(value):
                bad.append((name, value))
    return bad


# --------------------------------------------------------------------------------------------- rewards


class GuardedReward:
    """A reward function as TRL calls it, watched: an exception or a NaN/inf score stops the run with a message naming
    the reward, the step and the completion (``None`` passes: TRL's "not applicable").
    Same name as ``fn`` for TRL's logs (``rewards/<name>/mean``); picklable when ``fn`` is."""

    def __init__(self, fn, run_dir: str | os.PathLike | None = None, when: str | None = None):
        from trl.trainer.utils import get_callable_name

        self.fn, self.run_dir, self.__name__ = fn, run_dir, get_callable_name(fn)
        self.when = when  # where a failure happened, for a call outside training ("on a test call ...")

    def __call__(self, *args, **kwargs):
        state, completions = kwargs.get("trainer_state"), kwargs.get("completions", args[0] if args else None) or []
        step = state.global_step + 1 if state else None
        where = self.when or f"at step {step or '?'}"
        try:
            scores = self.fn(*args, **kwargs)
            if len(scores) != len(completions):
                raise ValueError(f"it returned {len(scores)} scores for {len(completions)} completions")
        except Exception as error:  # user code: one clear message, the traceback kept in the run folder
            frame = traceback.extract_tb(error.__traceback__)[-1]  # the line of the user's code that raised
            saved = f" ({Path(frame.filename).name}, line {frame.lineno})"
            if self.run_dir is not None and Path(self.run_dir).is_dir():
                path = Path(self.run_dir) / "reward-error.txt"
                path.write_text("".join(traceback.format_exception(error)), encoding="utf-8")
                saved += f". Full traceback: {path}"
            first = _excerpt(completion_text(completions[0])) if completions else "n/a"
            raise GrpoKitError(
                f"The reward function '{self.__name__}' raised {type(error).__name__}: "
                f"{str(error)[:200]} {where} (first completion of the batch: {first!r}){saved}. Fix the "
                "function (it must return one float or None per completion, for any text) or leave it out "
                f"of reward_funcs.{resume_hint(self.run_dir)}"
            ) from error
        for index, score in enumerate(scores):
            if isinstance(score, bool):  # TRL would take True for 1.0; a reward is a number, said as such
                raise GrpoKitError(
                    f"The reward function '{self.__name__}' returned {score} (a bool, not a number) for completion "
                    f"{index} {where}. Return a float per completion, e.g. 1.0 if ... else 0.0, or float(...)."
                    + resume_hint(self.run_dir)
                )
            if score is not None and not is_finite_number(score):
                text = _excerpt(completion_text(completions[index]))
                raise numerics_error(
                    step,
                    f"reward/{self.__name__}",
                    score,
                    self.run_dir,
                    where=where,
                    detail=f" (completion {index}: {text!r})",
                )
        return scores


def check_rewards(funcs, row: dict, tokenizer) -> None:
    """Call each plain reward function once, as TRL will, on made-up completions of one training prompt (a right
    answer, no tags, an empty text): a reward that raises or returns NaN fails now, before any weights load, not
    after an 8B model has loaded and generated for minutes."""
    texts = ["<think>\n2 + 2 = 4\n</think>\n<answer>4</answer>", "I do not know.", ""]
    completions = [[{"role": "assistant", "content": t}] for t in texts] if isinstance(row["prompt"], list) else texts
    columns = {key: [value] * len(texts) for key, value in row.items() if key != "prompt"}
    for fn in guard_rewards(funcs):
        if isinstance(fn, GuardedReward):  # reward models and async functions are left to TRL
            GuardedReward(fn.fn, when="on a test call before any weights loaded")(
                prompts=[row["prompt"]] * len(texts),
                completions=completions,
                trainer_state=TrainerState(),
                completion_ids=tokenizer(texts, add_special_tokens=False)["input_ids"],
                log_extra=lambda *args, **kwargs: None,
                log_metric=lambda *args, **kwargs: None,
                **columns,
            )


def guard_rewards(funcs, run_dir: str | os.PathLike | None = None) -> list:
    """Each plain reward function as a ``GuardedReward``; reward models (``nn.Module``) and async functions, which
    TRL calls differently, pass unchanged."""
    import torch
    from trl.trainer.utils import is_async_callable

    return [
        GuardedReward(fn, run_dir)
        if callable(fn) and not isinstance(fn, (torch.nn.Module, GuardedReward)) and not is_async_callable(fn)
        else fn
        for fn in funcs
    ]


# --------------------------------------------------------------------------------------------- trainer callbacks


class NumericsGuard(TrainerCallback):
    """Stop training with a ``NumericsError`` when a log has a NaN/inf loss, grad_norm or reward.

    Under fp16 a non-finite grad_norm with a finite loss is the loss scaler at work: it skips the step (the weights
    stay as they were) and halves its scale. PyTorch's ``GradScaler`` starts at 2**16, so a healthy run can skip up to
    16 steps in a row before its first finite grad_norm (a T4's first steps); after that, 3 in a row stop the run.
    """

    #: fp16: the most non-finite grad_norm logs in a row before the first finite one (16 halvings of 2**16, then 1).
    FP16_START = 17

    def __init__(self, run_dir: str | os.PathLike | None = None):
        self.run_dir, self.bad_grad_norms, self.scaler_settled = run_dir, 0, False

    def on_log(self, args, state, control, logs, **kwargs):  # the Trainer passes every log
        bad = non_finite(logs)
        grad = [item for item in bad if item[0] == "grad_norm"]
        self.bad_grad_norms = self.bad_grad_norms + 1 if grad else 0
        self.scaler_settled = self.scaler_settled or ("grad_norm" in logs and not grad)
        patience = (3 if self.scaler_settled else self.FP16_START) if args.fp16 else 1
        fatal = [item for item in bad if item[0] != "grad_norm"] + (grad if self.bad_grad_norms >= patience else [])
        if fatal:
            raise numerics_error(state.global_step, *fatal[0], self.run_dir)


class ScheduleToMaxSteps(TrainerCallback):
    """On resume, the learning rate of the next step comes from the schedule for *this* run's ``max_steps``.

    The Trainer restores the optimizer with the learning rate it had when the checkpoint was written. For a run killed
    midway that is right; for a finished run extended with ``--set max_steps=M`` it is the end of the old schedule (0
    for a linear decay), so the first added steps would not train. Here the rate is recomputed from the schedule the
    Trainer built for M steps, at the resumed step: an extended run continues as if it had been planned for M steps.
    """

    def on_train_begin(self, args, state, control, optimizer=None, lr_scheduler=None, **kwargs):
        if not state.global_step or not hasattr(lr_scheduler, "lr_lambdas"):  # a fresh run; not a LambdaLR schedule
            return
        for group, base, rate in zip(
            optimizer.param_groups, lr_scheduler.base_lrs, lr_scheduler.lr_lambdas, strict=True
        ):
            group["lr"] = base * rate(lr_scheduler.last_epoch)
        # what the Trainer logs as learning_rate
        lr_scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


class TrainingRun(Run, TrainerCallback):
    """A run folder being trained (``TrainingRun.open``, as ``runs.Run.open``), and the trainer callback that records
    it: its ``run.json`` as training begins, and its history, the Trainer's ``log_history`` (restored with a checkpoint:
    what a killed run logged after it is gone), as ``metrics.jsonl`` after each log (``runs.history_rows``: the plots,
    the doctor and resume read it).

    ``GRPOTrainer(callbacks=run.callbacks)`` gets it with the numerics guard, the resumed schedule and the run doctor.
    ``with TrainingRun.open(...) as run:`` around the trainer, its training and the save releases the lock at the end,
    and makes CUDA running out of memory, sampling from NaN/inf weights (a ``NumericsError``) and a full disk
    (``runs.disk_full``) errors that name the settings to change and the checkpoint to resume from.
    """

    state = None  # the Trainer's state once training began: the step an error stopped at

    @property
    def callbacks(self):
        return [self, NumericsGuard(self.dir), ScheduleToMaxSteps(), Doctor(self.dir)]

    def __enter__(self):
        return self

    def __exit__(self, kind, error, tb):
        import torch

        self.close()
        step = self.state.global_step if self.state else self.resumed_from or 0
        if isinstance(error, torch.OutOfMemoryError):
            where = f"at step {step + 1}" if self.state else "before the first step (loading the model or the trainer)"
            raise GrpoKitError(
                f"The GPU ran out of memory {where} ({str(error).splitlines()[0][:160]}). A resume may "
                "lower what does not change the run: a smaller vLLM share (--set vllm_gpu_memory_utilization=0.4) or "
                "--set gradient_checkpointing=true. Otherwise train a new run (another --output) that needs less: "
                "shorter completions (--set max_completion_length=N), fewer completions per forward pass (--set "
                "per_device_train_batch_size=1 with a larger gradient_accumulation_steps), a smaller group (--set "
                "num_generations=N), or a smaller recipe/model; `grpo-kit presets --plan NAME` shows the estimate "
                "(docs/VRAM.md)." + resume_hint(self.dir)
            ) from error
        if isinstance(error, RuntimeError) and any(  # torch.multinomial and friends on NaN/inf probabilities
            m in str(error).lower() for m in ("probability tensor contains either", "contains nan", "contains inf")
        ):
            raise numerics_error(
                step + 1,
                "the model's output (sampling probabilities)",
                "NaN/inf",
                self.dir,
                detail=" Weights can overflow while finite: if --resume fails the same way, move "
                "the newest checkpoint out of the run folder and resume from the one before.",
            ) from error
        if error and (full := disk_full(error, self.dir, step)):
            raise full from None

    def on_train_begin(self, args, state, control, **kwargs):
        self.state = state
        if state.is_world_process_zero:
            self.record()
            self.on_log(args, state, control)  # a resumed run's history as far as its checkpoint

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero:
            self.write_history(history_rows(state.log_history))


def _excerpt(text: str, length: int = 80) -> str:
    """The start of ``text`` on one line for an error message, newlines shown as ``⏎``.

    >>> _excerpt("x" * 50 + "<answer>4</answer>", length=5)
    'xxxxx …'
    """
    flat = text.replace("\n", "⏎")
    return flat if len(flat) <= length + 2 else flat[:length] + " …"
