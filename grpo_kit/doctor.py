"""The run doctor: why GRPO is not learning, said while the run trains, from what TRL logs at each step.

Each check reads the logged rows so far (``metrics.jsonl``'s, or the trainer's logs) and names a finding once, with
its step and the fix. The ``Doctor`` callback says them as they come (printed, in ``doctor.jsonl``, and as Trackio
alerts when the run reports to Trackio); ``diagnose`` replays a whole log (``train``'s summary, ``grpo-kit doctor``,
the model card). A finding is advice: the doctor never stops a run (NaN/inf do: ``callbacks.NumericsGuard``).
The windows are measured: silent on the shipped recipes' normal runs, each broken run found (tests/test_doctor.py).

>>> [f["check"] for f in diagnose([{"step": s, "reward": 0.0, "frac_reward_zero_std": 1.0} for s in (1, 2, 3)])]
['beta-0', 'no-signal']
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from transformers import TrainerCallback

from grpo_kit import runs
from grpo_kit.errors import GrpoKitError
from grpo_kit.files import write_jsonl

#: Logged steps in a row a condition must hold before it is a finding; the flat-reward check compares two windows.
PATIENCE, WINDOW = 3, 10
#: Entropy collapsing: the mean token entropy below this share of the run's first logged value (make demo's normal
#: run falls to 0.14 of it by step 7 as it learns the format).
ENTROPY_SHARE = 0.05

BETA_ZERO = (
    "the logged loss is about 0 at beta 0, as it should be: GRPO's loss is the advantage-weighted probability ratio, "
    "which is 0 on average on-policy while its gradient is not. Watch reward, frac_reward_zero_std and grad_norm."
)
NO_SIGNAL = (
    f"every group scored alike (frac_reward_zero_std >= 0.9) at {PATIENCE} logged steps in a row: every advantage is "
    "0, so GRPO has no signal. Give rewards that tell a group's completions apart (partial credit: tag_progress), a "
    "format prefill or worked examples (prefill, few_shot), a larger group (num_generations) or longer completions."
)
CLIPPED = (
    f"every completion was cut at max_completion_length (completions/clipped_ratio = 1) at {PATIENCE} logged steps "
    "in a row: no answer finishes. Raise --set max_completion_length, or ask for shorter reasoning (system_prompt, "
    "few_shot)."
)
FLAT = (
    "the reward has not risen in {n} logged steps ({first:.3f} -> {last:.3f}, mean of the first and last {w}) while "
    "groups differ: check that the rewards pay for what you want (--set log_completions=true shows samples with their "
    "scores), or try a higher learning_rate."
)
NO_GRADIENT = (
    f"grad_norm was 0 at {PATIENCE} logged steps in a row while groups differ: the LoRA is not moving. Check "
    "mask_truncated_completions (it drops every cut completion) and the learning-rate schedule."
)
ENTROPY = (
    "token entropy collapsed ({first:.3f} -> {last:.3f}) at {n} logged steps in a row: the model samples almost one "
    "text, so its groups stop differing. Lower the learning_rate, or raise temperature."
)


def _streak(rows: list, test) -> bool:
    """True when the last PATIENCE of ``rows`` (logged rows or values) all pass ``test``."""
    return len(rows) >= PATIENCE and all(test(row) for row in rows[-PATIENCE:])


def logged(history: list[dict], key: str) -> list[dict]:
    """The rows of ``history`` that logged a number for ``key`` (not None: a NaN/inf is written as null)."""
    return [row for row in history if isinstance(row.get(key), (int, float))]


def reward_first_last(history: list[dict], window: int = 3) -> tuple[float | None, float | None]:
    """Mean ``reward`` over the first and the last ``window`` logged steps."""
    values = [row["reward"] for row in logged(history, "reward")]
    if not values:
        return None, None
    window = min(window, len(values) // 2 or 1)
    return sum(values[:window]) / window, sum(values[-window:]) / window


def learned_nothing(history: list[dict]) -> str | None:
    """What the log shows when the run had nothing to learn from, else None: no reward was ever given (every reward
    function returned None), or grad_norm was 0 at every logged step (each group's completions all scored the same,
    so every advantage was 0 and the LoRA never moved).

    >>> learned_nothing([{"step": 1, "reward": 0.0, "grad_norm": 0.0}, {"step": 2, "reward": 0.0, "grad_norm": 0.0}])
    'grad_norm was 0 at all 2 logged steps: the completions of each group all scored the same, so every advantage was 0'
    """
    rows = [row for row in history if "grad_norm" in row or "reward" in row]
    if not rows:
        return None
    if not logged(rows, "reward"):
        return f"no reward was given at any of {len(rows)} logged steps (every reward function returned None)"
    if all(row.get("grad_norm") == 0 for row in rows):
        return (
            f"grad_norm was 0 at all {len(rows)} logged steps: the completions of each group all scored the same, so "
            "every advantage was 0"
        )
    return None


def collapse(history: list[dict]) -> str | None:
    """What the last logged step shows when the model no longer answers, else None: the reward fell to 0, and every
    completion was cut at max_completion_length where some used to end, with no gradient left. A learning rate far too
    high does that while every weight stays finite and small, so ``adapters.adapter_problem`` cannot see it; the
    run's own log can. (A budget too short for any answer clips every completion from the start: that is no
    collapse.)

    >>> collapse([{"step": 1, "reward": 0.25, "completions/clipped_ratio": 0.625}, {"step": 2, "reward": 0.0,
    ...     "completions/clipped_ratio": 1.0, "grad_norm": 0.0}])
    'at step 2 the reward fell from 0.250 to 0, every completion was cut at max_completion_length and grad_norm was 0'
    """
    rows = logged(history, "reward")
    if not rows:
        return None
    last, best = rows[-1], max(row["reward"] for row in rows)
    ended = min(row.get("completions/clipped_ratio", 1) for row in rows) < 1  # some completions ended before
    clipped, still = last.get("completions/clipped_ratio") == 1, last.get("grad_norm") == 0
    if last["reward"] == 0 < best and ended and clipped and still:
        return (
            f"at step {last.get('step')} the reward fell from {best:.3f} to 0, every completion was cut at "
            "max_completion_length and grad_norm was 0"
        )
    return None


def check(history: list[dict], *, beta: float = 0.0, final: bool = False) -> dict[str, str]:
    """``{check: message}`` of what the rows logged so far show (``final``: the run has ended)."""
    rows = logged(history, "reward")
    found, differ = {}, lambda row: row.get("frac_reward_zero_std", 0) < 0.9
    if rows and beta == 0:
        found["beta-0"] = BETA_ZERO
    if _streak(rows, lambda row: not differ(row)):
        found["no-signal"] = NO_SIGNAL
    if _streak(rows, lambda row: row.get("completions/clipped_ratio") == 1):
        found["clipped"] = CLIPPED
    if _streak(rows, lambda row: row.get("grad_norm") == 0 and differ(row)):
        found["no-gradient"] = NO_GRADIENT
    entropy = [row["entropy"] for row in logged(rows, "entropy")]
    if _streak(entropy, lambda value: value < ENTROPY_SHARE * entropy[0]):
        found["entropy"] = ENTROPY.format(first=entropy[0], last=entropy[-1], n=PATIENCE)
    if len(rows) >= 2 * WINDOW and all(map(differ, rows[-WINDOW:])):
        first, last = reward_first_last(rows, WINDOW)  # rows >= 2 * WINDOW: the first and last WINDOW rows
        if last <= first:
            found["flat"] = FLAT.format(n=len(rows), first=first, last=last, w=WINDOW)
    if why := collapse(rows):
        found["collapsed"] = (
            f"the run collapsed: {why}. The adapter no longer answers (export refuses it); train again with a lower "
            "--set learning_rate, or use an earlier checkpoint-N."
        )
    if final and (why := learned_nothing(history)):
        found["learned-nothing"] = (
            f"the run learned nothing: {why}. The adapter is the model it started from (export refuses it). Give "
            "GRPO rewards that tell a group's completions apart: a reward that returns numbers, partial credit "
            "(tag_progress), worked examples and a prefill (the cpu recipe's few_shot and prefill), longer "
            "completions or larger groups (max_completion_length, num_generations)."
        )
    return found


def finding(step: int | None, name: str, message: str) -> dict:
    return {"step": step, "check": name, "level": "note" if name == "beta-0" else "warning", "message": message}


def diagnose(history: list[dict], *, beta: float = 0.0) -> list[dict]:
    """Every finding of a run's log (``finding``), at the step where the ``Doctor`` callback says it."""
    found = {}
    for end in range(1, len(history) + 1):
        for name, message in check(history[:end], beta=beta, final=end == len(history)).items():
            found.setdefault(name, finding(history[end - 1].get("step"), name, message))
    return list(found.values())


class Doctor(TrainerCallback):
    """Says each finding once as the run trains: one printed line ``doctor: ... at step N: ...``, a row of
    ``run_dir/doctor.jsonl``, and a ``trackio.alert`` when the run reports to Trackio (which also posts it to
    TRACKIO_WEBHOOK_URL when that is set)."""

    def __init__(self, run_dir: str | os.PathLike | None = None):
        self.path, self.said = run_dir and Path(run_dir) / "doctor.jsonl", set()

    def on_train_begin(self, args, state, control, **kwargs):
        """A resumed run: what was said up to its checkpoint is not said again (its history's findings and
        ``doctor.jsonl``'s rows to that step); rows said after the checkpoint go, as the Trainer drops those steps."""
        self.said = set(check(runs.history_rows(state.log_history), beta=args.beta))
        if state.is_world_process_zero and self.path:
            rows = runs.read_metrics(self.path)  # a JSON line per finding ([] without the file)
            kept = [row for row in rows if row["step"] <= state.global_step]
            if kept != rows:
                write_jsonl(self.path, kept)
            self.said |= {row["check"] for row in kept}

    def on_log(self, args, state, control, logs, **kwargs):  # the Trainer passes every log
        if not state.is_world_process_zero or "reward" not in logs:
            return
        final = state.global_step >= state.max_steps  # the Trainer's log_history: every step, a resumed run's too
        for name, message in check(runs.history_rows(state.log_history), beta=args.beta, final=final).items():
            if name in self.said:
                continue
            self.said.add(name)
            said = finding(state.global_step, name, message)
            print(f"doctor: {said['level']} at step {said['step']}: {message}")
            if self.path:
                with open(self.path, "a", encoding="utf-8") as handle:
                    handle.write(json.dumps(said) + "\n")
            if "trackio" in args.report_to:  # TrainingArguments makes it a list
                import trackio

                level = trackio.AlertLevel.INFO if said["level"] == "note" else trackio.AlertLevel.WARN
                trackio.alert(f"{name} at step {said['step']}", message, level)


# --------------------------------------------------------------------------------------------- CLI


def cli_doctor(args) -> int:
    """``grpo-kit doctor RUN``: a run's vital signs and findings, from its ``metrics.jsonl`` (finished, stopped or
    still training) and its checkpoints."""
    run = runs.Run(args.run)
    run_dir = run.dir
    history = [row for row in run.history if "reward" in row]
    if not history:
        raise GrpoKitError(f"{run_dir}/metrics.jsonl has no logged step: give the folder of a grpo-kit train run.")
    first, last = reward_first_last(history)
    print(f"{run_dir}: {len(history)} logged steps, the last at step {history[-1].get('step')}")
    print(
        "reward: n/a"
        if first is None
        else f"reward: {first:.3f} -> {last:.3f} (means of the first and of the last logged steps)"
    )
    for key in ("frac_reward_zero_std", "completions/clipped_ratio", "grad_norm"):
        if values := [row[key] for row in logged(history, key)]:
            print(f"{key}: mean {sum(values) / len(values):.3g}, last {values[-1]:.3g}, max {max(values):.3g}")
    saved = [folder.name for folder in runs.checkpoints(run_dir)]
    resume = runs.latest_checkpoint(run_dir)
    print(f"checkpoints: {', '.join(saved) or 'none'}; --resume continues from {resume.name if resume else 'step 0'}")
    findings = diagnose(history, beta=run.recorded.get("beta", 0))
    for found in findings:
        print(f"{found['level']} at step {found['step']}: {found['message']}")
    print("" if any(f["level"] == "warning" for f in findings) else "no warning")
    return 0
